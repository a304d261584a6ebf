"""Chat: rendering messages with the model's template, and parsing the model's reply into reasoning, content
and tool calls, incrementally, as it streams.

The K3 family writes messages in "XTML" (model-spec section 10). The reply to a generation prompt, which ends
with `<|open|>think<|sep|>`, is laid out as

    REASONING <|close|>think<|sep|> CONTENT
    <|open|>tool_call name="NAME"<|sep|>ARGUMENTS<|close|>tool_call<|sep|>   (zero or more)
    <|close|>message<|sep|>

and ends with `<|end_of_msg|>` (the EOS). The think-closing marker is optional in practice: a tool call that
starts while the reply is still in its reasoning ends the reasoning instead of being lost.

XTML_CHAT_TEMPLATE is the jinja chat template that writes this format (kestrel's bundled model ships it).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..engine.tokenizer import Tokenizer
from .protocol import Message, Tool

XTML_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")

THINK_OPEN = "<|open|>think<|sep|>"
THINK_CLOSE = "<|close|>think<|sep|>"
TOOL_OPEN = '<|open|>tool_call name="'
TOOL_NAME_END = '"<|sep|>'
TOOL_CLOSE = "<|close|>tool_call<|sep|>"
MESSAGE_CLOSE = "<|close|>message<|sep|>"

REASONING, CONTENT, TOOL_NAME, TOOL_ARGS, DONE = "reasoning", "content", "tool_name", "tool_args", "done"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this model's chat template."""


def render_chat(tokenizer: Tokenizer, messages: list[Message], tools: list[Tool] | None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (and the tool definitions) under the model folder's jinja chat template."""
    if not tokenizer.chat_template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions with a plain prompt.")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    try:
        template = env.from_string(tokenizer.chat_template)
        return template.render(
            messages=[_message_dict(m) for m in messages],
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}.") from e


def _message_dict(message: Message) -> dict:
    data = message.model_dump(exclude_none=True)
    data["content"] = message.text()
    return data


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
    """Splits reply text, fed in pieces, into reasoning, content and tool calls; markers never leak.

    start: REASONING when the prompt opened a think section, CONTENT otherwise; TOOL_NAME or TOOL_ARGS when the
    prompt itself opened a (forced) tool call, with `forced_name` for the latter.
    """

    def __init__(self, start: str = CONTENT, forced_name: str | None = None):
        self.state = start
        self.pending = ""
        self.calls = [ParsedToolCall(_call_id(), forced_name or "")] if start in (TOOL_NAME, TOOL_ARGS) else []
        self._announced = 0

    def feed(self, text: str) -> ReplyDelta:
        """Parse more reply text; what can be told apart now."""
        self.pending += text
        delta = ReplyDelta()
        while self._advance(delta, final=False):
            pass
        return delta

    def finish(self) -> ReplyDelta:
        """Flush what was held back (the reply ended)."""
        delta = ReplyDelta()
        while self._advance(delta, final=True):
            pass
        self._announce(delta)
        return delta

    def _advance(self, delta: ReplyDelta, final: bool) -> bool:
        """Consume pending text up to the next marker; True when a marker was consumed (more may follow)."""
        if self.state == DONE:
            self.pending = ""
            return False
        markers = _MARKERS[self.state]
        hit = _first_marker(self.pending, markers)
        if hit is None:
            keep = 0 if final else _partial_marker_length(self.pending, markers)
            self._emit(delta, self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        position, marker = hit
        self._emit(delta, self.pending[:position])
        self.pending = self.pending[position + len(marker):]
        self._transition(marker, delta)
        return True

    def _emit(self, delta: ReplyDelta, text: str) -> None:
        if not text:
            return
        if self.state == REASONING:
            delta.reasoning += text
        elif self.state == CONTENT:
            delta.content += text
        elif self.state == TOOL_NAME:
            self.calls[-1].name += text
        elif self.state == TOOL_ARGS:
            self.calls[-1].arguments += text
            self._announce(delta)
            delta.tool_calls.append(ToolCallDelta(len(self.calls) - 1, arguments=text))

    def _transition(self, marker: str, delta: ReplyDelta) -> None:
        if marker == THINK_CLOSE:
            self.state = CONTENT
        elif marker == TOOL_OPEN:
            self.calls.append(ParsedToolCall(_call_id(), ""))
            self.state = TOOL_NAME
        elif marker == TOOL_NAME_END:
            self.state = TOOL_ARGS
            self._announce(delta)
        elif marker == TOOL_CLOSE:
            self._announce(delta)
            self.state = CONTENT
        elif marker == MESSAGE_CLOSE:
            self.state = DONE

    def _announce(self, delta: ReplyDelta) -> None:
        """Emit the id and name of calls not announced yet (before any of their arguments)."""
        while self._announced < len(self.calls):
            call = self.calls[self._announced]
            delta.tool_calls.append(ToolCallDelta(self._announced, id=call.id, name=call.name))
            self._announced += 1


_MARKERS = {
    REASONING: (THINK_CLOSE, TOOL_OPEN, MESSAGE_CLOSE),
    CONTENT: (TOOL_OPEN, MESSAGE_CLOSE),
    TOOL_NAME: (TOOL_NAME_END,),
    TOOL_ARGS: (TOOL_CLOSE, MESSAGE_CLOSE),
}


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(m), m) for m in markers if m in text]
    return min(hits) if hits else None


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that begins some marker (held back until it can be told apart)."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-length:]) for m in markers):
            return length
    return 0


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
