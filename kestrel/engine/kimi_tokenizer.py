"""Kimi's tiktoken tokenizer, as the published checkpoints ship it, converted into a `tokenizers` byte-level BPE.

A Kimi folder has no tokenizer.json. Its vocabulary is `tiktoken.model`: one `<base64 token bytes> <rank>` line
per token (163,584 for K3), and the 256 ids after the ranks are reserved special tokens, named by
tokenizer_config.json's `added_tokens_decoder` and `<|reserved_token_ID|>` otherwise.

tiktoken encodes each piece the pre-tokenizer pattern cuts out as one token when the piece is in the table, and
otherwise merges bytes: each step joins the adjacent pair whose concatenation has the lowest rank. A BPE whose
merges are all the ways to split each token into two tokens, ordered by the token's rank, does the same, given
`ignore_merges` (a piece that is in the vocabulary is taken whole); tests/engine/test_kimi_tokenizer.py checks it
against tiktoken. The conversion runs once, at load (about 2 s for 150,000 ranks).

Like Moonshot's own wrapper, encoding cuts the text first: into 400,000-character chunks, and each chunk where a
run of whitespace or of non-whitespace grows past 25,000 characters (the wrapper's workaround for tiktoken issue
195). The cuts change the tokens of such long runs, so kestrel makes the same ones.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from .byte_level import CHAR_OF_BYTE

TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_TOKENS = 256
MAX_ENCODE_CHARS = 400_000      # the wrapper's chunk length
MAX_RUN_CHARS = 25_000          # the longest run of whitespace or of non-whitespace it encodes in one piece

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"      # cased-upper-or-other letters and marks, not Han
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
"""Kimi's pre-tokenizer: o200k's case-aware rules with Han excluded from the letter classes, after a Han rule."""

_RUN = re.compile(r"\s+|\S+")      # Python's \s is str.isspace, which the wrapper tests


@dataclass(frozen=True)
class ReservedToken:
    """One of the 256 ids after the ranks; `special` tokens are control tokens, the others decode as text."""

    id: int
    name: str
    special: bool


def parse_ranks(data: bytes) -> dict[bytes, int]:
    """Token bytes -> rank from the lines of a tiktoken file; ranks must be 0..n-1 and cover all 256 bytes.

    Raises ValueError (saying which line, or what is missing) for anything else.
    """
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            encoded, rank = line.split()
            ranks[binascii.a2b_base64(encoded, strict_mode=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"line {number} is not '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("its ranks are not the numbers 0 to n-1, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"it lacks the single-byte token {missing[0]:#04x}")
    return ranks


def reserved_tokens(num_ranks: int, added_tokens_decoder: Mapping[str, Any]) -> list[ReservedToken]:
    """The 256 reserved tokens after `num_ranks` ranks, named from tokenizer_config.json's added_tokens_decoder.

    Unnamed ids are `<|reserved_token_ID|>`; every reserved token is special unless the config says
    `"special": false`. Raises ValueError for an entry outside the reserved ids or a name given twice.
    """
    named: dict[int, tuple[str, bool]] = {}
    for key, token in added_tokens_decoder.items():
        content = token.get("content") if isinstance(token, dict) else None
        if not key.isdigit() or not isinstance(content, str):
            raise ValueError(f"added_tokens_decoder entry {key!r} is not an id with a content string")
        if not num_ranks <= int(key) < num_ranks + NUM_RESERVED_TOKENS:
            raise ValueError(f"added_tokens_decoder names id {key} ({content!r}), outside the reserved ids "
                             f"{num_ranks}-{num_ranks + NUM_RESERVED_TOKENS - 1} that follow the ranks")
        named[int(key)] = (content, token.get("special", True) is not False)
    tokens = [ReservedToken(i, *named.get(i, (f"<|reserved_token_{i}|>", True)))
              for i in range(num_ranks, num_ranks + NUM_RESERVED_TOKENS)]
    names = [t.name for t in tokens]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"added_tokens_decoder names {duplicate!r} twice")
    return tokens


def bpe_backend(ranks: Mapping[bytes, int], reserved: list[ReservedToken],
                pattern: str = KIMI_PATTERN) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` that encodes as tiktoken does with these ranks and `pattern`.

    Every reserved token becomes a special added token at its id, so the backend's `encode_special_tokens`
    switch makes all of them plain text, as tiktoken's `disallowed_special=()` does. Raises ValueError when a
    reserved name is also spelled by an ordinary token (the two could not keep their separate ids).
    """
    latin1_to_chars = str.maketrans({chr(b): c for b, c in CHAR_OF_BYTE.items()})
    vocab = {token.decode("latin-1").translate(latin1_to_chars): rank for token, rank in ranks.items()}
    clash = next((t.name for t in reserved if t.name in vocab), None)
    if clash is not None:
        raise ValueError(f"the reserved token {clash!r} is also an ordinary token of the ranks")
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_merges(vocab), ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    ordered = sorted(reserved, key=lambda t: t.id)
    backend.add_special_tokens([AddedToken(t.name, special=True, normalized=False) for t in ordered])
    misplaced = next((t for t in ordered if backend.token_to_id(t.name) != t.id), None)
    if misplaced is not None:
        raise ValueError(f"the reserved token {misplaced.name!r} did not land on id {misplaced.id}")
    return backend


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, by the token's rank, then by the two halves' ranks."""
    merges: list[tuple[str, str]] = []
    rank_of = vocab.get
    for token in sorted(vocab, key=rank_of):
        splits = []
        for cut in range(1, len(token)):
            left_rank = rank_of(token[:cut])
            if left_rank is not None:
                right_rank = rank_of(token[cut:])
                if right_rank is not None:
                    splits.append((left_rank, right_rank, token[:cut], token[cut:]))
        splits.sort()
        merges.extend((left, right) for _, _, left, right in splits)
    return merges


def text_pieces(text: str) -> Iterator[str]:
    """`text` cut as Moonshot's wrapper cuts it before encoding: 400,000-character chunks, each cut again every
    25,000 characters of a longer run of whitespace or non-whitespace. The pieces join back to `text`."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        yield from _cut_long_runs(text[start:start + MAX_ENCODE_CHARS])


def _cut_long_runs(chunk: str) -> Iterator[str]:
    if len(chunk) <= MAX_RUN_CHARS:
        yield chunk
        return
    start = 0
    for run in _RUN.finditer(chunk):
        for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
            yield chunk[start:cut]
            start = cut
    yield chunk[start:]
