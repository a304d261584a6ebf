"""The routed experts' grouped GEMM: the torch reference against a token-by-token float64 loop, and the Triton kernels
(MXFP4 dequantized in the kernel, SiLU and SiTU fused) against the reference, under the Triton interpreter.

Tolerances, relative to the largest reference magnitude: 1e-5 for fp32 (observed at most 2e-6, SiTU's tanh being
computed differently), 2e-3 for fp16 (observed at most 4e-4: both sides round the GEMM outputs and the activation
to fp16, but accumulate in different orders).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import tiny_model
from kestrel.ops.torch import moe as reference
from kestrel.ops.torch.moe import ExpertWeights, GLUActivation
from kestrel.ops.triton.moe import _mxfp8, _mxfp8_dequantize, moe_experts
from kestrel.quant import fake_quantize_mxfp8, quantize_mxfp4

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
ACTIVATIONS = {"silu": GLUActivation("silu"), "situ": GLUActivation("situ", beta=4.0, linear_beta=25.0)}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().clamp(min=1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def loop_oracle(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                activation: GLUActivation) -> torch.Tensor:
    """The experts one token and one choice at a time, in float64: sum_k w[t,k] W2_e act(W1_e z_t, W3_e z_t)."""
    dense = {n: experts.dense(n, None, torch.float64) for n in ("w1", "w3", "w2")}
    out = torch.zeros(z.shape, dtype=torch.float64)
    for t in range(z.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            x = z[t].double()
            out[t] += w * dense["w2"][e] @ activation(dense["w1"][e] @ x, dense["w3"][e] @ x)
    return out


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
@torch.inference_mode()
def test_reference_matches_a_token_by_token_loop(preset: str) -> None:
    model, _ = tiny_model(preset)
    moe = next(m.block_sparse_moe for m in model.model.layers if hasattr(m, "block_sparse_moe"))
    generator = torch.Generator().manual_seed(0)
    experts = moe.experts.weights()
    z = torch.randn(7, experts.w1.shape[2] * (2 if experts.mxfp4 else 1), generator=generator)
    ids, weights = moe.gate(torch.randn(7, model.config.hidden_size, generator=generator))
    expected = loop_oracle(z, ids, weights, experts, moe.experts.activation)
    actual = reference.moe_experts(z, ids, weights, experts, moe.experts.activation)
    assert torch.allclose(actual.double(), expected, rtol=0, atol=1e-5)


def make_experts(num_experts: int, inter: int, dim: int, mxfp4: bool, generator: torch.Generator) -> ExpertWeights:
    dense = [torch.randn(num_experts, inter, dim, generator=generator) * 0.1,
             torch.randn(num_experts, inter, dim, generator=generator) * 0.1,
             torch.randn(num_experts, dim, inter, generator=generator) * 0.1]
    if not mxfp4:
        return ExpertWeights(*dense)
    packed, scales = zip(*(quantize_mxfp4(w) for w in dense))
    return ExpertWeights(*packed, *scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_kernel_matches_reference(dtype: torch.dtype, mxfp4: bool, activation: str) -> None:
    generator = torch.Generator().manual_seed(1)
    num_experts, dim, inter, tokens, top_k = 6, 64, 96, 19, 3       # 96: a partial column block
    experts = make_experts(num_experts, inter, dim, mxfp4, generator)
    z = torch.randn(tokens, dim, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(num_experts - 1, generator=generator)[:top_k] for _ in range(tokens)])
    ids[0] = torch.tensor([4, 0, 2])                        # expert 5 unused; expert 0 busiest
    ids[1:5, 0] = 0
    weights = torch.rand(tokens, top_k, generator=generator)
    expected = reference.moe_experts(z, ids, weights, experts, ACTIVATIONS[activation])
    actual = moe_experts(z, ids, weights, experts, ACTIVATIONS[activation])
    assert actual.dtype == dtype
    assert relative_error(actual, expected) < TOLERANCE[dtype]


def test_single_token_decode() -> None:
    generator = torch.Generator().manual_seed(2)
    experts = make_experts(8, 64, 32, True, generator)
    z = torch.randn(1, 32, generator=generator)
    ids, weights = torch.tensor([[7, 1]]), torch.tensor([[0.3, 0.9]])
    expected = reference.moe_experts(z, ids, weights, experts, ACTIVATIONS["situ"])
    assert relative_error(moe_experts(z, ids, weights, experts, ACTIVATIONS["situ"]), expected) < 1e-5


@triton.jit
def _mxfp8_roundtrip_kernel(x, out, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    values, scales = _mxfp8(tl.load(x + offsets), BLOCK_M, BLOCK_K)
    tl.store(out + offsets, _mxfp8_dequantize(values, scales, BLOCK_M, BLOCK_K))


def test_in_kernel_mxfp8_rounds_as_fake_quantize_mxfp8() -> None:
    """Bit for bit, on blocks that exercise the rule: ordinary values, ties, saturation at 448, E4M3 subnormals,
    zeros, huge and tiny scales, and a block holding Inf (NaN out). Blocks whose largest value is below 2^-118
    (scale code 0) are left out: the kernels read code 0 as 0, the reference as 2^-127."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=generator) * torch.logspace(-30, 30, 16, base=2).unsqueeze(1)
    x[0, :32] = torch.tensor([1.0, 1.0625, 1.125, 1.1875, 448.0, 449.0, 464.0, 2**-9, 2**-10, 3 * 2**-10] + [0.0] * 22)
    x[1, :32] = 0.0
    x[2, 32:64] = torch.linspace(-2.0**100, 2.0**100, 32)
    x[3, 64:96] = 2.0**-110
    x[4, 96] = float("inf")
    out = torch.empty_like(x)
    _mxfp8_roundtrip_kernel[(1,)](x, out, BLOCK_M=16, BLOCK_K=128)
    expected = fake_quantize_mxfp8(x)
    assert torch.equal(out.isnan(), expected.isnan()) and out[4, 96:].isnan().all()
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mxfp4", [False, True])
def test_mxfp8_activations_match_the_fake_quantized_reference(dtype: torch.dtype, mxfp4: bool) -> None:
    """W4A8 (MXFP4 experts through tl.dot_scaled) and dense experts, both GEMM inputs rounded to MXFP8; the
    tolerances of the unquantized kernel (observed 1e-6 in fp32, 2e-5 in fp16), far below MXFP8's own 5% effect."""
    generator = torch.Generator().manual_seed(6)
    num_experts, dim, inter, tokens, top_k = 6, 64, 96, 19, 3
    experts = make_experts(num_experts, inter, dim, mxfp4, generator)
    z = torch.randn(tokens, dim, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    activation = ACTIVATIONS["situ"]
    expected = reference.moe_experts(z, ids, weights, experts, activation, mxfp8_activations=True)
    unquantized = reference.moe_experts(z, ids, weights, experts, activation)
    actual = moe_experts(z, ids, weights, experts, activation, mxfp8_activations=True)
    assert relative_error(actual, expected) < TOLERANCE[dtype]
    assert relative_error(unquantized, expected) > 0.01
