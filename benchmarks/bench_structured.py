"""Structured outputs: the per-token cost of the next-token mask, kestrel's llguidance matcher against the
hand-written JSON automaton it replaced, at vocabularies of 4,096 and 163,840 tokens (K3's size), in one run.

Vocabularies: Kimi tokenizer folders (tiktoken.model with K3's 256 reserved tokens after the ranks, as
bench_tokenizer.py writes them) over Mistral's Tekken v3 rank table: its first 3,840 ranks for 4,096; all its
150,000 ranks plus 13,584 seeded concatenations of two of its tokens for 163,840. Constraint: one JSON object
(json_object, the one thing the old mask could do). Text: a JSON document of nested objects, arrays, numbers and
non-ASCII strings, tokenized by each vocabulary; for every token the mask of the current state is computed and
the token consumed, and the mean time per token is reported (the old automaton cached masks per state, so
repeated states were free: that is counted). The old automaton is read from git (kestrel/engine/json_mode.py at
OLD_COMMIT) and run unchanged. xgrammar, when installed (`pip install xgrammar`; kestrel does not depend on it),
is measured the same way, for the record of why llguidance was chosen; "compile" is the cost of a new grammar.
Writes the section "structured" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_structured.py
"""

from __future__ import annotations

import base64
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.bench_tokenizer import table_tokens, write_kimi_folder  # noqa: E402
from benchmarks.report import machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.engine.structured import GrammarCompiler, StructuredOutputsParams, apply_token_bitmasks  # noqa: E402
from kestrel.engine.tokenizer import Tokenizer  # noqa: E402
from replica import NUM_RESERVED  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_structured.py"
OLD_COMMIT = "14bdd8b"          # the last commit with the hand-written JSON mask
VOCAB_SIZES = (4_096, 163_840)
ROUNDS = 5
DOCUMENT = json.dumps({
    "model": "Kimi K3", "layers": 93, "experts": {"routed": 16, "shared": 2, "total": 896},
    "attention": ["KDA", "gated MLA"], "ratio": 0.75, "mxfp4": True, "note": "héllo, 世界 🙂",
    "items": [{"id": i, "value": i * 1.5, "label": f"item {i}"} for i in range(3)],
}, indent=2, ensure_ascii=False)
JSON_OBJECT = StructuredOutputsParams(json_object=True, disable_any_whitespace=False)     # DOCUMENT is indented


def old_json_mode() -> types.ModuleType:
    """kestrel/engine/json_mode.py as it was at OLD_COMMIT."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:kestrel/engine/json_mode.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("old_json_mode")
    sys.modules[module.__name__] = module          # dataclasses look their module up while building the class
    exec(compile(source, "old_json_mode.py", "exec"), module.__dict__)
    return module


def rank_table(num_ranks: int, tekken: list[str]) -> list[str]:
    """num_ranks base64 tokens: Tekken's first ones, then seeded concatenations of two Tekken tokens."""
    if num_ranks <= len(tekken):
        return tekken[:num_ranks]
    pool = [base64.b64decode(token) for token in tekken[256:20_000]]
    known = {base64.b64decode(token) for token in tekken}
    rng, out = random.Random(0), list(tekken)
    while len(out) < num_ranks:
        token = rng.choice(pool) + rng.choice(pool)
        if token not in known:
            known.add(token)
            out.append(base64.b64encode(token).decode())
    return out


