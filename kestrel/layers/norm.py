"""RMSNorm (AttnRes' depth mix and its norm are one op: kestrel.ops.torch.attn_res)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import batch_invariant, cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalised over D in fp32, times weight [D]; returned in x's dtype. Float32 on the CPU, eagerly
    and without gradients, one call of the C++ kernel kestrel_cpu::rms_norm (kestrel.ops.cpu) where these torch ops
    are ~8; traced graphs (inductor fuses them) and deterministic inference keep the torch ops."""
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and not torch.compiler.is_dynamo_compiling() and not batch_invariant.active() and cpu.available()):
        return torch.ops.kestrel_cpu.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
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
