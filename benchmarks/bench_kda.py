"""Chunked KDA on the CPU: kestrel's torch chunk_kda against transformers' and fla's torch references.

One run, same machine, same inputs (B=4 sequences of T=512 tokens, H=4 heads, K=V=64, float32 and
bfloat16): forward only and forward+backward, median milliseconds per call, tokens per second, and the speed
ratio against transformers' `chunk_kimi_delta_attention`. kestrel gets the batch as 4 packed sequences through
cu_seqlens. Other work shares these machines' cores, so the three implementations' calls are interleaved round by
round (each round calls every implementation once), one torch thread each (report.THREADS): a burst of load then
slows all of them alike, and the ratios hold where the absolute times do not. A run takes a few minutes. Writes the
section "kda-chunked" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_kda.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformers_kimi_linear  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.ops.torch import kda  # noqa: E402

BATCH, SEQ_LEN, HEADS, HEAD_DIM = 4, 512, 4, 64
ROUNDS = 5
"""Timed rounds, after one warm-up round."""
COMMAND = ".venv/bin/python benchmarks/bench_kda.py"

Inputs = dict[str, torch.Tensor]
KdaCall = Callable[[Inputs], torch.Tensor]


def load_transformers_chunk() -> KdaCall:
    """transformers' torch chunk KDA. With fla importable it would route to fla's Triton kernel, so fla is
    hidden while transformers' module is imported (the choice is made at import time)."""
    chunk_kimi_delta_attention = transformers_kimi_linear.load().chunk_kimi_delta_attention

    def run(x: Inputs) -> torch.Tensor:
        return chunk_kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False)[0]
    return run


def load_fla_naive_chunk() -> KdaCall:
    from fla.ops.kda.naive import naive_chunk_kda

    def run(x: Inputs) -> torch.Tensor:
        return naive_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])[0]
    return run


def kestrel_chunk(x: Inputs) -> torch.Tensor:
    """kestrel's chunk_kda on the batch packed as BATCH sequences of SEQ_LEN tokens."""
    flat = {name: t.flatten(0, 1) for name, t in x.items()}
    cu_seqlens = torch.arange(BATCH + 1, dtype=torch.int64) * SEQ_LEN
    o = kda.chunk_kda(flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"], cu_seqlens)[0]
    return o.unflatten(0, (BATCH, SEQ_LEN))


def make_inputs(dtype: torch.dtype) -> Inputs:
    """[B, T, H, D] inputs: L2-normalised q, k; sigmoid beta; the K3 lower-bounded gate -5 * sigmoid(x) (float32)."""
    generator = torch.Generator().manual_seed(0)
    shape = (BATCH, SEQ_LEN, HEADS, HEAD_DIM)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator)

    return {
        "q": F.normalize(randn(*shape), dim=-1).to(dtype),
        "k": F.normalize(randn(*shape), dim=-1).to(dtype),
        "v": randn(*shape).to(dtype),
        "g": -5.0 * randn(*shape).sigmoid(),
        "beta": randn(*shape[:3]).sigmoid().to(dtype),
    }


def timed_call(call: KdaCall, leaves: Inputs, grad_out: torch.Tensor, backward: bool) -> float:
    """Seconds of one call (and its backward pass)."""
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        o = call(leaves)
        if backward:
            o.backward(grad_out)
    seconds = time.perf_counter() - start
    for leaf in leaves.values():
        leaf.grad = None
    return seconds


def time_interleaved(calls: dict[str, KdaCall], inputs: Inputs, backward: bool) -> dict[str, float]:
    """Median seconds per call of each implementation over ROUNDS rounds that call each once, after a warm-up
    round."""
    grad_out = torch.randn(inputs["v"].shape, generator=torch.Generator().manual_seed(1)).to(inputs["v"].dtype)
    leaves = {name: t.detach().requires_grad_(backward) for name, t in inputs.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS + 1):
        for name, call in calls.items():
            times[name].append(timed_call(call, leaves, grad_out, backward))
    return {name: statistics.median(seconds[1:]) for name, seconds in times.items()}


def max_output_difference(call: KdaCall, reference: KdaCall, inputs: Inputs) -> float:
    with torch.no_grad():
        return (call(inputs).float() - reference(inputs).float()).abs().max().item()


def main() -> None:
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    transformers_chunk = load_transformers_chunk()
    implementations = {"kestrel": kestrel_chunk, "transformers": transformers_chunk,
                       "fla naive": load_fla_naive_chunk()}
    tokens = BATCH * SEQ_LEN
    header = ["implementation", "dtype", "pass", "ms / call", "tokens / s", "speed vs transformers",
              "max abs diff of o vs transformers"]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(dtype)
        differences = {name: max_output_difference(call, transformers_chunk, inputs)
                       for name, call in implementations.items()}
        for backward, label in ((True, "fwd+bwd"), (False, "fwd")):
            seconds = time_interleaved(implementations, inputs, backward)
            for name in implementations:
                rows.append([name, str(dtype).removeprefix("torch."), label, f"{seconds[name] * 1e3:.0f}",
                             f"{tokens / seconds[name]:,.0f}", f"{seconds['transformers'] / seconds[name]:.1f}x",
                             f"{differences[name]:.1e}"])
                print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(header, rows)
    print(table)
    load_after = os.getloadavg()[0]
    write_section("kda-chunked", f"""## KDA chunked (CPU, torch reference)

kestrel's `ops.torch.kda.chunk_kda` against transformers' `chunk_kimi_delta_attention` (torch fallback) and
fla's `naive_chunk_kda`, on the same inputs: B={BATCH} sequences x T={SEQ_LEN} tokens, H={HEADS}, K=V={HEAD_DIM},
chunk size 64 (kestrel: recursive halving down to {kda.LEAF_BLOCK}-token blocks), K3 lower-bounded gate.
Median of {ROUNDS} rounds after a warm-up round, each round calling the three in turn (interleaved, so that load
from other work slows all three alike); fwd+bwd backpropagates a fixed random output gradient to q, k, v, g, beta.
All three compute in float32; bfloat16 rows feed bfloat16 q, k, v, beta. Smaller than earlier runs of this section
(B=8 x T=1024), so that a run stays within a few minutes on the shared cores.

{machine()}; load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores shared
with other work (one torch thread, which keeps each op from waiting on the busier core), so compare the ratios, not
the absolute times.

{table}

Rerun: `{COMMAND}`
""")


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
