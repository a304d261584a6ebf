"""Gated MLP activations: SwiGLU (Kimi-Linear) and SiTU-GLU (K3 family)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up."""
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), in fp32, returned in gate's dtype."""
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (act * linear_beta * torch.tanh(u / linear_beta)).to(gate.dtype)


def glu(config: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's gated activation for gate, up [..., I]."""
    if config.hidden_act == "situ":
        return situ_glu(gate, up, config.situ_beta, config.situ_linear_beta)
    return silu_glu(gate, up)
