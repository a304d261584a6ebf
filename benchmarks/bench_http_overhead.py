"""What the HTTP path adds per token: the served inter-token latency at concurrency 1 against the offline step.

One run, same machine, same model (the bundled k3.1-tiny) and engine settings (`kestrel serve`'s defaults, then
the same with --enable-torch-compile): greedy requests of a 128-token prompt and 64 output tokens (ignore_eos),
one at a time, alternating between the offline `LLM.stream` (one engine step per token, in this process) and a
streamed `/v1/completions` to `kestrel serve` on loopback (a separate process, as users run it; timed by
`kestrel.bench.client`). Per-token times are the gaps between consecutive outputs (offline) or chunks (served);
the gap between the two is what serving costs per token (issue #57's target: within 0.3 ms at c=1). Both paths run
torch on one thread (benchmarks/report.py's THREADS; OMP_NUM_THREADS for the server). The CPU that the server's
event-loop thread and this process's client spend per served token (Linux /proc, process_time) are reported next
to the gap: on a machine whose spare cores are busy, that CPU is taken from the engine thread.
Writes the section "http-overhead" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_http_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_server import wait_until_up  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.bench.client import Client, RequestSpec  # noqa: E402
from kestrel.bench.metrics import percentile  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_http_overhead.py"
REQUESTS, PROMPT, OUTPUT, PORT = 16, 128, 64, 8766
CONFIGS = {"defaults (eager)": [], "--enable-torch-compile": ["--enable-torch-compile"]}


def prompt(i: int) -> list[int]:
    return [(7 * i + 13 * j) % 250 + 3 for j in range(PROMPT)]


@dataclass
class Measured:
    offline: list[float] = field(default_factory=list)     # per-token gaps, seconds
    served: list[float] = field(default_factory=list)
    loop_cpu: float = 0.0           # CPU seconds of the server's main thread (the event loop) during served requests
    client_cpu: float = 0.0         # CPU seconds of this process's client during served requests


def measure(model: Path, flags: list[str]) -> Measured:
    """Offline per-token gaps and served inter-token gaps, requests alternating between the paths so that machine
    noise hits both, with the CPU the served path spends outside the engine thread."""
    torch.set_num_threads(THREADS)
    llm = LLM(str(model), enable_torch_compile="--enable-torch-compile" in flags)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    server = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--model", str(model), "--port",
                               str(PORT), *flags], env={**os.environ, "OMP_NUM_THREADS": str(THREADS)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    result = Measured()
    try:
        wait_until_up(url)
        client = Client(url, model=BUNDLED_MODEL.name)
        loop = asyncio.new_event_loop()
        try:
            for i in range(REQUESTS + 1):                  # request 0 warms both paths up
                offline = _offline(llm, prompt(i), params)
                loop_cpu, client_cpu = _thread_cpu(server.pid), time.process_time()
                served = loop.run_until_complete(_served(client, prompt(i)))
                if i > 0:
                    result.offline += offline
                    result.served += served
                    result.loop_cpu += _thread_cpu(server.pid) - loop_cpu
                    result.client_cpu += time.process_time() - client_cpu
            loop.run_until_complete(client.close())
        finally:
            loop.close()
    finally:
        server.terminate()
        server.wait(30)
    return result


def _thread_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process pid's main thread, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _offline(llm: LLM, ids: list[int], params: SamplingParams) -> list[float]:
    stamps = []
    for _ in llm.stream({"prompt_token_ids": ids}, params):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def _served(client: Client, ids: list[int]) -> list[float]:
    body = {"prompt": ids, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}
    record, _ = await client.send(RequestSpec("completions", body, PROMPT))
    if not record.ok or len(record.chunk_times) != OUTPUT:
        raise RuntimeError(f"the served request failed or was cut short: {record.error or len(record.chunk_times)}")
    return record.itls


def row(config: str, m: Measured) -> list[object]:
    ms = lambda xs, p: 1000 * percentile(sorted(xs), p)  # noqa: E731
    tokens = REQUESTS * OUTPUT
    cells = [ms(m.offline, 50), ms(m.offline, 90), ms(m.served, 50), ms(m.served, 90),
             ms(m.served, 50) - ms(m.offline, 50), ms(m.served, 90) - ms(m.offline, 90),
             1000 * m.loop_cpu / tokens, 1000 * m.client_cpu / tokens]
    return [config, *(f"{c:.2f}" for c in cells)]


def main() -> None:
    rows = [row(config, measure(BUNDLED_MODEL, flags)) for config, flags in CONFIGS.items()]
    for r in rows:
        print(json.dumps(r))
    header = ["`kestrel serve`", "offline step p50", "offline step p90", "served ITL p50", "served ITL p90",
              "gap p50", "gap p90", "server event loop CPU per token", "client CPU per token"]
    table = markdown_table(header, rows)
    print(table)
    body = "\n\n".join([
        "## HTTP overhead per token (concurrency 1)",
        f"{REQUESTS} greedy requests of {PROMPT} prompt token ids and {OUTPUT} output tokens (ignore_eos), one at "
        "a time, on the bundled k3.1-tiny with `kestrel serve`'s defaults (and with --enable-torch-compile), "
        "alternating between the offline `LLM.stream` (per-token time: the gap between consecutive outputs, one "
        "engine step each) and a streamed `/v1/completions` to a separate `kestrel serve` process on loopback "
        "(inter-token latency: the gap between consecutive chunks, timed by `kestrel.bench.client`); torch on "
        f"{THREADS} thread{'' if THREADS == 1 else 's'} on both paths. The gap is what the HTTP path adds per "
        "token (issue #57's target: within 0.3 ms); the last two columns are the CPU that the server's event-loop "
        "thread and the client spend per served token. Milliseconds.",
        machine(),
        table,
        f"Rerun: `{COMMAND}`",
    ])
    write_section("http-overhead", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
