"""Speculative decoding on the CPU with the bundled model (models/k3.1-tiny): plain decoding against NGRAM drafts,
the model's own MTP layer (NEXTN) and the block draft shipped beside it (DFLASH, models/k3.1-tiny-dflash), over 8
requests served one at a time (concurrency 1), in groups of 2 and 4 (the block draft only) and all at once (8).

One run, same machine, float32 (in bfloat16 the verification's batched arithmetic rounds differently from one-token
steps, so near-ties can flip) with the MXFP4 experts held as a float32 copy (packed in the rows that say so),
greedy, EOS ignored. Two workloads from the held-out sample
(heldout_sample.txt): "held-out" continues 64-token stretches of it; "quoting" gives a 96-token stretch and then
its first 32 tokens again, the shape of agentic traffic that quotes earlier text (tool results, code under edit).
Every configuration runs untimed until a pass compiles no new graph (a compiled one compiles its shapes then; at
most WARMUP_PASSES), then ROUNDS times, the configurations taking turns group by group (a slow spell of the shared
machine falls on all alike), and keeps its best time; compiled configurations (enable_torch_compile) are compared
with plain compiled decoding. "token map": --speculative-token-map with the bundled model's map
(models/k3.1-tiny/token_map.pt, written by tools/token_map.py): the block draft chooses among its 1,024 tokens.
"acceptance length" is the mean number of tokens a verification step emits (accepted drafts plus the target's own
token); "same tokens" counts requests whose tokens equal plain (eager) decoding's.
Writes the section "spec" of docs/benchmarks.md after each workload (all of them take over an hour on 2 shared
cores), naming the workloads not yet measured.

Run: .venv/bin/python benchmarks/bench_spec.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_spec.py"
ROUNDS = 3
WARMUP_PASSES = 3
OUTPUT_TOKENS = 96
DFLASH = {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 4,
          "speculative_draft_model_path": str(BUNDLED_MODEL.parent / "k3.1-tiny-dflash")}
CUT = {**DFLASH, "speculative_num_draft_tokens": 6, "speculative_draft_min_confidence": 0.1}
COMPILED = {"enable_torch_compile": True}
TOKEN_MAP = {"speculative_token_map": str(BUNDLED_MODEL / "token_map.pt")}
DENSE, PACKED = {"moe_dense_experts": "float32"}, {"moe_dense_experts": "none"}
CONFIGS = {"plain": {}, "NGRAM k=4": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
           "NEXTN k=1": {"speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 1},
           "NEXTN k=2": {"speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 2},
           "DFLASH k=4": DFLASH, "DFLASH k=6, cut 0.1": CUT, "DFLASH k=4, token map": {**DFLASH, **TOKEN_MAP},
           "DFLASH k=6, cut 0.1, token map": {**CUT, **TOKEN_MAP},
           "plain, packed experts": PACKED, "DFLASH k=4, packed experts": {**DFLASH, **PACKED},
           "plain, compiled": COMPILED, "DFLASH k=4, compiled": {**DFLASH, **COMPILED},
           "DFLASH k=6, cut 0.1, compiled": {**CUT, **COMPILED},
           "DFLASH k=4, compiled, token map": {**DFLASH, **COMPILED, **TOKEN_MAP},
           "DFLASH k=4, compiled, off above 1 sequence": {**DFLASH, **COMPILED,
                                                         "speculative_disable_by_batch_size": 1}}
"""Every configuration holds the MXFP4 experts as a float32 copy (DENSE) unless it says "packed experts"; the
compiled and packed configurations are compared with plain decoding of the same kind, the others with plain."""
BETWEEN = ["plain", "DFLASH k=4", "DFLASH k=6, cut 0.1", "plain, compiled", "DFLASH k=4, compiled",
           "DFLASH k=4, compiled, off above 1 sequence"]
CONCURRENCY = {1: list(CONFIGS), 2: BETWEEN, 4: BETWEEN, 8: list(CONFIGS)}
"""The configurations run at each concurrency: all at 1 and 8, the block draft against plain between (where
speculation stops paying)."""


def compiled_graphs() -> int:
    """How many graphs torch.compile has made in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def baseline(name: str) -> str:
    return next((f"plain, {kind}" for kind in ("compiled", "packed experts") if kind in name), "plain")


def workloads(ids: list[int]) -> dict[str, list[list[int]]]:
    """Eight prompts of each workload."""
    held_out = [ids[i * 200:i * 200 + 64] for i in range(8)]
    quoting = [ids[i * 200:i * 200 + 96] + ids[i * 200:i * 200 + 32] for i in range(8)]
    return {"held-out": held_out, "quoting": quoting}


