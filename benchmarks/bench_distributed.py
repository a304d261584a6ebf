"""Communication of kestrel's tensor parallelism, and CPU throughput at TP1 against TP2, TP2 x DCP2 and PP2.

1. Bytes each rank puts into each collective per decode step and per prefill token, as the engine counts them
   (Parallel.bytes_sent) on small K3-shaped models at TP2 (gloo, 2 processes): K3-tiny (latent MoE, no indexer) and
   K3.1-tiny (with the indexer), both with 64-wide MXFP4 experts (one block per rank), float32, against the
   formula of kestrel/distributed/traffic.py for the same model and step. Then the formula for K3 itself at TP8,
   TP8 x EP8 (the same traffic: routed partials join the all-reduce) and DCP8 (SGLang's exchange and kestrel's),
   and the time a ring takes to move it on each catalogued interconnect (the roofline of `kestrel plan` adds it to
   every decode step).
2. The bundled model (models/k3.1-tiny) through kestrel.LLM at TP1, TP2, TP2 x DCP2 and PP2: 8 greedy requests of
   64 prompt tokens and 64 output tokens, ROUNDS rounds per layout, best time kept.
Writes the section "distributed" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_distributed.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.config import parse_config  # noqa: E402
from kestrel.cookbook.hardware import catalog  # noqa: E402
from kestrel.cookbook.model import resolve_config  # noqa: E402
from kestrel.distributed.launch import RankSpec, Workers, _free_port  # noqa: E402
from kestrel.distributed.traffic import (Forward, comm_seconds, dcp_traffic, kestrel_dcp_traffic,  # noqa: E402
                                         tp_traffic)
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402
from kestrel.models.checkpoint import build_model, save_model  # noqa: E402
from kestrel.models.init import init_weights  # noqa: E402
from kestrel.models.presets import tiny_config  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_distributed.py"
PREFILL, BATCH, CONTEXT = 64, 8, 32     # measured: one 64-token prompt; a decode step of 8 sequences at 32 tokens
K3_BATCH, K3_CONTEXT = 64, 11264
ROUNDS, REQUESTS, PROMPT, OUTPUT = 3, 8, 64, 64
PAGE = 16


def small_model(preset: str, folder: Path) -> Path:
    raw = tiny_config(preset)
    raw.get("text_config", raw)["moe_intermediate_size"] = 64
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=0), folder, config_json=raw)
    return folder


def rank_main(spec, folders: list[str], out: str) -> None:
    """One of 2 ranks: for each model, the counters of one prefill forward and of one decode step."""
    import torch.distributed as dist

    from kestrel.distributed.launch import init_process_groups
    from kestrel.distributed.layout import ParallelLayout
    from kestrel.engine.cache.page_table import PageTable
    from kestrel.engine.model_runner import ModelRunner, Step
    from kestrel.layers.cache import HybridCache
    from kestrel.models.checkpoint import load_model

    torch.set_num_threads(1)
    layout = ParallelLayout(2, 1, spec.rank)
    par, _ = init_process_groups(spec, layout, torch.device("cpu"), timeout_s=120)
    row = -(-max(PREFILL, CONTEXT) // PAGE)
    results = {}
    for folder in folders:
        model = load_model(folder, torch.float32, "cpu", par)
        cache = HybridCache.allocate(layout.cache_config(model.config), BATCH + 1, (BATCH + 1) * row, PAGE,
                                     torch.float32, device="cpu")
        table = [x for slot in range(BATCH + 1) for column in range(row) for x in (slot, column, slot * row + column)]
        runner = ModelRunner(model, cache, PageTable(BATCH + 1, row, 0, "cpu"), None)
        ids = torch.randint(3, model.config.vocab_size, (PREFILL,), generator=torch.Generator().manual_seed(0))

        def counted(step: Step) -> dict[str, int]:
            par.bytes_sent.clear()
            runner.execute(step)
            return dict(par.bytes_sent)

        prefill = counted(Step([[]], [table], ids.tolist(), [0], [PREFILL], [BATCH], row, [], [0]))
        context = ids[:CONTEXT - 1].tolist()
        runner.execute(Step([[]], [[]], context * BATCH, [0] * BATCH, [CONTEXT - 1] * BATCH, list(range(BATCH)), row,
                            [], []))
        decode = counted(Step([[]], [[]], ids[CONTEXT - 1:CONTEXT].tolist() * BATCH, [CONTEXT - 1] * BATCH, [1] * BATCH,
                              list(range(BATCH)), row, [], list(range(BATCH))))
        results[folder] = {"prefill": prefill, "decode": decode}
    if spec.rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure_traffic() -> list[list[object]]:
    """Rows: model, step, collective, counted bytes per rank, formula's bytes, equal."""
    with tempfile.TemporaryDirectory() as tmp:
        folders = {p: str(small_model(p, Path(tmp) / p)) for p in ("k3-tiny", "k3.1-tiny")}
        out = str(Path(tmp) / "counts.pt")
        port = _free_port()
        workers = Workers(rank_main, [RankSpec(r, 2, r, f"tcp://127.0.0.1:{port}", True) for r in range(2)],
                          list(folders.values()), out)
        for p in workers.processes:
            p.join(600)
        if any(p.exitcode for p in workers.processes):
            raise SystemExit(f"the ranks failed: {workers.failures()}")
        counts = torch.load(out)
        rows = []
        for preset, folder in folders.items():
            config = resolve_config(folder)
            for step, forward in (("prefill, per token", Forward.prefill(PREFILL)),
                                  (f"decode step, batch {BATCH} at {CONTEXT}", Forward.decode(BATCH, CONTEXT))):
                counted = counts[folder]["prefill" if step.startswith("prefill") else "decode"]
                expected = tp_traffic(config, 2, forward, 4)
                per = PREFILL if step.startswith("prefill") else 1
                for kind in expected:
                    got = counted.get(kind, 0)
                    rows.append([preset, step, kind, f"{got / per:,.0f}", f"{expected[kind] / per:,.0f}",
                                 "yes" if got == expected[kind] else "NO"])
        return rows


