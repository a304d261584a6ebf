"""The grammar that forces a reply to be a well-formed call of a listed tool (tool_choice required, or a named
function), with arguments valid for the tool's parameters schema, written in the dialect the prompt continues.

The prompt already wrote the reply's forced start (chat.py: `_k3_forced_start`, `_bundled_forced_start`); the
grammar (llguidance's Lark, control tokens by name) covers the rest of the message, and end-of-sequence follows it.

K3 (xtml.py's layout; after `<|open|>tools<|sep|>`, and after the call's opening when a function is named):

    <|open|>call tool="NAME" index="1"<|sep|> ARGUMENTS <|close|>call<|sep|> <|close|>tools<|sep|> <|close|>message<|sep|>

one argument element per property, in the schema's order (required ones always, the others optionally):
`<|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>`, a string value written raw (its
enum or const, its pattern and its length bounds as a regular expression, else any text), any other value as JSON
(`json.dumps`'s separators) valid for the property's schema, TYPE its JSON type as the renderer names it. A
property whose schema allows several JSON types gets one alternative per type. Properties not declared are not
written.

Bundled dialect (after `<|open|>tool_call name="`, and after `NAME"<|sep|>` when named):

    NAME"<|sep|> JSON <|close|>tool_call<|sep|> <|close|>message<|sep|>

the arguments as one JSON object valid for the parameters schema, its properties in the schema's order (as
llguidance writes JSON objects); properties not declared are not written here either, unless the schema states
`additionalProperties` (a small model otherwise invents keys until max_tokens).

A forced reply holds one call.
"""

from __future__ import annotations

import json
from typing import Any

from ..engine.structured import StructuredOutputsParams
from .protocol import Tool

_DUMPS_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_TYPE_ATTRIBUTE = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                   "null": "null", "object": "object", "array": "array"}
_PYTHON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
                 dict: "object", list: "array"}
_END_K3 = '<|close|> "call" <|sep|> <|close|> "tools" <|sep|> <|close|> "message" <|sep|>'
_END_BUNDLED = '<|close|> "tool_call" <|sep|> <|close|> "message" <|sep|>'


def forced_call(tools: list[Tool], name: str | None, bundled: bool) -> StructuredOutputsParams:
    """The constraint for a reply that must call `name` (None: any of `tools`), in the bundled dialect or K3's."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    rules: list[str] = []
    if bundled:
        calls = [_bundled_call(tool, named=name is not None) for tool in chosen]
    else:
        calls = [_k3_call(tool, index, named=name is not None, rules=rules) for index, tool in enumerate(chosen)]
    return StructuredOutputsParams(grammar="\n".join(["start: " + " | ".join(calls), *rules]))


def _bundled_call(tool: Tool, named: bool) -> str:
    head = "" if named else _literal(f'{tool.function.name}"') + " <|sep|> "
    return f"{head}%json {_json_schema({'additionalProperties': False, **_parameters(tool)})} {_END_BUNDLED}"


def _k3_call(tool: Tool, index: int, named: bool, rules: list[str]) -> str:
    """One tool's call; its argument values as rules named after the tool's position."""
    parameters = _parameters(tool)
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    arguments = []
    for position, (key, schema) in enumerate(properties.items()):
        rule = f"tool{index}_argument{position}"
        rules.append(f"{rule}: " + _argument(key, _resolve(schema, parameters), parameters, rules, rule))
        arguments.append(rule if key in required else f"{rule}?")
    opening = "call tool=" + _attribute(tool.function.name) + ' index="1"'
    head = "" if named else f"<|open|> {_literal(opening)} <|sep|> "
    return f"({head}{' '.join(arguments)} {_END_K3})"


def _argument(key: str, schema: Any, root: dict[str, Any], rules: list[str], rule: str) -> str:
    """One argument element: an alternative per JSON type the property allows."""
    branches = []
    for kind in _types(schema):
        opening = "argument key=" + _attribute(key) + " type=" + _attribute(_TYPE_ATTRIBUTE[kind])
        head = f"<|open|> {_literal(opening)} <|sep|>"
        if kind == "string":
            token = f"{rule.upper()}_TEXT"
            rules.append(f"{token}: {_raw_string(schema)}")
            branches.append(f"{head} {token}")
        else:
            branches.append(f"{head} %json {_json_schema(_typed(schema, kind), root)}")
    return "(" + " | ".join(branches) + ') <|close|> "argument" <|sep|>'


def _types(schema: Any) -> list[str]:
    """The JSON types a value of `schema` may have (integer folded into number where both are allowed)."""
    schema = schema if isinstance(schema, dict) else {}
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        kinds = list(dict.fromkeys(_PYTHON_TYPES[type(v)] for v in values))
    elif "type" in schema:
        kinds = [schema["type"]] if isinstance(schema["type"], str) else list(schema["type"])
    else:
        kinds = list(_JSON_TYPES)
    if "number" in kinds and "integer" in kinds:
        kinds.remove("integer")
    return [k for k in kinds if k in _TYPE_ATTRIBUTE]


def _typed(schema: Any, kind: str) -> dict[str, Any]:
    """schema narrowed to values of one JSON type."""
    base = dict(schema) if isinstance(schema, dict) else {}
    if "enum" in base or "const" in base:
        values = [base.pop("const")] if "const" in base else base.pop("enum")
        base["enum"] = [v for v in values if _PYTHON_TYPES[type(v)] == kind or
                        (kind == "number" and isinstance(v, (int, float)) and not isinstance(v, bool))]
    return {**base, "type": kind}


def _raw_string(schema: Any) -> str:
    """A Lark token for a string value written raw: its enum or const, its pattern and length bounds, else any text."""
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return " | ".join(_literal(v) for v in values if isinstance(v, str))
    schema = schema if isinstance(schema, dict) else {}
    parts = []
    if "pattern" in schema:
        parts.append(_regex(schema["pattern"].removeprefix("^").removesuffix("$")))
    if "minLength" in schema or "maxLength" in schema:
        parts.append(_regex(f"(?s:.{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}})"))
    return " & ".join(parts) or _regex("(?s:.*)")


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """A property's schema with a local `$ref` ("#/$defs/NAME", "#/definitions/NAME") followed."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            break
        schema = target
    return schema


def _json_schema(schema: dict[str, Any], root: dict[str, Any] | None = None) -> str:
    """A %json argument: the schema (with the root's definitions, for its refs), written as json.dumps writes."""
    definitions = {k: root[k] for k in ("$defs", "definitions") if root and k in root}
    return json.dumps({**schema, **definitions, "x-guidance": _DUMPS_STYLE})


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def _attribute(value: str) -> str:
    """An attribute value as xtml.py writes it: quoted, with & and " escaped."""
    return '"' + value.replace("&", "&amp;").replace('"', "&quot;") + '"'


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"
