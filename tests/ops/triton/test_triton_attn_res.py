"""AttnRes mix + RMSNorm: the torch reference against the spec's formula written out per source in float64
(model-spec section 3), and the fused Triton kernel against the reference, under the Triton interpreter.

Tolerances, relative to the largest reference magnitude: 1e-5 for fp32 (observed at most 3e-7), 2e-3 for fp16
(one fp16 rounding step; observed: identical).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel.layers.norm import RMSNorm
from kestrel.ops.torch.attn_res import mix_norm_reference as reference
from kestrel.ops.triton.attn_res import attn_res_mix_norm

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().clamp(min=1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def make_case(num_sources: int, tokens: int, dim: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    sources = (torch.randn(num_sources, tokens, dim, generator=generator)
               * torch.linspace(0.5, 3.0, num_sources).view(-1, 1, 1)).to(dtype)
    mix_norm = RMSNorm(dim, 1e-5)
    mix_norm.weight.data = 1 + 0.1 * torch.randn(dim, generator=generator)
    proj = nn.Linear(dim, 1, bias=False)
    proj.weight.data = torch.randn(1, dim, generator=generator)
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(dim, generator=generator)
    return sources, mix_norm, proj, norm


def spec_mix(sources: torch.Tensor, mix_norm: RMSNorm, proj: nn.Linear, norm: RMSNorm) -> tuple:
    """s_i = sum_d v_i[d] rsqrt(mean(v_i^2) + eps) norm_w[d] proj_w[d]; mix = sum_i softmax(s)_i v_i; then RMSNorm."""
    v = sources.double()
    w = mix_norm.weight.double() * proj.weight[0].double()
    logits = torch.stack([(v_i / torch.sqrt(v_i.pow(2).mean(-1, keepdim=True) + mix_norm.eps)) @ w for v_i in v])
    mixed = (torch.softmax(logits, dim=0).unsqueeze(-1) * v).sum(0)
    normed = mixed / torch.sqrt(mixed.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    return mixed, normed


@pytest.mark.parametrize("with_norm", [True, False])
@torch.inference_mode()
def test_reference_matches_the_spec(with_norm: bool) -> None:
    sources, mix_norm, proj, norm = make_case(4, 5, 48, torch.float32)
    out = reference(sources, mix_norm.weight, proj.weight[0], mix_norm.eps, norm.weight if with_norm else None,
                    norm.eps)
    expected_mixed, expected_normed = spec_mix(sources, mix_norm, proj, norm)
    assert torch.allclose(out.double(), expected_normed if with_norm else expected_mixed, rtol=0, atol=1e-5)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_sources", [1, 5])
@torch.inference_mode()
def test_kernel_matches_reference(dtype: torch.dtype, num_sources: int, with_norm: bool) -> None:
    sources, mix_norm, proj, norm = make_case(num_sources, 7, 40, dtype)      # 40: padded to 64 in the kernel
    args = (sources, mix_norm.weight, proj.weight[0], mix_norm.eps, norm.weight if with_norm else None, norm.eps)
    actual, expected = attn_res_mix_norm(*args), reference(*args)
    assert actual.dtype == dtype
    assert relative_error(actual, expected) < TOLERANCE[dtype]