def per_token(run: Callable[[], None], tokens: int, rounds: int) -> float:
    """Median seconds per token of `run` (one pass over the document) across rounds."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times)


def measure_old(old: types.ModuleType, tokenizer: Tokenizer, ids: list[int]) -> float:
    """The old automaton, with a fresh per-state mask cache (as each engine started)."""
    token_bytes = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]

    def run() -> None:
        masks, state = old.JsonTokenMasks(token_bytes, tokenizer.eos_token_ids), old.JsonState()
        for token in ids:
            assert masks.allowed(state)[token]
            state = old.advance(state, token_bytes[token])
    return per_token(run, len(ids), rounds=1)


def measure_llguidance(tokenizer: Tokenizer, ids: list[int]) -> dict[str, float]:
    start = time.perf_counter()
    grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    grammars.vocabulary()
    vocabulary = time.perf_counter() - start
    start = time.perf_counter()
    compiled = grammars.compile(JSON_OBJECT)
    compile_s = time.perf_counter() - start

    def run() -> None:
        matcher = compiled.matcher()
        for token in ids:
            matcher.bitmask()
            matcher.advance(token)
    mask = per_token(run, len(ids), ROUNDS)
    logits, bitmask = torch.randn(1, tokenizer.vocab_size), compiled.matcher().bitmask()
    apply = per_token(lambda: [apply_token_bitmasks(logits, [0], [bitmask]) for _ in ids], len(ids), ROUNDS)
    return {"mask": mask, "apply": apply, "compile": compile_s, "vocabulary": vocabulary}


def measure_xgrammar(tokenizer: Tokenizer, ids: list[int]) -> dict[str, float] | None:
    if importlib.util.find_spec("xgrammar") is None:
        return None
    import xgrammar

    vocab = [b"" if t in tokenizer.added_ids else tokenizer.token_bytes(t) or b""
             for t in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                                  stop_token_ids=tokenizer.eos_token_ids)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_builtin_json_grammar()
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def run() -> None:
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token)
    return {"mask": per_token(run, len(ids), ROUNDS), "compile": compile_s}


def main() -> None:
    torch.set_num_threads(1)
    old, tekken = old_json_mode(), table_tokens()
    rows, notes = [], []
    for size in VOCAB_SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            write_kimi_folder(Path(tmp), rank_table(size - NUM_RESERVED, tekken))
            tokenizer = Tokenizer.from_folder(tmp)
        assert tokenizer.vocab_size == size
        ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
        new = measure_llguidance(tokenizer, ids)
        old_s = measure_old(old, tokenizer, ids)
        xgr = measure_xgrammar(tokenizer, ids)
        result = {"vocab": size, "tokens": len(ids), "old": old_s, "llguidance": new, "xgrammar": xgr}
        print(json.dumps(result))
        rows.append([f"{size:,}", len(ids), f"{old_s * 1e3:.3f}", f"{new['mask'] * 1e3:.4f}",
                     f"{old_s / new['mask']:,.0f}", f"{new['apply'] * 1e3:.4f}", f"{new['compile'] * 1e3:.2f}",
                     f"{xgr['mask'] * 1e3:.4f}" if xgr else "not installed",
                     f"{xgr['compile'] * 1e3:.2f}" if xgr else "-"])
        notes.append(f"{size:,}: {new['vocabulary']:.2f} s")
    body = "\n\n".join([
        "## Structured outputs: next-token mask per token, llguidance vs the old hand-written JSON mask",
        "Constraint: one JSON object. Per token: compute the mask of the current state, then consume the token, "
        "over a JSON document tokenized by each vocabulary (Tekken v3 ranks with K3's 256 reserved tokens; 163,840 "
        "adds seeded merges). Old: kestrel/engine/json_mode.py at " + OLD_COMMIT + " (walks the vocabulary in Python "
        "for each new state, caches per state; one pass). llguidance: kestrel's GrammarMatcher, median of "
        f"{ROUNDS} passes; \"apply\" unpacks the bitmask onto [1, V] fp32 logits on the CPU; \"compile\" is a new "
        "grammar. xgrammar (not a kestrel dependency) the same way, for the record of the choice. Milliseconds; "
        "speed-up = old / llguidance.",
        machine(),
        markdown_table(["vocab", "tokens", "old mask", "llguidance mask", "speed-up", "llguidance apply",
                        "llguidance compile", "xgrammar mask", "xgrammar compile"], rows),
        "llguidance's view of the vocabulary, built once per engine on first use: " + ", ".join(notes) + ".",
        f"Rerun: `{COMMAND}`",
    ])
    write_section("structured", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