def serve(llm: LLM, group: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Seconds and tokens per request of serving one group of prompts at once."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in group], params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def measure(engines: dict[str, LLM], names: list[str], prompts: list[list[int]], concurrency: int
            ) -> dict[str, tuple[float, list[list[int]], float]]:
    """Per configuration: the best of ROUNDS times to serve the prompts `concurrency` at a time, one group after
    another; its tokens per request; its acceptance length. Each configuration serves every group untimed until a
    pass compiles no new graph (at most WARMUP_PASSES); then, round by round and group by group, the
    configurations take turns, so a slow spell of a shared machine falls on all of them alike."""
    groups = [prompts[first:first + concurrency] for first in range(0, len(prompts), concurrency)]
    for name in names:
        for _ in range(WARMUP_PASSES):                 # warm-up: compiles the compiled steps' shapes
            graphs = compiled_graphs()
            for group in groups:
                serve(engines[name], group)
            if compiled_graphs() == graphs:
                break
    stats = {name: engines[name].engine.spec_stats for name in names}
    before = {name: (s.verifications, s.accepted_tokens) for name, s in stats.items()}
    seconds = {name: [0.0] * ROUNDS for name in names}
    tokens: dict[str, list[list[int]]] = {name: [] for name in names}
    for r in range(ROUNDS):
        for group in groups:
            for name in names:
                elapsed, group_tokens = serve(engines[name], group)
                seconds[name][r] += elapsed
                if r == ROUNDS - 1:
                    tokens[name] += group_tokens
    results = {}
    for name in names:
        steps = stats[name].verifications - before[name][0]
        accepted = stats[name].accepted_tokens - before[name][1]
        results[name] = (min(seconds[name]), tokens[name], (accepted + steps) / steps if steps else 1.0)
    return results


def main() -> None:
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    engines = {name: LLM(str(BUNDLED_MODEL), dtype="float32", **{**DENSE, **args})
               for name, args in CONFIGS.items()}
    tokenizer = engines["plain"].engine.tokenizer
    ids = tokenizer.encode((BUNDLED_MODEL / "heldout_sample.txt").read_text(), add_special_tokens=False)
    rows = []
    measured = workloads(ids)
    for done, (workload, prompts) in enumerate(measured.items(), 1):
        for concurrency, names in sorted(CONCURRENCY.items()):
            results = measure(engines, names, prompts, concurrency)
            produced = OUTPUT_TOKENS * len(prompts)
            for name in names:
                seconds, tokens, acceptance = results[name]
                same = sum(a == b for a, b in zip(tokens, results["plain"][1]))
                rows.append([workload, concurrency, name, f"{produced / seconds:,.1f}",
                             f"{results[baseline(name)][0] / seconds:.2f}x",
                             f"{acceptance:.2f}" if "plain" not in name else "-", f"{same}/{len(prompts)}"])
                print(rows[-1], flush=True)
        write_section("spec", report(rows, list(measured)[done:], load_before))   # a stopped run keeps its rows


def report(rows: list[list], pending: list[str], load_before: float) -> str:
    """The section's text: the measured rows, and the workloads not measured yet (the run goes on, or stopped)."""
    load_after = os.getloadavg()[0]
    missing = (f" Not measured in this run (it stopped first, or is still running): {', '.join(pending)}."
               if pending else "")
    return "\n\n".join([
        "## Speculative decoding (CPU)",
        "The bundled model in float32, greedy, EOS ignored, 96 output tokens per request, 8 requests per workload "
        "served one at a time (concurrency 1), in groups of 2 or 4, or all at once (8; at 2 and 4 only the block "
        "draft against plain decoding, eager and compiled). \"held-out\": 64-token stretches of the held-out "
        "sample; \"quoting\": a 96-token stretch followed by its first 32 tokens again (text that quotes earlier "
        "text, as tool results and code edits do). NGRAM drafts from the sequence's own earlier tokens; NEXTN from "
        "the model's MTP layer, chained for k > 1; DFLASH from the block draft (`models/k3.1-tiny-dflash`, one "
        "forward per block). The MXFP4 experts are held as a float32 copy (`moe_dense_experts`, +17 MB) except in "
        "the \"packed experts\" rows, which compare with plain decoding from the packed experts (a verification "
        "expands the tiles of up to k+1 times as many experts). \"compiled\": `enable_torch_compile`, decode steps "
        "and verifications of equal drafts compiled by torch.compile (inductor's C++ backend), and the block draft "
        "too (one graph per power-of-two batch), compared with plain compiled decoding; the other rows with plain "
        "eager decoding. \"off above 1 sequence\": `speculative_disable_by_batch_size` 1, no drafts while more "
        "than one sequence runs (compiled, speculation stops paying at 2). \"token map\": "
        "`--speculative-token-map models/k3.1-tiny/token_map.pt`, the block draft choosing among the 1,024 tokens "
        "the model writes most (FR-Spec; its lm_head product cut to those rows). \"cut 0.1\": blocks of up to 6 "
        "drafts, all cut before the draft at which the product of the block draft's probabilities of a block's "
        "drafts, averaged over the step's drafting sequences, falls below 0.1 "
        "(`--speculative-draft-min-confidence 0.1`). Acceptance length: tokens emitted "
        "per verification step. Each configuration ran untimed until a pass compiled no new graph (at most "
        f"{WARMUP_PASSES} passes), then {ROUNDS} times, the configurations taking turns group by group; the table "
        "keeps the best time. "
        f"\"same tokens as plain\": against plain eager decoding.{missing}",
        f"{machine()}; load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores "
        "shared with other work, so compare the ratios, not the absolute rates.",
        markdown_table(["workload", "concurrency", "drafts", "output tok/s", "vs plain", "acceptance length",
                        "same tokens as plain"], rows),
        f"Rerun: `{COMMAND}`",
    ])


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
