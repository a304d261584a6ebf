"""Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json, no tokenizer.json), as kestrel loads it.

Oracle: the tiktoken library, built from the same files with the pre-tokenizer pattern written out from
model-spec section 10 and the special-token table read from tokenizer_config.json, unnamed reserved ids being
`<|reserved_token_ID|>` (tests/replica.py `tiktoken_encoding`); and the reference wrapper's cutting of long runs,
written out character by character. The vocabulary is the replica's: a real BPE of a few hundred merges over
mixed-script text. Everything is seeded or exhaustive; nothing is timed.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiktoken

from kestrel.engine import kimi_tokenizer
from kestrel.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from replica import (CORPUS, K3_ADDED_TOKENS, K3_NUM_RANKS, NUM_RESERVED, PATTERN, tiktoken_encoding,
                     write_kimi_tokenizer)

TEXTS = CORPUS + [
    "",
    "a",
    "   leading, trailing and   interior   runs   ",
    "\n\n\n  \t\t \r\n\r\n \u3000\u00a0\u2003 x \u200b\ufeff",
    "digits 1 12 123 1234 12345678901234567890 ١٢٣٤ ٣.١٤ ⅣⅫ ①②",
    "I'M HERE, YOU'RE THERE, HE'LL GO, SHE'D STAY, WE'VE SEEN, IT'S MINE, DON'T. i'm it's we're",
    "AI人工智能Model在2026年ReleasedÜberMaßstab 中文English混合",
    "e\u0301 a\u030a n\u0303 (combining) é å ñ (composed) ǅungla ǈ Ǉ",
    "👩‍👩‍👧‍👦 🏳️‍🌈 🧑🏿‍🚀 👍🏽 🇺🇳 #️⃣ 🫠🪿",
    "Ünïcödé ΑΒΓ αβγ ÆØÅ æøå İstanbul ß ẞ ﬁ ﬂ Ꭰ ꮰ",
    "tabs\tand\tnew\nlines\r\nwindows\rmac   \n   \n",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment\nif x: print(f\"{x!r:>10}\")\n\treturn -1;",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𠀀𠀁𪚥 \U0010fffd \ue000",
    "special strings: [BOS] <|end_of_msg|> <|open|>think<|sep|>x<|close|> <osagent_mode> [PAD]<|media_pad|>",
    "reserved: <|reserved_token_{base_plus_8}|> and a near miss <|end_of_msg|| and [BOS",
    Path(kimi_tokenizer.__file__).read_text(encoding="utf-8"),
]
RANDOM_ALPHABET = "aZ0 \n\t中文日本'sé😀👍🏽.,!-_<|>[]\u00a0\u3000\u0301ß"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi-tokenizer")
    write_kimi_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def oracle(folder) -> tiktoken.Encoding:
    return tiktoken_encoding(folder)


def texts(oracle: tiktoken.Encoding) -> list[str]:
    """TEXTS (with a real reserved id filled in) and 200 seeded random strings over a mixed alphabet."""
    rng = random.Random(0)
    randoms = ["".join(rng.choices(RANDOM_ALPHABET, k=rng.randint(1, 40))) for _ in range(200)]
    base = oracle.n_vocab - NUM_RESERVED
    return [t.replace("{base_plus_8}", str(base + 8)) for t in TEXTS] + randoms


def reference_pieces(text: str, max_chars: int = 400_000, max_run: int = 25_000) -> Iterator[str]:
    """Moonshot's wrapper: fixed chunks, then a cut wherever a whitespace or non-whitespace run passes max_run."""
    for start in range(0, len(text), max_chars):
        chunk = text[start:start + max_chars]
        run, run_is_space, cut = 0, chunk[0].isspace(), 0
        for i, char in enumerate(chunk):
            if char.isspace() != run_is_space:
                run, run_is_space = 1, char.isspace()
            else:
                run += 1
                if run > max_run:
                    yield chunk[cut:i]
                    cut, run = i, 1
        yield chunk[cut:]


# --- special tokens and loading -----------------------------------------------------------------------------

