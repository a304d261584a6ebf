"""Tokenizer loading and streaming detokenization, on a real byte-level BPE trained here on mixed-script text.

Oracles: the full `decode` of all generated ids (streamed pieces must add up to it and never run ahead of it),
and that text cut at the first stop string to complete.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kestrel.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Streaming text one token at a time is harder than it looks.",
    "Café, naïve, résumé, façade, über, jalapeño, smörgåsbord, Ærø, Łódź.",
    "日本語のテキストを分割します。中文分词很有趣。你好，世界！",
    "한국어 문장도 있습니다. Ελληνικά κείμενα. Русский текст.",
    "Emoji: 😀 🎉 👍🏽 🇯🇵 👩‍💻 🦀 ❤️ — and a thumbs up 👍.",
]
SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[PAD]"]
TEMPLATE = "{% for m in messages %}<|open|>{{ m.role }}<|sep|>{{ m.content }}<|close|>{% endfor %}"
TEXTS = [
    "Hello world, hello there!",
    "Café naïve résumé über façade",
    "日本語のテキスト、中文分词。",
    "Emoji 😀🎉👍🏽🇯🇵👩‍💻🦀 mixed with text",
    "한국어 Ελληνικά Русский 🦀 ok",
    "  leading spaces and\nnew lines\tand tabs  ",
    "unseen: ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ß ǅ ﷽ 🧬🪐",
]


def _train() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 30, trainer)
    tok.add_special_tokens(SPECIALS)      # after the ranks, as in K3
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer() -> HFTokenizer:
    return _train()


def write_folder(folder: Path, hf: HFTokenizer, config: dict | None = None, generation: dict | None = None) -> Path:
    """A model folder holding tokenizer.json and, when given, the two configs."""
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def k3_like_config(hf: HFTokenizer, **overrides) -> dict:
    """A tokenizer_config.json shaped like the family's: AddedToken dicts, added_tokens_decoder, a chat template."""
    config = {
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]", "special": True},
        "pad_token": "[PAD]",
        "add_bos_token": True,
        "chat_template": TEMPLATE,
        "added_tokens_decoder": {str(hf.token_to_id(t)): {"content": t, "special": True} for t in SPECIALS[:3]},
        "additional_special_tokens": ["<|open|>", {"content": "<|close|>"}, "<|sep|>"],
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer, tmp_path_factory) -> Tokenizer:
    folder = write_folder(tmp_path_factory.mktemp("k3tok"), hf_tokenizer, k3_like_config(hf_tokenizer),
                          {"eos_token_id": [hf_tokenizer.token_to_id("<|end_of_msg|>"),
                                            hf_tokenizer.token_to_id("[EOS]")]})
    return Tokenizer.from_folder(folder)


def tid(tokenizer: Tokenizer, token: str) -> int:
    return tokenizer.encode(token, add_special_tokens=False)[0]


Streamed = tuple[list[str], str, IncrementalDetokenizer]


