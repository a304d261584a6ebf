"""What compiling costs `kestrel serve` while its graphs compile: eager (the default), background, foreground.

One run, same machine, the bundled k3.1-tiny served as users start it (`kestrel serve`, torch on
benchmarks/report.py's THREADS, a separate process on loopback), four ways in turn:
- eager (the defaults);
- --enable-background-compile from an empty compile cache (steps compiled in the background, eager until their
  graph is ready);
- the same again, the cache now warm (a restart);
- --enable-torch-compile, warm (compiling in the foreground: a step of a new shape waits for its graph).
For each: the time from launch to the first answer (a 1-token completion), then streamed `/v1/completions`
(128-token prompts, 64 greedy tokens, ignore_eos) from 1 client, then from 8 at once, each for WINDOW_S seconds:
output tok/s, TTFT p50/p99, inter-token latency p50/p99 and the longest gap (what a compile freeze shows as), and
the output rate in the window's last third (after the compiles of the window's early part).
Writes the section "compile-defaults" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_compile_defaults.py (about 12 minutes on two cores)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.bench.client import Client, RequestSpec  # noqa: E402
from kestrel.bench.metrics import RequestRecord, percentile  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_compile_defaults.py"
PROMPT, OUTPUT, PORT, WINDOW_S = 128, 64, 8767, 75
CONCURRENCY = (1, 8)
LAUNCH_LIMIT_S = 600


def prompt(i: int) -> list[int]:
    return [(7 * i + 13 * j) % 250 + 3 for j in range(PROMPT)]


async def first_answer(url: str, launched: float, model: str = BUNDLED_MODEL.name) -> float:
    """Seconds from launch until a 1-token completion comes back."""
    client = Client(url, model=model, timeout=LAUNCH_LIMIT_S)
    try:
        while time.perf_counter() - launched < LAUNCH_LIMIT_S:
            record, _ = await client.send(RequestSpec("completions", {"prompt": prompt(0), "max_tokens": 1}))
            if record.ok:
                return time.perf_counter() - launched
            await asyncio.sleep(0.2)
    finally:
        await client.close()
    raise RuntimeError(f"no answer within {LAUNCH_LIMIT_S} s of launch")


async def window(url: str, concurrency: int, seconds: float, model: str = BUNDLED_MODEL.name
                 ) -> tuple[list[RequestRecord], float]:
    """Requests from `concurrency` clients, each sending the next as its last ends, started for `seconds`; their
    records and the window's length."""
    client = Client(url, model=model)
    numbers = itertools.count(1)
    records: list[RequestRecord] = []

    async def one_client() -> None:
        while client.now() < seconds:
            body = {"prompt": prompt(next(numbers)), "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}
            record, _ = await client.send(RequestSpec("completions", body, PROMPT))
            if not record.ok:
                raise RuntimeError(f"a request failed: {record.error}")
            records.append(record)
    try:
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return records, client.now()
    finally:
        await client.close()


def summarise(records: list[RequestRecord], length: float) -> dict[str, float]:
    gaps = sorted(g for r in records for g in r.itls)
    ttfts = sorted(r.ttft for r in records)
    tail = [t for r in records for t in r.chunk_times if t >= 2 * length / 3]
    return {"tok/s": sum(len(r.chunk_times) for r in records) / length,
            "last third tok/s": len(tail) / (length / 3),
            "TTFT p50": 1000 * percentile(ttfts, 50), "TTFT p99": 1000 * percentile(ttfts, 99),
            "ITL p50": 1000 * percentile(gaps, 50), "ITL p99": 1000 * percentile(gaps, 99),
            "ITL max": 1000 * gaps[-1]}


@contextlib.contextmanager
def kestrel_server(flags: list[str], port: int, env: dict[str, str] | None = None, model: str = BUNDLED_MODEL.name,
                   threads: int | None = THREADS) -> Iterator[tuple[str, float]]:
    """`kestrel serve` with flags on port (torch on `threads` threads, None: kestrel's own choice; env added to the
    environment) for the block, serving `model` (its served name): its URL and the seconds from launch to its first
    answer. Stopped on the way out."""
    environment = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    environment.update(env or {})
    launched = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), *flags],
                              env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, asyncio.run(first_answer(url, launched, model))
    finally:
        server.terminate()
        server.wait(60)


def serve(flags: list[str], cache: Path) -> dict:
    """Launch `kestrel serve` with flags and compile cache `cache`, measure, stop it."""
    with kestrel_server(flags, PORT, {"TORCHINDUCTOR_CACHE_DIR": str(cache)}) as (url, first):
        result = {"first answer s": first}
        for c in CONCURRENCY:
            result[c] = summarise(*asyncio.run(window(url, c, WINDOW_S)))
        return result


def main() -> None:
    takes_no_options(__doc__)
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "inductor"
        runs = {"eager (defaults)": serve([], cache),
                "--enable-background-compile, empty cache": serve(["--enable-background-compile"], cache),
                "--enable-background-compile, warm cache": serve(["--enable-background-compile"], cache),
                "--enable-torch-compile, warm cache": serve(["--enable-torch-compile"], cache)}
    print(json.dumps(runs, indent=1))
    columns = ["tok/s", "last third tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max"]
    rows = [[name, c, f"{run['first answer s']:.1f}", *(f"{run[c][k]:.1f}" for k in columns)]
            for name, run in runs.items() for c in CONCURRENCY]
    table = markdown_table(["`kestrel serve`", "concurrency", "launch to first answer (s)", "output tok/s",
                            "output tok/s, last third", "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)",
                            "ITL p99 (ms)", "longest gap (ms)"], rows)
    print(table)
    write_section("compile-defaults", "\n\n".join([
        "## `kestrel serve` while graphs compile",
        f"The bundled k3.1-tiny served by `kestrel serve` ({THREADS} torch thread{'' if THREADS == 1 else 's'}, a "
        "separate process on "
        "loopback), started four ways in turn: eager (the defaults); --enable-background-compile (CPU steps "
        "compiled in the background, eager until their graph is ready) from an empty compile cache, then restarted "
        "on the warm cache; --enable-torch-compile (foreground: a step of a new shape waits for its graph) on the warm "
        "cache. Launch to first answer: until a 1-token completion comes back. Then streamed /v1/completions "
        f"({PROMPT}-token prompts, {OUTPUT} greedy tokens, ignore_eos) from 1 client and then from 8, each client "
        f"sending its next request as its last ends, for {WINDOW_S} s each; the last third's rate is after the "
        "window's early compiles. The longest gap is where a compile freeze would show.",
        machine(), table, f"Command: `{COMMAND}`"]))


if __name__ == "__main__":
    main()
