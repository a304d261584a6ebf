"""Rotary position embeddings as HuggingFace configs describe them (a published draft's Qwen3 layers use them; the
Kimi family's own attention is NoPE): plain RoPE, or YaRN's context extension.

A config's scaling dict (`rope_scaling`, or transformers 5's `rope_parameters`) names its `rope_type`:
- "default" (or none): inverse frequencies theta^(-2i/d) for i < d/2, cos and sin unscaled;
- "yarn": `factor` s, `original_max_position_embeddings` L (the context trained at), optional `beta_fast` (32),
  `beta_slow` (1), `truncate` (true), `attention_factor`, `mscale`, `mscale_all_dim`. Frequency i is kept where it
  turns more than beta_fast times over L, divided by s where it turns fewer than beta_slow times, and blended
  linearly between, by dimension: with d(r) = d ln(L / (2 pi r)) / (2 ln theta), the ramp runs from
  floor(d(beta_fast)) to ceil(d(beta_slow)). cos and sin are scaled by attention_factor, else by
  m(s, mscale) / m(s, mscale_all_dim) when both are given, else m(s, 1), where m(s, k) = 0.1 k ln(s) + 1 (1 for
  s <= 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"}


@dataclass(frozen=True)
class Rope:
    """RoPE of one head size: inv_freq [head_dim / 2] fp32 and the factor cos and sin are scaled by."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., heads, head_dim] at positions [...] -> rotated, HF's rotate_half pairing (i with i + head_dim/2),
        computed in fp32, returned in x's dtype."""
        half = x.shape[-1] // 2
        angles = positions.float().unsqueeze(-1) * self.inv_freq.to(x.device)               # [..., half]
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).unsqueeze(-2) * self.attention_factor
                    for f in (torch.cos, torch.sin))
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


def rope_from_config(head_dim: int, theta: float, scaling: dict | None) -> Rope:
    """The Rope of a config's head size, theta and scaling dict (see the module docstring); a ValueError naming
    what is not supported."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    # in float32, as transformers computes them: at positions near 1M a one-ulp change turns an angle by ~0.01
    periods = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if kind == "default":
        return Rope(1.0 / periods)
    if kind != "yarn":
        raise ValueError(f"RoPE scaling {kind!r} is not supported (plain RoPE and YaRN are).")
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        raise ValueError(f"YaRN RoPE scaling with {', '.join(unknown)} is not supported.")
    factor, trained = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def dim_turning(rotations: float) -> float:
        """The dimension whose frequency turns `rotations` times over the trained context."""
        return head_dim * math.log(trained / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    kept = 1 - ramp                          # each frequency's weight unscaled (rounded as transformers rounds it)
    inv_freq = 1.0 / (factor * periods) * (1 - kept) + 1.0 / periods * kept
    return Rope(inv_freq, _yarn_attention_factor(scaling, factor))


def _yarn_attention_factor(scaling: dict, factor: float) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def m(scale: float, k: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return m(factor, mscale) / m(factor, all_dim) if mscale and all_dim else m(factor, 1.0)