def stream(tokenizer: Tokenizer, ids: list[int], prompt: Sequence[int] = (), **kwargs) -> Streamed:
    """(piece returned by each add(), what finish() returned, the detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.finish(), detok


def first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop string whose first occurrence ends first (longest on a tie)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    end, start, stop = min(found)
    return start, end, stop


def char_boundaries(tokenizer: Tokenizer, ids: list[int]) -> set[int]:
    """Character offsets in decode(ids) where a token ends on a whole character."""
    prefixes = (tokenizer.decode(ids[:k]) for k in range(len(ids) + 1))
    return {len(t) for t in prefixes if not t.endswith("\ufffd")}


# --- loading, encode, decode ---------------------------------------------------------------------------------

def test_round_trip_mixed_script(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    emoji = tokenizer.encode("🧬", add_special_tokens=False)
    assert len(emoji) > 1 and tokenizer.decode(emoji[:1]) == "\ufffd"    # one character, several tokens


def test_special_tokens_in_text_are_recognised(tokenizer):
    ids = tokenizer.encode("<|open|>user<|sep|>hi<|close|>", add_special_tokens=False)
    assert ids[0] == tid(tokenizer, "<|open|>") and ids[-1] == tid(tokenizer, "<|close|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|open|>user<|sep|>hi<|close|>"
    assert tokenizer.decode(ids) == "userhi"


def test_bos_follows_add_bos_token(tokenizer, hf_tokenizer, tmp_path):
    bos = tokenizer.bos_token_id
    assert bos == hf_tokenizer.token_to_id("[BOS]")
    assert tokenizer.encode("Hello")[0] == bos
    assert tokenizer.encode("Hello", add_special_tokens=False)[0] != bos
    assert tokenizer.encode("[BOS]Hello").count(bos) == 1             # a template's BOS is not doubled
    assert tokenizer.decode(tokenizer.encode("Hello")) == "Hello"
    without = Tokenizer.from_folder(write_folder(tmp_path, hf_tokenizer,
                                                 k3_like_config(hf_tokenizer, add_bos_token=False)))
    assert without.bos_token_id == bos and bos not in without.encode("Hello")


def test_eos_ids_merged_from_both_configs(tokenizer, hf_tokenizer, tmp_path):
    eos, end_of_msg = hf_tokenizer.token_to_id("[EOS]"), hf_tokenizer.token_to_id("<|end_of_msg|>")
    assert tokenizer.eos_token_ids == [eos, end_of_msg]
    single = Tokenizer.from_folder(write_folder(tmp_path / "a", hf_tokenizer, k3_like_config(hf_tokenizer),
                                                {"eos_token_id": end_of_msg}))
    assert single.eos_token_ids == [eos, end_of_msg]
    generation_only = Tokenizer.from_folder(write_folder(tmp_path / "b", hf_tokenizer, None,
                                                         {"eos_token_id": end_of_msg, "bos_token_id": 7}))
    assert generation_only.eos_token_ids == [end_of_msg] and generation_only.bos_token_id == 7


def test_config_fields(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == hf_tokenizer.get_vocab_size(with_added_tokens=True)
    assert tokenizer.pad_token_id == hf_tokenizer.token_to_id("[PAD]")
    assert tokenizer.special_ids == frozenset(hf_tokenizer.token_to_id(t) for t in SPECIALS)
    assert tokenizer.chat_template == TEMPLATE


def test_tokenizer_json_alone(hf_tokenizer, tmp_path):
    bare = Tokenizer.from_folder(write_folder(tmp_path, hf_tokenizer))
    assert bare.bos_token_id is None and bare.eos_token_ids == [] and bare.chat_template is None
    assert bare.special_ids == frozenset(hf_tokenizer.token_to_id(t) for t in SPECIALS)   # tokenizer.json marks them
    assert bare.encode("Hello") == bare.encode("Hello", add_special_tokens=False)


def test_chat_template_forms(hf_tokenizer, tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    listed = Tokenizer.from_folder(write_folder(tmp_path / "a", hf_tokenizer, {"chat_template": named}))
    assert listed.chat_template == "D"
    folder = write_folder(tmp_path / "b", hf_tokenizer, {})
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert Tokenizer.from_folder(folder).chat_template == TEMPLATE


def test_token_text(tokenizer):
    assert tokenizer.token_text(tid(tokenizer, "<|end_of_msg|>")) == "<|end_of_msg|>"
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    assert "".join(tokenizer.token_text(i) for i in hello) == "Hello"
    assert tokenizer.token_text(tokenizer.encode("🧬", add_special_tokens=False)[0]) == "\ufffd"


def test_skip_special_tokens_decode(tokenizer):
    ids = [tokenizer.bos_token_id, *tokenizer.encode("Hi 😀", add_special_tokens=False), tid(tokenizer, "[EOS]")]
    assert tokenizer.decode(ids) == "Hi 😀"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "[BOS]Hi 😀[EOS]"


@pytest.mark.parametrize("write, message", [
    (None, "No tokenizer.json"),
    ("{this is not json", "not a valid Hugging Face tokenizer"),
    ('{"model": {"type": "Unknown"}}', "not a valid Hugging Face tokenizer"),
])
def test_bad_tokenizer_json(tmp_path, write, message):
    if write is not None:
        (tmp_path / "tokenizer.json").write_text(write)
    with pytest.raises(TokenizerError, match=message) as err:
        Tokenizer.from_folder(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


@pytest.mark.parametrize("config, generation, message", [
    ("{broken", None, "tokenizer_config.json is not readable JSON"),
    ("[1, 2]", None, "must hold a JSON object"),
    ({"eos_token": "<|nope|>"}, None, "eos_token is '<|nope|>', which is not in tokenizer.json"),
    ({"add_bos_token": True}, None, "sets add_bos_token but names no bos_token"),
    (None, {"eos_token_id": [3, 10**6]}, "eos_token_id holds 1000000"),
])
def test_bad_configs(hf_tokenizer, tmp_path, config, generation, message):
    write_folder(tmp_path, hf_tokenizer)
    for name, content in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_folder(tmp_path)


# --- streaming --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_stream_texts(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Some prompt: ")
    pieces, tail, detok = stream(tokenizer, ids, prompt)
    assert all("\ufffd" not in p for p in pieces + [tail])
    assert "".join(pieces) + tail == detok.text == text
    assert detok.stop_string is None and detok.stop_token_index is None


def test_stream_holds_back_split_characters(tokenizer):
    ids = tokenizer.encode("a🧬b", add_special_tokens=False)
    pieces, tail, _ = stream(tokenizer, ids)
    assert "" in pieces and "🧬" in "".join(pieces) and tail == ""


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_stream_random_ids(tokenizer, seed, skip):
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(12))]
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    emitted = ""
    for i in ids:
        emitted += detok.add(i)
        assert full.startswith(emitted)          # never runs ahead: a U+FFFD only where the full decode has one
    emitted += detok.finish()
    assert emitted == detok.text == full


def test_stream_prompt_ending_inside_a_character(tokenizer):
    dna = tokenizer.encode("🧬", add_special_tokens=False)
    ids = tokenizer.encode(" and more 😀", add_special_tokens=False)
    pieces, tail, _ = stream(tokenizer, ids, tokenizer.encode("x") + dna[:1])
    assert "".join(pieces) + tail == tokenizer.decode(ids)


def test_stream_decodes_short_windows(tokenizer, monkeypatch):
    ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    widths = []
    decode = tokenizer.decode

    def recording_decode(window, *args, **kwargs):
        widths.append(len(window))
        return decode(window, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", recording_decode)
    pieces, tail, _ = stream(tokenizer, ids, list(range(40)))
    monkeypatch.undo()
    assert len(ids) > 300 and max(widths) <= 12
    assert "".join(pieces) + tail == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_stream_skip_special_tokens(tokenizer, skip):
    ids = [tid(tokenizer, "<|open|>"), *tokenizer.encode("Hi 😀", add_special_tokens=False),
           tid(tokenizer, "<|end_of_msg|>")]
    pieces, tail, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(pieces) + tail == ("Hi 😀" if skip else "<|open|>Hi 😀<|end_of_msg|>")


# --- stop strings -----------------------------------------------------------------------------------------------

def check_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str], include: bool) -> tuple[int, int]:
    """Stream `ids` with `stops`; check text, matched stop and stop token index against the full decode."""
    full = tokenizer.decode(ids)
    start, end, stop = first_stop(full, stops)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q: "), stop=stops, include_stop_str_in_output=include)
    expected = full[:end] if include else full[:start]
    emitted = ""
    for i in ids:
        emitted += detok.add(i)
        if detok.stop_string is None:
            assert full[:start].startswith(emitted)          # no part of the stop string before it completes
        else:
            assert emitted == expected
    emitted += detok.finish()
    assert emitted == detok.text == expected
    assert detok.stop_string == stop
    assert detok.stop_token_index == next(k for k in range(1, len(ids) + 1)
                                          if tokenizer.decode(ids[:k]).startswith(full[:end]))
    assert detok.add(ids[0]) == "" and detok.finish() == "" and detok.text == expected
    return start, end


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text", TEXTS[:5])
def test_stop_strings_everywhere(tokenizer, text, include):
    """Every substring of up to 5 characters as the stop string: mid-token starts and token-spanning stops."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    boundaries = char_boundaries(tokenizer, ids)
    mid_token = spanning = 0
    for length in range(1, 6):
        for at in range(len(text) - length + 1):
            start, end = check_stop(tokenizer, ids, [text[at:at + length]], include)
            mid_token += start not in boundaries
            spanning += any(start < b < end for b in boundaries)
    assert mid_token > 0 and spanning > 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_on_random_ids(tokenizer, include):
    rng = random.Random(7)
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(60)]
        full = tokenizer.decode(ids)
        at = rng.randrange(len(full) - 4)
        stop = full[at:at + rng.randint(1, 4)]
        if "\ufffd" not in stop:
            check_stop(tokenizer, ids, [stop, "never in there ∅"], include)


