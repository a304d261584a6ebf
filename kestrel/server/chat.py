"""Chat: rendering a conversation into the prompt, and parsing the model's reply into reasoning, content and tool
calls, incrementally, as it streams.

Rendering: a model folder's own chat template (tokenizer_config.json `chat_template` or `chat_template.jinja`) is
used where one is shipped; otherwise the conversation is written in K3's XTML as Moonshot's Python renderer writes
it (xtml.py), as the published checkpoints expect. kestrel's bundled model ships XTML_CHAT_TEMPLATE, an older XTML
dialect (a top-level `tools` element, no response channel, `<|open|>tool_call name="NAME"<|sep|>JSON<|close|>
tool_call<|sep|>` calls), so prompts from a folder template are continued in that dialect when kestrel forces the
start of a reply (JSON mode, tool_choice required or named), and in K3's otherwise.

Parsing: the prompt ends with the opened assistant message, `<|open|>think<|sep|>` when thinking (else
`<|open|>response<|sep|>`), and the reply continues it (xtml.py shows the layout):

    REASONING <|close|>think<|sep|> <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    <|open|>tools<|sep|> <|open|>call tool="NAME" index="1"<|sep|> ARGUMENT ELEMENTS <|close|>call<|sep|> ...
    <|close|>tools<|sep|> <|close|>message<|sep|>

ReplyParser reads both dialects with one set of rules: markers are elements that open and close; text goes to
the channel of the innermost open element (think: reasoning; response or the message itself: content; a call:
its arguments). A call's argument elements are streamed as one JSON object, `{"KEY": VALUE, ...}` exactly as
`json.dumps(arguments, ensure_ascii=False)` writes it (string values as they arrive, other values when their
element closes); a json element's text, or text written straight into a call, is passed on as it is. A marker
that skips ahead closes what it skips (a tools section opened while thinking ends the reasoning); a well-formed
marker is never shown as text, even where it has no place; nor is a control token: one that begins no well-formed
marker is dropped (the text after it stays), and a marker cut off by the end of the reply is dropped whole.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..engine.tokenizer import Tokenizer
from . import xtml
from .protocol import Message, ResponseFormat, Tool
from .xtml import CLOSE, END_OF_MSG, OPEN, SEP, Segment

XTML_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
"""The chat template of kestrel's bundled model (its older XTML dialect)."""

THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN = f"{OPEN}response{SEP}"
BUNDLED_CALL_OPEN = f'{OPEN}tool_call name="'

MESSAGE, THINK, RESPONSE, TOOLS, CALL, ARGUMENT, JSON_BLOCK, BUNDLED_CALL = (
    "message", "think", "response", "tools", "call", "argument", "json", "tool_call")
_CHILDREN = {MESSAGE: (THINK, RESPONSE, TOOLS, BUNDLED_CALL), TOOLS: (CALL,), CALL: (ARGUMENT, JSON_BLOCK)}
_IMPLIED_PARENT = {CALL: TOOLS}           # a call written outside a tools section opens one
_CALL_NAME = {CALL: "tool", BUNDLED_CALL: "name"}
_CONTENT_CHANNELS = (MESSAGE, RESPONSE)
_ARGUMENT_CHANNELS = (CALL, JSON_BLOCK, BUNDLED_CALL)

MAX_TAG = 512
"""The longest marker body (name and attributes) read as a marker; past it, the control token is dropped and the
rest is text."""
_OPEN_BODY = re.compile(r'([A-Za-z_][\w-]*)((?:\s+[\w-]+="[^"]*")*)\s*')
_CLOSE_BODY = re.compile(r"[A-Za-z_][\w-]*")
_OPEN_BODY_START = re.compile(r'(?:[A-Za-z_][\w-]*(?:\s+[\w-]+="[^"]*")*(?:\s+(?:[\w-]+(?:=(?:"[^"]*)?)?)?)?)?')
_CLOSE_BODY_START = re.compile(r"(?:[A-Za-z_][\w-]*)?")
CONTROL_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
"""The format's control tokens: never reasoning, content or arguments."""
_ATTRIBUTE = re.compile(r'([\w-]+)="([^"]*)"')


class ChatTemplateError(ValueError):
    """The messages cannot be rendered for this model; param: the request field to blame."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its segments, and the part of the reply the prompt already wrote (the opened assistant
    message's first channel, and any start kestrel forced), which the reply parser reads first."""

    segments: list[Segment]
    reply_start: str = ""

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


