"""`kestrel serve` with its defaults against llama.cpp's `llama-server` on the same K3 weights, over HTTP (issue 57).

The models are bench_llamacpp's: the bundled-size K3 (models/k3.1-tiny's weights as a K3) and the random 437M K3,
each a kestrel checkpoint (MXFP4 routed experts) and, for llama.cpp, a float32 GGUF of the same values written by its
own converter (bench_llamacpp.dense_copy + convert). llama-server is built from the same llama.cpp sources as
bench_llamacpp's llama-batched-bench (`ensure_llama_server`: the server target added to that build, its web UI off).

Three servers per model, one at a time, each a separate process on loopback with its defaults on this machine:
- llama-server (`-t THREADS -tb THREADS`, a context of SLOTS x SLOT_TOKENS tokens over SLOTS parallel slots, so that
  every client has a slot);
- `kestrel serve` with no flag and no OMP_NUM_THREADS (eager steps on kestrel's CPU kernels, torch on its default
  thread count: one per core);
- `kestrel serve --disable-cpu-kernels` (torch's kernels only: what the defaults were before them).
Each is timed from launch to its first answer (a 1-token completion; kestrel's CPU kernels built before, as a
first start on a machine builds them once, ~60 s on 2 cores: kestrel.ops.cpu.load), then driven by one client
(bench_compile_defaults.window: streamed /v1/completions, 128-token prompts, 64 greedy tokens, ignore_eos, each of C
clients sending its next request as its last ends) for WINDOW_S seconds at each concurrency C in CONCURRENCY: output
tok/s, TTFT p50/p99, inter-token latency p50/p99 and the longest gap.

The roofline at batch 1: the weights a decode step of one sequence reads (every weight but the embedding's, in
float32, and top-k / E of the routed experts in the bytes each engine stores them: kestrel's MXFP4, llama.cpp's
float32), divided by the measured ITL p50 at C = 1, as a fraction of this machine's copy bandwidth measured in the
same run (kestrel.cookbook.hardware.measure_cpu on THREADS threads; issue 57's target: 80%).

Writes the section "serve-vs-llamacpp" of docs/benchmarks.md. Cost: about 15 minutes on 2 cores (the first run also
builds llama.cpp and its server: bench_llamacpp.ensure_llamacpp, 10-20 minutes).

Run: .venv/bin/python benchmarks/bench_serve_llamacpp.py [--window S] [--models bundled,437m]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_compile_defaults import first_answer, kestrel_server, summarise, window  # noqa: E402
from benchmarks.bench_llamacpp import (LlamaCpp, bundled_as_k3, convert, dense_copy, ensure_llamacpp,  # noqa: E402
                                       random_437m, read_tensors, run)
from benchmarks.report import machine, markdown_table, write_section  # noqa: E402
from kestrel.cookbook.hardware import measure_cpu  # noqa: E402
from kestrel.ops import cpu  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_serve_llamacpp.py"
THREADS = 2
CONCURRENCY = (1, 8, 32)
WINDOW_S = 20.0
SLOTS, SLOT_TOKENS = 32, 256
PORT = 8768
MODELS = {"bundled": ("bundled-size K3 (k3.1-tiny's weights as K3)", bundled_as_k3),
          "437m": ("437M K3 (random, hidden 1024, 12 layers, 64 experts top-4)", random_437m)}
KESTREL = {"kestrel serve": [], "kestrel serve --disable-cpu-kernels": ["--disable-cpu-kernels"]}
METRICS = ["tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max"]


def ensure_llama_server(llama: LlamaCpp) -> Path:
    """llama-server in llama's build (its target added to the build, the web UI off; built once)."""
    server = llama.bin / "llama-server"
    if not server.is_file():
        build, log = llama.bin.parent, llama.bin.parent.parent / "server-build.log"
        print(f"building llama-server in {build} (log: {log})", flush=True)
        run(["cmake", "-S", str(llama.source), "-B", str(build), "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF"],
            log)
        run(["cmake", "--build", str(build), "-j2", "--target", "llama-server"], log)
    return server


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, port: int) -> Iterator[tuple[str, float]]:
    """llama-server on gguf for the block: its URL and the seconds from launch to its first answer."""
    launched = time.perf_counter()
    server = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(THREADS), "-tb", str(THREADS),
                               "-c", str(SLOTS * SLOT_TOKENS), "-np", str(SLOTS), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, asyncio.run(first_answer(url, launched, model=gguf.stem))
    finally:
        server.terminate()
        server.wait(60)


def drive(url: str, first: float, model: str, seconds: float) -> dict:
    result = {"first answer s": first}
    for c in CONCURRENCY:
        result[c] = summarise(*asyncio.run(window(url, c, seconds, model)))
    return result


def step_bytes(folder: Path) -> int:
    """The bytes a batch-1 decode step reads from the checkpoint in folder: every weight but the embedding's in
    float32, and top-k / E of the routed experts as stored (MXFP4 codes and scales, or float32)."""
    text = json.loads((folder / "config.json").read_text())["text_config"]
    share = text["num_experts_per_token"] / text["num_experts"]
    total = 0.0
    for name, t in read_tensors(folder).items():
        if name.endswith("embed_tokens.weight") or not t.is_floating_point() and ".experts." not in name:
            continue
        stored = t.numel() * (t.element_size() if ".experts." in name else 4)
        total += stored * share if ".experts." in name else stored
    return int(total)


