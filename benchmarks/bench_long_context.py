"""Long context on the bundled model (issue 62): offline decode step time after a 1K, 8K, 32K and 128K-token prompt
and prefill tok/s at 1K, 4K, 32K and 128K, with `context_length=133120` and prefix caching off (what
`kestrel serve --context-length 133120 --disable-radix-cache` runs), eager, one torch thread. Issue 62's targets:
decode at 128K within 1.5x of 1K, prefill tok/s at 128K at least half of 1K's.

Per context one random prompt, then `--decode-steps` greedy tokens; the engine's steps are timed one by one: the
prompt's chunks (prefill tok/s = prompt tokens / the time until its first token) and the decode steps after it
(median ms; the 1K prompt's decode runs again at the end, the base of the ratios its median over both runs' steps).
The bundled model's indexer keeps 64 keys per query and its KDA state does not grow, so what a decode
step does beyond the indexer's scan over the past keys should not grow with the context.

`--save FILE` keeps this run's numbers (JSON); `--before FILE` puts a saved run beside this one in the table (the
numbers before a change, measured with the code as it was): by default benchmarks/long_context_before.json, the
run before issue 62's fixes (dense attention over the whole context, a full sort for the top-k). Writes the
section "long-context" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_long_context.py [--before FILE] [--save FILE] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.plot import Panel, line_charts  # noqa: E402
from benchmarks.report import DOC, THREADS, machine, markdown_table, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.cookbook.hardware import CPU, CpuSpeed, measure_cpu  # noqa: E402
from kestrel.cookbook.layout import Layout  # noqa: E402
from kestrel.cookbook.planner import PlanRequest, plan  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402
from kestrel.layers.mla import LightningIndexer  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_long_context.py"
CONTEXT_LENGTH = 133120
BEFORE = Path(__file__).resolve().parent / "long_context_before.json"
DECODE_CONTEXTS = (1024, 8192, 32768, 131072)
PREFILL_CONTEXTS = (1024, 4096, 32768, 131072)
PLOT = DOC.parent / "long-context.svg"
MIB = 2 ** 20


def cache_bytes_per_token(llm: LLM) -> float:
    """The paged pools' bytes per cached token, from their tensors (every MLA layer's latents, index keys, scales)."""
    cache = llm.engine.cache
    rows = cache.mla[0].latent.values.shape[0]
    tensors = [t for layer in cache.mla for paged in (layer.latent, layer.index_keys) if paged is not None
               for t in (paged.values, paged.scales) if t is not None]
    return sum(t.nbytes for t in tensors) / rows


class SelectTimer:
    """Wall time the engine spends in LightningIndexer.select (the indexer's scan and top-k, every layer), added up
    from `reset` on; installed for the whole process."""

    def __init__(self) -> None:
        self.seconds = 0.0
        select = LightningIndexer.select

        @functools.wraps(select)
        def timed(indexer, *args, **kwargs):
            began = time.perf_counter()
            try:
                return select(indexer, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began
        LightningIndexer.select = timed

    def reset(self) -> float:
        """The seconds added up since the last reset."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run_prompt(llm: LLM, prompt_len: int, decode_steps: int, seed: int, timer: SelectTimer) -> dict:
    """One request alone in the engine: prefill seconds until its first token, and each decode step's seconds and
    the seconds it spent in the indexer's selection."""
    engine = llm.engine
    prompt = torch.randint(10, 4000, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    engine.add_request(f"ctx-{prompt_len}-{seed}", prompt, params)
    steps, produced = [], 0
    while engine.has_unfinished_requests():
        timer.reset()
        began = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - began
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs) if outputs else produced
        steps.append((elapsed, timer.reset(), tokens > produced))
        produced = max(produced, tokens)
    first = next(i for i, (*_, made) in enumerate(steps) if made)
    return {"prefill_s": sum(t for t, *_ in steps[:first + 1]), "decode_s": [t for t, *_ in steps[first + 1:]],
            "select_s": [s for _, s, _ in steps[first + 1:]]}


def planned(context: int, speed: CpuSpeed) -> dict:
    """What `kestrel plan --model models/k3.1-tiny --hardware cpu --engine kestrel --tp 1 --context C --measure`
    predicts for one token at `context` (seconds, lower bounds): the indexer's scan, a decode token's and a prompt
    token's context-dependent work."""
    result = plan(PlanRequest(model=str(BUNDLED_MODEL), hardware=CPU, engine="kestrel", layout=Layout(tp=1),
                              batches=(1,), context=context, cpu_speed=speed, compare_devices=False))
    cost, (bandwidth, flop_rate) = result.context_cost, result.rank_speed
    return {"index_scan_s": cost.index_scan.seconds(bandwidth, flop_rate),
            "decode_s": cost.decode_seconds(bandwidth, flop_rate), "prefill_s": cost.prefill_seconds(flop_rate)}


def measure(decode_steps: int) -> dict:
    """Every context once (after a short warm-up request), the shortest decoded again at the end: decode median ms
    (the shortest context's over both of its runs), prefill tok/s."""
    torch.set_num_threads(THREADS)
    speed = measure_cpu(THREADS)
    timer = SelectTimer()
    llm = LLM(str(BUNDLED_MODEL), context_length=CONTEXT_LENGTH, disable_radix_cache=True)
    run_prompt(llm, 256, 4, seed=0, timer=timer)                                # warm-up
    result: dict = {"decode_ms": {}, "select_ms": {}, "prefill_tok_s": {}}
    for context in sorted(set(DECODE_CONTEXTS) | set(PREFILL_CONTEXTS)):
        run = run_prompt(llm, context, decode_steps if context in DECODE_CONTEXTS else 1, seed=context, timer=timer)
        if context == DECODE_CONTEXTS[0]:
            first_run = run
        if context in DECODE_CONTEXTS:
            result["decode_ms"][str(context)] = 1000 * statistics.median(run["decode_s"])
            result["select_ms"][str(context)] = 1000 * statistics.median(run["select_s"])
        if context in PREFILL_CONTEXTS:
            result["prefill_tok_s"][str(context)] = context / run["prefill_s"]
        print(f"context {context}: prefill {context / run['prefill_s']:.0f} tok/s, decode "
              f"{1000 * statistics.median(run['decode_s']):.1f} ms/step" if run["decode_s"] else "", flush=True)
    # The shortest context's decode once more, last: its steps pooled with the first run's, so that the machine's
    # drift over the run weighs on the base of the ratios as on the longest context.
    first, again = DECODE_CONTEXTS[0], run_prompt(llm, DECODE_CONTEXTS[0], decode_steps, seed=1, timer=timer)
    result["decode_ms"][str(first)] = 1000 * statistics.median(first_run["decode_s"] + again["decode_s"])
    result["select_ms"][str(first)] = 1000 * statistics.median(first_run["select_s"] + again["select_s"])
    print(f"context {first} again: decode {1000 * statistics.median(again['decode_s']):.1f} ms/step", flush=True)
    result["cache_bytes_per_token"] = cache_bytes_per_token(llm)
    result["cpu"] = {"bandwidth": speed.bandwidth, "flop_rate": speed.flop_rate, "threads": speed.threads}
    result["machine"] = machine()
    result["load"] = os.getloadavg()[0]
    return result


def report(after: dict, before: dict | None, args: argparse.Namespace) -> str:
    label = "this run" if before is None else "after"
    first = str(DECODE_CONTEXTS[0])
    header = ["measure", *(["before"] if before else []), label, *(["before/after"] if before else [])]

    def row(name: str, key: str, context: str, fmt: str, ratio_of: str | None = None) -> list[str]:
        cells = [name]
        b, a = (before or {}).get(key, {}).get(context), after[key][context]
        if before:
            cells.append("-" if b is None else format(b, fmt))
        cells.append(format(a, fmt))
        if before:
            cells.append("-" if b is None else f"{b / a:.2f}x" if key == "decode_ms" else f"{a / b:.2f}x")
        return cells

    rows = [row(f"decode ms/step at {int(c) // 1024}K", "decode_ms", str(c), ".1f") for c in DECODE_CONTEXTS]
    rows += [row(f"prefill tok/s at {int(c) // 1024}K", "prefill_tok_s", str(c), ".0f") for c in PREFILL_CONTEXTS]
    per_token = after["cache_bytes_per_token"]
    rows += [[f"KV cache held at {c // 1024}K (MiB)", *(["-"] if before else []), f"{c * per_token / MIB:.1f}",
              *(["-"] if before else [])] for c in DECODE_CONTEXTS]

    def growth(r: dict) -> str:
        ratios = [(f"decode at {int(c) // 1024}K / 1K", r["decode_ms"][c] / r["decode_ms"][first])
                  for c in ("32768", "131072") if c in r["decode_ms"]]
        ratios += [(f"prefill tok/s at {int(c) // 1024}K / {int(base) // 1024}K",
                    r["prefill_tok_s"][c] / r["prefill_tok_s"][base])
                   for c, base in (("32768", "4096"), ("131072", "1024")) if c in r["prefill_tok_s"]
                   and base in r["prefill_tok_s"]]
        return "; ".join(f"{name}: {value:.2f}x" for name, value in ratios)

    lines = [f"## Long context (`{COMMAND}`)",
             f"Bundled model (k3.1-tiny: indexer top-64, 2 sparse MLA + 4 KDA layers), `context_length="
             f"{CONTEXT_LENGTH}`, prefix caching off, eager, one request alone; {args.decode_steps} decode steps "
             "per context (median; 1K's decode runs first and again last, its median over both runs' steps, so "
             "that the machine's drift during the run weighs on the ratios' base as on the long contexts); "
             "prefill tok/s = prompt tokens / time to the first token (chunks of 2,048). "
             "The ratio column is before/after for ms and after/before for tok/s (above 1 = faster).",
             markdown_table(header, rows),
             *prediction_tables(after),
             f"![decode step time and KV cache against context]({PLOT.name})",
             "By design a decode step still grows with the indexer's scan (every past index key read and scored per "
             "token; on the CPU one kernel, `kestrel_cpu::indexer_topk`, keeps each token's best positions as it "
             "scores them) and a prefill chunk with the scores of all its causal keys (O(T^2) over a prompt, 128 "
             "fused multiply-adds per token and key per layer); attention reads the 64 selected latents per query, "
             "and KDA's state and the MoE do not grow. The before run went to 32K only (`context_length=40960`)."]
    if before:
        lines.append(f"Before: {growth(before)} ({before['machine']}, load {before['load']:.1f}).")
    lines.append(f"{label.capitalize()}: {growth(after)} ({after['machine']}, load {after['load']:.1f}).")
    lines.append(f"Rerun: `{COMMAND}` (the before column: `--before`, default benchmarks/{BEFORE.name}, measured "
                 "before issue 62's fixes)")
    return "\n\n".join(lines)


def prediction_tables(run: dict) -> list[str]:
    """The plan's CPU predictions (this run's measured bandwidth and float32 rate) beside the measurements: the
    indexer's time per decode step, a decode step's and a prompt token's growth over 1K."""
    speed = CpuSpeed(**run["cpu"])
    plans = {c: planned(c, speed) for c in sorted(set(DECODE_CONTEXTS) | set(PREFILL_CONTEXTS))}
    base = DECODE_CONTEXTS[0]
    decode_rows = []
    for c in DECODE_CONTEXTS:
        step, select = run["decode_ms"][str(c)], run["select_ms"][str(c)]
        plan_select = 1000 * plans[c]["index_scan_s"]
        growth = step - run["decode_ms"][str(base)]
        plan_growth = 1000 * (plans[c]["decode_s"] - plans[base]["decode_s"])
        decode_rows.append([f"{c // 1024}K", f"{step:.1f}", f"{select:.2f}", f"{select / step:.0%}",
                            f"{plan_select:.2f}", f"{select / plan_select:.1f}x",
                            "-" if c == base else f"{growth:.1f}", "-" if c == base else f"{plan_growth:.2f}"])
    prefill_rows = []
    first = run["prefill_tok_s"][str(base)]
    for c in PREFILL_CONTEXTS:
        rate = run["prefill_tok_s"][str(c)]
        growth = 1e6 * (1 / rate - 1 / first)
        plan_growth = 1e6 * (plans[c]["prefill_s"] - plans[base]["prefill_s"])
        prefill_rows.append([f"{c // 1024}K", f"{rate:.0f}", f"{1 / (1 / first + plan_growth / 1e6):.0f}",
                             "-" if c == base else f"{growth:.0f}", "-" if c == base else f"{plan_growth:.0f}"])
    last = max(DECODE_CONTEXTS)
    scan = run["select_ms"][str(last)] - run["select_ms"][str(base)]
    plan_scan = 1000 * (plans[last]["index_scan_s"] - plans[base]["index_scan_s"])
    prefill_growth = 1 / run["prefill_tok_s"][str(last)] - 1 / first
    plan_prefill = plans[last]["prefill_s"] - plans[base]["prefill_s"]
    return [f"The plan's predictions on this CPU (`kestrel plan --model models/k3.1-tiny --hardware cpu --engine "
            f"kestrel --tp 1 --context C --measure`, kestrel.cookbook.context_cost) with the speed measured in this "
            f"run on {speed.threads} thread(s): a copy at {speed.bandwidth / 1e9:.1f} GB/s, float32 matmuls at "
            f"{speed.flop_rate / 1e9:.0f} GFLOP/s. The plan counts what depends on the context (the indexer's scan, "
            "the selected keys' attention, the KDA state) and times each part at its bound, reads or multiplies: "
            "a lower bound. Indexer measured: the time inside `LightningIndexer.select` (scores and top-k, both "
            "layers) per decode step, median.",
            markdown_table(["context", "decode ms/step", "indexer ms/step", "indexer share", "indexer ms planned",
                            "measured / planned", "step growth over 1K (ms)", "planned growth (ms)"], decode_rows),
            markdown_table(["context", "prefill tok/s", "planned tok/s (1K's measured + the planned growth)",
                            "growth per prompt token over 1K (us)", "planned growth (us)"], prefill_rows),
            f"At {last // 1024}K a prompt token's growth runs at {plan_prefill / prefill_growth:.0%} of the plan's "
            f"bound (the indexer's multiply-adds at the matmul rate: the kernel is compute-bound there); a decode "
            f"token's scan takes {scan / plan_scan:.1f}x the plan's bound (less the indexer's "
            f"{run['select_ms'][str(base)]:.2f} ms at 1K, its projections and the call, the same at every context), "
            "a bound on reading the keys: for one token the kernel is bound instead by transposing each 16 keys in "
            "registers (which keeps the reference's summation order, so that the selection equals it bit for bit) "
            "and by the multiply-adds, about as many instructions each at this indexer's 4 heads of 32."]


def plot(after: dict, before: dict | None) -> str:
    """docs/long-context.svg: decode ms/step and prefill tok/s (before and after), and the KV cache held, against the
    context."""
    def series(key: str, contexts: tuple[int, ...]) -> dict[str, list[float | None]]:
        runs = {"this run" if before is None else "after": after, **({"before": before} if before else {})}
        return {name: [run[key].get(str(c)) for c in contexts] for name, run in runs.items()}

    cache = [c * after["cache_bytes_per_token"] / MIB for c in DECODE_CONTEXTS]
    return line_charts([Panel("Decode step (ms)", "ms per step", list(DECODE_CONTEXTS),
                              series("decode_ms", DECODE_CONTEXTS)),
                        Panel("Prefill (tok/s)", "prompt tokens / s", list(PREFILL_CONTEXTS),
                              series("prefill_tok_s", PREFILL_CONTEXTS)),
                        Panel("KV cache held (MiB)", "MiB", list(DECODE_CONTEXTS), {"k3.1-tiny": cache})])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--before", type=Path, default=BEFORE if BEFORE.exists() else None,
                        help="a run saved with --save, shown as the before column (default: %(default)s)")
    parser.add_argument("--save", type=Path, help="keep this run's numbers here (JSON)")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    args = parser.parse_args()
    after = measure(args.decode_steps)
    if args.save:
        args.save.write_text(json.dumps(after, indent=1))
    before = json.loads(args.before.read_text()) if args.before else None
    body = report(after, before, args)
    if not args.no_write:
        write_section("long-context", body)
        PLOT.write_text(plot(after, before))
    print(body)


if __name__ == "__main__":
    main()
