"""Grouped GEMM over the routed experts, MXFP4 weights dequantized in the kernel, the gated activation fused.

Matches `kestrel.ops.torch.moe.moe_experts` (same signature). Token-expert pairs are sorted by expert and each
expert's pairs padded to whole blocks of BLOCK_M rows (torch, on the device, no host synchronisation: the block
count is bounded by shapes alone, and blocks past the real ones exit at once). Then:

1. `_gate_up_kernel`, one program per (block, BLOCK_N columns of I): gate = x W1^T and up = x W3^T for the block's
   pairs, act(gate, up) stored in the activation dtype;
2. `_down_kernel`, one program per (block, BLOCK_N columns of D): y = h W2^T times the pair's routing weight,
   stored per pair in fp32; the k pairs of a token are summed in torch.

MXFP4 rows hold two E2M1 codes per byte (even column low nibble, odd column high): a byte tile is dequantized to
an even-column and an odd-column weight tile, each multiplied with the matching columns of the activations.

With MXFP8 activations (the W4A8 recipe K3 was trained with), each activation tile is rounded in the kernel to
E4M3 with an E8M0 scale per 32 columns, exactly as `kestrel.quant.fake_quantize_mxfp8` rounds it, and multiplied
with MXFP4 experts by `tl.dot_scaled`: an MX tensor-core product where the GPU has one (sm_100), Triton's bf16
emulation elsewhere, both exact products accumulated in fp32. Dense experts get the rounded tile dequantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch.moe import SITU, ExpertWeights, GLUActivation
from .common import dot_precision, e2m1_to_float, e8m0_to_float, stable_tanh

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64
"""Tile sizes: pair rows per block, output columns and input columns per step (a multiple of the MXFP4 block 32)."""


@triton.jit
def _mxfp4_tiles(packed, scales, expert, n, n_ok, byte, byte_ok, N: tl.constexpr, K: tl.constexpr, dtype: tl.constexpr):
    """Expert `expert`'s rows n [BLOCK_N] at packed bytes `byte`: (even-column, odd-column) tiles in dtype."""
    mask = n_ok[:, None] & byte_ok[None, :]
    row = expert * N + n
    codes = tl.load(packed + row[:, None] * (K // 2) + byte[None, :], mask=mask, other=0)
    scale = e8m0_to_float(tl.load(scales + row[:, None] * (K // 32) + (byte // 16)[None, :], mask=mask, other=0))
    return (e2m1_to_float(codes & 0xF) * scale).to(dtype), (e2m1_to_float(codes >> 4) * scale).to(dtype)


@triton.jit
def _round_to_e4m3(v):
    """v fp32, |v| <= 448 -> the nearest E4M3 value (ties to even), in fp32. (v + c) - c with c = 1.5 * 2^23 E4M3
    spacings at v: the fp32 addition rounds, exactly on any GPU and in the interpreter (whose E4M3 cast does not
    round to nearest even), so the cast that follows is exact."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127            # floor(log2 |v|) for normal v
    spacing = tl.maximum(exponent, -6) - 3                                      # 3 mantissa bits; subnormal below 2^-6
    c = (((spacing + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def _mxfp8(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] fp32 -> MXFP8: E4M3 values [BLOCK_M, BLOCK_K] and E8M0 scale codes [BLOCK_M,
    BLOCK_K // 32] uint8, fake_quantize_mxfp8's rule: scale 2^(floor(log2 amax) - 8) clamped to [2^-127, 2^127],
    values clamped to +-448 and rounded to nearest even. A block holding Inf or NaN gets scale code 255 (NaN)."""
    blocks = tl.reshape(x, [BLOCK_M, BLOCK_K // 32, 32])
    amax_exponent = (tl.max(tl.abs(blocks), axis=2).to(tl.int32, bitcast=True) >> 23) & 0xFF   # 255: Inf or NaN
    exponent = tl.minimum(tl.maximum(amax_exponent - 127 - 8, -127), 127)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)          # 2^-exponent, a normal float
    values = _round_to_e4m3(tl.minimum(tl.maximum(blocks * inverse[:, :, None], -448.0), 448.0))
    codes = tl.where(amax_exponent == 255, 255, exponent + 127).to(tl.uint8)
    return tl.reshape(values, [BLOCK_M, BLOCK_K]).to(tl.float8e4nv), codes


@triton.jit
def _mxfp8_dequantize(values, codes, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """_mxfp8's output back to fp32 [BLOCK_M, BLOCK_K] (scale code 255: NaN; code 0, a block below 2^-118: 0)."""
    scale = tl.where(codes == 255, float("nan"), e8m0_to_float(codes))
    blocks = tl.reshape(values.to(tl.float32), [BLOCK_M, BLOCK_K // 32, 32]) * scale[:, :, None]
    return tl.reshape(blocks, [BLOCK_M, BLOCK_K])


@triton.jit
def _expert_product(x, x_rows, row_ok, w, w_scale, expert, n, n_ok, N: tl.constexpr, K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                    MXFP8: tl.constexpr, PRECISION: tl.constexpr):
    """x[x_rows] [BLOCK_M, K] @ W[expert][n]^T -> [BLOCK_M, BLOCK_N] fp32, W [E, N, K] dense or MXFP4, x rounded
    to MXFP8 first when MXFP8 (K a multiple of 32)."""
    dtype = x.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if MXFP8:
            column = k0 + tl.arange(0, BLOCK_K)
            column_ok = column < K
            x_tile = tl.load(x + x_rows[:, None] * K + column[None, :], mask=row_ok[:, None] & column_ok[None, :],
                             other=0.0)
            x_values, x_scales = _mxfp8(x_tile.to(tl.float32), BLOCK_M, BLOCK_K)
            row = expert * N + n
            if MXFP4:
                byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                codes = tl.load(w + row[None, :] * (K // 2) + byte[:, None],
                                mask=(2 * byte < K)[:, None] & n_ok[None, :], other=0)      # [BLOCK_K // 2, BLOCK_N]
                group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                w_scales = tl.load(w_scale + row[:, None] * (K // 32) + group[None, :],
                                   mask=n_ok[:, None] & (group < K // 32)[None, :], other=0)
                acc = tl.dot_scaled(x_values, x_scales, "e4m3", codes, w_scales, "e2m1", acc)
            else:
                x_tile = _mxfp8_dequantize(x_values, x_scales, BLOCK_M, BLOCK_K).to(dtype)
                w_tile = tl.load(w + row[:, None] * K + column[None, :], mask=n_ok[:, None] & column_ok[None, :],
                                 other=0.0).to(dtype)
                acc += tl.dot(x_tile, tl.trans(w_tile), input_precision=PRECISION)
        elif MXFP4:
            byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            column = 2 * byte
            column_ok = column < K
            x_mask = row_ok[:, None] & column_ok[None, :]
            x_even = tl.load(x + x_rows[:, None] * K + column[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x + x_rows[:, None] * K + column[None, :] + 1, mask=x_mask, other=0.0)
            w_even, w_odd = _mxfp4_tiles(w, w_scale, expert, n, n_ok, byte, column_ok, N, K, dtype)
            acc += tl.dot(x_even, tl.trans(w_even), input_precision=PRECISION)
            acc += tl.dot(x_odd, tl.trans(w_odd), input_precision=PRECISION)
        else:
            column = k0 + tl.arange(0, BLOCK_K)
            column_ok = column < K
            x_tile = tl.load(x + x_rows[:, None] * K + column[None, :], mask=row_ok[:, None] & column_ok[None, :],
                             other=0.0)
            w_tile = tl.load(w + (expert * N + n)[:, None] * K + column[None, :],
                             mask=n_ok[:, None] & column_ok[None, :], other=0.0).to(dtype)
            acc += tl.dot(x_tile, tl.trans(w_tile), input_precision=PRECISION)
    return acc


@triton.jit
def _gate_up_kernel(z, w1, w3, w1_scale, w3_scale, block_expert, row_pair, h, top_k, beta, linear_beta,
                    D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, MXFP8: tl.constexpr, SITU: tl.constexpr,
                    PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair + rows)
    row_ok = pair >= 0
    token = tl.where(row_ok, pair // top_k, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    dtype = z.dtype.element_ty
    gate = _expert_product(z, token, row_ok, w1, w1_scale, expert, n, n_ok, I, D, BLOCK_M, BLOCK_N, BLOCK_K,
                           MXFP4, MXFP8, PRECISION).to(dtype).to(tl.float32)
    up = _expert_product(z, token, row_ok, w3, w3_scale, expert, n, n_ok, I, D, BLOCK_M, BLOCK_N, BLOCK_K,
                         MXFP4, MXFP8, PRECISION).to(dtype).to(tl.float32)
    if SITU:
        act = beta * stable_tanh(gate / beta) * tl.sigmoid(gate) * linear_beta * stable_tanh(up / linear_beta)
    else:
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    tl.store(h + rows[:, None] * I + n[None, :], act.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h, w2, w2_scale, block_expert, row_pair, weights, pair_out,
                 D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, MXFP8: tl.constexpr, PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair + rows)
    row_ok = pair >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    y = _expert_product(h, rows, row_ok, w2, w2_scale, expert, n, n_ok, D, I, BLOCK_M, BLOCK_N, BLOCK_K,
                        MXFP4, MXFP8, PRECISION).to(h.dtype.element_ty).to(tl.float32)
    y = y * tl.load(weights + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(pair_out + pair[:, None] * D + n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


def _block_layout(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert in blocks of BLOCK_M rows.

    Returns block_expert [B] int64 (the expert of each block, -1 past the last real block) and row_pair
    [B * BLOCK_M] int64 (the pair t * k + j at each row, -1 in padding), with B = ceil(P / BLOCK_M) + min(E, P)
    bounding the real block count from the shapes alone.
    """
    flat = ids.flatten()
    pairs = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = blocks.cumsum(0)
    max_blocks = triton.cdiv(pairs, BLOCK_M) + min(num_experts, pairs)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=ids.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[sorted_expert]
    padded_row = (block_end - blocks)[sorted_expert] * BLOCK_M + rank
    row_pair = torch.full((max_blocks * BLOCK_M,), -1, dtype=torch.int64, device=ids.device)
    return block_expert, row_pair.scatter_(0, padded_row, order)


def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                activation: GLUActivation, mxfp8_activations: bool = False) -> torch.Tensor:
    """Triton version of `kestrel.ops.torch.moe.moe_experts` (see there for shapes and semantics)."""
    num_tokens, dim = z.shape
    top_k = ids.shape[1]
    num_experts, inter = experts.w1.shape[:2]
    if num_tokens == 0:
        return torch.zeros_like(z)
    z = z.contiguous()
    block_expert, row_pair = _block_layout(ids, num_experts)
    blocks = block_expert.numel()
    h = torch.empty(blocks * BLOCK_M, inter, dtype=z.dtype, device=z.device)
    precision = dot_precision(z.dtype)
    scales = (experts.w1_scale, experts.w3_scale, experts.w2_scale) if experts.mxfp4 else (z, z, z)
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        z, experts.w1, experts.w3, scales[0], scales[1], block_expert, row_pair, h, top_k,
        activation.beta, activation.linear_beta,
        D=dim, I=inter, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MXFP4=experts.mxfp4,
        MXFP8=mxfp8_activations, SITU=activation.kind == SITU, PRECISION=precision)
    pair_out = torch.empty(num_tokens * top_k, dim, dtype=torch.float32, device=z.device)
    _down_kernel[(blocks, triton.cdiv(dim, BLOCK_N))](
        h, experts.w2, scales[2], block_expert, row_pair, weights.float().contiguous(), pair_out,
        D=dim, I=inter, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MXFP4=experts.mxfp4,
        MXFP8=mxfp8_activations, PRECISION=precision)
    return pair_out.view(num_tokens, top_k, dim).sum(1).to(z.dtype)