def render_chat(tokenizer: Tokenizer, messages: list[Message], *, tools: list[Tool] | None = None,
                tool_choice: str | None = None, tool_name: str | None = None, json_mode: bool = False,
                reasoning_effort: str | None = None, response_format: ResponseFormat | None = None,
                add_generation_prompt: bool = True) -> ChatPrompt:
    """The prompt for `messages` under the folder's chat template, else K3's renderer.

    tool_choice: "none", "auto" or "required"; tool_name: a tool the reply must call (a named tool_choice);
    json_mode: the reply is constrained content (JSON mode, a schema, a regex or a grammar), so it starts in the
    content channel. A forced reply skips the reasoning.
    reasoning_effort: OpenAI's field (None: K3's default, max; "none": thinking off; "minimal": K3's lowest
    effort, low); K3's renderer writes it, a folder template gets it as the variable `reasoning_effort`. A folder
    template that does not read that variable (the bundled model's) cannot set an effort: "none" closes the
    reasoning before the reply, any other effort is a ChatTemplateError.
    """
    effort = "low" if reasoning_effort == "minimal" else reasoning_effort
    force_call = tool_choice == "required" or tool_name is not None
    if tokenizer.chat_template:
        return _render_folder_chat(tokenizer.chat_template, messages, tools if tool_choice != "none" else None,
                                   add_generation_prompt, effort, json_mode, force_call, tool_name)
    thinking = effort != "none"
    try:
        segments = xtml.render(messages, tools, add_generation_prompt=add_generation_prompt, thinking=thinking,
                               thinking_effort=(effort or "max") if thinking else None,
                               tool_choice=tool_choice, response_format=response_format)
    except xtml.XtmlError as e:
        raise ChatTemplateError(str(e)) from e
    if not add_generation_prompt:
        return ChatPrompt(segments)
    opened = _opened_channel("".join(s.text for s in segments))
    forced = _k3_forced_start(opened, json_mode, force_call, tool_name)
    return ChatPrompt(segments + forced, opened + "".join(s.text for s in forced))


def prompt_ids(tokenizer: Tokenizer, prompt: ChatPrompt, add_special_tokens: bool = True) -> list[int]:
    """The token ids of a rendered chat, as Moonshot's encoder makes them: each segment encoded on its own, control
    tokens recognised in control segments only (text that spells one stays text), BOS as the tokenizer adds it."""
    ids: list[int] = []
    for i, segment in enumerate(prompt.segments):
        ids += tokenizer.encode(segment.text, add_special_tokens=add_special_tokens and i == 0,
                                allow_special=segment.control)
    return ids


def _render_folder_chat(template: str, messages: list[Message], tools: list[Tool] | None,
                        add_generation_prompt: bool, effort: str | None, json_mode: bool, force_call: bool,
                        tool_name: str | None) -> ChatPrompt:
    """The prompt under a folder's chat template, with the reply start kestrel forces (render_chat)."""
    reads_effort = _reads_variable(template, "reasoning_effort")
    if effort not in (None, "none") and not reads_effort:
        raise ChatTemplateError("this model's chat template cannot set a thinking effort; send reasoning_effort "
                                "none (no reasoning) or leave it out.", "reasoning_effort")
    text = _render_template(template, messages, tools, add_generation_prompt, effort)
    if not add_generation_prompt:
        return ChatPrompt([Segment(text, control=True)])
    opened = _opened_channel(text)
    skip_thinking = json_mode or force_call or (effort == "none" and not reads_effort)
    start = _bundled_forced_start(opened, skip_thinking, force_call, tool_name)
    return ChatPrompt([Segment(text + start, control=True)], opened + start)


@functools.lru_cache(maxsize=8)
def _reads_variable(template: str, name: str) -> bool:
    """Whether the chat template reads the variable `name`."""
    try:
        return name in jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}.") from e


def _render_template(template: str, messages: list[Message], tools: list[Tool] | None, add_generation_prompt: bool,
                     reasoning_effort: str | None) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    try:
        return env.from_string(template).render(
            messages=[_message_dict(m) for m in messages],
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt, reasoning_effort=reasoning_effort)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}.") from e


def _message_dict(message: Message) -> dict:
    data = message.model_dump(exclude_none=True)
    data["content"] = message.text()
    return data


def _opened_channel(prompt: str) -> str:
    """The channel marker the generation prompt opened the reply with ("" if it opened none)."""
    return next((marker for marker in (THINK_OPEN, RESPONSE_OPEN) if prompt.endswith(marker)), "")


def _k3_forced_start(opened: str, json_mode: bool, force_call: bool, tool_name: str | None) -> list[Segment]:
    """The reply's forced start in K3's layout: the content channel for JSON mode; for a forced call, an empty
    response and the tools section (and the named call), as K3's renderer writes a reply that only calls tools."""
    if not (json_mode or force_call):
        return []
    out = xtml.close_tag("think") if opened == THINK_OPEN else []
    in_response = opened == RESPONSE_OPEN
    if json_mode:
        return out + ([] if in_response else xtml.open_tag("response"))
    out += ([] if in_response else xtml.open_tag("response")) + xtml.close_tag("response") + xtml.open_tag("tools")
    return out + (xtml.open_tag("call", [("tool", tool_name), ("index", 1)]) if tool_name else [])


