"""What --enable-deterministic-inference costs `kestrel serve`, and what it buys, in one run.

The bundled k3.1-tiny served by `kestrel serve` (torch on benchmarks/report.py's THREADS, a separate process on
loopback) in its checkpoint's dtype (bfloat16, the default) and in float32, with the mode off and on. For each:
- determinism, the issue's reproduction: a seeded sampled request (seed 42, temperature 1, prompt "KING.\\n", 32
  tokens, logprobs) and a greedy one, each sent alone, then CHECKS times while LOAD other clients send other
  prompts; how many of the answers under load equal the answer alone in text and logprobs, bit for bit;
- throughput: streamed /v1/completions (128-token prompts, 64 greedy tokens, ignore_eos) from 1, 8 and 32 clients
  (each sending its next request as its last ends) for WINDOW_S seconds each: output tok/s, TTFT and ITL.
Writes the section "deterministic" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_deterministic.py (about 14 minutes on two cores)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_compile_defaults import kestrel_server, prompt, summarise, window  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_deterministic.py"
PORT, WINDOW_S, CHECKS, LOAD = 8768, 40, 12, 12
CONCURRENCY = (1, 8, 32)
CHECKED = {"seeded": {"prompt": "KING.\n", "seed": 42, "temperature": 1.0, "max_tokens": 32, "logprobs": 1},
           "greedy": {"prompt": "KING.\n", "temperature": 0.0, "max_tokens": 32, "logprobs": 1}}


async def answer(http: httpx.AsyncClient, body: dict) -> tuple[str, list[float] | None]:
    response = await http.post("/v1/completions", json={"model": "k3.1-tiny", **body})
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["text"], (choice["logprobs"] or {}).get("token_logprobs")


async def determinism(url: str) -> dict[str, int]:
    """For each CHECKED request: how many of CHECKS answers sent while LOAD clients send other prompts equal its
    answer alone (text and logprobs, exactly)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        alone = {name: await answer(http, body) for name, body in CHECKED.items()}
        stop = asyncio.Event()

        async def load(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                await answer(http, {"prompt": prompt(100 * i + n)[:16 + 7 * i], "max_tokens": 24 + i,
                                    "temperature": 0.8, "seed": i})

        loaders = [asyncio.create_task(load(i)) for i in range(LOAD)]
        await asyncio.sleep(1)
        equal = {name: 0 for name in CHECKED}
        for _ in range(CHECKS):
            for name, body in CHECKED.items():
                equal[name] += await answer(http, body) == alone[name]
        stop.set()
        await asyncio.gather(*loaders)
    return equal


def serve(flags: list[str]) -> dict:
    """Launch `kestrel serve` with flags, measure, stop it."""
    with kestrel_server(flags, PORT) as (url, _):
        result: dict = {"equal": asyncio.run(determinism(url))}
        for c in CONCURRENCY:
            result[c] = summarise(*asyncio.run(window(url, c, WINDOW_S)))
        return result


def main() -> None:
    takes_no_options(__doc__)
    mode = "--enable-deterministic-inference"
    runs = {(dtype, on): serve([*flags, *([mode] if on else [])])
            for dtype, flags in (("bfloat16 (default)", []), ("float32", ["--dtype", "float32"]))
            for on in (False, True)}
    print(json.dumps({f"{dtype}, {'on' if on else 'off'}": run for (dtype, on), run in runs.items()}, indent=1))
    checks = markdown_table(["dtype", mode, *(f"{name} answers under load equal to alone" for name in CHECKED)],
                            [[dtype, "on" if on else "off", *(f"{run['equal'][n]} / {CHECKS}" for n in CHECKED)]
                             for (dtype, on), run in runs.items()])
    columns = ["tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max"]
    rows = [[dtype, "on" if on else "off", c, *(f"{run[c][k]:.1f}" for k in columns),
             f"{run[c]['tok/s'] / runs[dtype, False][c]['tok/s']:.2f}"]
            for (dtype, on), run in runs.items() for c in CONCURRENCY]
    table = markdown_table(["dtype", mode, "concurrency", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                            "ITL p50 (ms)", "ITL p99 (ms)", "longest gap (ms)", "tok/s vs off"], rows)
    print(checks, table, sep="\n\n")
    write_section("deterministic", "\n\n".join([
        "## Deterministic inference: what it buys and what it costs",
        f"The bundled k3.1-tiny served by `kestrel serve` ({THREADS} torch thread{'' if THREADS == 1 else 's'}, a "
        f"separate process on loopback) in its checkpoint's dtype (bfloat16, the default) and in float32, with {mode} "
        f"off and on. Determinism: a seeded sampled request (seed 42, temperature 1) and a greedy one, 32 tokens with "
        f"logprobs, sent alone, then {CHECKS} times each while {LOAD} other clients send other prompts (sampled, "
        "seeded, of other lengths); an answer counts as equal when its text and every logprob equal the answer alone "
        "exactly. Throughput: streamed /v1/completions (128-token prompts, 64 greedy tokens, ignore_eos), each "
        f"client sending its next request as its last ends, {WINDOW_S} s per concurrency; the last column divides "
        "by the same dtype with the mode off.",
        machine(), checks, table, f"Command: `{COMMAND}`"]))


if __name__ == "__main__":
    main()
