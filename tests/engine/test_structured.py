"""Structured outputs (kestrel/engine/structured.py, llguidance) against independent oracles: Python's json module
and UTF-8 decoder for JSON mode at the byte level, the `jsonschema` package for schema outputs, Python's `re` for
regex and grammar outputs; on the bundled model and on the K3 replica fixture. Every output is replayed through a
fresh matcher: each of its tokens was allowed where it stands, and end-of-sequence only once the text is whole."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import tokenizers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from kestrel import LLM, SamplingParams
from kestrel.engine import structured
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.engine.byte_level import CHAR_OF_BYTE
from kestrel.engine.structured import MAX_SPACE, GrammarCompiler, GrammarMatcher, StructuredOutputsParams
from kestrel.engine.tokenizer import Tokenizer

RAW_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x7f"), max_size=8)   # DEL is escaped
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), RAW_TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(RAW_TEXT, inner, max_size=3)),
                      max_leaves=10)
OBJECTS = st.dictionaries(RAW_TEXT, VALUES, max_size=4)
JSON_OBJECT = StructuredOutputsParams(json_object=True)
FLEXIBLE_JSON_OBJECT = StructuredOutputsParams(json_object=True, disable_any_whitespace=False)
EOS = 256                                   # the byte vocabulary's end-of-sequence token, after the 256 bytes

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "minItems": 1, "maxItems": 2}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer",
                                                                                    "minimum": -9, "maximum": 9},
                                                                              "y": {"type": ["integer", "null"],
                                                                                    "minimum": 0, "maximum": 9}},
                                                "required": ["x", "y"], "additionalProperties": False},
                                      "name": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
     "required": ["point", "name"], "additionalProperties": False},
]
REGEXES = [r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", r"(yes|no), because [a-z]{1,6}\.", r"[A-Z][a-z]{0,5}"]
GRAMMAR = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"\n'
GRAMMAR_REGEX = r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)"
CHOICES = ["yes", "no", "no way", 'say "hi" \\ \n', "naïve 你好 🙂", "(a|b)*."]


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def allows(bitmask, token: int) -> bool:
    return bool(int(bitmask[token // 32]) >> (token % 32) & 1)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> Tokenizer:
    """A byte-level vocabulary: token b is byte b, EOS after them, so texts are tested byte by byte."""
    folder = tmp_path_factory.mktemp("byte-vocab")
    tok = tokenizers.Tokenizer(models.BPE({char: byte for byte, char in CHAR_OF_BYTE.items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["[EOS]"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def byte_grammars(byte_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer, EOS + 1)


def feed(matcher: GrammarMatcher, data: bytes) -> bool:
    """Feed data byte by byte, each checked against the mask first; False at the first byte the mask refuses."""
    for byte in data:
        if not allows(matcher.bitmask(), byte):
            return False
        matcher.advance(byte)
    return True


def complete(matcher: GrammarMatcher) -> bool:
    """The text so far is whole: end-of-sequence is allowed (and only then does the matcher accept)."""
    eos = allows(matcher.bitmask(), EOS)
    assert eos == matcher.accepting
    return eos


@settings(max_examples=300, deadline=None)
@given(OBJECTS, st.sampled_from([None, 1, 2]), st.booleans())
def test_every_prefix_of_a_json_object_is_accepted_and_only_the_whole_is_complete(byte_grammars, obj, indent,
                                                                                  ascii_only):
    for constraint, layout in ((JSON_OBJECT, {"separators": (",", ":")}), (FLEXIBLE_JSON_OBJECT, {"indent": indent})):
        data = json.dumps(obj, ensure_ascii=ascii_only, **layout).encode()
        matcher = byte_grammars.compile(constraint).matcher()
        for i, byte in enumerate(data):
            assert feed(matcher, bytes([byte])), data[: i + 1]
            assert complete(matcher) == (i == len(data) - 1)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='{}[]":,0123456789.eE+-truefalsn \\ax', max_size=24))
def test_whatever_the_grammar_completes_is_a_json_object(byte_grammars, text):
    matcher = byte_grammars.compile(FLEXIBLE_JSON_OBJECT).matcher()
    done = feed(matcher, text.encode()) and complete(matcher)
    has_long_space = re.search(r"[ \t\n\r]{%d,}" % (MAX_SPACE + 1), text) is not None
    if done:
        assert is_json_object(text)
    elif is_json_object(text) and not has_long_space and text[:1] == "{" and text.rstrip() == text:
        assert done, text


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=8), st.text(max_size=4).map(str.encode)))
@example(b"\xc3")                       # a lead byte whose character never ends
@example(b"\xff\xfe\x80")               # bytes that start no character
@example(b"\xed\xa0\x80")               # a surrogate
@example(b"\xf0\x9f\x99\x82")           # U+1F642, four bytes
def test_string_bytes_are_accepted_exactly_when_they_are_utf8(byte_grammars, data):
    text = b'{"a":"' + data.replace(b'"', b"").replace(b"\\", b"").replace(b"\x7f", b"") + b'"}'
    try:
        valid = is_json_object(text.decode("utf-8"))
    except UnicodeDecodeError:
        valid = False
    matcher = byte_grammars.compile(JSON_OBJECT).matcher()
    assert (feed(matcher, text) and complete(matcher)) == valid


@pytest.mark.parametrize("text", ['{"a":1,}', '{"a" 1}', '{a:1}', '[1]', '{"a":01}', '{"a":tru e}', '{"a":"\x01"}',
                                  '{"a":1}}', '{"a":"\\q"}', '{"a":1.}', '{} ', ' {}', '{' + ' ' * 21 + '}',
                                  '{"a":"\x7f"}'])
def test_invalid_texts_are_refused(byte_grammars, text):
    for constraint in (JSON_OBJECT, FLEXIBLE_JSON_OBJECT):
        matcher = byte_grammars.compile(constraint).matcher()
        assert not (feed(matcher, text.encode()) and complete(matcher))


def test_json_is_compact_unless_whitespace_is_asked_for(byte_grammars):
    """By default `,` and `:` alone; disable_any_whitespace=False: up to MAX_SPACE whitespace characters per gap."""
    compact, spaced = b'{"ok":true,"n":1}', b'{ "ok" :\ttrue,\n"n":1' + b" " * MAX_SPACE + b"}"
    schema = StructuredOutputsParams(json=SCHEMAS[0])
    flexible_schema = StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=False)
    for constraint, accepted in ((JSON_OBJECT, {compact}), (FLEXIBLE_JSON_OBJECT, {compact, spaced}),
                                 (schema, {compact}), (flexible_schema, {compact, spaced})):
        for text in (compact, spaced):
            jsonschema.validate(json.loads(text), SCHEMAS[0])
            matcher = byte_grammars.compile(constraint).matcher()
            assert (feed(matcher, text) and complete(matcher)) == (text in accepted), (constraint, text)


def test_masks_and_advance_agree_on_a_real_vocabulary():
    """The bundled tokenizer (4,096 tokens, two end-of-sequence ids): along a JSON document every token is allowed,
    both end-of-sequence ids only at the end, and tokens the mask refuses are refused by advance too."""
    tokenizer = Tokenizer.from_folder(BUNDLED_MODEL)
    grammars = GrammarCompiler(tokenizer, 4096)
    document = json.dumps({"name": "héllo 你好", "n": [1, 2.5e3, None, True]}, separators=(",", ":"))
    ids = tokenizer.encode(document, add_special_tokens=False)
    matcher = grammars.compile(JSON_OBJECT).matcher()
    assert len(tokenizer.eos_token_ids) == 2
    for i, token in enumerate(ids):
        mask = matcher.bitmask()
        assert allows(mask, token)
        assert not any(allows(mask, eos) for eos in tokenizer.eos_token_ids)
        refused = [t for t in range(0, 4096, 97) if not allows(mask, t)][:5]
        for t in refused:
            with pytest.raises(ValueError, match="does not allow token"):
                copy = grammars.compile(JSON_OBJECT).matcher()
                for earlier in ids[:i]:
                    copy.advance(earlier)
                copy.advance(t)
        matcher.advance(token)
    assert all(allows(matcher.bitmask(), eos) for eos in tokenizer.eos_token_ids) and matcher.accepting


def test_constraints_state_exactly_one_thing():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar="root ::= \"a\"")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert SamplingParams(json_object=True).structured_outputs == JSON_OBJECT
    with pytest.raises(ValueError, match="json_object"):
        SamplingParams(json_object=True, structured_outputs=StructuredOutputsParams(regex="a"))


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(json={"type": "wrong"}), "the JSON schema cannot be compiled"),
    (StructuredOutputsParams(regex="a(b"), "the regular expression cannot be compiled"),
    (StructuredOutputsParams(grammar="root ::= missing"), "the grammar cannot be compiled"),
])
def test_a_bad_constraint_is_one_sentence(byte_grammars, constraint, message):
    with pytest.raises(ValueError, match=message) as error:
        byte_grammars.compile(constraint)
    assert str(error.value).count("\n") == 0 and str(error.value).endswith(".")


def test_a_choice_accepts_each_of_its_strings_and_nothing_else(byte_grammars):
    """Each string whole, one that begins another too; never a prefix, a longer text, or what a string says as a
    regex; an empty list or a non-string is refused."""
    constraint = StructuredOutputsParams(choice=CHOICES)
    for text in CHOICES:
        matcher = byte_grammars.compile(constraint).matcher()
        assert feed(matcher, text.encode()) and complete(matcher), text
    for text in ["", "ye", "no wa", "yes ", "yesno", "no way!", 'say "hi"', "naïve", "ab."]:
        matcher = byte_grammars.compile(constraint).matcher()
        assert not (feed(matcher, text.encode()) and complete(matcher)), text
    assert constraint.choice == tuple(CHOICES) and constraint.key == StructuredOutputsParams(choice=(*CHOICES,)).key
    for bad in ([], ["a", 1], "yes"):
        with pytest.raises(ValueError, match="choice must be a list of at least one string"):
            StructuredOutputsParams(choice=bad)


def test_compiled_grammars_are_cached_least_recently_used_first(byte_tokenizer):
    grammars = GrammarCompiler(byte_tokenizer, EOS + 1, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first_a, first_b = grammars.compile(a), grammars.compile(b)
    assert grammars.compile(StructuredOutputsParams(regex="a+")) is first_a      # a is now the most recently used
    grammars.compile(c)                                                          # so b goes
    assert grammars.cached() == 2 and grammars.compile(a) is first_a and grammars.compile(b) is not first_b
    schema = grammars.compile(StructuredOutputsParams(json={"type": "object", "required": []}))
    assert grammars.compile(StructuredOutputsParams(json='{"required": [], "type": "object"}')) is schema


@pytest.fixture(scope="module")
def bundled() -> LLM:
    return LLM(str(BUNDLED_MODEL))


@pytest.fixture(scope="module")
def replica(k3_replica_dir) -> LLM:
    return LLM(str(k3_replica_dir), dtype="float32")


def generate(llm: LLM, prompt: str, constraint: StructuredOutputsParams, seeds: int, max_tokens: int):
    params = [SamplingParams(structured_outputs=constraint, temperature=1.0, seed=s, max_tokens=max_tokens)
              for s in range(seeds)]
    return [o.outputs[0] for o in llm.generate([prompt] * seeds, params)]


def assert_replays(llm: LLM, constraint: StructuredOutputsParams, token_ids: list[int]) -> None:
    """Each token was allowed where it stands; a final end-of-sequence only where the text is whole."""
    matcher = llm.engine.grammars.compile(constraint).matcher()
    for token in token_ids:
        assert allows(matcher.bitmask(), token)
        if token in llm.engine.eos_token_ids:
            assert matcher.accepting
        matcher.advance(token)


@pytest.mark.parametrize("which", ["bundled", "replica"])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["scalars", "enum-array", "nested-pattern"])
def test_schema_outputs_validate(request, which, schema):
    llm = request.getfixturevalue(which)
    constraint = StructuredOutputsParams(json=schema)
    for output in generate(llm, "Answer in JSON:", constraint, seeds=3, max_tokens=96):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)
        assert_replays(llm, constraint, output.token_ids)


@pytest.mark.parametrize("which", ["bundled", "replica"])
def test_regex_and_grammar_outputs_match(request, which):
    llm = request.getfixturevalue(which)
    cases = [(StructuredOutputsParams(regex=r), r) for r in REGEXES] + \
        [(StructuredOutputsParams(grammar=GRAMMAR), GRAMMAR_REGEX)]
    for constraint, pattern in cases:
        for output in generate(llm, "Say it:", constraint, seeds=2, max_tokens=48):
            assert_replays(llm, constraint, output.token_ids)
            if output.finish_reason == "stop":
                assert re.fullmatch(pattern, output.text), (pattern, output.text)
            else:       # cut short by max_tokens: still a prefix the grammar can finish
                assert output.finish_reason == "length"


def test_json_object_outputs_are_json_prefixes_and_complete_objects(model_dir):
    llm = LLM(str(model_dir))
    outputs = generate(llm, "the quick brown", JSON_OBJECT, seeds=6, max_tokens=60)
    complete_objects = 0
    for output in outputs:
        assert_replays(llm, JSON_OBJECT, output.token_ids)
        if output.finish_reason == "stop":
            complete_objects += 1
            assert is_json_object(output.text)
    assert complete_objects >= 1


def test_a_bad_constraint_fails_at_once_offline_and_only_its_request_in_the_engine(bundled):
    with pytest.raises(ValueError, match="the regular expression cannot be compiled"):
        bundled.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    engine = bundled.engine
    engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]")))
    engine.add_request("good", "x", SamplingParams(max_tokens=2))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    assert finished["bad"].finish_reason == "error" and "cannot be compiled" in finished["bad"].stop_reason
    assert finished["good"].finish_reason == "length"


def test_the_engine_runs_other_requests_while_a_grammar_compiles(bundled, monkeypatch):
    release = threading.Event()
    compile_grammar = structured._compile

    def slow_compile(constraint, vocabulary):
        assert release.wait(60)
        return compile_grammar(constraint, vocabulary)

    monkeypatch.setattr(structured, "_compile", slow_compile)
    engine = bundled.engine
    slow = StructuredOutputsParams(regex="slow compile [0-9]")
    engine.add_request("constrained", "x", SamplingParams(structured_outputs=slow, max_tokens=20, temperature=0))
    engine.add_request("plain", "x", SamplingParams(max_tokens=3, temperature=0))
    done = set()
    while "plain" not in done:
        done |= {o.request_id for o in engine.step() if o.finished}
    assert "constrained" not in done and engine.requests["constrained"].sequences[0].output_ids == []
    release.set()
    texts = {}
    while engine.has_unfinished_requests():
        texts |= {o.request_id: o.outputs[0].text for o in engine.step() if o.finished}
    assert re.fullmatch("slow compile [0-9]", texts["constrained"])
