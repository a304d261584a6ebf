"""Test helpers: tiny random models of each family member."""

from __future__ import annotations

import torch

from kestrel.config import parse_config
from kestrel.models.checkpoint import build_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config

FAMILY = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]


def tiny_model(preset: str, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.1, **overrides):
    """A random model of `preset`, its text-config keys replaced by `overrides` (eval mode)."""
    raw = tiny_config(preset)
    text = raw.get("text_config", raw)
    text.update(overrides)
    model = init_weights(build_model(parse_config(raw), dtype), seed=seed, std=std)
    for name, p in model.named_parameters():   # spread the router bias so it really steers selection
        if name.endswith("e_score_correction_bias"):
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model.eval(), raw
