"""Random initialisation of a Kimi model (tests, training from scratch), following the family's conventions."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..layers.kda import KimiDeltaAttention
from ..layers.moe import RoutedExperts, Router
from ..layers.norm import RMSNorm
from ..quant import quantize_mxfp4
from .kimi import KimiForCausalLM


@torch.no_grad()
def init_weights(model: KimiForCausalLM, seed: int = 0, std: float = 0.02) -> KimiForCausalLM:
    """Fill every tensor of `model` deterministically from `seed`.

    Linear and embedding weights ~ N(0, std); norms = 1; KDA's A_log = log U(1, 16) and dt_bias = softplus^-1 of
    U(1e-3, 1e-1) (as fla initialises them); conv weights ~ U(+-1/sqrt(kernel)); the router bias = 0; MXFP4
    experts are drawn dense and quantized.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, scale: float = std) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * scale)

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal(module.weight)
        elif isinstance(module, nn.Conv1d):
            bound = 1 / math.sqrt(module.kernel_size[0])
            module.weight.copy_((torch.rand(module.weight.shape, generator=gen) * 2 - 1) * bound)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        if isinstance(module, KimiDeltaAttention):
            module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(1, 16, generator=gen).log())
            dt = torch.empty(module.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, Router):
            normal(module.weight)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, RoutedExperts):
            _init_experts(module, normal)
    return model


def _init_experts(experts: RoutedExperts, normal) -> None:
    for name in ("w1", "w3", "w2"):
        if not experts.mxfp4:
            normal(getattr(experts, name))
            continue
        packed = getattr(experts, f"{name}_packed")
        dense = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2)
        normal(dense)
        q, s = quantize_mxfp4(dense)
        packed.copy_(q)
        getattr(experts, f"{name}_scale").copy_(s)
