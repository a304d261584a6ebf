"""Masked softmax attention over a padded batch: the plain and the absorbed (latent) forms of MLA both use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, over allowed keys) v, in fp32.

    q: [N, L, H, D]; k: [N, S, Hk, D] and v: [N, S, Hk, Dv] with Hk = H (plain MLA) or Hk = 1 (absorbed MLA, one
    latent shared by all heads); mask: [N, L, S] bool, True where query l may attend to key s. A query row with no
    allowed key (padding) returns zeros. Returns [N, L, H, Dv] in q's dtype.
    """
    has_key = mask.any(-1)                                              # [N, L]
    if k.shape[2] == 1:     # one latent for all heads: scores straight against it, no per-head copies
        scores = torch.einsum("nlhd,nsd->nhls", q.float(), k[:, :, 0].float()) * scale
        probs = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), torch.finfo(torch.float32).min), dim=-1)
        out = torch.einsum("nhls,nsd->nlhd", probs, v[:, :, 0].float())
    else:                   # per-head keys: torch's fused attention; keyless rows attend anywhere, then zeroed
        allowed = (mask | ~has_key.unsqueeze(-1)).unsqueeze(1)
        out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                             v.float().transpose(1, 2), attn_mask=allowed, scale=scale).transpose(1, 2)
    return (out * has_key[..., None, None]).to(q.dtype)
