"""Post-training MXFP4 quantization of routed experts."""

from __future__ import annotations

import torch

from helpers import tiny_model
from kestrel.cli import main
from kestrel.layers.batch import ForwardBatch
from kestrel.models.checkpoint import load_model, save_model
from kestrel.models.quantize import quantize_experts
from kestrel.quant import dequantize_mxfp4, quantize_mxfp4


def test_quantized_model_holds_the_quantized_experts_and_everything_else_unchanged():
    model, _ = tiny_model("kimi-linear-tiny")
    quantized = quantize_experts(model)
    assert quantized.config.experts_mxfp4 and not model.config.experts_mxfp4
    experts, original = quantized.model.layers[2].block_sparse_moe.experts, model.model.layers[2].block_sparse_moe.experts
    packed, scale = quantize_mxfp4(original.w2)
    assert torch.equal(experts.w2_packed, packed) and torch.equal(experts.w2_scale, scale)
    dense = dict(model.named_parameters())
    for name, p in quantized.named_parameters():
        assert torch.equal(p, dense[name])
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    batch = ForwardBatch.build([40])
    with torch.no_grad():
        a, b = model.compute_logits(model(ids, batch)), quantized.compute_logits(quantized(ids, batch))
    assert 0 < (a - b).norm() / a.norm() < 0.5     # 4-bit noise through 4 random layers; uncorrelated logits give ~1.4
    w = dequantize_mxfp4(experts.w1_packed, experts.w1_scale, torch.float32)
    assert (w - original.w1).norm() / original.w1.norm() < 0.15


def test_quantize_experts_command(tmp_path):
    model, raw = tiny_model("kimi-linear-tiny")
    save_model(model, tmp_path / "dense", config_json=raw)
    assert main(["quantize-experts", str(tmp_path / "dense"), "--out", str(tmp_path / "mxfp4")]) == 0
    loaded = load_model(tmp_path / "mxfp4", dtype=torch.float32)
    assert loaded.config.experts_mxfp4
    assert torch.equal(loaded.model.layers[1].block_sparse_moe.experts.w3_scale,
                       quantize_experts(model).model.layers[1].block_sparse_moe.experts.w3_scale)
    assert main(["quantize-experts", str(tmp_path / "mxfp4"), "--out", str(tmp_path / "again")]) == 2
