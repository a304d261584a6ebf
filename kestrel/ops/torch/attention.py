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


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """masked_attention with each query's keys listed rather than masked: every query reads only its own keys.

    q: [N, L, H, D]; k: [N, S, Hk, D] and v: [N, S, Hk, Dv] (Hk = H or 1, as in masked_attention); selected:
    [N, L, K] int64 key positions (-1: none; a position listed twice would count twice). Returns
    [N, L, H, Dv] in q's dtype, equal to masked_attention with the mask that holds exactly the listed keys; a query
    with none gets zeros. Work and memory grow with L * K, not L * S.
    """
    n, s = k.shape[:2]
    rows = (torch.arange(n, device=q.device).view(n, 1, 1) * s + selected.clamp(min=0)).flatten(0, 1)  # [N*L, K]
    keys, values = k.flatten(0, 1)[rows], v.flatten(0, 1)[rows]         # each query its own sequence of K keys
    out = masked_attention(q.flatten(0, 1).unsqueeze(1), keys, values, (selected >= 0).flatten(0, 1).unsqueeze(1),
                           scale)
    return out.squeeze(1).unflatten(0, (n, -1))
