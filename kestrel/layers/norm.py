"""Normalisation layers: RMSNorm, the per-head gated RMSNorm of KDA's output, and AttnRes' depth mix."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalised over D in fp32, times weight [D]; returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (weight [D])."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(RMSNorm):
    """KDA output norm: RMSNorm(x) * sigmoid(gate) per head, in fp32 (weight [head_dim], fp32 in checkpoints)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., head_dim] -> [..., head_dim] in x's dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Attention Residuals: a softmax over depth that mixes stored residual snapshots.

    Each source v_i [T, D] gets the logit s_i = <RMSNorm(v_i) * norm.weight, proj.weight>; the result is
    sum_i softmax_i(s_i) v_i over the raw sources, computed in fp32 (model-spec section 3). proj is Linear(D, 1).
    Returns [T, D] in the sources' dtype.
    """
    v = torch.stack(sources).float()                                        # [S, T, D]
    scale = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)
    w = norm.weight.float() * proj.weight.float().squeeze(0)                # [D]
    p = torch.softmax((v * scale) @ w, dim=0)                               # [S, T]
    return (p.unsqueeze(-1) * v).sum(0).to(sources[-1].dtype)
