"""The decode roofline: bytes counted from the model's tensors, bounds that move the right way."""

from __future__ import annotations

import pytest

from kestrel.cookbook.calculator import CacheSettings
from kestrel.cookbook.layout import Layout
from kestrel.cookbook.model import EXPERTS, model_facts
from kestrel.cookbook.planner import PlanRequest, plan
from kestrel.cookbook.roofline import crossover_context, decode_step, experts_touched

B300_BANDWIDTH = 7.7e12
TP8 = Layout(tp=8)


def step(model="k3", layout=TP8, batch=1, context=8192, tokens=1, assumptions="planner"):
    return decode_step(model_facts(model), layout, CacheSettings(), B300_BANDWIDTH, layout.world, batch, context,
                       tokens, assumptions)


def test_experts_touched():
    assert experts_touched(1, 896, 16) == pytest.approx(16)
    assert experts_touched(10_000, 896, 16) == pytest.approx(896)
    assert experts_touched(64, 896, 16, "most_favourable") == 16
    with pytest.raises(ValueError, match="unknown assumptions"):
        experts_touched(1, 896, 16, "optimistic")


def test_single_token_reads_the_active_weights_and_the_cache():
    facts = model_facts("k3")
    one = step(batch=1, context=8192)
    # most favourable: every weight split over TP8, 16 experts per layer, no embedding table
    best = step(batch=1, context=8192, assumptions="most_favourable")
    shares = facts.bytes_by_sharding()
    expected = (sum(shares.values()) - shares[EXPERTS] - facts.embedding_bytes(Layout(tp=1).first_rank())
                + shares[EXPERTS] * 16 / 896) / 8
    assert best.weight_bytes == pytest.approx(expected, rel=1e-6)
    assert one.weight_bytes >= best.weight_bytes
    assert one.kv_bytes == 8192 * 27_648                          # TP ranks each read the whole latent
    assert one.state_bytes == 2 * 56_171_520                      # read and written
    assert one.tokens_per_s_per_user == pytest.approx(B300_BANDWIDTH / one.total_bytes)


def test_bounds_move_the_right_way():
    small, large = step(batch=1), step(batch=64)
    assert large.step_seconds > small.step_seconds
    assert large.tokens_per_s_per_device > small.tokens_per_s_per_device
    assert large.tokens_per_s_per_user < small.tokens_per_s_per_user
    assert step(context=65536).step_seconds > step(context=8192).step_seconds
    assert step(layout=Layout(tp=8, dcp=8)).kv_bytes == step().kv_bytes // 8


def test_crossovers():
    k3 = step(model="k3", batch=8)
    at = crossover_context(k3, "kv")
    assert at == pytest.approx(k3.weight_bytes / (k3.kv_bytes / k3.context), rel=1e-6)
    assert crossover_context(k3, "index_keys") is None                # K3 has no indexer
    assert crossover_context(step(model="k3", batch=64), "kv") < at    # more sequences, earlier crossover
    k31 = step(model="k3.1-pro", batch=8, context=1_048_576)
    assert k31.kv_bytes == 8 * 2048 * 27_648                           # top-2048 latents only
    assert crossover_context(k31, "kv") is None
    index_at = crossover_context(k31, "index_keys")
    assert index_at * k31.index_key_bytes / k31.context == pytest.approx(k31.weight_bytes, rel=1e-5)


def test_indexer_scan_at_one_million_tokens_has_a_number_per_batch():
    result = plan(PlanRequest(model="k3.1-pro", layout=Layout(tp=8, dcp=8), context=1_048_576))
    ratios = [c.indexer_to_weights_at_max_context for c in result.crossovers]
    assert all(r is not None for r in ratios)
    assert ratios == sorted(ratios)                                    # grows with the batch
    assert [c.indexer_context for c in result.crossovers] == sorted(
        (c.indexer_context for c in result.crossovers), reverse=True)


def test_pipeline_stages_add_up():
    flat = step(layout=Layout(tp=8))
    staged = step(layout=Layout(tp=1, pp=8))
    assert staged.state_bytes == 8 * flat.state_bytes                  # attention TP 1: whole state per stage rank
    assert staged.tokens_per_s_per_device > staged.tokens_per_s_per_user / 8


def test_bad_sizes():
    with pytest.raises(ValueError, match="at least 1"):
        step(batch=0)
