"""The all-to-all MoE (`--moe-a2a-backend torch`): each token's routed-expert input travels only to the ranks that
hold a slot it chose, and their weighted outputs come back to it.

A token is owned by one rank: its attention group's tokens split into contiguous shares over the group's ranks
(`own_rows`). The owner sends the token's row once to every rank of each EP group holding one of its slots (with
moe_tp > 1 an expert's intermediate width is split over its group's ranks, and each computes its share), with the
token's k slot ids and routing weights; each rank computes the pairs of its own slots (RoutedExperts.forward) and
returns one row per received token: the weighted sum of its experts' outputs. The owner adds the returned rows in
rank order, in float32.

Bytes one rank sends (traffic.a2a_traffic): per dispatched (token, destination rank) pair to another rank, the row
(D x activation bytes) and 8 k bytes of slot ids (int32) and weights (fp32); the same rows' outputs back; and the
row counts (8 bytes to each other rank).
"""

from __future__ import annotations

import torch

from ..distributed.layout import partition
from ..distributed.parallel import Parallel


def own_rows(tokens: int, par: Parallel) -> tuple[tuple[int, int], tuple[int, ...]]:
    """([lo, hi) of this rank's share, every rank's share size) of its attention group's `tokens` tokens."""
    rank, parts = par.layout.axis("ffn")
    shares = [partition(tokens, parts, r) for r in range(parts)]
    return shares[rank], tuple(hi - lo for lo, hi in shares)


def destinations(slots: torch.Tensor, slots_per_rank: int, par: Parallel) -> tuple[torch.Tensor, list[int]]:
    """The tokens to send, rank by rank (token indices [pairs]), and how many go to each TP rank, for slots [T, k]:
    token t goes once to every rank of each EP group holding one of its slots."""
    layout = par.layout
    hit = torch.zeros(layout.ep_size, slots.shape[0], dtype=torch.bool, device=slots.device)
    hit.scatter_(0, (slots // slots_per_rank).t(), True)
    per_group = hit.nonzero()[:, 1].split(hit.sum(1).tolist())           # each EP group's tokens, in order
    groups = [r // layout.moe_tp_size for r in range(layout.tp_size)]
    return torch.cat([per_group[g] for g in groups]), [per_group[g].numel() for g in groups]


def dispatch_and_combine(experts, z: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                         par: Parallel) -> torch.Tensor:
    """z [T, D] (this rank's own tokens), slots [T, k] (RoutedExperts.route), weights [T, k] fp32 ->
    sum_k weights * expert_k(z) [T, D] in z's dtype, computed where the experts are."""
    order, sent = destinations(slots, experts.slots, par)
    received = par.exchange_counts(sent)
    rows = par.all_to_all(z[order], sent, received, "a2a_dispatch")
    meta = torch.cat([slots[order].to(torch.int32), weights[order].float().view(torch.int32)], dim=1)
    meta = par.all_to_all(meta, sent, received, "a2a_dispatch")
    k = slots.shape[1]
    out = experts(rows, meta[:, :k].long(), meta[:, k:].view(torch.float32))
    back = par.all_to_all(out, received, sent, "a2a_combine")
    total = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    return total.index_add_(0, order, back.float()).to(z.dtype)
