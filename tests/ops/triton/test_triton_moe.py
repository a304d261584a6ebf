"""The routed experts' grouped GEMM: the torch reference against a token-by-token float64 loop, and the Triton kernels
(MXFP4 dequantized in the kernel, SiLU and SiTU fused) against the reference, under the Triton interpreter.

Tolerances, relative to the largest reference magnitude: 1e-5 for fp32 (observed at most 2e-6, SiTU's tanh being
computed differently), 2e-3 for fp16 (observed at most 4e-4: both sides round the GEMM outputs and the activation
to fp16, but accumulate in different orders).
"""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from kestrel.ops.torch import moe as reference
from kestrel.ops.torch.moe import ExpertWeights, GLUActivation
from kestrel.ops.triton.moe import moe_experts
from kestrel.quant import quantize_mxfp4

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
