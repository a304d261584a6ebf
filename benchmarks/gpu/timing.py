"""Timing on one CUDA device: median milliseconds of a call (CUDA events), and the device's copy bandwidth."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() over iters calls after warmup calls (the first warm-up compiles kernels)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth_gbps(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth, GB/s, counting the bytes read and the bytes written."""
    size = int(gib * 2**30)
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=2, iters=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size / (ms * 1e-3) / 1e9
