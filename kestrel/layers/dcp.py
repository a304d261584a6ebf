"""Decode context parallelism of the MLA cache (`--dcp-size`, dividing the TP group into DCP groups of
consecutive ranks).

DCP rank r holds position p of every sequence when p % dcp == r, at row
page_table[n, p // page_size] * (page_size / dcp) + (p % page_size) // dcp of its cache: each rank stores 1/dcp of
every page. Attention runs in the absorbed form, whose keys and values are the latent every head shares, so any
rank can attend any head's query over the positions it holds: the DCP group's absorbed queries are gathered, each
rank attends the group's heads over its positions (a partial softmax and its log-sum-exp), and the partials are
merged by log-sum-exp (an all-reduce of the maximum, then of the rescaled outputs and weights); each rank keeps its
own heads. The lightning indexer does the same with its scores: the group's index queries gathered, each rank
scores the keys it holds, the other DCP groups' heads summed in (the ranks holding the same positions), the scores
gathered into every position's, and every rank selects the same top-k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.parallel import Parallel
from .batch import ForwardBatch


def cache_rows(page_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int,
               dcp: int) -> torch.Tensor:
    """This rank's cache row of position pos of sequence seq (for a position the rank holds)."""
    cols = (pos // page_size).clamp(max=page_table.shape[1] - 1)
    return page_table[seq, cols] * (page_size // dcp) + (pos % page_size) // dcp


def held_positions(batch: ForwardBatch, rank: int, dcp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions this rank holds, [N, S'] with S' = ceil(max_total / dcp) (p = j * dcp + rank), and which of
    them each sequence has reached after this call, [N, S'] bool."""
    count = -(-batch.max_total // dcp)
    positions = torch.arange(count, device=batch.positions.device) * dcp + rank
    positions = positions.expand(batch.num_seqs, count)
    return positions, positions < batch.seq_lens.unsqueeze(1)


def gather_heads(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The DCP group's heads of x [T, H/tp, ...] -> [T, dcp * H/tp, ...] (rank order is head order)."""
    parts = par.dcp_gather(x)                                     # [dcp, T, H/tp, ...]
    return parts.transpose(0, 1).flatten(1, 2)


def gather_positions(scores: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Every DCP rank's scores over the positions it holds, [N, L, S'] -> [N, L, S' * dcp] by position."""
    parts = par.dcp_gather(scores)                                # [dcp, N, L, S']
    return parts.permute(1, 2, 3, 0).flatten(2)


def partial_attention(q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, scale: float,
                      value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention over this rank's positions: q [N, L, H, D], context [N, S', D] (the latents), mask
    [N, L, S'] -> (outputs [N, L, H, value_dim], log-sum-exp [N, L, H]) in fp32; -inf and zeros without a key."""
    scores = torch.einsum("nlhd,nsd->nlhs", q.float(), context.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1))
    return torch.einsum("nlhs,nsv->nlhv", probs, context[..., :value_dim].float()), lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The softmax over every DCP rank's positions from each one's partial (out [N, L, H, V], lse [N, L, H])."""
    top = par.dcp_all_reduce(lse.clone(), op=dist.ReduceOp.MAX)
    weight = torch.exp(lse - torch.where(torch.isfinite(top), top, 0))          # 0 where this rank has no key
    total = par.dcp_all_reduce(weight.clone())
    summed = par.dcp_all_reduce((out * weight.unsqueeze(-1)).contiguous())
    return summed / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
