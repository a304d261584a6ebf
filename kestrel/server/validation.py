"""A request body that failed validation as one OpenAI-style 400: the bad field named, with the range a number out
of it accepts, read from the request model's declaration."""

from __future__ import annotations

from types import UnionType
from typing import Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .errors import ApiError


def validation_error(errors: list[dict], body_model: type | None = None) -> ApiError:
    """One 400 naming the first bad field. Pydantic reports each alternative of a union as its own error: the one
    that got deepest into the value is named (with the accepted range for a number out of it); alternatives that
    failed equally deep are "no accepted type"."""
    if errors[0].get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON.")
    paths = [_field_path(e.get("loc", ())) for e in errors]
    if not paths[0]:
        return ApiError(400, "the request body must be a JSON object.")
    related = [i for i, p in enumerate(paths) if p[:len(paths[0])] == paths[0] or paths[0][:len(p)] == p]
    depth = max(len(paths[i]) for i in related)
    deepest = [i for i in related if len(paths[i]) == depth]
    error, field = errors[deepest[0]], ".".join(paths[deepest[0]])
    if len(deepest) > 1:
        return ApiError(400, f"{field}: no accepted type matches {error.get('input')!r:.80}.", field)
    bounds = _bounds(_field_info(body_model, paths[deepest[0]])) if error.get("type") in _RANGE_ERRORS else ""
    if bounds:
        return ApiError(400, f"{field} must be {bounds}; got {error.get('input')!r:.80}.", field)
    return ApiError(400, f"{field}: {error.get('msg', 'invalid value')}.", field)


_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_BOUND_WORDS = {"ge": "at least", "gt": "greater than", "le": "at most", "lt": "less than"}


def _field_path(loc) -> list[str]:
    """['messages', '0', 'content'] from pydantic's location, without "body" and the type names of union members."""
    return [str(part) for part in loc[1:] if not (isinstance(part, str) and (
        part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool")))]


def _field_info(model: type | None, path: list[str]) -> FieldInfo | None:
    """The declaration of the field at `path` in a request model (through unions and lists), or None."""
    info, types = None, [model]
    for part in path:
        if part.isdigit():                # a list item: its type is among the list's
            continue
        holders = [t for t in _member_types(types) if isinstance(t, type) and issubclass(t, BaseModel)
                   and part in t.model_fields]
        if not holders:
            return None
        info = holders[0].model_fields[part]
        types = [info.annotation]
    return info


def _member_types(types: list) -> list:
    """The types that unions and lists among `types` are made of, recursively."""
    out = []
    for t in types:
        out += _member_types(list(get_args(t))) if get_origin(t) in (Union, UnionType, list) else [t]
    return out


def _bounds(info: FieldInfo | None) -> str:
    """'at least 1 and at most 128' from a field's declared bounds ("" if it declares none)."""
    if info is None:
        return ""
    return " and ".join(f"{words} {getattr(m, key)}" for m in info.metadata for key, words in _BOUND_WORDS.items()
                        if getattr(m, key, None) is not None)