def test_special_tokens_match_tokenizer_config(tokenizer, folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    base = tokenizer.vocab_size - NUM_RESERVED
    assert [(int(i) - base, t["content"], t["special"]) for i, t in config["added_tokens_decoder"].items()] \
        == K3_ADDED_TOKENS
    for offset, name, special in K3_ADDED_TOKENS:
        assert tokenizer.encode(name, add_special_tokens=False) == [base + offset]
        assert tokenizer.token_text(base + offset) == name
        assert (base + offset in tokenizer.special_ids) == special
    named = {base + offset for offset, _, _ in K3_ADDED_TOKENS}
    unnamed = [i for i in range(base, base + NUM_RESERVED) if i not in named]
    assert all(tokenizer.encode(f"<|reserved_token_{i}|>") == [i] for i in unnamed)
    assert set(unnamed) <= tokenizer.special_ids
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (base, base + 255)
    assert tokenizer.eos_token_ids == [base + 1, base + 2]        # [EOS], then generation_config's <|end_of_msg|>
    assert tokenizer.chat_template is None and not tokenizer.add_bos_token


def test_k3_table_has_the_published_ids():
    """The replica's table, put after K3's 163,584 ranks, gives the ids the model card and configs state."""
    published = {"[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587,
                 "<|close|>": 163588, "<|sep|>": 163589, "[start_header_id]": 163590, "[end_header_id]": 163591,
                 "[EOT]": 163593, "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                 "<|media_pad|>": 163605, "<osagent_mode>": 163649, "[UNK]": 163838, "[PAD]": 163839}
    assert {name: K3_NUM_RANKS + offset for offset, name, _ in K3_ADDED_TOKENS} == published


def test_folder_without_a_tokenizer(tmp_path):
    assert Tokenizer.from_folder_or_none(tmp_path) is None
    with pytest.raises(TokenizerError, match="No tokenizer.json or tiktoken.model in"):
        Tokenizer.from_folder(tmp_path)


def _ranks_file(tokens: list[bytes]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))


BYTES = [bytes([b]) for b in range(256)]


@pytest.mark.parametrize("ranks, added, message", [
    (_ranks_file(BYTES) + "not-base64! 256\n", {}, "not a valid tiktoken file \\(line 257 is not"),
    (_ranks_file(BYTES).replace(" 255\n", " 300\n"), {}, "ranks are not the numbers 0 to n-1"),
    (_ranks_file(BYTES[1:]), {}, "lacks the single-byte token 0x00"),
    (_ranks_file(BYTES), {"10": {"content": "[BOS]", "special": True}}, "does not fit tiktoken.model: "
     "added_tokens_decoder names id 10 \\('\\[BOS\\]'\\), outside the reserved ids 256-511"),
    (_ranks_file(BYTES), {"256": {"content": "[X]"}, "257": {"content": "[X]"}}, "names '\\[X\\]' twice"),
    (_ranks_file(BYTES + [b"[BOS]"]), {"257": {"content": "[BOS]"}}, "cannot be served as a byte-level BPE"),
])
def test_bad_tiktoken_folders(tmp_path, ranks, added, message):
    (tmp_path / "tiktoken.model").write_text(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    with pytest.raises(TokenizerError, match=message) as err:
        Tokenizer.from_folder(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


# --- encoding ---------------------------------------------------------------------------------------------------

def test_encode_matches_tiktoken(tokenizer, oracle):
    for text in texts(oracle):
        assert tokenizer.encode(text) == oracle.encode(text, allowed_special="all"), text
        assert tokenizer.encode(text, allow_special=False) == oracle.encode(text, disallowed_special=()), text


def test_special_strings_are_text_unless_allowed(tokenizer, oracle):
    text = "a<|end_of_msg|>b<|open|>[PAD]"
    allowed, plain = tokenizer.encode(text), tokenizer.encode(text, allow_special=False)
    assert set(allowed) & tokenizer.special_ids and all(i < oracle.n_vocab - NUM_RESERVED for i in plain)
    assert tokenizer.decode(plain) == tokenizer.decode(allowed, skip_special_tokens=False) == text


def test_every_codepoint_class_splits_as_tiktoken(tokenizer, oracle):
    """All code points below U+3000, every 61st above, and all whitespace, each in letter, digit, Han, case and
    space contexts: both regex engines must cut them alike (Unicode tables and \\s included)."""
    points = [c for c in range(0x110000) if (c < 0x3000 or c % 61 == 0 or chr(c).isspace())
              and not 0xD800 <= c < 0xE000]
    contexts = [f"a{c}b {c}{c}1{c} 中{c}A{c}'S\n{c}\t{c}" for c in map(chr, points)]
    for start in range(0, len(contexts), 2000):
        text = " ".join(contexts[start:start + 2000])
        assert tokenizer.encode(text, allow_special=False) == oracle.encode(text, disallowed_special=()), start


def test_pieces_in_the_table_are_taken_whole(tmp_path):
    """tiktoken looks a whole piece up before merging: a token no merge path reaches is still used."""
    tokens = BYTES + [b"ab", b"xyz", b" xyz", b"abab"]          # no "xy", "yz" or " x" to merge through
    (tmp_path / "tiktoken.model").write_text(_ranks_file(tokens))
    tokenizer = Tokenizer.from_folder(tmp_path)
    ranks = {t: i for i, t in enumerate(tokens)}
    oracle = tiktoken.Encoding("whole", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    for text in ["xyz", " xyz xyz", "xyzxyz", "abab ab", "ababab"]:
        assert tokenizer.encode(text) == oracle.encode(text), text
    assert tokenizer.encode(" xyz") == [258]


def test_reserved_tokens_that_decode_as_text(tmp_path):
    """A reserved token the config marks "special": false is text: any spelling, spaces and non-ASCII included."""
    name = "<|思 考|>"
    (tmp_path / "tiktoken.model").write_text(_ranks_file(BYTES))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"256": {"content": name, "special": False}}}))
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.encode(f"a{name}b") == [97, 256, 98] and 256 not in tokenizer.special_ids
    assert tokenizer.decode([97, 256, 98]) == f"a{name}b" and tokenizer.token_bytes(256) == name.encode()


