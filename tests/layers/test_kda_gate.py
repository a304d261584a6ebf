"""Both KDA decay-gate forms against fla's naive gate references."""

from __future__ import annotations

import torch
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

from kestrel.ops.torch.kda_decode import decay_gate, l2_normalize


def inputs(h: int = 3, k: int = 8):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(5, h, k, generator=gen) * 3, torch.rand(h, generator=gen) * 3,
            torch.randn(h * k, generator=gen))


def test_unbounded_gate_matches_fla():
    raw, a_log, dt = inputs()
    torch.testing.assert_close(decay_gate(raw, a_log, dt, None), naive_kda_gate(raw, a_log, dt))


def test_lower_bound_gate_matches_fla():
    raw, a_log, dt = inputs()
    got = decay_gate(raw, a_log, dt, -5.0)
    torch.testing.assert_close(got, naive_kda_lowerbound_gate(raw, a_log, dt, lower_bound=-5.0))
    assert bool(((got >= -5.0) & (got <= 0)).all())   # saturates to the bounds in fp32


def test_l2_normalize_matches_fla_convention():
    x = torch.randn(4, 3, 8)
    torch.testing.assert_close(l2_normalize(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
