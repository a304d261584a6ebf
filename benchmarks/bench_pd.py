"""PD disaggregation and data parallel behind SGLang's router (issue 20).

Transfer: the bundled model's handoff for prompts of several lengths, computed by an in-process engine and fetched
over loopback TCP by the TCP backend (connection, header, CRC-32 on both sides, bytes): time and tensor bytes per
request against kestrel.disagg.size.handoff_bytes (the analytic size); then that formula for Kimi K3 and K3.1 Pro
(from kestrel/configs/, as SGLang's K3 PD recipe runs them: page size 64, FP8 KV cache, float32 recurrent state).
Data parallel: the agentic workload (kestrel.bench.agentic) against one `kestrel serve`, the same through
`kestrel router` (SGLang's router, cache-aware), and the router over two `kestrel serve` instances; fresh servers
per row, one torch thread each.
Writes the section "pd" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_pd.py [--sessions 6] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_prefix_cache import kestrel_serve  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, write_section  # noqa: E402
from kestrel.bench.agentic import AgenticShape, describe, sessions  # noqa: E402
from kestrel.bench.metrics import summarize  # noqa: E402
from kestrel.bench.prefix import metric  # noqa: E402
from kestrel.bench.runner import RunConfig, run_agentic  # noqa: E402
from kestrel.config import load_config  # noqa: E402
from kestrel.disagg.outbox import Outbox  # noqa: E402
from kestrel.disagg.size import handoff_bytes  # noqa: E402
from kestrel.disagg.tcp import TcpBackend  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs  # noqa: E402
from kestrel.engine.async_engine import AsyncEngine  # noqa: E402
from kestrel.engine.engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling import SamplingParams  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_pd.py"
PORT = 8771
CONFIGS = Path(__file__).resolve().parent.parent / "kestrel" / "configs"
LARGE = {"Kimi K3": "kimi-k3.json", "Kimi K3.1 Pro": "kimi-k3.1-pro.json"}
LARGE_PROMPTS = [1024, 8192, 32768, 131072]
LINK_GBPS = 400          # one 400 Gb/s NIC (RDMA), for the arithmetic column only


def measure_transfers(lengths: list[int], rounds: int) -> list[dict]:
    """Per prompt length: median fetch time over loopback TCP and the handoff's tensor bytes (the bundled model)."""
    engine = AsyncEngine(LLMEngine(EngineArgs(model=str(BUNDLED_MODEL))))
    args = engine.engine.args
    cache = engine.engine.cache
    analytic = {n: handoff_bytes(engine.engine.config, n, args.page_size, cache.kda[0].conv.dtype,
                                 cache.kda[0].recurrent.dtype, cache.mla[0].latent.values.dtype) for n in lengths}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def main() -> list[dict]:
        outbox, backend, port = Outbox(asyncio.get_running_loop(), 600), TcpBackend(), PORT
        await backend.serve(outbox, "127.0.0.1", port)
        rows = []
        try:
            for n in lengths:
                times, sizes = [], set()
                for r in range(rounds + 1):                            # round 0 warms up
                    key = (n, r)
                    outcome = outbox.open(key)
                    prompt = [(7 * r + 13 * i) % 4000 + 10 for i in range(n)]
                    async for _ in engine.generate(f"p{n}-{r}", prompt, params,
                                                   handoff=lambda h, key=key: outbox.publish(key, h)):
                        pass
                    began = time.perf_counter()
                    handoff = await backend.fetch("127.0.0.1", port, key, 60)
                    await outcome
                    if r:
                        times.append(time.perf_counter() - began)
                        sizes.add(sum(t.nbytes for t in handoff.tensors.values()))
                rows.append({"prompt": n, "seconds": statistics.median(times), "bytes": sizes.pop(),
                             "analytic": analytic[n]})
                print(rows[-1], flush=True)
        finally:
            await backend.close()
        return rows

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def analytic_rows() -> list[list[object]]:
    rows = []
    for name, file in LARGE.items():
        config = load_config(CONFIGS / file)
        state = handoff_bytes(config, 0, 64, torch.bfloat16)
        for n in LARGE_PROMPTS:
            fp8 = handoff_bytes(config, n, 64, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
            bf16 = handoff_bytes(config, n, 64, torch.bfloat16)
            rows.append([name, f"{n:,}", f"{(fp8 - state) / 2**20:,.1f}", f"{state / 2**20:,.1f}",
                         f"{fp8 / 2**20:,.1f}", f"{bf16 / 2**20:,.1f}", f"{fp8 * 8 / (LINK_GBPS * 1e9) * 1e3:,.1f}"])
    return rows


@contextmanager
def sglang_router(workers: list[str], port: int):
    """`kestrel router` (cache-aware) over workers; yields its URL once it is ready."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "router", "--port", str(port),
                                    "--prometheus-port", str(port + 100), "--log-level", "warn",
                                    "--worker-urls", *workers], stdout=log, stderr=subprocess.STDOUT)
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
        try:
            while not _ready(url):
                if time.time() > deadline or process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the router did not come up:\n{log.read()[-2000:]}")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait(30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readiness").status_code == 200
    except httpx.TransportError:
        return False


def agentic(label: str, instances: int, routed: bool, shape: AgenticShape, args: argparse.Namespace) -> dict:
    """One replay of the sessions against fresh servers: the run's metrics and each worker's requests and hits."""
    with ExitStack() as stack:
        workers = [stack.enter_context(kestrel_serve([], PORT + 1 + i))[0] for i in range(instances)]
        url = stack.enter_context(sglang_router(workers, PORT + 10)) if routed else workers[0]
        config = RunConfig(base_url=url, model="k3.1-tiny", workload="agentic", num_prompts=args.num_prompts,
                           concurrency=args.concurrency, seed=shape.seed)
        run = asyncio.run(run_agentic(config, sessions(shape), args.think_scale, progress=False))
        split = [_worker_counts(w) for w in workers]
    result = {"label": label, "metrics": summarize(run["records"], run["duration_s"]), "workers": split,
              "load_after": os.getloadavg()[0]}
    print(label, result["metrics"]["output_throughput"], result["metrics"]["ttft_s"]["median"], split, flush=True)
    return result


def _worker_counts(url: str) -> tuple[int, float, float]:
    """(requests finished, prefix-cache hit tokens, queried tokens) from the worker's /metrics."""
    text = httpx.get(url + "/metrics").text
    return (int(metric(text, 'kestrel_requests_total{outcome="success"}') or 0),
            metric(text, "kestrel_prefix_cache_hit_tokens") or 0.0, metric(text, "kestrel_prefix_cache_queried_tokens")
            or 0.0)


def dp_row(result: dict, baseline: dict) -> list[object]:
    m, base = result["metrics"], baseline["metrics"]
    hits = sum(h for _, h, _ in result["workers"]) / max(1.0, sum(q for _, _, q in result["workers"]))
    return [result["label"], f"{m['completed']}/{m['failed']}", f"{m['output_throughput']:.1f}",
            f"{m['output_throughput'] / base['output_throughput']:.2f}x", f"{1000 * m['ttft_s']['median']:.0f}",
            f"{1000 * m['ttft_s']['p90']:.0f}", " / ".join(str(n) for n, _, _ in result["workers"]),
            f"{100 * hits:.1f}", f"{result['load_after']:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32,256,1024,1920", help="transfer: prompt lengths (bundled model)")
    parser.add_argument("--rounds", type=int, default=5, help="transfer: measured handoffs per length")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns-median", type=int, default=6)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--think-scale", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=1000, help="cap on agentic requests per run")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    transfers = measure_transfers([int(n) for n in args.lengths.split(",")], args.rounds)
    shape = AgenticShape(sessions=args.sessions, turns_median=args.turns_median, max_context=args.max_context)
    runs = [agentic("1 instance, direct", 1, False, shape, args),
            agentic("1 instance, via router", 1, True, shape, args),
            agentic("2 instances, via router", 2, True, shape, args)]
    body = report(transfers, runs, shape, args, load_before, os.getloadavg()[0])
    write_section("pd", body)
    print(body)


