"""Routing against transformers' grouped top-k router; MXFP4 experts against the same experts held dense."""

from __future__ import annotations

import dataclasses
import importlib

import torch

from kestrel.config import parse_config
from kestrel.layers.moe import MoE, Router
from kestrel.models.presets import tiny_config
from kestrel.quant import dequantize_mxfp4, quantize_mxfp4


def test_grouped_router_matches_transformers():
    modeling = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    raw = tiny_config("kimi-linear-tiny")
    raw.update(num_experts=16, num_experts_per_token=3, num_expert_group=4, topk_group=2)
    config = parse_config(raw)
    ours = Router(config)
    theirs = modeling.KimiLinearTopkRouter(modeling.KimiLinearConfig(
        hidden_size=64, num_local_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        routed_scaling_factor=2.446, pad_token_id=0))
    torch.manual_seed(0)
    ours.weight.data.normal_()
    ours.e_score_correction_bias.data.normal_(0, 0.3)
    theirs.weight.data.copy_(ours.weight)
    theirs.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(50, 64)
    ids, weights = ours(x)
    _, their_weights, their_ids = theirs(x)
    order, their_order = ids.sort(-1), their_ids.sort(-1)
    assert torch.equal(order.values, their_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), their_weights.gather(1, their_order.indices))


def test_router_bias_steers_selection_only():
    config = parse_config(tiny_config("kimi-linear-tiny"))
    router = Router(config)
    torch.manual_seed(0)
    router.weight.data.normal_()
    x = torch.randn(20, 64)
    ids, _ = router(x)
    router.e_score_correction_bias.data[ids[0, 0]] = -10.0       # push the top expert of token 0 out
    new_ids, new_weights = router(x)
    assert int(ids[0, 0]) not in new_ids[0].tolist()
    scores = torch.sigmoid(x @ router.weight.t())
    expected = scores.gather(1, new_ids)
    torch.testing.assert_close(new_weights, expected / expected.sum(-1, keepdim=True) * config.routed_scaling_factor)


def packed_and_dense_moe():
    packed_config = parse_config(tiny_config("k3-tiny"))
    dense_config = dataclasses.replace(packed_config, experts_mxfp4=False)
    torch.manual_seed(0)
    packed, dense = MoE(packed_config), MoE(dense_config)
    for p in packed.parameters():
        p.data.normal_(0, 0.2)
    for name in ("w1", "w3", "w2"):
        q, s = quantize_mxfp4(torch.randn(getattr(dense.experts, name).shape) * 0.2)
        getattr(packed.experts, f"{name}_packed").copy_(q)
        getattr(packed.experts, f"{name}_scale").copy_(s)
        getattr(dense.experts, name).data.copy_(dequantize_mxfp4(q, s, torch.float32))
    dense.load_state_dict(packed.state_dict(), strict=False)
    return packed, dense


def test_packed_mxfp4_experts_equal_their_dequantized_dense_form():
    packed, dense = packed_and_dense_moe()
    assert packed.experts.w1_packed.dtype == torch.uint8 and not hasattr(packed.experts, "w1")
    x = torch.randn(30, 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), dense(x), atol=1e-6, rtol=1e-6)


def test_mxfp8_activation_fake_quant_is_off_by_default_and_close_when_on():
    packed, _ = packed_and_dense_moe()
    x = torch.randn(30, 64)
    with torch.no_grad():
        exact = packed(x)
        packed.experts.mxfp8_activations = True
        quantized = packed(x)
    assert not torch.equal(exact, quantized)
    assert (quantized - exact).norm() / exact.norm() < 0.05
