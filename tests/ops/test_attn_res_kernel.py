"""kestrel_cpu::attn_res_mix_norm (kestrel.ops.cpu) against the float64 mix within float32's first-order bound,
derived pass by pass, with and without the norm, for 1 to 9 sources and widths either side of a vector; the
dispatched op takes it for float32 CPU inputs only (not traced, not in deterministic inference, not with the
kernels off); registered soundly (opcheck); misshapen operands are refused."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.cpu as cpu
from kestrel.ops import batch_invariant
from kestrel.ops.torch.attn_res import attn_res_mix_norm, mix_norm_reference
from helpers import gamma

@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()


def operands(num_sources: int, tokens: int, dim: int, norm: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    sources = torch.randn(num_sources, tokens, dim, generator=generator) * torch.rand(num_sources, 1, 1,
                                                                                      generator=generator) * 4
    weights = [torch.randn(dim, generator=generator) for _ in range(3)]
    return sources, weights[0], weights[1], 1e-6, weights[2] if norm else None, 1e-5


def bound(sources, mix_w, proj_w, mix_eps, norm_w, norm_eps) -> torch.Tensor:
    """First order, in float64: each logit's error gamma_{D+4} sum |v w| rsqrt(..) (its dot product, square sum and
    rsqrt), doubled in the probabilities plus gamma_{S+3} (exp, sum, division), plus gamma_S in the mix's sum; the
    norm adds its rsqrt's gamma_{D+3} and half the relative error its square sum takes from the mix."""
    v, w = sources.double(), (mix_w * proj_w).double()
    num_sources, dim = v.shape[0], v.shape[-1]
    r = torch.rsqrt(v.pow(2).mean(-1) + mix_eps)                                      # [S, T]
    logit_error = gamma(dim + 4) * (v.abs() @ w.abs()) * r
    probs = torch.softmax((v * r.unsqueeze(-1)) @ w, 0)
    weighted = (probs.unsqueeze(-1) * v.abs()).sum(0)                                 # [T, D]
    mix_error = (2 * logit_error.max(0).values + gamma(num_sources + 3) + gamma(num_sources)).unsqueeze(-1) * weighted
    if norm_w is None:
        return mix_error
    mix = (probs.unsqueeze(-1) * v).sum(0)
    squares = mix.pow(2).sum(-1, keepdim=True)
    r2 = torch.rsqrt(squares / dim + norm_eps)
    relative = gamma(dim + 3) + ((mix.abs() * mix_error).sum(-1, keepdim=True) / (squares + dim * norm_eps))
    return norm_w.double().abs() * r2 * (mix_error + mix.abs() * (relative + gamma(2)))


@pytest.mark.parametrize("num_sources, tokens, dim", [(1, 1, 1), (2, 3, 15), (3, 1, 16), (5, 7, 33), (9, 4, 192)])
@pytest.mark.parametrize("norm", [False, True])
def test_the_kernel_is_the_float64_mix_within_float32s_bound(num_sources, tokens, dim, norm) -> None:
    args = operands(num_sources, tokens, dim, norm, seed=num_sources * 100 + dim)
    exact = mix_norm_reference(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    actual = torch.ops.kestrel_cpu.attn_res_mix_norm(*args)
    assert actual.dtype == torch.float32 and actual.shape == (tokens, dim)
    assert ((actual.double() - exact).abs() <= 2 * bound(*args)).all()


def test_the_op_takes_the_kernel_for_float32_cpu_inputs_only(monkeypatch) -> None:
    args = operands(3, 2, 40, True, seed=5)
    calls, kernel = [], torch.ops.kestrel_cpu.attn_res_mix_norm
    monkeypatch.setattr(torch.ops.kestrel_cpu, "attn_res_mix_norm", lambda *a: calls.append(1) or kernel(*a))
    assert torch.equal(attn_res_mix_norm(*args), kernel(*args)) and calls
    calls.clear()
    attn_res_mix_norm(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    torch.compile(attn_res_mix_norm, backend="aot_eager", fullgraph=True)(*args)
    with batch_invariant.invariant():
        attn_res_mix_norm(*args)
    cpu.set_enabled(False)
    try:
        assert torch.equal(attn_res_mix_norm(*args), mix_norm_reference(*args))
    finally:
        cpu.set_enabled(True)
    assert not calls


def test_soundness_and_refusals() -> None:
    args = operands(2, 3, 24, True, seed=7)
    torch.library.opcheck(torch.ops.kestrel_cpu.attn_res_mix_norm.default, args)
    torch.library.opcheck(torch.ops.kestrel_cpu.attn_res_mix_norm.default, (*args[:4], None, args[5]))
    sources, mix_w, proj_w, eps, norm_w, norm_eps = args
    with pytest.raises(RuntimeError, match="sources must be a contiguous float32"):
        torch.ops.kestrel_cpu.attn_res_mix_norm(sources.double(), mix_w, proj_w, eps, norm_w, norm_eps)
    with pytest.raises(RuntimeError, match="must be contiguous float32 .D."):
        torch.ops.kestrel_cpu.attn_res_mix_norm(sources, mix_w[:5], proj_w, eps, norm_w, norm_eps)
    with pytest.raises(RuntimeError, match="must be contiguous float32 .D."):
        torch.ops.kestrel_cpu.attn_res_mix_norm(sources, mix_w, proj_w, eps, norm_w[:5], norm_eps)
