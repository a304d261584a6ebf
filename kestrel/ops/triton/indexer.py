"""The lightning indexer's scores over the paged indexer-key cache, FP8 keys dequantized in the kernel.

Matches `kestrel.ops.torch.paged_indexer.paged_indexer_scores` (same signature). One program scores a block of
cache positions for one query token: the keys are read once for all indexer heads, [Hi, D] x [D, S] is one
matrix product, and the ReLU'd head scores are summed with the token's head weights. The top-k selection that
follows stays in torch (`kestrel.ops.torch.indexer.topk_positions`, one partial selection): `paged_indexer_topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch.indexer import topk_positions
from .common import dot_precision, load_cache_rows

BLOCK_S = 64
"""Cache positions per program."""


@triton.jit
def _scores_kernel(q, weights, keys, key_scales, page_table, seq_index, positions, out, page_size, table_width,
                   context_len, key_scale,
                   HI: tl.constexpr, D: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    seq = tl.load(seq_index + t)
    position = tl.load(positions + t)
    visible = s <= position
    page = tl.load(page_table + seq * table_width + s // page_size, mask=visible, other=0)
    row = page * page_size + s % page_size
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    key = load_cache_rows(keys, key_scales, row, visible, d, d_ok, D, q.dtype.element_ty, FP8)          # [BLOCK_S, D]
    head = tl.arange(0, BLOCK_HI)
    head_ok = head < HI
    query = tl.load(q + (t * HI + head)[:, None] * D + d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    dots = tl.maximum(tl.dot(query, tl.trans(key), input_precision=PRECISION), 0.0) * key_scale   # [HI, BLOCK_S]
    head_weight = tl.load(weights + t * HI + head, mask=head_ok, other=0.0).to(tl.float32)
    score = tl.sum(dots * head_weight[:, None], axis=0)
    tl.store(out + t * context_len + s, tl.where(visible, score, float("-inf")), mask=s < context_len)


def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_values: torch.Tensor,
                         key_scales: torch.Tensor | None, page_table: torch.Tensor, page_size: int,
                         seq_index: torch.Tensor, positions: torch.Tensor, context_len: int, tokens_per_seq: int = 1
                         ) -> torch.Tensor:
    """Triton version of `kestrel.ops.torch.paged_indexer.paged_indexer_scores` (see there for shapes; each program
    scores its own token, so the grouping tokens_per_seq changes nothing here)."""
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(num_tokens, context_len, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or context_len == 0:
        return out
    fp8 = key_scales is not None
    _scores_kernel[(num_tokens, triton.cdiv(context_len, BLOCK_S))](
        q.contiguous(), weights.contiguous(), key_values.view(torch.uint8) if fp8 else key_values,
        key_scales if fp8 else weights, page_table, seq_index, positions, out, page_size, page_table.shape[1],
        context_len, dim ** -0.5,
        HI=num_heads, D=dim, BLOCK_HI=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_S=BLOCK_S, FP8=fp8, PRECISION=dot_precision(q.dtype))
    return out


def paged_indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_values: torch.Tensor,
                       key_scales: torch.Tensor | None, page_table: torch.Tensor, page_size: int,
                       seq_index: torch.Tensor, positions: torch.Tensor, context_len: int, topk: int,
                       tokens_per_seq: int = 1) -> torch.Tensor:
    """`kestrel.ops.torch.paged_indexer.paged_indexer_topk` with this module's scores."""
    return topk_positions(paged_indexer_scores(q, weights, key_values, key_scales, page_table, page_size, seq_index,
                                               positions, context_len, tokens_per_seq), topk)
