"""Routing against transformers' grouped top-k router; MXFP4 experts against the same experts held dense; the MoE
layer (latent or not, shared experts or not) against its formula written out token by token; held dense copies of
MXFP4 experts; greedy tokens of tiny models with the layer replaced by that formula."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import kestrel.layers.linear as linear_layers
import kestrel.layers.moe as moe_layers
from helpers import greedy_generate, tiny_model
from kestrel.config import parse_config
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.moe import MoE, Router, hold_dense_experts, pack_onednn_experts
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


def plain_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward written out in float64 one token and one chosen expert at a time (the router's choice and
    weights taken as given): x [T, hidden] -> [T, hidden] float64."""
    ids, weights = moe.gate(x)
    experts = moe.experts.weights()
    w1, w3, w2 = (dequantize_mxfp4(getattr(experts, n), getattr(experts, f"{n}_scale"), torch.float64)
                  if experts.mxfp4 else getattr(experts, n).double() for n in ("w1", "w3", "w2"))
    act = moe.experts.activation
    x = x.double()
    z = x @ moe.routed_expert_down_proj.weight.double().t() if moe.latent else x
    y = torch.stack([sum(w * w2[e] @ act(w1[e] @ z[t], w3[e] @ z[t]) for e, w in zip(ids[t], weights[t].double()))
                     for t in range(len(x))])
    if hasattr(moe, "routed_expert_norm"):
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + moe.routed_expert_norm.eps)
        y = y * moe.routed_expert_norm.weight.double()
    if moe.latent:
        y = y @ moe.routed_expert_up_proj.weight.double().t()
    if hasattr(moe, "shared_experts"):
        shared = moe.shared_experts
        gate, up = (x @ proj.weight.double().t() for proj in (shared.gate_proj, shared.up_proj))
        y = y + shared.activation(gate, up) @ shared.down_proj.weight.double().t()
    return y


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_layer_matches_its_token_by_token_formula(preset: str, mxfp4: bool, shared: int, tokens: int) -> None:
    raw = tiny_config(preset)
    config = dataclasses.replace(parse_config(raw), num_shared_experts=shared, experts_mxfp4=mxfp4)
    generator = torch.Generator().manual_seed(tokens)
    moe = MoE(config)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    if mxfp4:
        for name in ("w1", "w3", "w2"):
            packed = getattr(moe.experts, f"{name}_packed")
            q, s = quantize_mxfp4(torch.randn(*packed.shape[:-1], 2 * packed.shape[-1], generator=generator) * 0.2)
            packed.copy_(q)
            getattr(moe.experts, f"{name}_scale").copy_(s)
    x = torch.randn(tokens, config.hidden_size, generator=generator)
    with torch.no_grad():
        expected = plain_moe(moe, x)
        actual = moe(x)
    assert hasattr(moe, "shared_experts") == bool(shared)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_held_dense_copies_compute_what_the_packed_experts_do(torch_paths) -> None:
    """On the grouped torch path (the CPU kernel's own MXFP4 and float32 products are tested against the per-token
    formula in tests/ops/test_moe_experts.py), a held copy multiplies exactly as the packed experts expand."""
    packed, _ = packed_and_dense_moe()
    keys = set(packed.state_dict())
    x = torch.randn(30, 64)
    with torch.no_grad():
        expected = packed(x)
        for dtype in (torch.bfloat16, torch.float32):
            packed.experts.hold_dense_copy(dtype)
            held = packed.experts.weights()
            assert held.w13.dtype == dtype and not held.mxfp4 and held.w1.data_ptr() == held.w13.data_ptr()
            torch.testing.assert_close(packed(x), expected, rtol=0, atol=0)
        packed.experts.hold_dense_copy(None)
        assert packed.experts.weights().mxfp4
    assert set(packed.state_dict()) == keys


@pytest.mark.parametrize("held", [False, True], ids=["dense", "held-copy"])
def test_onednn_copies_compute_what_the_plain_experts_do(held: bool, monkeypatch: pytest.MonkeyPatch,
                                                     torch_paths) -> None:
    """pack_onednn_experts gives dense float32 experts (or a held float32 copy) oneDNN-packed copies of their
    weights, which the op's grouped path (the CPU kernel off) then multiplies by: with the plain weights zeroed
    after packing, the MoE's outputs at 1 to 30 tokens still equal the plain experts' to float32 rounding, while a
    wanted gradient reads the plain weights.
    The copies take the weights' bytes; experts under EXPERT_PACKED_MIN_WEIGHT, bfloat16 ones and packed MXFP4
    ones get none, nor any on a CPU that prefers MKL (Intel's), and dropping a held copy drops them."""
    packed, dense = packed_and_dense_moe()
    moe = packed if held else dense
    monkeypatch.setattr(linear_layers, "ONEDNN", True)
    assert pack_onednn_experts(moe) == 0                                 # this model's experts are small
    monkeypatch.setattr(moe_layers, "EXPERT_PACKED_MIN_WEIGHT", 1)
    monkeypatch.setattr(linear_layers, "ONEDNN", False)
    assert pack_onednn_experts(dense) == 0
    monkeypatch.setattr(linear_layers, "ONEDNN", True)
    assert pack_onednn_experts(packed) == 0                              # MXFP4, no dense copy
    if held:
        packed.experts.hold_dense_copy(torch.bfloat16)
        assert pack_onednn_experts(packed) == 0
        packed.experts.hold_dense_copy(torch.float32)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = [moe(x[:n]) for n in (1, 5, 30)]
        plain = moe.experts.weights()
        assert pack_onednn_experts(moe) == 4 * (plain.w1.numel() + plain.w3.numel() + plain.w2.numel())
        assert moe.experts.weights().onednn_w13 is not None
        for weight in (plain.w1, plain.w3, plain.w2):
            weight.zero_()
        for n, want in zip((1, 5, 30), expected):
            torch.testing.assert_close(moe(x[:n]), want, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():
        assert not torch.allclose(moe(x.clone().requires_grad_()), expected[2], rtol=1e-3, atol=1e-3)
    if held:
        packed.experts.hold_dense_copy(None)
        assert packed.experts.onednn is None and packed.experts.weights().mxfp4


def test_dense_experts_refuse_a_dense_copy() -> None:
    _, dense = packed_and_dense_moe()
    with pytest.raises(ValueError, match="already dense"):
        dense.experts.hold_dense_copy(torch.bfloat16)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
def test_greedy_tokens_equal_the_token_by_token_formula(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill of 3 prompts, then batched decode: the same tokens with the MoE layers computed token by token, with
    the in-place op on packed experts, and on a held bf16 copy; and close logits over a whole sequence."""
    model, _ = tiny_model(preset)
    prompts = [[5, 17, 99, 3, 42, 8, 7], [200, 1], list(range(30, 70))]
    sequence = torch.tensor(prompts[2])
    with torch.inference_mode():
        ours = greedy_generate(model, prompts, 8)
        our_logits = model.compute_logits(model(sequence, ForwardBatch.build([len(sequence)])))
        held = hold_dense_experts(model, torch.bfloat16)
        assert held > 0 if model.config.experts_mxfp4 else held == 0
        assert greedy_generate(model, prompts, 8) == ours
        hold_dense_experts(model, None)
        monkeypatch.setattr(MoE, "forward", lambda self, x: plain_moe(self, x).to(x.dtype))
        assert greedy_generate(model, prompts, 8) == ours
        plain_logits = model.compute_logits(model(sequence, ForwardBatch.build([len(sequence)])))
    torch.testing.assert_close(our_logits, plain_logits, rtol=1e-4, atol=1e-4)
