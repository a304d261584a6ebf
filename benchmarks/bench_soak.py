"""The long soak: rounds of seeded mixed requests (kestrel.bench.soak: valid, invalid, streamed, n > 1, stop
strings, JSON mode, aborted streams, disconnects) against `kestrel serve` on the bundled model, as users run it.

After every round the server must be idle and hold nothing (KV and state pools at 0 in /metrics, no running or
waiting request); the table shows the server's resident memory round by round against its value after the first
round (the baseline: caches and allocator pools warm), which must stay flat, and every answer that broke its
request's contract. Writes the section "soak" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_soak.py [--rounds 10] [--requests-per-round 2000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import machine, markdown_table, write_section  # noqa: E402
from kestrel.bench.soak import soak  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_soak.py"
PORT = 8766
IDLE_GAUGES = ("kestrel_kv_cache_usage_ratio", "kestrel_state_pool_usage_ratio", "kestrel_num_requests_running",
               "kestrel_num_requests_waiting")


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


def held(url: str) -> dict[str, float]:
    """The idle gauges that are not zero, waiting up to 10 s for the last aborts to land."""
    deadline = time.time() + 10
    while True:
        text = httpx.get(url + "/metrics").text
        gauges = {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for name in IDLE_GAUGES}
        busy = {name: value for name, value in gauges.items() if value}
        if not busy or time.time() > deadline:
            return busy
        time.sleep(0.1)


def start_server() -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--port", str(PORT)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                return process
        except httpx.TransportError:
            if time.time() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("kestrel serve did not come up")
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests-per-round", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    vocab = json.loads((BUNDLED_MODEL / "config.json").read_text())["text_config"]["vocab_size"]
    url = f"http://127.0.0.1:{PORT}"
    process = start_server()
    rows, problems, baseline = [], [], None
    try:
        for round_index in range(args.rounds):
            start = time.perf_counter()
            report = asyncio.run(soak(url, args.requests_per_round, args.concurrency, vocab, seed=round_index))
            seconds = time.perf_counter() - start
            busy, rss = held(url), rss_mib(process.pid)
            baseline = baseline or rss
            problems += report.problems + [f"round {round_index + 1}: still held after the round: {busy}"] * bool(busy)
            rows.append([round_index + 1, report.sent, report.answered, report.refused, report.abandoned,
                         len(report.problems), "none" if not busy else ", ".join(busy), f"{rss:.0f}",
                         f"{rss / baseline:.3f}", f"{report.sent / seconds:.1f}"])
            print(rows[-1], flush=True)
    finally:
        process.terminate()
        process.wait(60)
    total = sum(row[1] for row in rows)
    body = "\n\n".join([
        f"## Soak (`{COMMAND}`)",
        f"{machine()}. The bundled model behind `kestrel serve`; {args.rounds} rounds of {args.requests_per_round} "
        f"seeded requests ({total:,} in all), {args.concurrency} at a time: 70% valid (completions and chat, "
        "streamed or not, n of 1 or 2, stop strings, JSON mode), 15% invalid, 10% streams closed after one chunk, "
        "5% requests abandoned mid-flight. Every answer is checked against its request; after each round the "
        "server must hold nothing. Memory is the server's RSS against round 1's.",
        markdown_table(["round", "sent", "answered", "refused (4xx)", "abandoned", "broken answers",
                        "held after the round", "RSS MiB", "RSS vs round 1", "requests/s"], rows),
        "Broken answers: " + ("none." if not problems else "\n" + "\n".join(f"- {p}" for p in problems[:20])),
    ])
    write_section("soak", body)
    print(body)


if __name__ == "__main__":
    main()