def k3_traffic() -> tuple[list[list[object]], list[list[object]]]:
    """K3's bytes per rank by the formula (bf16), and the time per decode step on each catalogued interconnect."""
    config = resolve_config("k3")
    decode, prefill = Forward.decode(K3_BATCH, K3_CONTEXT), Forward.prefill(8192)
    def sglang_dcp(forward: Forward) -> dict[str, int]:
        return {**tp_traffic(config, 8, forward, 2), **dcp_traffic(config, 8, 8, forward, 2)}

    def kestrel_dcp(forward: Forward) -> dict[str, int]:
        return {**tp_traffic(config, 8, forward, 2, dcp=8), **kestrel_dcp_traffic(config, 8, 8, forward, 2)}

    layouts = {"TP8 (and TP8 x EP8)": lambda forward: tp_traffic(config, 8, forward, 2),
               "TP8 x DCP8, SGLang's exchange": sglang_dcp, "TP8 x DCP8, kestrel's exchange": kestrel_dcp}
    rows, steps = [], {}
    for name, traffic in layouts.items():
        per_step, per_token = traffic(decode), traffic(prefill)
        rows += [[name, kind, f"{per_step[kind] / 1e6:,.2f} MB", f"{per_token[kind] / 8192:,.0f} B"]
                 for kind in per_step]
        steps[name] = per_step
    times = []
    for device in catalog().values():
        bandwidth = device.fact("scale_up_bandwidth")
        if bandwidth.value and bandwidth.unit == "GB/s":
            times.append([device.id, f"{bandwidth.value:g} GB/s",
                          *(f"{comm_seconds(step, dict.fromkeys(step, 8), bandwidth.value * 1e9) * 1e6:,.0f} us"
                            for step in steps.values())])
    return rows, times


LAYOUTS = {"TP1": {}, "TP2": {"tp_size": 2}, "TP2 x DCP2": {"tp_size": 2, "dcp_size": 2}, "PP2": {"pp_size": 2}}


