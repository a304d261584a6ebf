"""Absorbed-form MLA decode over the paged latent cache (dense or sparse), with FP8 rows dequantized in the kernel.

Matches `kestrel.ops.torch.paged_attention.paged_mla_decode` (same signature). All heads share one latent per
token, so a program takes a block of heads of one query token and streams that token's cache rows once for all of
them: scores = q_latent . latent + q_shared . shared_key, an online softmax, and acc += p @ latent. The rows of a
long context are split across programs (flash-decoding); a second kernel merges the splits' partial results.
Row r of a sequence's position p is page_table[seq, p // page_size] * page_size + p % page_size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision, load_cache_rows, multiprocessor_count

BLOCK_S = 16
"""Cache rows per inner step (with 32 heads x 512 values in flight, 16 rows keep sm_90 free of register spills)."""
MIN_SPLIT_ROWS = 128
"""A split covers at least this many rows, so the splits' partial results stay small next to the rows read."""


@triton.jit
def _partial_kernel(q, cache, cache_scales, page_table, seq_index, positions, selected,
                    partial_out, partial_max, partial_sum, scale, page_size, table_width, num_selected, split_len,
                    H: tl.constexpr, ROW: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr,
                    SPARSE: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = tl.load(seq_index + t)
    position = tl.load(positions + t)
    total = num_selected if SPARSE else position + 1
    begin = split * split_len
    end = tl.minimum(total, begin + split_len)
    head_ok = head < H
    dv = tl.arange(0, BLOCK_V)
    dv_ok = dv < DV
    dr = DV + tl.arange(0, BLOCK_R)
    dr_ok = dr < ROW
    q_rows = (t * H + head)[:, None] * ROW
    q_latent = tl.load(q + q_rows + dv[None, :], mask=head_ok[:, None] & dv_ok[None, :], other=0.0)
    q_shared = tl.load(q + q_rows + dr[None, :], mask=head_ok[:, None] & dr_ok[None, :], other=0.0)
    dtype = q.dtype.element_ty

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    for start in range(begin, end, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        ok = s < end
        if SPARSE:
            p = tl.load(selected + t * num_selected + s, mask=ok, other=-1)
            ok = ok & (p >= 0) & (p <= position)
        else:
            p = s
        page = tl.load(page_table + seq * table_width + p // page_size, mask=ok, other=0)
        row = page * page_size + p % page_size
        latent = load_cache_rows(cache, cache_scales, row, ok, dv, dv_ok, ROW, dtype, FP8)      # [BLOCK_S, BLOCK_V]
        shared = load_cache_rows(cache, cache_scales, row, ok, dr, dr_ok, ROW, dtype, FP8)      # [BLOCK_S, BLOCK_R]
        scores = (tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
                  + tl.dot(q_shared, tl.trans(shared), input_precision=PRECISION))
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(dtype), latent, input_precision=PRECISION)
        running_max = new_max

    out_rows = (t * num_splits + split) * H + head
    tl.store(partial_out + out_rows[:, None] * DV + dv[None, :], acc, mask=head_ok[:, None] & dv_ok[None, :])
    tl.store(partial_max + out_rows, running_max, mask=head_ok)
    tl.store(partial_sum + out_rows, running_sum, mask=head_ok)


@triton.jit
def _combine_kernel(partial_out, partial_max, partial_sum, out, num_splits,
                    H: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, BLOCK_V)
    dv_ok = dv < DV
    overall_max = float("-inf")
    for split in range(0, num_splits):
        overall_max = tl.maximum(overall_max, tl.load(partial_max + (t * num_splits + split) * H + h))
    shift = tl.where(overall_max == float("-inf"), 0.0, overall_max)
    total = 0.0
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for split in range(0, num_splits):
        row = (t * num_splits + split) * H + h
        weight = tl.exp(tl.load(partial_max + row) - shift)
        total += weight * tl.load(partial_sum + row)
        acc += weight * tl.load(partial_out + row * DV + dv, mask=dv_ok, other=0.0)
    result = tl.where(total > 0.0, acc / total, 0.0)          # a query with no visible row gets zeros
    tl.store(out + (t * H + h) * DV + dv, result.to(out.dtype.element_ty), mask=dv_ok)


def _num_splits(programs: int, max_rows: int, device: torch.device) -> int:
    """Splits per query: enough programs to fill the GPU twice over, each split at least MIN_SPLIT_ROWS rows."""
    wanted = triton.cdiv(2 * multiprocessor_count(device), max(programs, 1))
    return max(1, min(wanted, triton.cdiv(max_rows, MIN_SPLIT_ROWS)))


def paged_mla_decode(q: torch.Tensor, cache_values: torch.Tensor, cache_scales: torch.Tensor | None,
                     page_table: torch.Tensor, page_size: int, seq_index: torch.Tensor, positions: torch.Tensor,
                     scale: float, value_dim: int, selected: torch.Tensor | None = None, tokens_per_seq: int = 1
                     ) -> torch.Tensor:
    """Triton version of `kestrel.ops.torch.paged_attention.paged_mla_decode` (see there for shapes; each program
    reads its own token's rows, so the grouping tokens_per_seq changes nothing here).

    The split count comes from shapes only (the page table's width, or selected's), so no host synchronisation.
    """
    num_tokens, num_heads, row_width = q.shape
    q = q.contiguous()
    if selected is not None:
        selected = selected.contiguous()      # the kernel reads row t at selected + t * num_selected
    out = torch.empty(num_tokens, num_heads, value_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    fp8 = cache_scales is not None
    block_h = min(32, max(16, triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    max_rows = selected.shape[1] if selected is not None else page_table.shape[1] * page_size
    splits = _num_splits(num_tokens * head_blocks, max_rows, q.device)
    split_len = triton.cdiv(triton.cdiv(max_rows, splits), BLOCK_S) * BLOCK_S
    partial_out = torch.empty(num_tokens * splits * num_heads, value_dim, dtype=torch.float32, device=q.device)
    partial_max = torch.empty(num_tokens * splits * num_heads, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    block_v = max(16, triton.next_power_of_2(value_dim))
    _partial_kernel[(num_tokens, head_blocks, splits)](
        q, cache_values.view(torch.uint8) if fp8 else cache_values, cache_scales if fp8 else q, page_table,
        seq_index, positions, selected if selected is not None else positions,
        partial_out, partial_max, partial_sum, scale, page_size, page_table.shape[1],
        selected.shape[1] if selected is not None else 0, split_len,
        H=num_heads, ROW=row_width, DV=value_dim, BLOCK_H=block_h, BLOCK_V=block_v,
        BLOCK_R=max(16, triton.next_power_of_2(row_width - value_dim)), BLOCK_S=BLOCK_S, FP8=fp8,
        SPARSE=selected is not None, PRECISION=dot_precision(q.dtype), num_warps=8 if block_v >= 256 else 4,
        num_stages=2)
    _combine_kernel[(num_tokens, num_heads)](partial_out, partial_max, partial_sum, out, splits,
                                            H=num_heads, DV=value_dim, BLOCK_V=block_v)
    return out