@pytest.mark.parametrize("text", [
    "a" * 25_000, "a" * 25_001, " " * 60_001 + "x", "x" + "\n" * 50_000 + "y" * 26_000,
    ("ab" * 13_000 + " ") * 2, "word " * 80_002,
], ids=["25000", "25001", "spaces", "newlines-then-letters", "two-long-words", "over-one-chunk"])
def test_long_runs_are_cut_as_the_reference_wrapper(tokenizer, oracle, text):
    assert list(kimi_tokenizer.text_pieces(text)) == list(reference_pieces(text))
    expected = [i for piece in reference_pieces(text) for i in oracle.encode(piece, allowed_special="all")]
    assert tokenizer.encode(text) == expected


# --- decoding and streaming -------------------------------------------------------------------------------------

def test_round_trips(tokenizer, oracle):
    for text in texts(oracle):
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
        assert tokenizer.decode(tokenizer.encode(text, allow_special=False)) == text


def test_decode_and_token_bytes_match_tiktoken(tokenizer, oracle):
    rng = random.Random(1)
    for _ in range(300):
        ids = rng.choices(range(oracle.n_vocab), k=rng.randint(1, 12))
        assert tokenizer.decode(ids, skip_special_tokens=False) == oracle.decode(ids)
        assert tokenizer.decode(ids) == oracle.decode([i for i in ids if i not in tokenizer.special_ids])
    for i in range(oracle.n_vocab):
        expected = None if i in tokenizer.special_ids else oracle.decode_single_token_bytes(i)
        assert tokenizer.token_bytes(i) == expected, i


def test_streaming_never_breaks_utf8(tokenizer, oracle):
    prompt = tokenizer.encode("Prompt: 你好 🙂 ")
    for text in texts(oracle):
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
        pieces = [detok.add(i) for i in ids] + [detok.finish()]
        assert all("\ufffd" not in piece for piece in pieces), text
        assert "".join(pieces) == detok.text == text


def test_streaming_random_ids_adds_up_to_the_full_decode(tokenizer, oracle):
    """Ids that cut characters anywhere: each emitted piece is whole text, and all of it is the full decode."""
    rng = random.Random(2)
    for _ in range(200):
        ids = rng.choices(range(oracle.n_vocab), k=rng.randint(1, 20))
        detok = IncrementalDetokenizer(tokenizer, [])
        streamed = [detok.add(i) for i in ids]
        full = tokenizer.decode(ids)
        assert "".join(streamed) + detok.finish() == full
        assert full.startswith("".join(streamed))
