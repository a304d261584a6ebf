"""kestrel_cpu::rms_norm and kestrel_cpu::glu (kestrel.ops.cpu) against float64 within float32's error bound, each
output's relative error counted from its roundings (every step of both is free of cancellation: square sums of
positive terms, products, 1 + exp(-g), tanh of a rounded argument, whose relative error that argument's bounds;
ATen's vectorised exp and tanh are within 1 ulp), widths either side of a vector, strided rows; the layers take them
for float32 CPU tensors eagerly without gradients only (not traced, not with gradients or the kernels off; the norm,
a reduction, not in deterministic inference either); registered soundly (opcheck); misshapen operands refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kestrel.ops.cpu as cpu
from kestrel.layers.norm import rms_norm
from kestrel.ops import batch_invariant
from kestrel.ops.torch.moe import SILU, SITU, GLUActivation
from helpers import OpCalls, gamma, traced_targets

@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()


def strided(rows: int, width: int, seed: int) -> torch.Tensor:
    """[rows, width] float32, every row a slice of a wider one (the columns of a fused product)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + 5, generator=generator) * 3)[:, 2:2 + width]


@pytest.mark.parametrize("rows, dim", [(1, 1), (3, 15), (2, 16), (5, 33), (4, 192), (2, 1024)])
def test_rms_norm_is_the_float64_norm_within_float32s_bound(rows, dim) -> None:
    """Relative error at most gamma_{D+5}: the square sum gamma_D (halved by the square root), the mean, the eps, the
    square root and the reciprocal, and the two products."""
    x, weight = strided(rows, dim, seed=dim), torch.randn(dim, generator=torch.Generator().manual_seed(1))
    actual = torch.ops.kestrel_cpu.rms_norm(x, weight, 1e-5)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert bool(((actual.double() - exact).abs() <= gamma(dim + 5) * exact.abs()).all())


@pytest.mark.parametrize("kind, roundings", [(SILU, 7), (SITU, 16)])
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 15), (2, 16), (5, 33), (4, 256)])
def test_glu_is_the_float64_activation_within_float32s_bound(kind, roundings, rows, width) -> None:
    """Relative error at most gamma_7 (SiLU: exp, sum, reciprocal, two products) or gamma_16 (SiTU: two quotients,
    two tanh, exp, sum, reciprocal, four products), exp and tanh counted as 2 roundings each."""
    gate, up = strided(rows, width, seed=width), strided(rows, width, seed=width + 1)
    activation = GLUActivation(kind, 4.0, 25.0)
    actual = torch.ops.kestrel_cpu.glu(gate, up, kind == SITU, 4.0, 25.0)
    g, u = gate.double(), up.double()
    if kind == SILU:
        exact = torch.nn.functional.silu(g) * u
    else:
        exact = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)
    assert bool(((actual.double() - exact).abs() <= gamma(roundings) * exact.abs()).all())
    with torch.no_grad():
        assert torch.equal(actual, activation(gate, up))                     # the layer's call, on the kernel


@pytest.mark.parametrize("mode", ["eager", "grad", "deterministic", "float64", "kernels off", "traced"])
def test_the_layers_take_the_kernels_for_float32_cpu_inference_only(mode) -> None:
    x, weight = strided(3, 40, seed=2), torch.randn(40)
    activation = GLUActivation(SITU, 4.0, 25.0)
    if mode == "float64":
        x, weight = x.double(), weight.double()

    def both(x, weight):
        return rms_norm(x, weight, 1e-5), activation(x, x * 0.5)

    if mode == "traced":
        with torch.no_grad():
            _, targets = traced_targets(both, x, weight)
        assert targets and not any("kestrel_cpu" in target for target in targets)
        return
    cpu.set_enabled(mode != "kernels off")
    try:
        with OpCalls() as calls, torch.set_grad_enabled(mode == "grad"), \
                (batch_invariant.invariant() if mode == "deterministic" else contextlib.nullcontext()):
            both(x, weight)
    finally:
        cpu.set_enabled(True)
    # glu is elementwise (batch-invariant), so deterministic inference keeps it
    expected = {"eager": ["kestrel_cpu.rms_norm", "kestrel_cpu.glu"], "deterministic": ["kestrel_cpu.glu"]}
    assert [name for name in calls.names if name.startswith("kestrel_cpu")] == expected.get(mode, [])


def test_the_ops_are_registered_soundly_and_refuse_misshapen_operands() -> None:
    x, weight = strided(3, 20, seed=3), torch.randn(20)
    torch.library.opcheck(torch.ops.kestrel_cpu.rms_norm.default, (x, weight, 1e-5))
    torch.library.opcheck(torch.ops.kestrel_cpu.glu.default, (x, x.contiguous(), True, 4.0, 25.0))
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.kestrel_cpu.rms_norm(x, weight[:19], 1e-5)
    with pytest.raises(RuntimeError, match="rows"):
        torch.ops.kestrel_cpu.rms_norm(x.t(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="gate and up"):
        torch.ops.kestrel_cpu.glu(x, x[:2], False, 1.0, 1.0)
