"""The model's gated MLP activation: SwiGLU (Kimi-Linear) or SiTU-GLU (K3 family), from its config."""

from __future__ import annotations

from ..config import ModelConfig
from ..ops.torch.moe import SILU, SITU, GLUActivation


def glu_activation(config: ModelConfig) -> GLUActivation:
    """act(gate, up): SiLU(gate) * up, or beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)."""
    if config.hidden_act == "situ":
        return GLUActivation(SITU, config.situ_beta, config.situ_linear_beta)
    return GLUActivation(SILU)
