"""JSON mode's automaton against Python's json module, and the engine constrained by it."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kestrel import LLM, SamplingParams
from kestrel.engine.json_mode import MAX_SPACE, JsonState, JsonTokenMasks, advance

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=10)
OBJECTS = st.dictionaries(st.text(max_size=6), VALUES, max_size=4)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@settings(max_examples=300, deadline=None)
@given(OBJECTS, st.sampled_from([None, 1, 2]), st.booleans())
def test_every_prefix_of_a_json_object_is_accepted_and_only_the_whole_is_complete(obj, indent, ascii_only):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only)
    data = text.encode()
    state = JsonState()
    for i, byte in enumerate(data):
        state = advance(state, bytes([byte]))
        assert state is not None, text[: i + 1]
        assert state.complete == (i == len(data) - 1)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='{}[]":,0123456789.eE+-truefalsn \\ax', max_size=24))
def test_whatever_the_automaton_completes_json_parses(text):
    state = advance(JsonState(), text.encode())
    has_long_space = re.search(r"[ \t\n\r]{%d,}" % (MAX_SPACE + 1), text) is not None
    if state is not None and state.complete:
        assert is_json_object(text)
    elif is_json_object(text) and not has_long_space and text.lstrip()[:1] == "{" and text.rstrip() == text:
        assert state is not None and state.complete, text


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=8), st.text(max_size=4).map(str.encode)))
@example(b"\xc3")                       # a lead byte whose character never ends: was accepted
@example(b"\xff\xfe\x80")               # bytes that start no character: were accepted
@example(b"\xed\xa0\x80")               # a surrogate
@example(b"\xf0\x9f\x99\x82")           # U+1F642, four bytes
def test_string_bytes_are_accepted_exactly_when_they_are_utf8(data):
    text = b'{"a":"' + data.replace(b'"', b"").replace(b"\\", b"") + b'"}'
    try:
        valid = is_json_object(text.decode("utf-8"))
    except UnicodeDecodeError:
        valid = False
    state = advance(JsonState(), text)
    assert (state is not None and state.complete) == valid


@pytest.mark.parametrize("text", ['{"a":1,}', '{"a" 1}', '{a:1}', '[1]', '{"a":01}', '{"a":tru e}', '{"a":"\x01"}',
                                  '{"a":1}}', '{"a":"\\q"}', '{"a":1.}', '{} '])
def test_invalid_texts_are_refused(text):
    state = advance(JsonState(), text.encode())
    assert state is None or not state.complete


def test_token_masks_follow_the_automaton_and_allow_eos_only_at_the_end():
    tokens = [b"{", b"}", b'"a"', b":", b"1", b" ", b"x", None, b'"a":1}']
    masks = JsonTokenMasks(tokens, eos_token_ids=[7])
    start = masks.allowed(JsonState())
    assert start.tolist() == [True, False, False, False, False, True, False, False, False]
    inside = advance(JsonState(), b"{")
    assert masks.allowed(inside).tolist() == [False, True, True, False, False, True, False, False, True]
    done = advance(JsonState(), b'{"a":1}')
    assert done.complete and masks.allowed(done).tolist() == [False] * 7 + [True, False]


def test_engine_json_mode_produces_json_prefixes_and_complete_objects(model_dir):
    llm = LLM(str(model_dir))
    params = [SamplingParams(json_object=True, temperature=1.0, seed=s, max_tokens=60) for s in range(6)]
    outputs = llm.generate(["the quick brown"] * 6, params)
    complete = 0
    for output in outputs:
        completion = output.outputs[0]
        assert advance(JsonState(), completion.text.encode()) is not None
        if completion.finish_reason == "stop":
            complete += 1
            assert is_json_object(completion.text)
    assert complete >= 1
