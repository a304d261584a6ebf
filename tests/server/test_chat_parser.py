"""The reply parser: reasoning, content and tool calls, fed in every possible split; markers never leak.

Replies are written in K3's layout (Moonshot's renderer, `nemo_automodel/components/models/kimi_k3/encoding.py` in
NVIDIA-NeMo/Automodel: think, response and tools channels, calls with argument elements) and in the bundled
model's older dialect (kestrel/server/chat_template.jinja). The invariants: feeding a text in any pieces gives what
feeding it whole gives, and no control token (or marker cut off by the reply's end) reaches reasoning or content.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kestrel.server.chat import CONTROL_TOKENS, RESPONSE_OPEN, THINK_OPEN, ReplyParser

THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE = "<|open|>response<|sep|>{}<|close|>response<|sep|>"
END = "<|close|>message<|sep|>"
TOOLS = "<|open|>tools<|sep|>{}<|close|>tools<|sep|>"
CALL = '<|open|>call tool="{}" index="{}"<|sep|>{}<|close|>call<|sep|>'
STRING_ARG = '<|open|>argument key="{}" type="string"<|sep|>{}<|close|>argument<|sep|>'
NUMBER_ARG = '<|open|>argument key="{}" type="number"<|sep|>{}<|close|>argument<|sep|>'
WEATHER = CALL.format("get_weather", 1, STRING_ARG.format("city", "Paris") + NUMBER_ARG.format("days", "3"))
WEATHER_ARGS = json.dumps({"city": "Paris", "days": 3})
BUNDLED_ARGS = json.dumps({"city": "Paris", "unit": "°C"})
BUNDLED_CALL = f'<|open|>tool_call name="get_weather"<|sep|>{BUNDLED_ARGS}<|close|>tool_call<|sep|>'


def parse(text: str, cuts: list[int], start: str = THINK_OPEN):
    """Feed text cut at the given positions; (reasoning, content, [(name, arguments)], parser)."""
    parser = ReplyParser(start)
    reasoning = content = ""
    calls: dict[int, dict] = {}
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    for delta in deltas:
        reasoning += delta.reasoning
        content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": "", "id": None})
            if call.id is not None:
                assert entry["id"] is None and entry["arguments"] == ""     # announced before any argument
                entry.update(id=call.id, name=call.name)
            entry["arguments"] += call.arguments
    listed = [calls[i] for i in sorted(calls)]
    assert [(c["id"], c["name"], c["arguments"]) for c in listed] == \
        [(c.id, c.name, c.arguments) for c in parser.calls]                 # deltas add up to the parsed calls
    return reasoning, content, [(c["name"], c["arguments"]) for c in listed], parser


REPLIES = [
    ("k3 content", f"thinking{THINK_CLOSE}{RESPONSE.format('The answer.')}{END}", "thinking", "The answer.", []),
    ("k3 tool call", f"hmm{THINK_CLOSE}{RESPONSE.format('Let me check.')}{TOOLS.format(WEATHER)}{END}", "hmm",
     "Let me check.", [("get_weather", WEATHER_ARGS)]),
    ("k3 two calls, no arguments, json block",
     f"{THINK_CLOSE}{RESPONSE.format('')}"
     + TOOLS.format(CALL.format("a", 1, "") + CALL.format("b&c", 2, '<|open|>json type="object"<|sep|>not json'
                                                           '<|close|>json<|sep|>')) + END,
     "", "", [("a", "{}"), ("b&c", "not json")]),
    ("k3 escaped attributes and JSON values",
     f"r{THINK_CLOSE}{RESPONSE.format('')}"
     + TOOLS.format(CALL.format("a&amp;b", 1, STRING_ARG.format("q&quot;", 'say "hi"\n')
                                + '<|open|>argument key="n" type="array"<|sep|>[1,2, {"x": null}]'
                                  '<|close|>argument<|sep|>'
                                + '<|open|>argument key="b" type="boolean"<|sep|>maybe<|close|>argument<|sep|>')) + END,
     "r", "", [("a&b", json.dumps({'q"': 'say "hi"\n', "n": [1, 2, {"x": None}], "b": "maybe"}))]),
    ("think close skipped: tools end the reasoning", f"I should look it up{TOOLS.format(WEATHER)}{END}",
     "I should look it up", "", [("get_weather", WEATHER_ARGS)]),
    ("call without a tools section", f"x{THINK_CLOSE}{WEATHER}{END}", "x", "", [("get_weather", WEATHER_ARGS)]),
    ("response without a think close", f"r{RESPONSE.format('c')}{END}", "r", "c", []),
    ("text after the message ignored", f"r{THINK_CLOSE}{RESPONSE.format('c')}{END}trailing", "r", "c", []),
    ("stray control tokens dropped, their text kept",
     f"a <|open| b<|open|>x y<|sep|>{THINK_CLOSE}x <|close|>tool y <|sep|><|end_of_msg|>", "a <|open| bx y",
     "x tool y ", []),
    ("a marker cut off by the end dropped", "<|close|>th", "", "", []),
    ("a call cut off in its name dropped", f'r{THINK_CLOSE}c<|open|>tool_call name="get', "r", "c", []),
    ("misplaced markers dropped", f"a<|close|>call<|sep|>b<|open|>argument key=\"k\"<|sep|>c{THINK_CLOSE}d",
     "abc", "d", []),
    ("bundled dialect", f"hmm{THINK_CLOSE}Let me check.{BUNDLED_CALL}{END}", "hmm", "Let me check.",
     [("get_weather", BUNDLED_ARGS)]),
    ("bundled two calls", f"{THINK_CLOSE}{BUNDLED_CALL}{BUNDLED_CALL}", "", "",
     [("get_weather", BUNDLED_ARGS), ("get_weather", BUNDLED_ARGS)]),
]


@pytest.mark.parametrize("name, text, reasoning, content, calls", REPLIES, ids=[r[0] for r in REPLIES])
def test_every_split_gives_the_same_parse(name, text, reasoning, content, calls):
    for cut in range(len(text) + 1):
        for second in (cut, min(len(text), cut + 3), min(len(text), cut + 11)):
            got_reasoning, got_content, got_calls, _ = parse(text, sorted({cut, second}))
            assert (got_reasoning, got_content, got_calls) == (reasoning, content, calls), (cut, second)
    assert parse(text, list(range(1, len(text))))[:3] == (reasoning, content, calls)     # a character at a time


def test_the_prompt_decides_where_the_reply_starts():
    assert parse("Hi<|close|>response<|sep|>", [1], start=RESPONSE_OPEN)[1] == "Hi"       # thinking off
    assert parse("Hi", [1], start="")[1] == "Hi"                                           # not XTML at all
    forced = f'{THINK_OPEN}{THINK_CLOSE}{RESPONSE.format("")}<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
    _, content, calls, _ = parse(STRING_ARG.format("q", "x") + "<|close|>call<|sep|>", [4], start=forced)
    assert content == "" and calls == [("f", '{"q": "x"}')]
    required = f'{THINK_OPEN}{THINK_CLOSE}<|open|>tool_call name="'                      # bundled dialect, required
    assert parse('lookup"<|sep|>{}<|close|>tool_call<|sep|>', [2], start=required)[2] == [("lookup", "{}")]


def test_a_forced_call_is_announced_with_the_first_delta():
    parser = ReplyParser(f'{THINK_OPEN}{THINK_CLOSE}<|open|>tool_call name="f"<|sep|>')
    first = parser.feed("")
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "f", "")] and first.tool_calls[0].id


def test_a_truncated_call_is_still_reported():
    _, _, calls, _ = parse(f'x{THINK_CLOSE}<|open|>tool_call name="get_weather"<|sep|>{{"ci', [5])
    assert calls == [("get_weather", '{"ci')]
    open_argument = STRING_ARG.format("a", "x").removesuffix("<|close|>argument<|sep|>")
    truncated = f'{THINK_CLOSE}<|open|>call tool="f" index="1"<|sep|>{open_argument}'
    assert parse(truncated, [7])[2] == [("f", '{"a": "x')]
    held = f'{THINK_CLOSE}<|open|>call tool="f" index="1"<|sep|><|open|>argument key="n" type="number"<|sep|>12'
    assert parse(held, [3])[2] == [("f", '{"n": 12')]


def test_a_marker_cut_off_by_the_end_is_dropped():
    for cut in ("<|close|>", "<|close|>th", "<|close|>think", '<|open|>tool_call name="get_'):   # by max_tokens
        assert parse("r" + cut, [1])[:2] == ("r", ""), cut
    assert parse("r<|open|>1 + 1", [3])[:2] == ("r1 + 1", "")      # could never be a marker: only the token goes
    assert parse("r<|open|>" + "x" * 600 + "<|sep|>", [9])[0] == "r" + "x" * 600


PIECES = ["<|open|>", "<|close|>", "<|sep|>", "<|", "|>", "think", "response", "tools", "call", "argument", "json",
          "message", "tool_call", ' tool="f"', ' index="1"', ' key="k"', ' type="string"', ' type="number"',
          ' name="g"', " ", "a", "1", '"', "{", "\n", "&quot;", "é", "🙂"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.sampled_from([THINK_OPEN, RESPONSE_OPEN, ""]),
       st.lists(st.integers(0, 400), max_size=6))
@example(["<|open|>", "<|open|>", "think", "<|sep|>", "a"], THINK_OPEN, [8])
@example(["<|close|>", "think", "<|sep|>", "<|open|>", "call", ' tool="f"', "<|sep|>", "<|open|>", "argument",
          ' key="k"', ' type="number"', "<|sep|>", "1", "a"], THINK_OPEN, [20, 40])
def test_any_text_parses_the_same_in_any_split(pieces, start, cuts):
    text = "".join(pieces)
    whole = parse(text, [], start)[:3]
    assert not any(token in whole[0] + whole[1] for token in CONTROL_TOKENS)
    assert parse(text, sorted({min(c, len(text)) for c in cuts}), start)[:3] == whole
    for cut in range(len(text) + 1):
        assert parse(text, [cut], start)[:3] == whole
