"""Kimi tokenizer throughput: kestrel's (tiktoken.model converted at load into a `tokenizers` BPE) against the
tiktoken library on the same rank table, the same pattern and the same text.

K3's own 163,584-rank tiktoken.model cannot be fetched here, so the table is the largest real tiktoken-style table
that a PyPI package ships: Mistral's Tekken v3 (`tekken_240911.json`, 150,000 ranks, in the `mistral-common` wheel,
downloaded once with pip into .cache/ and read without installing it). It is written out as a Kimi folder:
tiktoken.model with those ranks, tokenizer_config.json with K3's special-token table after them
(tests/replica.py), and encoded with Kimi's pattern. Text: kestrel's Python sources (code), the repository's
Markdown (English prose) and a mixed-script document (Chinese, Japanese, Korean, Cyrillic, Greek, Arabic, emoji,
numbers). Each engine encodes and decodes every document; rounds alternate between the two and the median round
counts. The ids of both are compared on every document. Writes the section "tokenizer" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_tokenizer.py
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import tiktoken

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.report import machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.engine.tokenizer import Tokenizer  # noqa: E402
from replica import added_tokens_decoder, tiktoken_encoding  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_tokenizer.py"
TABLE_PACKAGE, TABLE_VERSION = "mistral-common", "1.13.1"
TABLE_MEMBER = "mistral_common/data/tekken_240911.json"
CACHE = ROOT / ".cache" / "bench_tokenizer"
ROUNDS, LOADS = 5, 3
MIXED = [
    "人工智能正在改变世界，大语言模型可以阅读很长的上下文并调用工具。",
    "東京の天気は晴れです。明日は雨が降るかもしれません。",
    "서울의 날씨는 맑습니다. 내일은 비가 올 수도 있습니다.",
    "Москва — столица России; погода сегодня ясная.",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "القاهرة هي عاصمة مصر والطقس اليوم مشمس.",
    "Emoji and numbers: 😀 🎉 👍🏽 🇯🇵 👩‍💻, 3.14159, 2718281828, $19.99, 2026-11-30.",
    "Mixed 中文English混合 text with CamelCase, snake_case and it's-contractions.",
]


def table_tokens() -> list[str]:
    """The Tekken table's base64 tokens in rank order, from the cached mistral-common wheel."""
    wheels = sorted(CACHE.glob(f"mistral_common-{TABLE_VERSION}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(CACHE),
                        f"{TABLE_PACKAGE}=={TABLE_VERSION}"], check=True)
        wheels = sorted(CACHE.glob(f"mistral_common-{TABLE_VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        vocab = json.loads(wheel.read(TABLE_MEMBER))["vocab"]
    return [entry["token_bytes"] for entry in sorted(vocab, key=lambda entry: entry["rank"])]


def write_kimi_folder(folder: Path, tokens: list[str]) -> None:
    """A Kimi tokenizer folder over these ranks, with K3's special-token table after them."""
    (folder / "tiktoken.model").write_text("".join(f"{token} {rank}\n" for rank, token in enumerate(tokens)))
    config = {"added_tokens_decoder": added_tokens_decoder(len(tokens)), "bos_token": "[BOS]",
              "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def documents() -> dict[str, list[str]]:
    """The text, by kind: one document per file, and one seeded mixed-script document."""
    rng = random.Random(0)
    mixed = "\n".join(" ".join(rng.sample(MIXED, 3)) for _ in range(600))
    return {"code (kestrel/**/*.py)": [p.read_text() for p in sorted((ROOT / "kestrel").rglob("*.py"))],
            "prose (*.md)": [p.read_text() for p in sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])],
            "mixed scripts": [mixed]}


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def throughput(kestrel: Tokenizer, oracle: tiktoken.Encoding, docs: list[str]) -> dict[str, object]:
    """Tokens per second of encode and decode, each engine's median round, rounds alternating."""
    ids = [kestrel.encode(d, add_special_tokens=False) for d in docs]
    same = sum(a == oracle.encode(d, allowed_special="all") for a, d in zip(ids, docs))
    tokens = sum(map(len, ids))
    rounds: dict[str, list[float]] = {"kestrel encode": [], "tiktoken encode": [], "kestrel decode": [],
                                      "tiktoken decode": []}
    for _ in range(ROUNDS):
        rounds["kestrel encode"].append(seconds(lambda: [kestrel.encode(d, add_special_tokens=False) for d in docs]))
        rounds["tiktoken encode"].append(seconds(lambda: [oracle.encode(d, allowed_special="all") for d in docs]))
        rounds["kestrel decode"].append(seconds(lambda: [kestrel.decode(i) for i in ids]))
        rounds["tiktoken decode"].append(seconds(lambda: [oracle.decode(i) for i in ids]))
    rate = {name: tokens / statistics.median(seconds) for name, seconds in rounds.items()}
    return {"tokens": tokens, "documents": len(docs), "identical": same, **rate}


def main() -> None:
    tokens = table_tokens()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_kimi_folder(folder, tokens)
        load_kestrel = statistics.median(seconds(lambda: Tokenizer.from_folder(folder)) for _ in range(LOADS))
        load_tiktoken = statistics.median(seconds(lambda: tiktoken_encoding(folder)) for _ in range(LOADS))
        kestrel, oracle = Tokenizer.from_folder(folder), tiktoken_encoding(folder)
        results = {kind: throughput(kestrel, oracle, docs) for kind, docs in documents().items()}
    rows = []
    for kind, r in results.items():
        print(json.dumps({"text": kind, **r}))
        rows.append([kind, r["tokens"], f"{r['identical']}/{r['documents']}",
                     f"{r['kestrel encode'] / 1e6:.2f}", f"{r['tiktoken encode'] / 1e6:.2f}",
                     f"{r['kestrel encode'] / r['tiktoken encode']:.2f}",
                     f"{r['kestrel decode'] / 1e6:.2f}", f"{r['tiktoken decode'] / 1e6:.2f}",
                     f"{r['kestrel decode'] / r['tiktoken decode']:.2f}"])
    print(f"load: kestrel {load_kestrel:.2f} s, tiktoken {load_tiktoken:.2f} s")
    body = "\n\n".join([
        "## Tokenizer: Kimi's tiktoken.model in kestrel vs the tiktoken library",
        f"The rank table is Mistral's Tekken v3 ({len(tokens):,} ranks, from the `{TABLE_PACKAGE}` {TABLE_VERSION} "
        "wheel; K3's own 163,584-rank file is not available offline) with K3's 256 reserved tokens after it and "
        "Kimi's pre-tokenizer pattern. kestrel converts the ranks at load into a `tokenizers` byte-level BPE; "
        "tiktoken is the library Moonshot's own tokenizer wraps. One thread each; each engine's median of "
        f"{ROUNDS} alternating rounds over all documents. Million tokens per second; ratio = kestrel / tiktoken; "
        "\"same ids\" counts documents both encode identically.",
        machine(),
        f"Load (parse the ranks, convert, read the configs; median of {LOADS}): kestrel {load_kestrel:.2f} s, "
        f"tiktoken {load_tiktoken:.2f} s.",
        markdown_table(["text", "tokens", "same ids", "encode kestrel", "encode tiktoken", "ratio",
                        "decode kestrel", "decode tiktoken", "ratio"], rows),
        f"Rerun: `{COMMAND}`",
    ])
    write_section("tokenizer", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
