"""Kimi K3 chat prompts in XTML, written as Moonshot's own Python renderer writes them.

The published K3 checkpoints ship no chat template: Moonshot renders chats in Python (`build_chat_segments` in
`nemo_automodel/components/models/kimi_k3/encoding.py`, NVIDIA-NeMo/Automodel; the `nemo-automodel` wheel carries
the same file). This module writes the same text, cut into the same segments. Every message is an element

    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>

where `<|open|>`, `<|close|>`, `<|sep|>` and `<|end_of_msg|>` are control tokens and everything else (tag names,
attributes, message text) is plain text: a `Segment` says which, because the ids differ (text that happens to
spell a control token is encoded as ordinary text, and each segment is encoded on its own).

In order, a prompt holds: the tool declarations (a system message of type "tool-declare"); the thinking-effort
note; the messages; the tool-choice and response-format notes; the generation prompt. An assistant message is

    <|open|>think<|sep|>REASONING<|close|>think<|sep|>        (always, when thinking is on)
    <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|>                                        (when it calls tools)
      <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="KEY" type="string"<|sep|>VALUE<|close|>argument<|sep|>   (one per argument)
      <|close|>call<|sep|>
    <|close|>tools<|sep|>

with string values written raw and other values as JSON; arguments that are not a JSON object are written whole
in `<|open|>json type="object"<|sep|>...<|close|>json<|sep|>`. A tool result is a message with role "tool", the
tool's name and the 1-based position of the call it answers; results are put in the order of the calls they
answer (matched by tool_call_id). A system message that carries `tools` declares more tools mid-conversation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .protocol import Message, ResponseFormat, Tool, ToolCall

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
THINKING_EFFORTS = ("low", "medium", "high", "max")


class XtmlError(ValueError):
    """The messages cannot be written in XTML (an unnamed tool result, tool-call arguments that are not an object)."""


@dataclass(frozen=True)
class Segment:
    """A piece of the prompt: a control marker (encoded with control tokens) or plain text (encoded as text)."""

    text: str
    control: bool = False


def render(messages: list[Message], tools: list[Tool] | None = None, *, add_generation_prompt: bool = True,
           thinking: bool = True, thinking_effort: str | None = None, tool_choice: str | None = None,
           response_format: ResponseFormat | None = None) -> list[Segment]:
    """The prompt's segments. thinking_effort: one of THINKING_EFFORTS or None (no note); tool_choice: "required"
    and "none" add their note, anything else none; response_format: json_object and json_schema add their note."""
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise XtmlError(f"thinking effort {thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}.")
    out: list[Segment] = []
    if tools:
        out += _tool_declaration([t.model_dump(exclude_none=True) for t in tools], dynamic=False)
    if thinking and thinking_effort is not None:
        out += _note("thinking-effort", "`thinking_effort` guides on how much to think in your thinking channel (not "
                     "including the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                     f"Now the system is invoked with `thinking_effort={thinking_effort}`.")
    out += _messages(messages, thinking)
    if tool_choice in _TOOL_CHOICE_NOTES:
        out += _note("tool-choice", _TOOL_CHOICE_NOTES[tool_choice])
    if response_format is not None and response_format.type != "text":
        out += _note("response-format", _response_format_note(response_format))
    if add_generation_prompt:
        out += open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")
    return out


def open_tag(name: str, attributes: Iterable[tuple[str, Any]] = ()) -> list[Segment]:
    """`<|open|>name key="value" ...<|sep|>`: each attribute is four text segments, its value escaped."""
    out = [Segment(OPEN, True), *_text(name)]
    for key, value in attributes:
        out += [*_text(f" {key}"), *_text('="'), *_text(_escape(value)), *_text('"')]
    return out + [Segment(SEP, True)]


def close_tag(name: str) -> list[Segment]:
    """`<|close|>name<|sep|>`."""
    return [Segment(CLOSE, True), *_text(name), Segment(SEP, True)]


def unescape(value: str) -> str:
    """An attribute value as written, back to its text."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _text(text: str) -> list[Segment]:
    return [Segment(text)] if text else []


def _element(name: str, attributes: list[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    """A whole message element, closed and followed by the end-of-message token."""
    return open_tag(name, attributes) + body + close_tag(name) + [Segment(END_OF_MSG, True)]


def _note(kind: str, body: str) -> list[Segment]:
    """A system message kestrel adds on the caller's behalf (type tool-declare, thinking-effort, ...)."""
    return _element("message", [("role", "system"), ("type", kind)], _text(body.strip()))


_RAW_JSON_NOTE = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
                  "formatting.")
_TOOL_CHOICE_NOTES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}


