"""Helpers shared by the Triton kernels: FP8/FP4 decoding by bit manipulation, paged-cache row loads, a stable
tanh, and launch sizing.

FP8 E4M3 and FP4 E2M1 codes are decoded through float16 bit patterns rather than Triton's float8 types, so the
same code runs on any GPU and under the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def fp8_e4m3_to_float(code):
    """uint8 E4M3 (fn) codes -> fp32 values (exact; NaN codes are never written by the caches)."""
    bits = code.to(tl.uint16)
    half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)      # exponent and mantissa into float16's positions
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0   # 2^(15 - 7): float16's bias over E4M3's


@triton.jit
def e2m1_to_float(code):
    """4-bit E2M1 codes (in the low nibble of a uint8) -> fp32 values in {0, +-0.5, ..., +-6}."""
    bits = code.to(tl.uint16)
    half = ((bits & 0x7) << 9) | ((bits & 0x8) << 12)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0  # 2^(15 - 1)


@triton.jit
def e8m0_to_float(code):
    """uint8 E8M0 scale codes -> 2^(code - 127) in fp32, exact (the code is the fp32 exponent field; code 0, kept
    for all-zero blocks, gives 0 instead of 2^-127)."""
    return (code.to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_cache_rows(cache, cache_scales, row, row_ok, column, column_ok, row_width, dtype: tl.constexpr,
                    FP8: tl.constexpr):
    """Paged-cache values [rows, columns] in `dtype`: FP8 codes (uint8) times the row's fp32 scale when FP8,
    rounded to dtype as `PagedRows.read` rounds."""
    values = tl.load(cache + row[:, None] * row_width + column[None, :], mask=row_ok[:, None] & column_ok[None, :],
                     other=0)
    if FP8:
        row_scale = tl.load(cache_scales + row, mask=row_ok, other=0.0)
        return (fp8_e4m3_to_float(values) * row_scale[:, None]).to(dtype)
    return values.to(dtype)


@triton.jit
def stable_tanh(x):
    """tanh in fp32, exact at both tails: 1 - 2 / (exp(2x) + 1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: 3xTF32 for fp32 operands (tensor cores at about fp32 accuracy; Triton's "ieee" fp32
    products become FMA loops that spill registers on sm_90), the operands' own precision otherwise."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def require_power_of_two(name: str, value: int, minimum: int = 16) -> None:
    """Raise ValueError unless value is a power of two >= minimum (the kernels' tile sizes are the dims)."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"the Triton kernels need {name} to be a power of two >= {minimum}, got {value}; "
                         "use the torch backend for this shape.")


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter), so split logic is exercised."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