def throughput() -> list[list[object]]:
    """Output tokens/s of the bundled model at TP1, TP2, TP2 x DCP2 and PP2, one layout after the other (a process
    joins one distributed instance at a time), best of ROUNDS rounds each."""
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + PROMPT))} for i in range(REQUESTS)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    best = dict.fromkeys(LAYOUTS, float("inf"))
    for name, sizes in LAYOUTS.items():
        llm = LLM(str(BUNDLED_MODEL), dtype="float32", max_total_tokens=8192, max_mamba_cache_size=16,
                  disable_radix_cache=True, **sizes)
        try:
            for _ in range(ROUNDS):
                start = time.perf_counter()
                llm.generate(prompts, params)
                best[name] = min(best[name], time.perf_counter() - start)
        finally:
            llm.engine.shutdown()
    tokens = REQUESTS * OUTPUT
    return [[name, f"{best[name]:.2f} s", f"{tokens / best[name]:,.1f}", f"{best['TP1'] / best[name]:.2f}x"]
            for name in LAYOUTS]


def main() -> None:
    torch.set_num_threads(THREADS)
    measured = measure_traffic()
    k3_rows, k3_times = k3_traffic()
    speed = throughput()
    body = "\n\n".join([
        f"## Distributed: communication and TP / DCP / PP throughput\n\n`{COMMAND}` ({machine()})",
        "Bytes each rank puts into each collective (the input it contributes), counted by the engine "
        "(`Parallel.bytes_sent`) on two gloo ranks at TP2, float32, against `kestrel/distributed/traffic.py` for "
        f"the same model and step. Prefill: one {PREFILL}-token prompt, divided by its tokens.",
        markdown_table(["model", "step", "collective", "counted", "formula", "equal"], measured),
        f"K3 by the same formula (bf16): a decode step of {K3_BATCH} sequences at {K3_CONTEXT:,} tokens, and per "
        "token of an 8,192-token prefill. EP8 moves what TP8 moves: kestrel's routed partials join the MoE "
        "all-reduce (no all-to-all dispatch). DCP8 twice: SGLang's exchange (queries gathered, partial outputs "
        "reduce-scattered; what the cookbook's roofline uses) and kestrel's (`kestrel_dcp_traffic`: queries, index "
        "queries and index scores gathered, the log-sum-exp merge as fp32 all-reduces of every head's partial "
        "output, so it moves more; the scores leave the TP all-reduce).",
        markdown_table(["layout", "collective", "per decode step", "per prefill token"], k3_rows),
        "Time a ring takes to move one such decode step at each catalogued device's scale-up bandwidth (the "
        "catalog's figure; NVLink's counts both directions), which `kestrel plan`'s roofline adds to each step:",
        markdown_table(["device", "scale-up bandwidth", *(f"{layout}, per decode step" for layout in
                                                          ("TP8", "DCP8 (SGLang)", "DCP8 (kestrel)"))], k3_times),
        f"The bundled model through `kestrel.LLM`: {REQUESTS} greedy requests of {PROMPT} prompt and {OUTPUT} "
        f"output tokens, best of {ROUNDS} rounds per layout (one layout after the other: a process joins one "
        f"distributed instance at a time); rank 0 keeps {THREADS} torch thread, the spawned "
        "rank its share of the cores.",
        markdown_table(["layout", "time", "output tok/s", "vs TP1"], speed),
        "On this 2-core machine TP2 cannot be faster: the model is tiny (192-wide), so each step is dominated by "
        "per-op overhead that both ranks pay in full, every layer adds a gloo all-reduce over loopback TCP, rank 0 "
        "also pickles and broadcasts each step's batch, and the two ranks share the same two busy cores. TP "
        "exists for models whose weights do not fit one device; its speed case is on GPUs with NVLink. PP2 halves "
        "each rank's layers but a step still passes both stages in turn: its two micro-batches overlap the stages "
        "for part of the step only (bubble 1/3 of a step), and each micro-batch pays its own per-op overhead. "
        "DCP2 halves each rank's KV memory but adds up to seven collectives per MLA layer (the gathered queries, "
        "index queries, head weights and index scores; the log-sum-exp merge's three all-reduces), and runs "
        "attention in torch's padded absorbed form.",
    ])
    print(body)
    write_section("distributed", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
