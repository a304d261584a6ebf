"""The lightning indexer's scores and its causal top-k selection (DeepSeek Sparse Attention, K3.1 Pro)."""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """I[n, l, s] = sum_h weights[n, l, h] * relu(q[n, l, h] . k[n, s]) * D^-0.5, -inf where mask is False.

    q: [N, L, Hi, D]; k: [N, S, D]; weights: [N, L, Hi] (already scaled by Hi^-0.5); mask: [N, L, S] bool.
    Returns [N, L, S] fp32.
    """
    dots = torch.einsum("nlhd,nsd->nlhs", q.float(), k.float()).relu() * q.shape[-1] ** -0.5
    scores = torch.einsum("nlhs,nlh->nls", dots, weights.float())
    return scores.masked_fill(~mask, float("-inf"))


def topk_mask(scores: torch.Tensor, mask: torch.Tensor, topk: int) -> torch.Tensor:
    """Keep the topk highest-scoring allowed keys of each query: [N, L, S] bool (all allowed keys if fewer).

    Ties go to the earlier position, so the selection does not depend on how the batch is laid out (relu makes
    exact-zero scores common): the keys above each row's topk-th highest score, then the earliest of those tied
    with it, as many as are left (what a stable descending sort keeps, without sorting: 3.5 ms for a 511-token
    prefill's [511, 511] scores on two cores).
    """
    if scores.shape[-1] <= topk:
        return mask
    threshold = scores.topk(topk, dim=-1).values[..., -1:]
    above, tied = scores > threshold, scores == threshold
    room = topk - above.sum(-1, keepdim=True)
    return (above | (tied & (tied.cumsum(-1) <= room))) & mask
