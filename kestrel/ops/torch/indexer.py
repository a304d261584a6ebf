"""The lightning indexer's scores and its causal top-k selection (DeepSeek Sparse Attention, K3.1 Pro).

Every selection here keeps what a stable descending sort of the scores keeps (ties go to the earlier position, so
the selection does not depend on how the batch is laid out: relu makes exact-zero scores common), without sorting:
the keys above the topk-th highest score (a partial selection, torch.topk), then the earliest of those tied with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SCORE_BLOCK = 4096
"""Keys scored at a time by `indexer_topk` (a prefill chunk of L queries holds [L, Hi, SCORE_BLOCK] dot products,
never [L, context])."""


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """I[n, l, s] = sum_h weights[n, l, h] * relu(q[n, l, h] . k[n, s]) * D^-0.5, -inf where mask is False.

    q: [N, L, Hi, D]; k: [N, S, D]; weights: [N, L, Hi] (already scaled by Hi^-0.5); mask: [N, L, S] bool.
    Returns [N, L, S] fp32.
    """
    dots = torch.einsum("nlhd,nsd->nlhs", q.float(), k.float())
    dots = dots.relu_().mul_(q.shape[-1] ** -0.5) if not dots.requires_grad else dots.relu() * q.shape[-1] ** -0.5
    scores = torch.einsum("nlhs,nlh->nls", dots, weights.float())
    return scores.masked_fill(~mask, float("-inf"))


def _keep(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., S] bool with exactly topk True per row (S > topk): the first topk of a stable descending sort."""
    threshold = scores.topk(topk, dim=-1).values[..., -1:]
    above, tied = scores > threshold, scores == threshold
    room = topk - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def topk_mask(scores: torch.Tensor, mask: torch.Tensor, topk: int) -> torch.Tensor:
    """Keep the topk highest-scoring allowed keys of each query: [N, L, S] bool (all allowed keys if fewer).

    Ties go to the earlier position (module docstring): 3.5 ms for a 511-token prefill's [511, 511] scores on two
    cores.
    """
    if scores.shape[-1] <= topk:
        return mask
    return _keep(scores, topk) & mask


_LOW = 2 ** 32 - 1
_NEG_INF_RANK = -(2 ** 31) + 2 ** 23 - 1
"""`_ranked`'s high half for a -inf score (its bits 0xFF800000, then every bit but the sign flipped)."""


def _ranked(scores: torch.Tensor, start: int = 0) -> torch.Tensor:
    """[..., S] fp32 -> [..., S] int64 keys in the selection's order, all distinct: the score's bits made
    monotonic as a signed integer in the high half (-0.0 counted as +0.0), 2^32 - 1 - position in the low half, so
    of two equal scores the earlier position ranks higher. start: the position of column 0."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)                 # + 0.0 turns -0.0 into +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)                                  # negative floats count down
    position = torch.arange(start, start + scores.shape[-1], device=scores.device)
    return (ordered.long() << 32) | (_LOW - position)


def _positions(keys: torch.Tensor) -> torch.Tensor:
    """`_ranked` keys -> their positions, -1 for -inf scores."""
    return torch.where((keys >> 32) > _NEG_INF_RANK, _LOW - (keys & _LOW), -1)


def topk_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The topk highest-scoring positions of each query, [..., min(topk, S)] int64 from the highest score down
    (what a stable descending sort puts first), -1 (at the end) where the score is -inf.

    scores: [..., S] fp32, -inf at disallowed positions. Ties go to the earlier position, so the selection equals
    topk_mask's: every allowed position when there are at most topk of them. One partial selection (torch.topk)
    over keys that hold both the score and the position, not a sort; no host synchronisation (a compiled decode
    step traces it).
    """
    return _positions(_ranked(scores).topk(min(topk, scores.shape[-1]), dim=-1).values)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, last: torch.Tensor, topk: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, block: int = SCORE_BLOCK
                 ) -> torch.Tensor:
    """`topk_positions` of the causal `indexer_scores`, block by block over the keys: [N, L, min(topk, S)] int64.

    q: [N, L, Hi, D]; k: [N, S, D]; weights: [N, L, Hi]; last: [N, L] int64, the last position each query sees
    (-1: none, a padding row); reduce: applied to each block's scores before selecting (tensor parallelism sums
    the ranks' partial scores). Each block of keys keeps its own topk (the global topk is among them: a key
    with fewer than topk keys before it in the whole order has fewer in its block), then the topk of those
    candidates: the same positions, in the same order, as topk_positions over the whole [N, L, S] scores, which
    are never held at once.
    """
    s = k.shape[1]
    candidates = []
    for start in range(0, max(s, 1), block):
        position = torch.arange(start, min(start + block, s), device=k.device)
        scores = indexer_scores(q, k[:, start:start + block], weights, position <= last.unsqueeze(-1))
        if reduce is not None:
            scores = reduce(scores)
        candidates.append(_ranked(scores, start).topk(min(topk, scores.shape[-1]), dim=-1).values)
    keys = candidates[0] if len(candidates) == 1 else torch.cat(candidates, -1)
    return _positions(keys.topk(min(topk, s), dim=-1).values)
