"""The lightning indexer's scores for new tokens against the paged indexer-key cache, and its top-k (K3.1 Pro).

`paged_indexer_scores` is the reference for the Triton scoring kernel; the top-k selection that follows is
`topk_positions` (torch on every backend). `paged_indexer_topk` is both: on the CPU, the C++ kernel
kestrel_cpu::indexer_topk (kestrel.ops.cpu), which keeps each token's best positions as it scores the keys block by
block, so that no [T, context] score matrix is formed.
"""

from __future__ import annotations

import torch

from .. import cpu
from .indexer import indexer_scores, topk_positions
from .paged_attention import group_rows, read_rows

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_KEY_DTYPES = (*KERNEL_DTYPES, torch.float8_e4m3fn)


def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_values: torch.Tensor,
                         key_scales: torch.Tensor | None, page_table: torch.Tensor, page_size: int,
                         seq_index: torch.Tensor, positions: torch.Tensor, context_len: int, tokens_per_seq: int = 1
                         ) -> torch.Tensor:
    """I[t, s] = sum_h weights[t, h] relu(q[t, h] . key_s) D^-0.5 for s <= positions[t], else -inf.

    q: [T, Hi, D]; weights: [T, Hi] (already scaled by Hi^-0.5); key_values: [R, D] (model dtype, or FP8 E4M3
    with key_scales [R] fp32), dequantized to q's dtype; page_table: [N, P] int64; seq_index, positions: [T]
    int64; context_len: the number of score columns (at least max(positions) + 1); tokens_per_seq: the query
    tokens' grouping (kestrel.ops.torch.paged_attention: each group reads its keys once). Returns [T, context_len]
    fp32.
    """
    groups = q.shape[0] // tokens_per_seq
    rows, _, mask = group_rows(page_table, page_size, seq_index, positions, context_len, tokens_per_seq)
    # Rows past a group's last token may be unwritten (NaN, say): each key only reaches its own score column, which
    # the mask sets to -inf, so they are read as they are rather than zeroed first (a pass over the whole context).
    keys = read_rows(key_values, key_scales, rows, q.dtype)
    q, weights, mask = (x.unflatten(0, (groups, tokens_per_seq)) for x in (q, weights, mask))
    return indexer_scores(q, keys, weights, mask).flatten(0, 1)


def paged_indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_values: torch.Tensor,
                       key_scales: torch.Tensor | None, page_table: torch.Tensor, page_size: int,
                       seq_index: torch.Tensor, positions: torch.Tensor, context_len: int, topk: int,
                       tokens_per_seq: int = 1) -> torch.Tensor:
    """topk_positions(paged_indexer_scores(...), topk): [T, min(topk, context_len)] int64, best first, -1 after a
    token's last visible position (same arguments as paged_indexer_scores). On the CPU, kestrel_cpu::indexer_topk
    (where built), whose scores are the batch-invariant products': the same positions as the reference's under
    `kestrel.ops.batch_invariant.invariant()`, within rounding of them otherwise (float32, bfloat16 and float16
    queries and keys, or FP8 keys; other dtypes take the reference)."""
    width = min(topk, context_len)
    if (q.device.type == "cpu" and q.dtype in KERNEL_DTYPES and key_values.dtype in KERNEL_KEY_DTYPES and width > 0
            and cpu.available()):
        return torch.ops.kestrel_cpu.indexer_topk(q, weights.float(), key_values, key_scales, page_table, page_size,
                                                  seq_index, positions, width)
    return topk_positions(paged_indexer_scores(q, weights, key_values, key_scales, page_table, page_size, seq_index,
                                               positions, context_len, tokens_per_seq), topk)