def _response_format_note(response_format: ResponseFormat) -> str:
    note = f"The system is invoked with `response_format={response_format.type}`.\n{_RAW_JSON_NOTE}"
    if response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise XtmlError("response_format json_schema needs a json_schema object with a schema.")
        schema = _compact_json(_sorted_keys(response_format.json_schema.schema_))
        note += f"\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
    return note


def _tool_declaration(tools: list[dict], dynamic: bool) -> list[Segment]:
    specs = _compact_json(_sorted_keys(tools))
    if dynamic:
        body = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                f"```json\n{specs}\n```")
    else:
        body = f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{specs}\n```"
    return _element("message", [("role", "system"), ("type", "tool-declare")], _text(body))


def _messages(messages: list[Message], thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    calls: list[ToolCall] = []        # the latest assistant message's tool calls
    answered = 0                      # tool results since that message
    for message, called in _results_in_call_order(messages):
        if message.role == "assistant":
            calls, answered = message.tool_calls or [], 0
            out += _element("message", _role(message), _assistant_body(message, thinking))
        elif message.role == "tool":
            answered += 1
            name = called or message.name or (calls[answered - 1].function.name if answered <= len(calls) else None)
            if name is None:
                raise XtmlError("a tool message needs a tool name: give the tool_call_id of an earlier assistant "
                                "tool call, or a name.")
            out += _element("message", [("role", "tool"), ("tool", name), ("index", answered)], _content(message))
        elif message.role in ("system", "developer") and message.tools:
            out += _tool_declaration([t.model_dump(exclude_none=True) for t in message.tools], dynamic=True)
        else:
            out += _element("message", _role(message), _content(message))
    return out


def _role(message: Message) -> list[tuple[str, Any]]:
    """role (developer is written as system) and the sender's name."""
    role = "system" if message.role == "developer" else message.role
    return [("role", role)] + ([("name", message.name)] if message.name else [])


def _content(message: Message) -> list[Segment]:
    """Message text; each part of a list of parts is its own segment."""
    if isinstance(message.content, list):
        return [s for part in message.content for s in _text(part.text)]
    return _text(message.content or "")


def _assistant_body(message: Message, thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    if thinking:
        reasoning = message.reasoning_content or ""
        out += open_tag("think") + (_text(reasoning) if reasoning.strip() else []) + close_tag("think")
    out += open_tag("response") + _content(message) + close_tag("response")
    if message.tool_calls:
        out += open_tag("tools")
        for index, call in enumerate(message.tool_calls, start=1):
            out += open_tag("call", [("tool", call.function.name), ("index", index)])
            out += _arguments(call.function.arguments)
            out += close_tag("call")
        out += close_tag("tools")
    return out


def _arguments(arguments: str) -> list[Segment]:
    """A call's arguments: one element per key of the JSON object; text that is not JSON whole in a json element."""
    if not arguments.strip():
        return []
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return open_tag("json", [("type", "object")]) + _text(arguments) + close_tag("json")
    if not isinstance(parsed, dict):
        raise XtmlError("tool call arguments must be a JSON object.")
    out: list[Segment] = []
    for key, value in parsed.items():
        out += open_tag("argument", [("key", key), ("type", _json_type(value))])
        out += _text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        out += close_tag("argument")
    return out


def _json_type(value: Any) -> str:
    """The type attribute of an argument: the JSON type of its value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _results_in_call_order(messages: list[Message]) -> list[tuple[Message, str | None]]:
    """The messages, each run of tool results sorted into the order of the calls it answers, paired with the name of
    the call each result answers. A run is matched to the latest assistant message's tool calls by tool_call_id; a
    run with any result that matches none is left as it is (names None)."""
    out: list[tuple[Message, str | None]] = []
    positions: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        if messages[i].role != "tool":
            if messages[i].role == "assistant":
                positions = _call_positions(messages[i].tool_calls or [])
            out.append((messages[i], None))
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end].role == "tool":
            end += 1
        run = messages[i:end]
        matches = [positions.get(m.tool_call_id) if m.tool_call_id is not None else None for m in run]
        if all(matches):
            order = sorted(range(len(run)), key=lambda k: matches[k][0])
            out += [(run[k], matches[k][1]) for k in order]
        else:
            out += [(m, None) for m in run]
        i = end
    return out


def _call_positions(calls: list[ToolCall]) -> dict[str, tuple[int, str]]:
    """call id -> (1-based position, tool name); an id used twice keeps its first call."""
    positions: dict[str, tuple[int, str]] = {}
    for position, call in enumerate(calls, start=1):
        if call.id is not None:
            positions.setdefault(call.id, (position, call.function.name))
    return positions


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

