"""The output constraint a request asks for, from whichever field states it: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` and legacy `guided_json` / `guided_regex` /
`guided_grammar` / `guided_choice`, SGLang's `json_schema` / `regex` / `ebnf`. A request states at most one.

A json_schema response format is enforced whether or not it says `strict` (as vLLM does): the reply always
matches the schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.structured import StructuredOutputsParams
from .errors import ApiError
from .protocol import ResponseFormat, SamplingFields

# (request field, the StructuredOutputsParams field its value goes to)
_EXTRA_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                 ("guided_choice", "choice"), ("json_schema", "json"), ("regex", "regex"), ("ebnf", "grammar"))


@dataclass(frozen=True)
class RequestedConstraint:
    """A request's constraint and the field that stated it (named in errors)."""

    params: StructuredOutputsParams
    field: str


def requested_constraint(body: SamplingFields, response_format: ResponseFormat | None) -> RequestedConstraint | None:
    """The constraint the request states, or None; an ApiError (400) for two of them or an ill-formed one."""
    stated: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and response_format.type == "json_object":
        stated.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ApiError(400, "response_format json_schema needs a json_schema object with a schema.",
                           "response_format")
        stated.append(("response_format", {"json": response_format.json_schema.schema_}))
    if body.structured_outputs is not None:
        stated.append(("structured_outputs", body.structured_outputs.fields()))
    stated += [(field, {kind: getattr(body, field)}) for field, kind in _EXTRA_FIELDS
               if getattr(body, field) is not None]
    if not stated:
        return None
    if len(stated) > 1:
        raise ApiError(400, f"{stated[0][0]} and {stated[1][0]} both constrain the output; give only one.",
                       stated[1][0])
    field, fields = stated[0]
    try:
        return RequestedConstraint(StructuredOutputsParams(**fields), field)
    except ValueError as e:
        raise ApiError(400, f"{field}: {e}", field) from e