def test_first_completed_stop_wins(tokenizer):
    ids = tokenizer.encode("xx abcdefg yy", add_special_tokens=False)
    check_stop(tokenizer, ids, ["abcdefg", "cde"], include=False)          # "cde" completes first
    check_stop(tokenizer, ids, ["bcd", "abcd"], include=True)               # same end: the longer one
    _, _, detok = stream(tokenizer, ids, stop=["bcd", "abcd"])
    assert detok.stop_string == "abcd" and detok.text == "xx "


def test_stop_string_across_split_emoji(tokenizer):
    ids = tokenizer.encode("go 🧬 now", add_special_tokens=False)
    check_stop(tokenizer, ids, ["🧬"], include=True)
    check_stop(tokenizer, ids, [" 🧬 n"], include=False)


def test_partial_stop_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("say wor", add_special_tokens=False)
    pieces, tail, detok = stream(tokenizer, ids, stop=["world"])
    assert "".join(pieces) == "say " and tail == "wor" and detok.stop_string is None
    assert detok.text == "say wor"


def test_stop_on_special_token_text(tokenizer):
    ids = [*tokenizer.encode("done", add_special_tokens=False), tid(tokenizer, "<|end_of_msg|>"), 300, 301]
    pieces, tail, detok = stream(tokenizer, ids, skip_special_tokens=False, stop=["<|end_of_msg|>"])
    assert detok.text == "done" and detok.stop_token_index == len(ids) - 2


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])