def report(transfers: list[dict], runs: list[dict], shape: AgenticShape, args: argparse.Namespace,
           load_before: float, load_after: float) -> str:
    transfer_rows = [[f"{t['prompt']:,}", f"{t['bytes']:,}", f"{t['analytic']:,}",
                      "yes" if t["bytes"] == t["analytic"] else "**no**", f"{1000 * t['seconds']:.2f}",
                      f"{t['bytes'] / t['seconds'] / 2**20:,.0f}"] for t in transfers]
    generated = describe(sessions(shape))
    page = EngineArgs(str(BUNDLED_MODEL)).page_size
    one, routed, two = (run["metrics"] for run in runs)
    return "\n\n".join([
        f"## PD disaggregation and data parallel (`{COMMAND}`)",
        f"{machine()}; load average {load_before:.1f} before, {load_after:.1f} after on 2 cores shared with other "
        "work, so compare ratios within the run, not absolute times.",
        "Handoff size. What a prefill instance sends per request (kestrel.disagg.size.handoff_bytes, from "
        "kestrel.layers.cache's kv_bytes_per_token and state_bytes_per_slot): the latents and indexer keys of every "
        "MLA layer for the prompt rounded up to whole pages (+ a 4-byte scale per vector with an FP8 KV cache), plus "
        "the fixed KDA state of the request (conv + recurrent state of every KDA layer), plus a JSON header "
        "(names, shapes, CRC-32s). The first token travels in the header; its KV is computed on the decode side.",
        f"Bundled k3.1-tiny (bf16 cache, float32 recurrent state, page size {page}): the handoff computed by an "
        "in-process engine and fetched by the TCP backend over loopback (connect, header, payload, CRC-32 on both "
        f"sides, ack); median of {args.rounds} requests per length, after a warm-up.",
        markdown_table(["prompt tokens", "tensor bytes sent", "analytic bytes", "equal", "transfer ms", "MiB/s"],
                       transfer_rows),
        f"Kimi K3 and K3.1 Pro, analytic only (kestrel/configs/; SGLang's K3 PD recipe: page size 64, "
        "`--kv-cache-dtype fp8_e4m3`; bf16 conv state, float32 recurrent state). The KDA state is the same for "
        "every request and is most of the handoff below ~32k prompt tokens with an FP8 KV cache (~16k with bf16); "
        f"the last column is the FP8 handoff over one {LINK_GBPS} Gb/s link at line rate (arithmetic, not measured).",
        markdown_table(["model", "prompt tokens", "KV pages MiB (fp8)", "KDA state MiB", "handoff MiB (fp8 KV)",
                        "handoff MiB (bf16 KV)", f"ms at {LINK_GBPS} Gb/s"], analytic_rows()),
        f"Data parallel. The agentic workload (kestrel.bench.agentic, seed {shape.seed}): {generated['sessions']} "
        f"sessions, {generated['requests']} requests, median prompt {generated['median_input_words']} words, median "
        f"output {generated['median_output_tokens']} tokens, think times x{args.think_scale}, {args.concurrency} "
        "lanes; fresh `kestrel serve` processes (bundled model, one torch thread each) per row; the router is "
        "`kestrel router` (sglang-router, cache_aware). TTFT in ms; hits are prompt tokens over all workers.",
        markdown_table(["deployment", "completed/failed", "output tok/s", "vs 1 instance", "TTFT median",
                        "TTFT p90", "requests per worker", "prefix hit %", "load after"],
                       [dp_row(r, runs[0]) for r in runs]),
        f"Two instances behind the router give {two['output_throughput'] / routed['output_throughput']:.2f}x the "
        "output throughput of one instance behind it (and "
        f"{two['output_throughput'] / one['output_throughput']:.2f}x that of one instance without it). Each "
        "instance runs one torch thread on a machine with 2 cores shared with other work, so two instances can at "
        "best use both cores: the ceiling is 2x. With the load average above the core count no core is idle for the "
        "second instance, and other work's load moves between rows (see the last column): a router row faster "
        "than the direct one is that, not the router. What this run does show: the router failed nothing, and the "
        "prefix-cache hit rate over both workers stays at one instance's (the cache-aware router keeps each "
        "session on one worker). On GPUs each instance owns its devices and data parallel scales with them.",
        f"Rerun: `{COMMAND}`",
    ])


if __name__ == "__main__":
    main()
