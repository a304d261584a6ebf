"""A 1M-token context on the bundled model (issue 62): one 1,048,559-token prompt prefilled and 17 tokens generated
to exactly 1,048,576 tokens, with `context_length=1048576`, prefix caching off, eager, every core's torch thread (what
`kestrel serve --context-length 1048576 --disable-radix-cache` runs); beside it, in the same process, a 1K-token
prompt with 16 decode steps.

Reports prefill tok/s, the decode steps' median ms, the cache bytes the sequence holds (its pages' rows, measured
from the pool tensors, against the memory plan's bytes per token), the KDA state of one sequence (the same at any
context), and the process's peak resident memory. A long run (45 minutes on this 2-core AMD EPYC: the indexer
scores every causal pair of the prompt, 2 x 5.5e11 of them); writes the section "long-context-1m" of
docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_million_context.py [--context 1048576]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_long_context import cache_bytes_per_token, run_prompt  # noqa: E402
from benchmarks.report import machine, markdown_table, write_section  # noqa: E402
from kestrel import LLM  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_million_context.py"
DECODE_STEPS = 16
GIB = 2 ** 30


def state_bytes_per_sequence(llm: LLM) -> int:
    """One sequence's KDA conv and recurrent state over all KDA layers, from the pool tensors."""
    return sum((s.conv[0].nbytes + s.recurrent[0].nbytes) for s in llm.engine.cache.kda)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2 ** 20, help="tokens at the end (default %(default)s)")
    args = parser.parse_args()
    began = time.time()
    llm = LLM(str(BUNDLED_MODEL), context_length=args.context, disable_radix_cache=True)
    run_prompt(llm, 256, 4, seed=0)                                             # warm-up
    rows = []
    for total in (1024, args.context):
        prompt_len = total - DECODE_STEPS - 1                   # the prefill's own token, then the decode steps
        run = run_prompt(llm, prompt_len, DECODE_STEPS, seed=prompt_len)
        rows.append([f"{total:,}", f"{prompt_len / run['prefill_s']:.0f}", f"{run['prefill_s']:.1f}",
                     f"{1000 * statistics.median(run['decode_s']):.1f}",
                     f"{total * cache_bytes_per_token(llm) / GIB:.3f}",
                     f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f}"])
        print(rows[-1], flush=True)
    measured, planned = cache_bytes_per_token(llm), llm.engine.plan.kv_bytes_per_token
    body = "\n\n".join([
        f"## A 1M-token context (`{COMMAND}`)",
        f"Bundled model (k3.1-tiny: indexer top-64, 2 sparse MLA + 4 KDA layers), `context_length={args.context}`, "
        f"prefix caching off, eager, one request alone: a prompt of context - {DECODE_STEPS + 1} tokens, its first "
        f"token, then {DECODE_STEPS} greedy decode steps to exactly the context (median step); the 1K row ran first "
        "in the same process. Cache = the sequence's cached tokens x the pools' measured bytes per token; peak RSS "
        "is the process's so far (the 1M row includes the 1K row's).",
        markdown_table(["context (tokens)", "prefill tok/s", "prefill s", "decode ms/step", "cache GiB",
                        "peak RSS GiB"], rows),
        f"Pools' bytes per cached token, measured from their tensors: {measured:.0f}; the memory plan's formula: "
        f"{planned} ({'equal' if measured == planned else 'DIFFERENT'}). One sequence's KDA state: "
        f"{state_bytes_per_sequence(llm):,} bytes at any context. The run took {(time.time() - began) / 60:.0f} "
        f"minutes ({machine()}).",
    ])
    write_section("long-context-1m", body)
    print(body)


if __name__ == "__main__":
    main()
