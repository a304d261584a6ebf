"""kestrel_cpu::kda_decode_step_, one decode token of a KDA layer on the CPU: against kda_decode's torch ops in float64
within float32's first-order error bound, derived stage by stage (conv, silu, L2 norms, gate, delta rule, gated
RMSNorm), with both gates (K3's bounded sigmoid, Kimi-Linear's softplus), strided input rows, conv widths 2 and 4;
its pools updated at the sequences' slots only, the conv state exactly, a fresh sequence's slot read as zeros
whatever it holds (NaN here); registered soundly (opcheck); misshapen operands and slots outside the pool refused.
kda_decode takes it for a plain decode of float32 pools, eagerly and traced by torch.compile, and keeps its torch
ops for verifications, bfloat16 pools and deterministic inference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kestrel.ops.cpu as cpu
from kestrel.ops import batch_invariant
from kestrel.ops.torch import kda_decode as reference
from kestrel.ops.torch.kda_decode import KDALayerParams
from helpers import U, OpCalls, gamma, traced_targets

SLOTS, USE_STATE = [5, 2, 7, 0, 3], [True, False, True, True, False]
POOL = 8


@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()


def decode_args(heads: int, dim: int, width: int, lower_bound: float | None, seed: int,
                pool_dtype: torch.dtype = torch.float32) -> tuple:
    """kda_decode's arguments for one token of each of len(SLOTS) sequences; beta_raw and out_gate are column slices
    of wider rows (as a fused projection's outputs are), and fresh sequences' slots hold NaN."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    n, channels = len(SLOTS), 3 * heads * dim
    params = KDALayerParams(randn(channels, width, std=0.5), randn(heads), randn(heads * dim), 1 + randn(dim, std=0.2),
                            lower_bound, 1e-5)
    conv_pool, state_pool = randn(POOL, width - 1, channels), randn(POOL, heads, dim, dim, std=0.3)
    fresh = torch.tensor(SLOTS)[~torch.tensor(USE_STATE)]
    conv_pool[fresh], state_pool[fresh] = float("nan"), float("nan")
    wide = randn(n, heads * dim + heads + 3)
    out_gate = wide[:, 1 + heads:].narrow(1, 0, heads * dim).view(n, heads, dim)
    return (randn(n, channels), randn(n, heads, dim), wide[:, 1:1 + heads], out_gate, params, conv_pool,
            state_pool.to(pool_dtype), torch.tensor(SLOTS), None, torch.tensor(USE_STATE))


def float64(args: tuple) -> tuple:
    """The arguments in float64 (the pools as fresh copies)."""
    def wide(x):
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    params = KDALayerParams(*(wide(getattr(args[4], f.name)) for f in dataclasses.fields(KDALayerParams)))
    return (*map(wide, args[:4]), params, *(wide(x).clone() for x in args[5:7]), *args[7:])


def bound(qkv, gate_raw, beta_raw, out_gate, params: KDALayerParams, conv_pool, state_pool, slots, use_state, scale
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """First-order bounds, in float64, on the output [N, H, D] and the new states [N, H, D, D] (float64 arguments).

    Conv: gamma_{W+1} of sum |w x| per channel; silu (slope <= 1.1) passes it on and adds gamma_4; an L2 norm passes
    a channel's error, and its part along the vector, times rsqrt, and adds gamma_{D+4}; the gate's sigmoid (slope
    <= 1/4) or softplus (slope <= 1) passes gamma_3 of its argument on and adds gamma_5, exp(g) adds u; beta
    gamma_3. The delta rule: the residual gamma_{2D+2} of |v| + sum |k d S| plus the errors of k and d; each new
    state row |S| e_d + |r| e_{beta k} + |beta k| e_r + gamma_3 of its terms; o gamma_{D+1} of scale sum |q S'| plus
    the errors of q and S'. The gated RMSNorm passes o's error, and its part along o, times rsqrt and adds
    gamma_{D+8}."""
    n, heads, dim = gate_raw.shape
    keep = use_state.view(-1, 1, 1)
    window = torch.cat([torch.where(keep, conv_pool[slots], 0), qkv.unsqueeze(1)], 1)          # [N, W, C]
    y = torch.einsum("nwc,cw->nc", window, params.conv_weight)
    y_err = gamma(params.conv_weight.shape[1] + 1) * torch.einsum("nwc,cw->nc", window.abs(),
                                                                  params.conv_weight.abs())
    s = F.silu(y)
    s_err = (1.1 * y_err + gamma(4) * s.abs()).view(n, 3, heads, dim)
    s = s.view(n, 3, heads, dim)

    def l2(x, x_err):
        r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        unit = x * r
        along = (unit.abs() * x_err).sum(-1, keepdim=True)
        return unit, r * (x_err + unit.abs() * along) + gamma(dim + 4) * unit.abs()

    (q, q_err), (k, k_err) = l2(s[:, 0], s_err[:, 0]), l2(s[:, 1], s_err[:, 1])
    v, v_err = s[:, 2], s_err[:, 2]
    x = gate_raw + params.dt_bias.view(heads, dim)
    rate = params.A_log.exp().view(heads, 1)
    if params.lower_bound is None:
        softplus = F.softplus(x)
        g = -rate * softplus
        g_err = rate * (torch.sigmoid(x) * gamma(3) * x.abs() + gamma(5) * softplus)
    else:
        z = rate * x
        sig = torch.sigmoid(z)
        g = params.lower_bound * sig
        g_err = abs(params.lower_bound) * (sig * (1 - sig) * gamma(3) * z.abs() + gamma(5) * sig)
    d = g.exp()
    d_err = d * (g_err + U)
    beta = torch.sigmoid(beta_raw).unsqueeze(-1)                                               # [N, H, 1]
    beta_err = gamma(3) * beta
    state = torch.where(keep.unsqueeze(-1), state_pool[slots], 0)                             # [N, H, D, D]
    kd, kd_err = (k * d).unsqueeze(-1), (k_err * d + k.abs() * d_err).unsqueeze(-1)
    residual = v - (kd * state).sum(-2)                                                        # [N, H, D]
    residual_err = (gamma(2 * dim + 2) * (v.abs() + (kd.abs() * state.abs()).sum(-2)) + v_err
                    + (kd_err * state.abs()).sum(-2))
    bk, bk_err = (beta * k).unsqueeze(-1), (beta_err * k.abs() + beta * k_err).unsqueeze(-1)
    new = d.unsqueeze(-1) * state + bk * residual.unsqueeze(-2)
    new_err = (state.abs() * d_err.unsqueeze(-1) + residual.abs().unsqueeze(-2) * bk_err
               + bk.abs() * residual_err.unsqueeze(-2)
               + gamma(3) * ((d.unsqueeze(-1) * state).abs() + (bk * residual.unsqueeze(-2)).abs()))
    o = scale * (q.unsqueeze(-1) * new).sum(-2)
    o_err = scale * (gamma(dim + 1) * (q.abs().unsqueeze(-1) * new.abs()).sum(-2)
                     + (q_err.unsqueeze(-1) * new.abs() + q.abs().unsqueeze(-1) * new_err).sum(-2))
    squares = o.pow(2).sum(-1, keepdim=True)
    r = torch.rsqrt(squares / dim + params.norm_eps)
    gain = params.norm_weight.abs() * torch.sigmoid(out_gate)
    along = (o.abs() * o_err).sum(-1, keepdim=True) / (squares + dim * params.norm_eps)
    out = o * r * gain
    return gain * r * (o_err + o.abs() * along) + gamma(dim + 8) * out.abs(), new_err


CASES = [(2, 32, 4, -5.0), (1, 16, 2, None), (3, 64, 4, None), (1, 128, 4, -5.0)]


@pytest.mark.parametrize("heads, dim, width, lower_bound", CASES)
def test_the_kernel_is_the_float64_step_within_float32s_bound(heads, dim, width, lower_bound) -> None:
    args = decode_args(heads, dim, width, lower_bound, seed=heads * 1000 + dim)
    exact_args = float64(args)
    scale = dim ** -0.5
    out_bound, state_bound = bound(*exact_args[:8], exact_args[9], scale)
    expected, _ = reference.kda_decode(*exact_args)                      # float64: kda_decode's torch ops
    conv_pool, state_pool = (p.clone() for p in args[5:7])
    params = args[4]
    actual = torch.ops.kestrel_cpu.kda_decode_step_(*args[:4], params.conv_weight, params.A_log, params.dt_bias,
                                                    params.norm_weight, lower_bound, params.norm_eps, conv_pool,
                                                    state_pool, args[7], args[9], scale)
    assert actual.dtype == torch.float32 and actual.shape == (len(SLOTS), heads, dim)
    slots = args[7]
    for got, want, allowed in ((actual, expected, out_bound), (state_pool[slots], exact_args[6][slots], state_bound)):
        error = (got.double() - want).abs()
        assert bool((error <= allowed).all()), f"largest error / bound {float((error / allowed).max()):.3g}"
    assert torch.equal(conv_pool[slots].double(), exact_args[5][slots])   # rows moved, not computed: exact
    untouched = [s for s in range(POOL) if s not in SLOTS]
    for updated, before in zip((conv_pool, state_pool), args[5:7]):
        assert torch.equal(updated[untouched], before[untouched])


def test_the_op_is_registered_soundly_and_refuses_what_it_cannot_read() -> None:
    args = decode_args(2, 32, 4, -5.0, seed=7)
    params = args[4]
    conv_pool, state_pool = (p.nan_to_num() for p in args[5:7])

    def call(qkv=args[0], gate_raw=args[1], slots=args[7], conv=conv_pool):
        return torch.ops.kestrel_cpu.kda_decode_step_(qkv, gate_raw, args[2], args[3], params.conv_weight,
                                                      params.A_log, params.dt_bias, params.norm_weight, -5.0, 1e-5,
                                                      conv, state_pool, slots, args[9], 0.2)

    torch.library.opcheck(torch.ops.kestrel_cpu.kda_decode_step_.default,
                          (*args[:4], params.conv_weight, params.A_log, params.dt_bias, params.norm_weight, -5.0,
                           1e-5, conv_pool, state_pool, args[7], args[9], 0.2))
    with pytest.raises(RuntimeError, match="out of range"):
        call(slots=args[7] + POOL)
    with pytest.raises(RuntimeError, match="must be float32 rows"):
        call(qkv=args[0].double())
    with pytest.raises(RuntimeError, match="must be float32 rows"):
        call(gate_raw=args[1].transpose(1, 2))
    with pytest.raises(RuntimeError, match="conv_pool"):
        call(conv=conv_pool[:, :2].contiguous())


@pytest.mark.parametrize("pool_dtype, mode, kernel", [(torch.float32, "eager", True), (torch.float32, "traced", True),
                                                      (torch.float32, "deterministic", False),
                                                      (torch.bfloat16, "eager", False),
                                                      (torch.bfloat16, "traced", False)])
def test_a_plain_decode_step_takes_the_kernel_on_float32_pools(pool_dtype, mode, kernel) -> None:
    """Eagerly and traced, a plain decode step over float32 pools is the kernel's one call on the step's own
    arguments (the same output and pools as calling it directly, exactly); bfloat16 pools and deterministic inference
    keep the torch ops (the same as with the kernels off, exactly)."""
    args = decode_args(2, 32, 4, -5.0, seed=3, pool_dtype=pool_dtype)
    args = (*args[:5], args[5].nan_to_num(), args[6].nan_to_num(), *args[7:])
    expected_pools, pools = [p.clone() for p in args[5:7]], [p.clone() for p in args[5:7]]
    params = args[4]
    with torch.inference_mode(), (batch_invariant.invariant() if mode == "deterministic" else torch.inference_mode()):
        if kernel:
            expected = torch.ops.kestrel_cpu.kda_decode_step_(*args[:4], params.conv_weight, params.A_log,
                                                              params.dt_bias, params.norm_weight, params.lower_bound,
                                                              params.norm_eps, *expected_pools, args[7], args[9],
                                                              32 ** -0.5)
        else:
            cpu.set_enabled(False)
            try:
                expected, _ = reference.kda_decode(*args[:5], *expected_pools, *args[7:])
            finally:
                cpu.set_enabled(True)
        if mode == "traced":
            (actual, _), targets = traced_targets(reference.kda_decode, *args[:5], *pools, *args[7:])
            assert any("kestrel_cpu.kda_decode_step_" in target for target in targets) == kernel
        else:
            with OpCalls() as calls:
                actual, _ = reference.kda_decode(*args[:5], *pools, *args[7:])
            assert calls.names.count("kestrel_cpu.kda_decode_step_") == kernel
    assert torch.equal(actual, expected)
    for got, want in zip(pools, expected_pools):
        assert torch.equal(got, want)


def test_a_traced_verification_keeps_the_torch_recurrence() -> None:
    """keep_token_states (a speculative verification) wants every token's state and leaves the pools as they were:
    the kernel does not apply."""
    args = decode_args(2, 32, 4, -5.0, seed=4)
    args = (*args[:5], args[5].nan_to_num(), args[6].nan_to_num(), *args[7:])
    with torch.inference_mode():
        expected = reference.kda_decode(*args, keep_token_states=True)
        actual, targets = traced_targets(reference.kda_decode, *args, keep_token_states=True)
    assert targets and not any("kda_decode_step_" in target for target in targets)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
