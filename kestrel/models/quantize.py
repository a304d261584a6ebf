"""Post-training quantization of routed experts to MXFP4, the format the family's checkpoints ship in."""

from __future__ import annotations

import dataclasses

import torch

from ..layers.moe import RoutedExperts
from ..quant import quantize_mxfp4
from .checkpoint import build_model
from .kimi import KimiForCausalLM


@torch.no_grad()
def quantize_experts(model: KimiForCausalLM) -> KimiForCausalLM:
    """A copy of `model` whose routed experts are MXFP4 (packed, compressed-tensors layout); all else is shared
    unchanged. A model whose experts are already MXFP4 is returned as is."""
    if model.config.experts_mxfp4 or not model.config.num_experts:
        return model
    weight = model.lm_head.weight
    quantized = build_model(dataclasses.replace(model.config, experts_mxfp4=True), weight.dtype, device="meta")
    quantized.to_empty(device=weight.device)
    source = dict(model.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, RoutedExperts):
            for w in ("w1", "w3", "w2"):
                packed, scale = quantize_mxfp4(getattr(source[name], w))
                getattr(module, f"{w}_packed").copy_(packed)
                getattr(module, f"{w}_scale").copy_(scale)
    state = {k: v for k, v in model.state_dict().items() if ".experts.w" not in k}
    quantized.load_state_dict(state, strict=False)
    return quantized.eval()
