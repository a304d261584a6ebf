"""What --enable-deterministic-inference costs `kestrel serve`, and what it buys, in one run.

Two models served by `kestrel serve` (torch on benchmarks/report.py's THREADS, a separate process on loopback), with
the mode off and on: the bundled k3.1-tiny in its checkpoint's dtype (bfloat16, the default) and in float32, and a
437M-parameter K3 drawn at random (benchmarks/bench_llamacpp.py's, float32, token ids for prompts). For each:
- determinism, the issue's reproduction: a seeded sampled request (seed 42, temperature 1, 32 tokens, logprobs; the
  prompt "KING.\\n", or 4 token ids for the 437M model) and a greedy one, each sent alone, then CHECKS times while
  LOAD other clients send other prompts; how many of the answers under load equal the answer alone in tokens and
  logprobs, bit for bit;
- throughput: streamed /v1/completions (128-token prompts, 64 greedy tokens, ignore_eos) from 1, 8 and 32 clients
  (each sending its next request as its last ends) for WINDOW_S seconds each: output tok/s, TTFT and ITL.
Writes the section "deterministic" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_deterministic.py (about 25 minutes on two cores)
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_compile_defaults import kestrel_server, prompt, summarise, window  # noqa: E402
from benchmarks.bench_llamacpp import random_437m  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_deterministic.py"
PORT, WINDOW_S, CHECKS, LOAD = 8768, 40, 12, 12
CONCURRENCY = (1, 8, 32)
CHECKED = {"seeded": {"seed": 42, "temperature": 1.0, "max_tokens": 32, "logprobs": 1},
           "greedy": {"temperature": 0.0, "max_tokens": 32, "logprobs": 1}}
M437 = "k3-437m"


async def answer(http: httpx.AsyncClient, model: str, body: dict) -> tuple[list[str], list[float]]:
    """A completion's tokens and logprobs."""
    response = await http.post("/v1/completions", json={"model": model, "logprobs": 0, **body})
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


async def determinism(url: str, model: str, checked_prompt: str | list[int]) -> dict[str, int]:
    """For each CHECKED request (with checked_prompt): how many of CHECKS answers sent while LOAD clients send other
    prompts equal its answer alone (tokens and logprobs, exactly)."""
    checked = {name: {"prompt": checked_prompt, **body} for name, body in CHECKED.items()}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        alone = {name: await answer(http, model, body) for name, body in checked.items()}
        stop = asyncio.Event()

        async def load(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                await answer(http, model, {"prompt": prompt(100 * i + n)[:16 + 7 * i], "max_tokens": 24 + i,
                                           "temperature": 0.8, "seed": i})

        loaders = [asyncio.create_task(load(i)) for i in range(LOAD)]
        await asyncio.sleep(1)
        equal = {name: 0 for name in CHECKED}
        for _ in range(CHECKS):
            for name, body in checked.items():
                equal[name] += await answer(http, model, body) == alone[name]
        stop.set()
        await asyncio.gather(*loaders)
    return equal


def serve(flags: list[str], model: str, checked_prompt: str | list[int]) -> dict:
    """Launch `kestrel serve` with flags (serving `model` under that name), measure, stop it."""
    with kestrel_server([*flags, "--served-model-name", model], PORT, model=model) as (url, _):
        result: dict = {"equal": asyncio.run(determinism(url, model, checked_prompt))}
        for c in CONCURRENCY:
            result[c] = summarise(*asyncio.run(window(url, c, WINDOW_S, model)))
        return result


def main() -> None:
    takes_no_options(__doc__)
    mode = "--enable-deterministic-inference"
    bundled = ["--model", str(BUNDLED_MODEL)]
    with tempfile.TemporaryDirectory() as folder:
        m437 = ["--model", str(random_437m(Path(folder) / M437)), "--mem-fraction-static", "0.3"]
        setups = {("k3.1-tiny", "bfloat16 (default)"): (bundled, BUNDLED_MODEL.name, "KING.\n"),
                  ("k3.1-tiny", "float32"): ([*bundled, "--dtype", "float32"], BUNDLED_MODEL.name, "KING.\n"),
                  ("437M K3", "float32"): (m437, M437, [5, 17, 29, 41])}
        runs = {(*setup, on): serve([*flags, *([mode] if on else [])], name, checked)
                for setup, (flags, name, checked) in setups.items() for on in (False, True)}
    print(json.dumps({" ".join(map(str, key)): run for key, run in runs.items()}, indent=1))
    checks = markdown_table(["model", "dtype", mode,
                             *(f"{name} answers under load equal to alone" for name in CHECKED)],
                            [[model, dtype, "on" if on else "off", *(f"{run['equal'][n]} / {CHECKS}" for n in CHECKED)]
                             for (model, dtype, on), run in runs.items()])
    columns = ["tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max"]
    rows = [[model, dtype, "on" if on else "off", c, *(f"{run[c][k]:.1f}" for k in columns),
             f"{run[c]['tok/s'] / runs[model, dtype, False][c]['tok/s']:.2f}"]
            for (model, dtype, on), run in runs.items() for c in CONCURRENCY]
    table = markdown_table(["model", "dtype", mode, "concurrency", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                            "ITL p50 (ms)", "ITL p99 (ms)", "longest gap (ms)", "tok/s vs off"], rows)
    print(checks, table, sep="\n\n")
    write_section("deterministic", "\n\n".join([
        "## Deterministic inference: what it buys and what it costs",
        f"`kestrel serve` ({THREADS} torch thread{'' if THREADS == 1 else 's'}, a separate process on loopback) with "
        f"{mode} off and on: the bundled k3.1-tiny in its checkpoint's dtype (bfloat16, the default) and in float32, "
        "and a 437M-parameter K3 drawn at random (bench_llamacpp.py's; float32, --mem-fraction-static 0.3). "
        "Determinism: a seeded sampled request (seed 42, temperature 1) and a greedy one, 32 tokens with logprobs, "
        f"sent alone, then {CHECKS} times each while {LOAD} other clients send other prompts (sampled, seeded, of "
        "other lengths); an answer counts as equal when its tokens and every logprob equal the answer alone exactly. "
        "Throughput: streamed /v1/completions (128-token prompts, 64 greedy tokens, ignore_eos), each client sending "
        f"its next request as its last ends, {WINDOW_S} s per concurrency; the last column divides by the same model "
        "and dtype with the mode off.",
        machine(), checks, table, f"Command: `{COMMAND}`"]))


if __name__ == "__main__":
    main()
