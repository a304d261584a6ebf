"""Expert-parallel load balancing (EPLB): where each logical expert's replicas live.

Each of `ranks` EP ranks holds `slots` physical expert slots (its own E/ranks experts plus redundant ones). From a
window of routing statistics (tokens per logical expert), `place` replicates the heaviest experts (`replica_counts`)
and packs the replicas onto ranks greedily by longest-processing-time, so the heaviest rank stays light; tokens of
an expert are assumed to split equally over its replicas. A placement is a [ranks * slots] int64 tensor of logical
expert ids, rank g holding slots [g*slots, (g+1)*slots). After DeepSeek's EPLB (github deepseek-ai/EPLB).
"""

from __future__ import annotations

from collections import Counter

import torch


def _check(load: torch.Tensor, physical: int) -> None:
    if physical < load.numel():
        raise ValueError(f"{physical} physical slots cannot hold {load.numel()} experts; give each expert a slot.")
    if bool((load < 0).any()):
        raise ValueError("expert load has a negative entry; pass token counts, which are >= 0.")


def replica_counts(load: torch.Tensor, physical: int) -> torch.Tensor:
    """load [E] (tokens per logical expert, float or int, >= 0) -> replicas [E] int64, each >= 1, summing to
    `physical` (>= E). Each extra replica goes to the expert with the largest load per replica (ties: lowest id),
    which minimizes the largest load per replica."""
    _check(load, physical)
    load = load.double()
    replicas = torch.ones_like(load, dtype=torch.int64)
    for _ in range(physical - load.numel()):
        replicas[torch.argmax(load / replicas)] += 1          # argmax returns the first maximum
    return replicas


def place(load: torch.Tensor, ranks: int, slots: int, current: torch.Tensor | None = None) -> torch.Tensor:
    """load [E] -> placement [ranks * slots] int64: the logical expert held by each physical slot.

    Replicas (each carrying load[e] / replicas[e]) go in decreasing per-replica load (ties: lowest expert) to the
    least-loaded rank with a free slot, skipping ranks that already hold the expert while another has a free slot
    (ties: lowest rank). With `current` [ranks * slots] (the placement in force), the packed ranks are renumbered to
    match the current ranks they share most experts with, and each slot keeps its expert wherever its rank keeps
    that expert, so applying the placement copies few experts; otherwise a rank's experts are in ascending order."""
    replicas = replica_counts(load, ranks * slots).tolist()
    per = (load.double() / torch.tensor(replicas, dtype=torch.float64)).tolist()
    items = sorted((e for e, n in enumerate(replicas) for _ in range(n)), key=lambda e: (-per[e], e))
    held: list[list[int]] = [[] for _ in range(ranks)]
    rank_sum = [0.0] * ranks
    for e in items:
        free = [g for g in range(ranks) if len(held[g]) < slots]
        fresh = [g for g in free if e not in held[g]] or free
        g = min(fresh, key=lambda g: (rank_sum[g], g))
        held[g].append(e)
        rank_sum[g] += per[e]
    old = current.view(ranks, slots).tolist() if current is not None else [[-1] * slots for _ in range(ranks)]
    held = _match(held, old)
    return torch.tensor([e for g in range(ranks) for e in _order(held[g], old[g])], dtype=torch.int64)


def _match(held: list[list[int]], old: list[list[int]]) -> list[list[int]]:
    """The packed ranks' expert lists reassigned to ranks: greedily, the packed rank and the current rank sharing
    the most experts are paired first (ties: lowest current rank, then lowest packed rank)."""
    shared = [[sum((Counter(h) & Counter(o)).values()) for o in old] for h in held]
    pairs = sorted((-shared[n][g], g, n) for n in range(len(held)) for g in range(len(old)))
    by_rank: dict[int, list[int]] = {}
    used: set[int] = set()
    for _, g, n in pairs:
        if g not in by_rank and n not in used:
            by_rank[g] = held[n]
            used.add(n)
    return [by_rank[g] for g in range(len(old))]


def _order(experts: list[int], old: list[int]) -> list[int]:
    """A rank's experts in slot order: each slot keeps its `old` expert while the rank still holds a copy of it;
    the remaining experts fill the other slots in ascending order."""
    left = Counter(experts)
    kept: list[int | None] = []
    for e in old:
        keep = left[e] > 0
        kept.append(e if keep else None)
        left[e] -= keep
    rest = iter(sorted(left.elements()))
    return [e if e is not None else next(rest) for e in kept]


def rank_load(placement: torch.Tensor, load: torch.Tensor, ranks: int) -> torch.Tensor:
    """placement [ranks * slots], load [E] -> [ranks] float64: the load each rank carries when each expert's load
    splits equally over its replicas."""
    replicas = torch.bincount(placement, minlength=load.numel()).clamp(min=1)
    per = load.double() / replicas
    return per[placement].view(ranks, -1).sum(1)


def imbalance(per_rank: torch.Tensor) -> float:
    """max / mean of a per-rank load [ranks] (1.0 when all zero)."""
    mean = per_rank.double().mean()
    return 1.0 if mean == 0 else float(per_rank.double().max() / mean)


def initial_placement(experts: int, ranks: int, slots: int) -> torch.Tensor:
    """The placement at load time, without statistics [ranks * slots]: rank g holds experts
    [g*E/ranks, (g+1)*E/ranks) first, then fills its redundant slots with copies of its own experts in order, so no
    weight crosses ranks at start-up."""
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split evenly over {ranks} ranks; use a divisor of the experts.")
    _check(torch.zeros(experts), ranks * slots)
    local = experts // ranks
    own = torch.arange(slots) % local
    return torch.cat([g * local + own for g in range(ranks)])
