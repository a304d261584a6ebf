"""The reply parser: reasoning, content and tool calls, fed in every possible split; markers never leak."""

from __future__ import annotations

import json

import pytest

from kestrel.server.chat import (CONTENT, REASONING, THINK_CLOSE, TOOL_ARGS, TOOL_CLOSE, TOOL_NAME, TOOL_OPEN,
                                 MESSAGE_CLOSE, ReplyParser)

ARGS = json.dumps({"city": "Paris", "unit": "°C"})
CALL = f'{TOOL_OPEN}get_weather"<|sep|>{ARGS}{TOOL_CLOSE}'


def parse(text: str, pieces: list[int], start: str = REASONING, forced: str | None = None):
    """Feed text cut at the given positions; collect everything the parser emitted."""
    parser = ReplyParser(start, forced)
    reasoning = content = ""
    calls: dict[int, dict] = {}
    cuts = [0, *pieces, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(cuts, cuts[1:])] + [parser.finish()]
    for delta in deltas:
        reasoning += delta.reasoning
        content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": "", "id": None})
            if call.id is not None:
                assert entry["id"] is None and entry["arguments"] == ""     # announced before any argument
                entry.update(id=call.id, name=call.name)
            entry["arguments"] += call.arguments
    return reasoning, content, [calls[i] for i in sorted(calls)], parser


REPLIES = [
    ("thinking", f"thinking{THINK_CLOSE}The answer.{MESSAGE_CLOSE}", "thinking", "The answer.", []),
    ("tool after reasoning", f"hmm{THINK_CLOSE}Let me check.{CALL}{MESSAGE_CLOSE}", "hmm", "Let me check.",
     [("get_weather", ARGS)]),
    ("think marker skipped", f"I should look it up{CALL}{MESSAGE_CLOSE}", "I should look it up", "",
     [("get_weather", ARGS)]),
    ("two calls", f"{THINK_CLOSE}{CALL}{CALL}", "", "", [("get_weather", ARGS), ("get_weather", ARGS)]),
    ("text after close ignored", f"r{THINK_CLOSE}c{MESSAGE_CLOSE}trailing", "r", "c", []),
    ("marker-like text", f"a <|open| b{THINK_CLOSE}x <|close|>tool y", "a <|open| b", "x <|close|>tool y", []),
]


@pytest.mark.parametrize("name, text, reasoning, content, calls", REPLIES, ids=[r[0] for r in REPLIES])
def test_every_split_gives_the_same_parse(name, text, reasoning, content, calls):
    for cut in range(len(text) + 1):
        for second in (cut, min(len(text), cut + 3)):
            got_reasoning, got_content, got_calls, _ = parse(text, sorted({cut, second}))
            assert (got_reasoning, got_content) == (reasoning, content), (cut, second)
            assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    _, _, one_char, _ = parse(text, list(range(1, len(text))))       # one character at a time
    assert [(c["name"], c["arguments"]) for c in one_char] == calls


def test_without_reasoning_the_reply_starts_as_content():
    _, content, calls, _ = parse(f"Hi{CALL}", [1], start=CONTENT)
    assert content == "Hi" and calls[0]["name"] == "get_weather"


def test_forced_calls_start_inside_the_call():
    _, content, calls, _ = parse(f'{ARGS}{TOOL_CLOSE}', [3], start=TOOL_ARGS, forced="get_weather")
    assert content == "" and calls == [{"name": "get_weather", "arguments": ARGS, "id": calls[0]["id"]}]
    _, _, calls, _ = parse(f'lookup"<|sep|>{{}}{TOOL_CLOSE}', [2], start=TOOL_NAME)
    assert calls[0]["name"] == "lookup" and calls[0]["arguments"] == "{}"


def test_a_truncated_call_is_still_reported():
    _, _, calls, parser = parse(f'x{THINK_CLOSE}{TOOL_OPEN}get_weather"<|sep|>{{"ci', [5])
    assert calls == [{"name": "get_weather", "arguments": '{"ci', "id": calls[0]["id"]}]
    assert parser.calls[0].arguments == '{"ci'
