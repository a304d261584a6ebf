"""Masked softmax attention over a padded batch: the plain and the absorbed (latent) forms of MLA both use it."""

from __future__ import annotations

import torch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, over allowed keys) v, in fp32.

    q: [N, L, H, D]; k: [N, S, Hk, D] and v: [N, S, Hk, Dv] with Hk = H (plain MLA) or Hk = 1 (absorbed MLA, one
    latent shared by all heads); mask: [N, L, S] bool, True where query l may attend to key s. A query row with no
    allowed key (padding) returns zeros. Returns [N, L, H, Dv] in q's dtype.
    """
    scores = torch.einsum("nlhd,nshd->nhls", q.float(), k.float().expand(-1, -1, q.shape[2], -1)) * scale
    allowed = mask.unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("nhls,nshd->nlhd", probs, v.float().expand(-1, -1, q.shape[2], -1))
    return out.to(q.dtype)
