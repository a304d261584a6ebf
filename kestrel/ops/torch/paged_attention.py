"""Absorbed-form MLA decode straight from the paged latent cache, dense or over the indexer's selected positions.

The cache is a flat array of rows, row = page * page_size + offset, each holding one token's latent (the first
value_dim values, 512 in the family) and its head-shared key part (64): the keys are whole rows, the values their
latent part. Rows may be FP8 E4M3 with one fp32 scale each; they are dequantized to the query's dtype on read,
as `kestrel.layers.cache.PagedRows.read` does. Rows a query cannot see may be unwritten (the cache is not
initialised), so they never reach a result. Query token t of sequence seq_index[t] sits at positions[t] and
attends to positions 0..positions[t] of its sequence (all of them, or only those in `selected[t]`).

The query tokens come in groups of `tokens_per_seq` consecutive tokens of one sequence at increasing positions (1:
a decode step; more: a speculative verification of equal drafts, `ForwardBatch.uniform`): each group reads its
sequence's rows once, not once per token. With `selected` (sparse MLA) each token reads only its
selected rows, so a step's work does not grow with the context.

Float32 queries on the CPU (eagerly and traced) run on kestrel's C++ kernel kestrel_cpu::paged_mla
(kestrel.ops.cpu): each token reads its visible rows where they lie, once for all heads, with an online softmax, where
the torch ops gather them ([T, S, Dk], for a sparse prefill chunk 2,048 rows per token) and score them in a [T, H, S]
matrix. Deterministic inference keeps the torch ops, whose order its batch-invariant products fix.
"""

from __future__ import annotations

import torch

from .. import batch_invariant, cpu
from .attention import masked_attention

KERNEL_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def paged_rows(page_table: torch.Tensor, page_size: int, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Flat cache row of `position` in sequence `seq` (broadcast together); columns past the table clamp to its last."""
    column = (position // page_size).clamp(max=page_table.shape[1] - 1)
    return page_table[seq, column] * page_size + position % page_size


def read_rows(values: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """Rows [...] of a paged cache (values [R, D], FP8 scales [R] or None) -> [..., D] in dtype."""
    if scales is None:
        return values[rows].to(dtype)
    return (values[rows].float() * scales[rows].unsqueeze(-1)).to(dtype)


def group_rows(page_table: torch.Tensor, page_size: int, seq_index: torch.Tensor, positions: torch.Tensor,
               context_len: int, tokens_per_seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For query tokens in groups of tokens_per_seq (see the module docstring), over positions 0..context_len-1:
    each group's cache rows [T / L, S] int64; which of them its last token sees [T / L, S] bool (the rows past it
    may never have been written); and which positions each token sees [T, S] bool."""
    position = torch.arange(context_len, device=positions.device)
    visible = position <= positions.unsqueeze(1)
    rows = paged_rows(page_table, page_size, seq_index[::tokens_per_seq].unsqueeze(1), position)
    return rows, visible[tokens_per_seq - 1::tokens_per_seq], visible


def paged_mla_decode(q: torch.Tensor, cache_values: torch.Tensor, cache_scales: torch.Tensor | None,
                     page_table: torch.Tensor, page_size: int, seq_index: torch.Tensor, positions: torch.Tensor,
                     scale: float, value_dim: int, selected: torch.Tensor | None = None, tokens_per_seq: int = 1
                     ) -> torch.Tensor:
    """softmax(q . rows * scale) @ rows[:, :value_dim] over each query's visible cache rows.

    q: [T, H, Dk] (the absorbed query: latent part, then shared-key part; Dk = the cache row width);
    cache_values: [R, Dk] (model dtype, or FP8 E4M3 with cache_scales [R] fp32); page_table: [N, P] int64;
    seq_index, positions: [T] int64; selected: [T, k] int64 positions (-1 = none) for sparse MLA, or None;
    tokens_per_seq: the query tokens' grouping (see the module docstring).
    Returns [T, H, value_dim] in q's dtype; a query with no visible row gets zeros.
    """
    if (q.device.type == "cpu" and q.dtype == torch.float32 and cache_values.dtype in KERNEL_VALUE_DTYPES
            and not batch_invariant.active() and cpu.available()):
        return torch.ops.kestrel_cpu.paged_mla(q.contiguous(), cache_values, cache_scales, page_table, page_size,
                                               seq_index, positions, scale, value_dim, selected)
    if selected is not None:
        return _sparse_decode(q, cache_values, cache_scales, page_table, page_size, seq_index, positions, scale,
                              value_dim, selected)
    groups = q.shape[0] // tokens_per_seq
    context_len = page_table.shape[1] * page_size       # every position the table can hold (no host sync)
    rows, seen, mask = group_rows(page_table, page_size, seq_index, positions, context_len, tokens_per_seq)
    # Rows past a group's last query may never have been written (the cache is not initialised): zero them.
    context = torch.where(seen.unsqueeze(-1), read_rows(cache_values, cache_scales, rows, q.dtype), 0)
    context = context.unsqueeze(2)                                                     # [T/L, S, 1, Dk]
    o = masked_attention(q.unflatten(0, (groups, tokens_per_seq)), context, context[..., :value_dim],
                         mask.unflatten(0, (groups, tokens_per_seq)), scale)
    return o.flatten(0, 1)


SPARSE_ROWS = 1 << 16
"""Selected rows `_sparse_decode` reads at once (a prefill chunk's tokens go by slices of SPARSE_ROWS / k)."""


def _sparse_decode(q: torch.Tensor, cache_values: torch.Tensor, cache_scales: torch.Tensor | None,
                   page_table: torch.Tensor, page_size: int, seq_index: torch.Tensor, positions: torch.Tensor,
                   scale: float, value_dim: int, selected: torch.Tensor) -> torch.Tensor:
    """paged_mla_decode over the selected positions only: each query token reads its k listed rows (those at or
    before its position), never the rest of its context. Equals the dense form masked to them."""
    step = max(1, SPARSE_ROWS // max(1, selected.shape[1]))
    if q.shape[0] > step:
        return torch.cat([_sparse_decode(q[i:i + step], cache_values, cache_scales, page_table, page_size,
                                         seq_index[i:i + step], positions[i:i + step], scale, value_dim,
                                         selected[i:i + step]) for i in range(0, q.shape[0], step)])
    listed = (selected >= 0) & (selected <= positions.unsqueeze(1))                    # [T, k]
    rows = paged_rows(page_table, page_size, seq_index.unsqueeze(1), selected.clamp(min=0))
    context = torch.where(listed.unsqueeze(-1), read_rows(cache_values, cache_scales, rows, q.dtype), 0)
    context = context.unsqueeze(2)                                                     # [T, k, 1, Dk]
    o = masked_attention(q.unsqueeze(1), context, context[..., :value_dim], listed.unsqueeze(1), scale)
    return o.squeeze(1)