def measure_model(llama: LlamaCpp, server: Path, key: str, work: Path, seconds: float) -> dict:
    title, make = MODELS[key]
    folder = make(work / key)
    dense = dense_copy(folder, work / f"{key}-dense")
    gguf = convert(llama, dense, work / f"{key}.gguf")
    runs = {}
    with llama_server(server, gguf, PORT) as (url, first):
        runs["llama-server"] = drive(url, first, gguf.stem, seconds)
    for name, flags in KESTREL.items():
        with kestrel_server(["--model", str(folder), "--served-model-name", key, *flags], PORT, model=key,
                            threads=None) as (url, first):
            runs[name] = drive(url, first, key, seconds)
    return {"title": title, "runs": runs, "bytes": {"kestrel": step_bytes(folder), "llama.cpp": step_bytes(dense)}}


def report(results: dict, bandwidth: float, version: str, seconds: float) -> str:
    header = ["model", "server", "concurrency", "launch to first answer (s)", "output tok/s", "x llama-server",
              "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)", "longest gap (ms)",
              "roofline at batch 1"]
    rows, targets = [], []
    for result in results.values():
        base = result["runs"]["llama-server"]
        for name, run_ in result["runs"].items():
            for c in CONCURRENCY:
                point = run_[c]
                engine = "llama.cpp" if name == "llama-server" else "kestrel"
                roofline = (f"{result['bytes'][engine] / (point['ITL p50'] / 1000) / bandwidth:.0%}"
                            if c == 1 else "")
                rows.append([result["title"], name, c, f"{run_['first answer s']:.1f}", f"{point['tok/s']:.1f}",
                             f"{point['tok/s'] / base[c]['tok/s']:.2f}x",
                             *(f"{point[k]:.1f}" for k in METRICS[1:]), roofline])
        defaults = result["runs"]["kestrel serve"]
        for c, want in zip(CONCURRENCY, (1.0, 1.5, 1.5)):
            ratio = defaults[c]["tok/s"] / base[c]["tok/s"]
            targets.append(f"- {result['title']}, c={c}: output tok/s {ratio:.2f}x llama-server's (target "
                           f">= {want}x): {'met' if ratio >= want else 'NOT met'}")
        for c in CONCURRENCY:
            ratio = defaults[c]["ITL max"] / base[c]["ITL max"]
            targets.append(f"- {result['title']}, c={c}: longest gap {ratio:.1f}x llama-server's (target <= 3x): "
                           f"{'met' if ratio <= 3 else 'NOT met'}")
    return "\n\n".join([
        "## `kestrel serve` against llama-server, defaults, over HTTP (serve-vs-llamacpp)",
        f"Each server a separate process on loopback with its defaults on this machine ({THREADS} threads each); "
        f"llama.cpp {version} "
        f"(llama-server, {SLOTS} slots of {SLOT_TOKENS} tokens) on a float32 GGUF of the same weights (MXFP4 experts "
        "dequantized; kestrel keeps them MXFP4); `kestrel serve --disable-cpu-kernels` is kestrel's defaults before "
        "its CPU kernels ran eagerly. One client: streamed /v1/completions, 128-token prompts, 64 greedy tokens, "
        f"ignore_eos, C clients each sending its next request as its last ends, {seconds:.0f} s per concurrency. "
        "Roofline at batch 1: the weights a one-sequence decode step reads (every weight but the embedding, float32; "
        "top-k / E of the routed experts as each engine stores them) per ITL p50, as a fraction of the copy "
        f"bandwidth measured in the same run ({bandwidth / 1e9:.1f} GB/s on {THREADS} threads).",
        machine(), markdown_table(header, rows), "Targets (issue 57):", "\n".join(targets), f"Command: `{COMMAND}`"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=WINDOW_S, help="seconds per concurrency (default %(default)s)")
    parser.add_argument("--models", default=",".join(MODELS), help="which models (default %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "kestrel" / "llama.cpp-0.3.36",
                        help="where llama.cpp is built (default %(default)s)")
    args = parser.parse_args()
    keys = args.models.split(",")
    if unknown := set(keys) - set(MODELS):
        parser.error(f"unknown models {', '.join(sorted(unknown))}; choose among {', '.join(MODELS)}.")
    llama = ensure_llamacpp(args.cache_dir)
    server = ensure_llama_server(llama)
    bandwidth = measure_cpu(THREADS).bandwidth
    cpu.load()                                  # the servers' kernels: built once per machine, not in their launch
    with tempfile.TemporaryDirectory() as folder:
        results = {key: measure_model(llama, server, key, Path(folder), args.window) for key in keys}
    print(json.dumps(results, indent=1, default=str))
    text = report(results, bandwidth, llama.version, args.window)
    print(text)
    write_section("serve-vs-llamacpp", text)


if __name__ == "__main__":
    main()
