"""A small, faithful replica of a published Kimi K3 checkpoint folder, for testing the text path as users run it.

The published folder holds config.json (K3's layout: `text_config` inside a `kimi_k3` config), bf16 safetensors
shards with an index, Kimi's tiktoken tokenizer (`tiktoken.model`, base64 token and rank per line; 163,584 ranks)
with `tokenizer_config.json` naming the 256 reserved special ids after the ranks, `generation_config.json` whose
`eos_token_id` is `<|end_of_msg|>`, and no tokenizer.json. The replica has the same files and layout, tiny random
weights, and a real tiktoken BPE trained here (a few hundred merges over a small mixed-script corpus); its
special-token table is the published one (names, order, offsets after the ranks, special flags).
`tiktoken_encoding` reads such a folder with the tiktoken library: the tests' oracle.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe

from kestrel.config import parse_config
from kestrel.models.checkpoint import build_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config

K3_NUM_RANKS = 163_584
NUM_RESERVED = 256
# Published tokenizer_config.json added_tokens_decoder, as offsets after the ranks: (offset, name, special).
K3_ADDED_TOKENS = [
    (0, "[BOS]", True), (1, "[EOS]", True), (2, "<|end_of_msg|>", True),
    (3, "<|open|>", False), (4, "<|close|>", False), (5, "<|sep|>", False),
    (6, "[start_header_id]", True), (7, "[end_header_id]", True), (9, "[EOT]", True),
    (18, "<|media_begin|>", True), (19, "<|media_content|>", True), (20, "<|media_end|>", True),
    (21, "<|media_pad|>", True), (65, "<osagent_mode>", True), (254, "[UNK]", True), (255, "[PAD]", True),
]
# The published pre-tokenizer pattern (model-spec section 10), written out here apart from kestrel's copy.
PATTERN = (r"[\p{Han}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
           r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
           r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS_OFFSET, END_OF_MSG_OFFSET, MEDIA_PAD_OFFSET, PAD_OFFSET = 0, 2, 21, 255
NUM_MERGES = 400
SHARD_BYTES = 256 * 1024        # small shards, so the replica has several and an index, as the published one
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what they'd said they'll do, and we've done it.",
    "Kimi K3 serves long contexts: 1,048,576 tokens, 93 layers, 896 experts, 16 routed + 2 shared.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    '{"role": "user", "content": "What is the weather in Paris?", "tools": [{"name": "get_weather"}]}',
    "人工智能正在改变世界。我们今天学习中文分词和大语言模型。你好，世界！",
    "日本語のテキストを分割します。東京は晴れです。ひらがなとカタカナ。",
    "한국어 문장도 있습니다. 서울의 날씨는 맑습니다.",
    "Русский текст для проверки. Ελληνικά κείμενα. العربية نص قصير.",
    "Emoji: 😀 🎉 👍🏽 🇯🇵 👩‍💻 🦀 ❤️ and more 🙂🙂🙂.",
    "CamelCaseWords, snake_case_words, SHOUTING WORDS, MixedCASEwords and McDonald's.",
    "    indented   text\twith\ttabs\r\nand windows newlines\n\n\nand blank lines   \n",
    "Numbers: 3.14159, 2718281828, 0x1F600, 1e-5, -42, 100%, $19.99, 2026-11-30.",
]


def train_ranks(texts: list[str], num_merges: int) -> list[bytes]:
    """Token bytes in rank order: the 256 single bytes, then one token per byte-pair merge, most frequent pair
    first (ties broken by the pair's bytes), learnt over words cut from `texts`."""
    words = Counter(w.encode() for text in texts for w in re.findall(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\w\s]+|\s+", text))
    pieces = {tuple(bytes([b]) for b in word): count for word, count in words.items()}
    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    for _ in range(num_merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for piece, count in pieces.items():
            for pair in zip(piece, piece[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        if best[0] + best[1] not in known:
            tokens.append(best[0] + best[1])
            known.add(best[0] + best[1])
        pieces = {_merge(piece, best): count for piece, count in pieces.items()}
    return tokens


def _merge(piece: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(piece):
        if piece[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(piece[i])
            i += 1
    return tuple(out)


def added_tokens_decoder(num_ranks: int) -> dict[str, dict]:
    """tokenizer_config.json's added_tokens_decoder for a vocabulary of `num_ranks` ranks, in the published form."""
    return {str(num_ranks + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": special}
            for offset, name, special in K3_ADDED_TOKENS}


def write_kimi_tokenizer(folder: Path, num_merges: int = NUM_MERGES) -> int:
    """Write tiktoken.model, tokenizer_config.json and generation_config.json as K3 ships them; return the number
    of ranks (the first reserved id)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = train_ranks(CORPUS, num_merges)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    (folder / "tiktoken.model").write_text("".join(lines))
    config = {
        "added_tokens_decoder": added_tokens_decoder(len(tokens)),
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "clean_up_tokenization_spaces": False, "eos_token": "[EOS]",
        "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer", "unk_token": "[UNK]",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": len(tokens) + END_OF_MSG_OFFSET}))
    return len(tokens)


def write_k3_replica(folder: Path) -> None:
    """A K3-layout checkpoint folder with tiny random bf16 weights in several shards and the Kimi tokenizer."""
    folder = Path(folder)
    num_ranks = write_kimi_tokenizer(folder)
    ids = {"bos_token_id": num_ranks + BOS_OFFSET, "eos_token_id": num_ranks + END_OF_MSG_OFFSET,
           "pad_token_id": num_ranks + PAD_OFFSET}
    raw = tiny_config("k3-tiny")
    raw.update(ids, dtype="bfloat16", media_placeholder_token_id=num_ranks + MEDIA_PAD_OFFSET)
    raw["text_config"].update(ids, vocab_size=num_ranks + NUM_RESERVED)
    model = init_weights(build_model(parse_config(raw), torch.bfloat16), seed=0, std=0.1)
    save_model(model, folder, max_shard_bytes=SHARD_BYTES, config_json=raw)


def tiktoken_encoding(folder: Path) -> tiktoken.Encoding:
    """The tiktoken library's encoding of a Kimi folder: its ranks, PATTERN, and the 256 reserved tokens named
    from tokenizer_config.json (`<|reserved_token_ID|>` where unnamed), as Moonshot's wrapper builds it."""
    data = (folder / "tiktoken.model").read_bytes()      # the hash keeps tiktoken's path-keyed cache honest
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"), expected_hash=hashlib.sha256(data).hexdigest())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    names = {int(i): token["content"] for i, token in config.get("added_tokens_decoder", {}).items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + NUM_RESERVED)}
    return tiktoken.Encoding(folder.name, pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)
