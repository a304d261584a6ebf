"""The HTTP path's added latency: TTFT and inter-token latency through `kestrel serve` against the offline API.

One run, same machine, same model (the bundled k3.1-tiny, computing in float32) and the same requests: 24 greedy
requests of 32 prompt token ids and 32 output tokens, one at a time, streamed both ways, alternating between
the two paths. The server runs as a separate process on loopback (as users run it); the client measures from
sending the request.
Writes the section "server" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_server.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_server.py"
REQUESTS, PROMPT, OUTPUT, PORT = 24, 32, 32, 8765


def prompts() -> list[list[int]]:
    return [[(7 * i + j) % 250 + 3 for j in range(PROMPT)] for i in range(REQUESTS)]


def measure(model: Path) -> tuple[list, list]:
    """(offline timings, server timings), alternating request by request so that machine noise hits both."""
    llm = LLM(str(model), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    server = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--model", str(model), "--port",
                               str(PORT), "--dtype", "float32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        wait_until_up(url)
        with httpx.Client(base_url=url, timeout=120) as http:
            _offline(llm, prompts()[0], params), _stream(http, prompts()[0])       # warm-up
            pairs = [(_offline(llm, p, params), _stream(http, p)) for p in prompts()]
    finally:
        server.terminate()
        server.wait(30)
    return [a for a, _ in pairs], [b for _, b in pairs]


def _offline(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[float]]:
    start, stamps = time.perf_counter(), []
    for _ in llm.stream({"prompt_token_ids": prompt}, params):
        stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def wait_until_up(url: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("kestrel serve did not come up")


def _stream(http: httpx.Client, prompt: list[int]) -> tuple[float, list[float]]:
    body = {"prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True, "stream": True}
    start, stamps = time.perf_counter(), []
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def summary(label: str, timings: list[tuple[float, list[float]]]) -> list[object]:
    ttft = [t for t, _ in timings]
    itl = [gap for _, gaps in timings for gap in gaps]
    ms = lambda xs, q: f"{1000 * statistics.quantiles(xs, n=100)[q - 1]:.2f}"  # noqa: E731
    return [label, f"{1000 * statistics.mean(ttft):.2f}", ms(ttft, 50), ms(ttft, 90),
            f"{1000 * statistics.mean(itl):.2f}", ms(itl, 50), ms(itl, 90)]


def main() -> None:
    offline, served = measure(BUNDLED_MODEL)
    rows = [summary("offline `LLM.stream`", offline), summary("HTTP `/v1/completions` stream", served)]
    for row in rows:
        print(json.dumps(row))
    added = [f"{float(b) - float(a):+.2f}" for a, b in zip(rows[0][1:], rows[1][1:])]
    body = "\n\n".join([
        "## Server: latency added by the HTTP path",
        f"{REQUESTS} greedy requests of {PROMPT} prompt token ids and {OUTPUT} output tokens, one at a time, "
        "on the bundled k3.1-tiny (float32 compute); the server runs as a separate `kestrel serve` process on "
        "loopback and the client times each streamed chunk; offline and HTTP requests alternate. Milliseconds.",
        machine(),
        markdown_table(["path", "TTFT mean", "TTFT p50", "TTFT p90", "ITL mean", "ITL p50", "ITL p90"],
                       rows + [["added by HTTP", *added]]),
        f"Rerun: `{COMMAND}`",
    ])
    write_section("server", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
