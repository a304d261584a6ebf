"""Post-training MXFP4 quantization of routed experts."""

from __future__ import annotations

import torch

from helpers import tiny_model
from kestrel.cli import main
from kestrel.models.checkpoint import load_model, save_model
from kestrel.models.quantize import quantize_experts
from kestrel.quant import quantize_mxfp4


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
    # what the quantized experts compute is checked against an independent OCP MX reference in tests/quant


def test_quantize_experts_command(tmp_path):
    model, raw = tiny_model("kimi-linear-tiny")
    save_model(model, tmp_path / "dense", config_json=raw)
    assert main(["quantize-experts", str(tmp_path / "dense"), "--out", str(tmp_path / "mxfp4")]) == 0
    loaded = load_model(tmp_path / "mxfp4", dtype=torch.float32)
    assert loaded.config.experts_mxfp4
    assert torch.equal(loaded.model.layers[1].block_sparse_moe.experts.w3_scale,
                       quantize_experts(model).model.layers[1].block_sparse_moe.experts.w3_scale)
    assert main(["quantize-experts", str(tmp_path / "mxfp4"), "--out", str(tmp_path / "again")]) == 2
