"""The forced-call grammar (kestrel/server/tool_grammar.py) against the renderers: what K3's renderer (xtml.py,
checked against Moonshot's) and the bundled chat template write for an assistant call with valid arguments is
accepted token by token after the forced start, end-of-sequence only at the message's end; calls with arguments
the schema refuses or does not declare, or of a tool not asked for, are not."""

from __future__ import annotations

import json

import pytest

from kestrel.engine.structured import GrammarCompiler, GrammarMatcher
from kestrel.engine.tokenizer import Tokenizer
from kestrel.server.chat import ChatPrompt, prompt_ids, render_chat
from kestrel.server.protocol import Message, Tool
from kestrel.server.tool_grammar import forced_call
from kestrel.server.xtml import open_tag, render
from replica import write_kimi_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "unit": {"enum": ["c", "f"]},
                                     "where": {"$ref": "#/$defs/place"},
                                     "note": {"type": ["string", "null"]}},
    "required": ["city", "days"], "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}}}
SEARCH = {"type": "function", "function": {"name": 'say "hi" & go', "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,5}$"}}, "required": ["q"]}}}
TOOLS = [Tool.model_validate(t) for t in (WEATHER, SEARCH)]
VALID = [("get_weather", {"city": "Paris\nN <b>", "days": 3}),
         ("get_weather", {"city": "", "days": 7, "unit": "f", "where": {"lat": -1.5}, "note": None}),
         ("get_weather", {"city": "Rome", "days": 1, "note": "warm"}),
         ('say "hi" & go', {"q": "abc"})]
INVALID = [("get_weather", {"city": "Paris"}),                         # a required argument missing
           ("get_weather", {"city": "Paris", "days": 9}),              # out of range
           ("get_weather", {"city": "Paris", "days": 2, "unit": "k"}),  # not in the enum
           ("get_weather", {"days": 2, "city": "Paris"}),              # not in the schema's order
           ("get_weather", {"city": "a" * 13, "days": 2}),             # too long
           ('say "hi" & go', {"q": "ABC"}),                            # against the pattern
           ('say "hi" & go', {"q": "abc", "page": 2})]                 # a property not declared


@pytest.fixture(scope="module")
def k3_tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("k3-tokenizer")
    write_kimi_tokenizer(folder)
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def bundled_tokenizer(model_folder) -> Tokenizer:
    return Tokenizer.from_folder(model_folder)


def assistant_call(name: str, arguments: dict) -> Message:
    return Message.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})


def k3_reply_ids(tokenizer: Tokenizer, name: str, arguments: dict, named: bool) -> list[int]:
    """The ids K3's renderer writes for the call after the forced start (`<|open|>tools<|sep|>`, and the call's
    opening when named), up to and with the end-of-message token."""
    segments = render([assistant_call(name, arguments)], add_generation_prompt=False)
    start = open_tag("call", [("tool", name), ("index", 1)]) if named else open_tag("tools")
    end = next(i for i in range(len(segments)) if segments[i:i + len(start)] == start) + len(start)
    return prompt_ids(tokenizer, ChatPrompt(segments[end:]), add_special_tokens=False)


def bundled_reply_ids(tokenizer: Tokenizer, name: str, arguments: dict, named: bool) -> list[int]:
    """The ids the bundled chat template writes for the call after the forced start (`<|open|>tool_call name="`,
    and `NAME"<|sep|>` when named)."""
    text = render_chat(tokenizer, [assistant_call(name, arguments)], add_generation_prompt=False).text
    start = f'tool_call name="{name}"<|sep|>' if named else 'tool_call name="'
    return tokenizer.encode(text[text.index(start) + len(start):], add_special_tokens=False)


def accepts(matcher: GrammarMatcher, ids: list[int], eos_ids: list[int]) -> bool:
    """Every id is allowed where it stands; the end-of-message token only where the grammar accepts."""
    *body, end = ids
    assert end in eos_ids
    for token in body:
        mask = matcher.bitmask()
        if not int(mask[token // 32]) >> (token % 32) & 1:
            return False
        assert not matcher.accepting
        matcher.advance(token)
    return matcher.accepting


@pytest.mark.parametrize("bundled", [False, True], ids=["k3", "bundled"])
def test_the_renders_of_valid_calls_are_accepted_and_invalid_ones_refused(request, bundled):
    tokenizer = request.getfixturevalue("bundled_tokenizer" if bundled else "k3_tokenizer")
    reply_ids = bundled_reply_ids if bundled else k3_reply_ids
    grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    eos = tokenizer.eos_token_ids
    required = grammars.compile(forced_call(TOOLS, None, bundled))
    named = grammars.compile(forced_call(TOOLS, "get_weather", bundled))
    for name, arguments in VALID:
        assert accepts(required.matcher(), reply_ids(tokenizer, name, arguments, named=False), eos)
        ids = reply_ids(tokenizer, name, arguments, named=True)
        assert accepts(named.matcher(), ids, eos) == (name == "get_weather")
    for name, arguments in INVALID:
        assert not accepts(required.matcher(), reply_ids(tokenizer, name, arguments, named=False), eos)