def _bundled_forced_start(opened: str, skip_thinking: bool, force_call: bool, tool_name: str | None) -> str:
    """The reply's forced start in the bundled dialect: past the reasoning (skip_thinking: JSON mode, a forced call,
    or thinking off), then for a forced call the opening of a tool_call."""
    if not skip_thinking:
        return ""
    out = THINK_CLOSE if opened == THINK_OPEN else ""
    if force_call:
        out += BUNDLED_CALL_OPEN + (f'{tool_name}"{SEP}' if tool_name else "")
    return out


@dataclass
class ToolCallDelta:
    """A new tool call (id and name set) or more of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""


class ReplyParser:
    """Splits reply text, fed in pieces, into reasoning, content and tool calls; every split of the same text gives
    the same result, and well-formed markers never reach the text.

    reply_start: what the prompt already wrote of the reply (ChatPrompt.reply_start), read first and not reported;
    calls it opens are announced with the first delta.
    """

    def __init__(self, reply_start: str = ""):
        self.calls: list[ParsedToolCall] = []
        self._stack = [MESSAGE]           # the open elements; empty once the message closed
        self._pending = ""                # text not parsed yet: it may begin a marker
        self._arguments: _ArgumentsJson | None = None      # the open call's arguments
        self._announced = 0
        self.feed(reply_start)            # not reported...
        self._announced = 0               # ...so the calls it opened are announced with the first delta

    def feed(self, text: str) -> ReplyDelta:
        """Parse more reply text; what can be told apart now."""
        self._pending += text
        delta = ReplyDelta()
        self._parse(delta, final=False)
        return delta

    def finish(self) -> ReplyDelta:
        """Flush what was held back (the reply ended)."""
        delta = ReplyDelta()
        self._parse(delta, final=True)
        if self._stack and self._stack[-1] == ARGUMENT:
            self._argument_text(delta, self._arguments.flush())
        return delta

    def _parse(self, delta: ReplyDelta, final: bool) -> None:
        self._announce(delta)
        position = 0
        while self._stack and (piece := _next_piece(self._pending, position, final)) is not None:
            kind, value, position = piece
            if kind == "text":
                self._text(delta, value)
            elif kind == "open":
                name, attributes = _open_body(value)
                self._open(delta, name, attributes)
            elif kind == "close":
                self._close(delta, value)
        self._pending = self._pending[position:] if self._stack else ""

    def _text(self, delta: ReplyDelta, text: str) -> None:
        channel = self._stack[-1]
        if channel == THINK:
            delta.reasoning += text
        elif channel in _CONTENT_CHANNELS:
            delta.content += text
        elif channel == ARGUMENT:
            self._argument_text(delta, self._arguments.argument_text(text))
        elif channel in _ARGUMENT_CHANNELS:
            self._argument_text(delta, self._arguments.raw_text(text))

    def _open(self, delta: ReplyDelta, name: str, attributes: dict[str, str]) -> None:
        """Open `name` inside the innermost open element that can hold it (closing those inside that one)."""
        if name == MESSAGE:                # a new message begins: the reply is over
            self._pop_to(0, delta)
            return
        for depth in range(len(self._stack) - 1, -1, -1):
            children = _CHILDREN.get(self._stack[depth], ())
            if name in children or _IMPLIED_PARENT.get(name) in children:
                self._pop_to(depth + 1, delta)
                if name not in children:
                    self._push(delta, _IMPLIED_PARENT[name], {})
                self._push(delta, name, attributes)
                return

    def _close(self, delta: ReplyDelta, name: str) -> None:
        """Close `name` and everything open inside it; a close of nothing open is dropped."""
        if name in self._stack:
            self._pop_to(len(self._stack) - 1 - self._stack[::-1].index(name), delta)

    def _push(self, delta: ReplyDelta, name: str, attributes: dict[str, str]) -> None:
        if name in _CALL_NAME:
            self.calls.append(ParsedToolCall(_call_id(), attributes.get(_CALL_NAME[name], "")))
            self._arguments = _ArgumentsJson(raw=name == BUNDLED_CALL)
            self._announce(delta)
        elif name == ARGUMENT:
            self._argument_text(delta, self._arguments.open_argument(attributes.get("key", ""),
                                                                     attributes.get("type", "string")))
        self._stack.append(name)

    def _pop_to(self, depth: int, delta: ReplyDelta) -> None:
        while len(self._stack) > depth:
            name = self._stack.pop()
            if name == ARGUMENT:
                self._argument_text(delta, self._arguments.close_argument())
            elif name in _CALL_NAME:
                self._argument_text(delta, self._arguments.close())
                self._arguments = None

    def _argument_text(self, delta: ReplyDelta, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            delta.tool_calls.append(ToolCallDelta(len(self.calls) - 1, arguments=text))

    def _announce(self, delta: ReplyDelta) -> None:
        """Emit the id and name of calls not announced yet (before any of their arguments)."""
        while self._announced < len(self.calls):
            call = self.calls[self._announced]
            delta.tool_calls.append(ToolCallDelta(self._announced, id=call.id, name=call.name))
            self._announced += 1


class _ArgumentsJson:
    """A call's arguments as one JSON object, written while its argument elements stream in (what K3's renderer
    wrote from `{"KEY": VALUE}` reads back as `json.dumps` of it); raw text (a json element's, or the bundled
    dialect's) is passed on as it is."""

    def __init__(self, raw: bool):
        self.members = 0
        self.raw = raw
        self.kind: str | None = None      # the open argument's type
        self.value = ""                   # a non-string value, held until its element closes

    def open_argument(self, key: str, kind: str) -> str:
        head = ("{" if self.members == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self.members += 1
        self.kind = kind
        return head + ('"' if kind == "string" else "")

    def argument_text(self, text: str) -> str:
        if self.kind == "string":
            return json.dumps(text, ensure_ascii=False)[1:-1]
        self.value += text
        return ""

    def close_argument(self) -> str:
        kind, value = self.kind, self.value
        self.kind, self.value = None, ""
        if kind == "string":
            return '"'
        try:                               # a value that is not JSON is passed on as a string
            return json.dumps(json.loads(value), ensure_ascii=False)
        except (ValueError, RecursionError):
            return json.dumps(value, ensure_ascii=False)

    def raw_text(self, text: str) -> str:
        self.raw = True
        return text

    def close(self) -> str:
        return "}" if self.members else "" if self.raw else "{}"

    def flush(self) -> str:
        """The held value, as written (the reply ended inside it)."""
        value, self.value = self.value, ""
        return value


def _next_piece(text: str, position: int, final: bool) -> tuple[str, str, int] | None:
    """The next piece of `text` from `position`: ("text", text, end), ("open", body, end), ("close", name, end) or
    ("drop", "", end) for a control token that is no marker's part, or a marker the reply's end cut off; None when
    what follows may still become a marker (held back unless `final`)."""
    start = _find_control(text, position, len(text), CONTROL_TOKENS)
    if start == -1:
        end = len(text) if final else len(text) - _partial_control_start(text, position)
        return ("text", text[position:end], end) if end > position else None
    if start > position:
        return "text", text[position:start], start
    token = next(t for t in CONTROL_TOKENS if text.startswith(t, position))
    body_start = position + len(token)
    if token not in (OPEN, CLOSE):
        return "drop", "", body_start
    window_end = body_start + MAX_TAG + len(SEP)
    sep = text.find(SEP, body_start, window_end)
    nested = _find_control(text, body_start, sep if sep != -1 else window_end, (OPEN, CLOSE))
    if sep != -1 and nested == -1:
        body = text[body_start:sep]
        kind = "open" if token == OPEN else "close"
        if (_OPEN_BODY if kind == "open" else _CLOSE_BODY).fullmatch(body):
            return kind, body, sep + len(SEP)
        return "drop", "", body_start
    if nested != -1 or len(text) >= window_end:
        return "drop", "", body_start
    if final:                             # cut off: dropped whole if it could still have become a marker
        body_start_pattern = _OPEN_BODY_START if token == OPEN else _CLOSE_BODY_START
        return "drop", "", len(text) if body_start_pattern.fullmatch(text, body_start) else body_start
    return None


def _find_control(text: str, start: int, end: int, tokens: tuple[str, ...]) -> int:
    """Where the first of `tokens` begins in text[start:end], or -1."""
    hits = [i for i in (text.find(token, start, end) for token in tokens) if i != -1]
    return min(hits) if hits else -1


def _partial_control_start(text: str, position: int) -> int:
    """Length of the longest suffix of text[position:] that begins a control token."""
    longest = max(len(token) for token in CONTROL_TOKENS) - 1
    for length in range(min(len(text) - position, longest), 0, -1):
        tail = text[len(text) - length:]
        if any(token.startswith(tail) for token in CONTROL_TOKENS):
            return length
    return 0


def _open_body(body: str) -> tuple[str, dict[str, str]]:
    name, attributes = _OPEN_BODY.fullmatch(body).groups()
    return name, {key: xtml.unescape(value) for key, value in _ATTRIBUTE.findall(attributes)}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
