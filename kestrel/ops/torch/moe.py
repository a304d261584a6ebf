"""The routed experts' grouped GEMM: act(x W1^T, x W3^T) W2^T for every token-expert pair, weighted and summed.

The reference for the Triton grouped GEMM, computing what `kestrel.layers.moe.RoutedExperts.forward` computes:
pairs are grouped by expert and padded to the busiest expert's count, the experts in use are dequantized (MXFP4)
or gathered (dense) in the activation dtype, and each GEMM is one batched matmul, its inputs fake-quantized to
MXFP8 when asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...quant import dequantize_mxfp4, fake_quantize_mxfp8

SILU, SITU = "silu", "situ"


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked routed experts (E experts, D model or latent width, I intermediate width).

    Dense: w1, w3 [E, I, D] and w2 [E, D, I] in a float dtype, scales None. MXFP4: w1, w3 [E, I, D/2] and
    w2 [E, D, I/2] packed uint8 (two E2M1 codes per byte along the input dim, kestrel.quant.mxfp4's layout) with
    E8M0 scales w1_scale, w3_scale [E, I, D/32] and w2_scale [E, D, I/32] uint8.
    """

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w3_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def mxfp4(self) -> bool:
        return self.w1_scale is not None

    def dense(self, name: str, experts: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Weight `name` (w1, w3 or w2) as dense [E', out, in] in dtype: of the experts [E'], or of all of them
        (dense weights used in place, no copy in their own dtype) when experts is None."""
        weight = getattr(self, name)
        if experts is not None:
            weight = weight[experts]
        if not self.mxfp4:
            return weight.to(dtype)
        scale = getattr(self, f"{name}_scale")
        return dequantize_mxfp4(weight, scale if experts is None else scale[experts], dtype)


@dataclass(frozen=True)
class GLUActivation:
    """The experts' gated activation: SiLU(gate) * up, or SiTU-GLU with its two betas."""

    kind: str = SILU
    beta: float = 1.0
    linear_beta: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [..., I] -> [..., I] in gate's dtype (SiTU computed in fp32)."""
        if self.kind == SILU:
            return F.silu(gate) * up
        g, u = gate.float(), up.float()
        act = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        return (act * self.linear_beta * torch.tanh(u / self.linear_beta)).to(gate.dtype)


def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                activation: GLUActivation, mxfp8_activations: bool = False) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(z[t]) -> [T, D] in z's dtype.

    z: [T, D] (fp32, fp16 or bf16); ids: [T, k] int64; weights: [T, k] fp32 routing weights. Each expert GEMM
    runs in z's dtype, its input rounded to MXFP8 first with mxfp8_activations (D and I multiples of 32); the
    weighted sum is accumulated in fp32.
    """
    quantize = fake_quantize_mxfp8 if mxfp8_activations else (lambda t: t)
    return grouped_moe(z, ids, weights, experts, activation, quantize_inputs=quantize)


def grouped_moe(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                activation: GLUActivation, quantize_inputs: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """moe_experts with quantize_inputs (e.g. MXFP8 fake quantization) applied to both GEMMs' inputs.

    Pairs are grouped by expert and padded to the busiest expert's count, so each GEMM is one batched matmul over
    the experts in use, or over all experts (dense weights in place, no copies) when most of them are in use.
    """
    if z.shape[0] == 0:
        return torch.zeros_like(z)
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    tokens = order // top_k
    used, group = flat[order].unique_consecutive(return_inverse=True)
    if not experts.mxfp4 and 2 * len(used) > experts.w1.shape[0]:
        used, group = None, flat[order]
    counts = torch.bincount(group, minlength=experts.w1.shape[0] if used is None else len(used))
    row = torch.arange(len(order), device=z.device) - (counts.cumsum(0) - counts)[group]
    width = int(counts.max())
    slot = group * width + row                                   # [T * k]: each pair's row in the padded batch
    x = z.new_zeros(len(counts) * width, z.shape[1]).index_copy(0, slot, z.index_select(0, tokens))
    x = quantize_inputs(x.view(len(counts), width, -1))
    w1, w3, w2 = (experts.dense(name, used, z.dtype) for name in ("w1", "w3", "w2"))
    h = quantize_inputs(activation(x @ w1.transpose(1, 2), x @ w3.transpose(1, 2)))
    y = (h @ w2.transpose(1, 2)).flatten(0, 1).index_select(0, slot).float() * weights.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(z, dtype=torch.float32).index_add(0, tokens, y).to(z.dtype)
