"""The planner against published figures, SGLang's calculator, kestrel's own engine, and its invariants."""

from __future__ import annotations

import dataclasses

import pytest

from kestrel import LLM
from kestrel.cookbook.calculator import (CacheSettings, balanced_ratio, ratio_text, replayssm_ring_bytes_per_layer,
                                         slots_per_request, verify_states, verify_width)
from kestrel.cookbook.hardware import Fact, get_device
from kestrel.cookbook.layout import Layout
from kestrel.cookbook.model import model_facts
from kestrel.cookbook import planner
from kestrel.cookbook.planner import PlanRequest, min_devices, plan
from kestrel.cookbook.recipes import RecipeRequest, make_recipe
from kestrel.cookbook.verify import write_checkpoint


def test_k3_parameter_counts_match_the_published_figures():
    k3 = model_facts("k3")
    assert round(k3.total_params / 1e12, 2) == 2.78
    assert round(k3.active_params / 1e9, 1) == 104.2


def test_k3_kv_per_token_and_state_per_slot_at_tp8():
    result = plan(PlanRequest(model="k3", hardware="b300", layout=Layout(tp=8)))
    assert result.kv_bytes_per_token == 27_648                         # 24 layers x 576 x 2 B
    assert result.state_bytes_per_slot_per_rank == 56_171_520          # SGLang's calculator at TP8, fp32
    assert result.state_bytes_per_slot == 8 * 56_171_520
    fp8 = model_facts("k3")
    assert fp8.kv_bytes_per_token("fp8") == 13_824                     # SGLang's count: per-tensor scales
    assert fp8.kv_bytes_per_token("fp8", row_scales=True) == 24 * (576 + 4)   # kestrel's: a scale per row


def test_k31_kv_in_sglangs_dsa_pool_and_in_kestrels():
    """SGLang (sgl-project/sglang python/sglang/srt/mem_cache/kv_cache_configurator.py calculate_mla_kv_cache_dim,
    memory_pool.py DSATokenToKVPool): a DSA layer's row in fp8 is 512 + 512 // 128 x 4 + 64 x 2 = 656 B, its indexer
    key 128 fp8 values + one fp32 scale = 132 B whatever the KV dtype. kestrel keeps keys in the KV dtype."""
    k31 = model_facts("k3.1-pro")
    assert k31.latent_bytes_per_token("fp8") == 24 * (512 + 16 + 64 * 2) == 24 * 656
    assert k31.latent_bytes_per_token("bf16") == 27_648
    assert k31.index_key_bytes_per_token("bf16") == k31.index_key_bytes_per_token("fp8") == 24 * 132
    assert k31.kv_bytes_per_token("bf16", row_scales=True) == 27_648 + 24 * 128 * 2
    assert model_facts("k3").kv_bytes_per_token("fp8") == 24 * 576        # K3 has no indexer: the plain MLA pool


# --mamba-full-memory-ratio as SGLang's calculator prints it for these cells: its `derive` function
# (_kimi_k3_mamba_ratio_calculator.jsx @395187ca) run under node on each cell's flags (171 cells agreed).
SGLANG_CALCULATOR_CELLS = [
    ("k3/b300/unified/low-latency", 11264, "0.9", 0.9018406723484849),
    ("k3/b300/unified/balanced", 11264, "7.21", 7.214725378787879),
    ("k3/b300/prefill/high-throughput", 11264, "5.77", None),
    ("k3/b300/decode/balanced", 11264, "1.44", None),
    ("k3/b200/unified/low-latency", 11264, "0.72", None),
    ("k3/gb200/unified/low-latency", 11264, "0.45", None),
    ("k3/h200/unified/high-throughput", 11264, "0.18", None),
    ("k3/h100/decode/low-latency", 11264, "0.045", None),
    ("k3/mi355x/unified/balanced", 11264, "14.4", None),
    ("k3/b300/unified/balanced,spec=mtp", 11264, "5.13", None),
    ("k3/b200/unified/low-latency,spec=mtp", 11264, "0.43", None),
    ("k3/b300/prefill/low-latency,spec=mtp", 11264, "0.86", None),
    ("k3/gb200/decode/high-throughput,spec=mtp", 11264, "1.03", None),
]


# The Ascend 950 cell runs DSPARK only (item 6 of issue 18), which the node run above did not cover. The calculator's
# derive on its flags: attention TP 32 (--enable-dp-attention without --dp-size), --disable-radix-cache (S = 1),
# DSPARK without ReplaySSM (D = 7 + 1), draft KV 1,400 B:
# 9 x 69 x (3 x 128 x 128 x 4 + 9 x 3 x 128 x 2) / (11264 x (27648 + 1400)) = 0.386 -> "0.39".
SGLANG_CALCULATOR_CELLS.append(("k3/ascend-950pr/unified/balanced,spec=mtp", 11264, "0.39",
                                9 * 69 * (3 * 128 * 128 * 4 + 9 * 3 * 128 * 2) / (11264 * (27_648 + 1400))))


@pytest.mark.parametrize("recipe_id, length, text, value", SGLANG_CALCULATOR_CELLS)
def test_pinned_ratio_matches_sglangs_calculator(recipe_id, length, text, value):
    recipe = make_recipe(RecipeRequest.from_id(recipe_id, length))
    assert recipe.ratio_text == text
    if value is not None:
        assert recipe.plan.balanced_ratio == pytest.approx(value, rel=1e-12)


def test_ratio_is_the_formula_and_balances_the_pools():
    result = plan(PlanRequest(model="k3", hardware="b300", layout=Layout(tp=8, dcp=8)))
    s, d = result.slots_per_request, result.verify_states
    expected = (s + d) * result.state_bytes_per_slot_per_rank / (11264 * 27_648 / 8)
    assert result.ratio == pytest.approx(expected, rel=1e-12)
    # balanced: the KV pool and the state pool fill at the same number of average requests
    pools = result.pools
    assert pools.kv_tokens / 11264 == pytest.approx(pools.state_slots / s, rel=0.01)


@pytest.mark.parametrize("settings, pp, expected", [
    (CacheSettings(), 1, 5),
    (CacheSettings(radix_strategy="extra_buffer_lazy"), 1, 4),
    (CacheSettings(radix_strategy="no_buffer"), 1, 3),
    (CacheSettings(radix_strategy="no_buffer", skip_decode_lock=True), 1, 3),
    (CacheSettings(radix_strategy="off"), 1, 1),
    (CacheSettings(mode="decode"), 1, 1),
    (CacheSettings(skip_decode_lock=True), 1, 4),
    (CacheSettings(overlap_schedule=False), 1, 4),
    (CacheSettings(), 2, 4),
])
def test_slots_per_request_follow_sglang(settings, pp, expected):
    assert slots_per_request(settings, pp) == expected


def test_verify_states():
    assert verify_states(CacheSettings(spec="mtp", draft_tokens=7)) == 8            # the page's calculator: block + 1
    # SGLang python/sglang/srt/arg_groups/speculative_hook.py _handle_dflash: --speculative-num-draft-tokens is set
    # to --speculative-dflash-block-size, and the configurator keeps that many verify states
    assert verify_states(CacheSettings(spec="dflash", draft_tokens=8)) == 8
    assert verify_width(CacheSettings(spec="dflash", draft_tokens=8)) == 8
    assert verify_width(CacheSettings()) == 1
    assert verify_states(CacheSettings(spec="mtp", draft_tokens=7, replay_ssm=True)) == 0
    assert verify_states(CacheSettings(spec="mtp", draft_tokens=7, mode="prefill")) == 0
    assert verify_states(CacheSettings()) == 0


def test_ratio_text_follows_sglangs_rounding():
    assert [ratio_text(r) for r in (0.9018, 0.05799, 1.2, 2.0, 7.2147, 14.43, 10.0)] == \
        ["0.9", "0.058", "1.2", "2", "7.21", "14.4", "10"]


def test_monotonic_in_request_length():
    previous = None
    for length in (1024, 4096, 11264, 65536, 262144):
        result = plan(PlanRequest(avg_request_len=length))
        if previous is not None:
            assert result.ratio < previous.ratio
            assert result.admitted_requests <= previous.admitted_requests
            assert result.pools.state_slots <= previous.pools.state_slots
            assert result.pools.kv_tokens >= previous.pools.kv_tokens
        previous = result
    assert balanced_ratio(5, 0, 100, 10.0, 10) == pytest.approx(2 * balanced_ratio(5, 0, 100, 10.0, 20))


def test_monotonic_in_memory():
    previous = None
    for fraction in (0.8, 0.85, 0.9, 0.95):
        result = plan(PlanRequest(mem_fraction=fraction))
        if previous is not None:
            assert result.pools.kv_tokens > previous.pools.kv_tokens
            assert result.pools.state_slots >= previous.pools.state_slots
            assert result.admitted_requests >= previous.admitted_requests
        previous = result


def test_minimum_device_count_is_the_fit_boundary():
    facts, b300 = model_facts("k3"), get_device("b300")
    needed = min_devices(facts, b300, CacheSettings(), 0.85, 11264, 0)
    assert needed == 8
    assert plan(PlanRequest(layout=Layout(tp=8))).fits
    assert not plan(PlanRequest(layout=Layout(tp=4))).fits
    # a 1.56 TB checkpoint on 64 GB Mac minis, 512 GB Mac Studios
    assert min_devices(facts, get_device("mac-mini-m4-pro"), CacheSettings(), 0.85, 11264, 0) > 24
    assert min_devices(facts, get_device("mac-studio-m3-ultra"), CacheSettings(), 0.85, 11264, 0) == 4


def test_pipeline_stages_split_the_weights():
    whole = plan(PlanRequest(model="k3", layout=Layout(tp=8)))
    staged = plan(PlanRequest(model="k3", layout=Layout(tp=1, pp=8)))
    assert staged.nodes.devices == 8
    assert staged.weight_bytes_per_rank_total < whole.weight_bytes_per_rank_total * 1.2
    assert staged.slots_per_request == 4       # pipeline parallelism turns overlap scheduling off


def test_unknown_bandwidth_blocks_the_roofline_only():
    result = plan(PlanRequest(hardware="zhenwu-m890", layout=Layout(tp=16)))
    assert result.fits is True
    assert all(step.tokens_per_s_per_user is None for step in result.roofline)
    assert all(step.weight_bytes > 0 for step in result.roofline)
    blocked = {u.fact: u.blocks for u in result.unknowns}
    assert "decode roofline tokens/s per user and per device" in blocked["zhenwu-m890 memory bandwidth"]
    assert "node count" in blocked["zhenwu-m890 devices per node"]


def test_unknown_memory_blocks_the_fit(monkeypatch):
    device = get_device("zhenwu-v900")
    blind = dataclasses.replace(device, id="blind", facts={**device.facts,
                                                           "memory": Fact(None, "GB", "unknown", "no source")})
    monkeypatch.setattr(planner, "get_device", lambda _: blind)
    result = plan(PlanRequest(hardware="blind-test"))
    assert result.pools is None and result.fits is None and result.admitted_requests is None
    assert any(u.fact == "blind memory" and "fits" in u.blocks for u in result.unknowns)


def test_draft_weights_of_an_unknown_draft_are_an_unknown():
    result = plan(PlanRequest(cache=CacheSettings(spec="dflash")))
    assert result.weight_bytes_per_rank["draft"] == 0
    assert any("dflash draft" in u.fact for u in result.unknowns)
    dspark = plan(PlanRequest(cache=CacheSettings(spec="mtp")))
    assert dspark.weight_bytes_per_rank["draft"] == 4_500_000_000
    assert dspark.verify_states == 8


@pytest.mark.parametrize("request_, message", [
    (PlanRequest(hardware="a100"), "unknown hardware 'a100'; choose one of: vera-rubin, b300"),
    (PlanRequest(layout=Layout(tp=5)), "96 MLA heads, not divisible by the attention TP size 5"),
    (PlanRequest(layout=Layout(tp=16, dp=3)), "--dp 3 must divide --tp 16"),
    (PlanRequest(layout=Layout(tp=8, ep=3)), "--ep 3 must divide --tp 8"),
    (PlanRequest(layout=Layout(tp=8, dcp=16)), "--dcp 16 must divide the attention TP size 8"),
    (PlanRequest(layout=Layout(tp=1, pp=94)), "--pp 94 exceeds the model's 93 layers"),
    (PlanRequest(model="kimi-linear-48b", layout=Layout(tp=3)), "32 MLA heads"),
    (PlanRequest(mem_fraction=1.5), "--mem-fraction must be in (0, 1]"),
    (PlanRequest(avg_request_len=0), "--avg-request-len must be at least 1"),
    (PlanRequest(cache=CacheSettings(kv_dtype="int4")), "unknown kv dtype 'int4'"),
    (PlanRequest(model="kimi-linear-48b", cache=CacheSettings(spec="mtp")), "give --draft-tokens N and --draft-kv"),
    (PlanRequest(nodes=3), "--nodes 3 would leave nodes idle, so pass --nodes 1"),
    (PlanRequest(layout=Layout(tp=16, dp=4), max_running_requests=2), "leaves no request for some of the 4"),
    (PlanRequest(nodes=0), "--nodes must be at least 1"),
    (PlanRequest(layout=Layout(tp=16), nodes=1), "1 node(s) of 8 b300 hold 8 devices"),
])
def test_bad_input_is_one_clear_error(request_, message):
    with pytest.raises(ValueError) as error:
        plan(request_)
    assert message in str(error.value)
    assert str(error.value).count(".") >= 1 and "\n" not in str(error.value)


def test_a_config_of_another_family_is_refused_with_the_reason(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="'llama' is not a Kimi K3 family model"):
        plan(PlanRequest(model=str(config)))


def test_planner_predicts_kestrels_own_engine_allocation(tmp_path):
    """On the CPU, a plan of kestrel's engine sizes the pools its engine allocates."""
    write_checkpoint("kimi-linear-tiny", tmp_path)
    ratio, fraction = 0.5, 0.005
    engine = LLM(str(tmp_path), device="cpu", mem_fraction_static=fraction, mamba_full_memory_ratio=ratio,
                 mamba_ssm_dtype="float32", kv_cache_dtype="auto").engine.plan
    predicted = plan(PlanRequest(model="kimi-linear-tiny", hardware="cpu", dtype="fp32", layout=Layout(tp=1),
                                 cache=CacheSettings(kv_dtype="fp32", kv_layout="kestrel", radix_strategy="off"),
                                 mem_fraction=fraction, ratio=ratio, compare_devices=False, engine="kestrel"))
    assert predicted.weight_bytes_per_rank_total == engine.weight_bytes
    assert predicted.state_bytes_per_slot == engine.state_bytes_per_slot
    assert predicted.kv_bytes_per_token == engine.kv_bytes_per_token
    assert predicted.pools.state_slots == engine.num_slots
    assert predicted.pools.kv_tokens == engine.kv_tokens


def test_replayssm_ring_reproduces_sglangs_worked_values():
    """sgl-project/sglang test_replayssm_ring_accounting.py::test_kda_fold: 4 heads of 8, ring of 8, bf16
    activations: raw v 512 + raw k 512 + per-K gate 1024 + beta 128 + d 512 + k 512 = 3,200 B per layer."""
    assert replayssm_ring_bytes_per_layer(heads=4, head_dim=8, record_len=8, activation_bytes=2) == 3200
    # K3 at TP8 with the default --linear-replayssm-cache-len 16 (SGLang server_args): 12 heads of 128 per rank
    assert replayssm_ring_bytes_per_layer(12, 128, 16, 2) == 295_680
    assert model_facts("k3").replay_ring_bytes_per_slot(16) // 8 == 69 * 295_680 == 20_401_920


def test_replay_ring_is_charged_per_state_slot_and_the_conv_windows_per_request():
    """Issue 59 row 10. SGLang's newer solver (its CPU test of the speculative Mamba verify scratch,
    test_replayssm_spec_drops_snapshots_and_charges_the_ring): under ReplaySSM spec-verify a slot costs state + ring
    (a KDA model's ring is --linear-replayssm-cache-len long, 16), the verify states are gone, but the conv verify
    windows stay (the conv rollback reads them), W verified tokens deep per running request plus the padding row, in
    the joint solve K = (budget - slot - window) // (slot + window / S). KDA keeps the dense window layout: each
    token's window is the conv state, (K - 1) x 3 x heads x head_dim in bf16."""
    settings = CacheSettings(spec="mtp", replay_ssm=True)
    with_ring = plan(PlanRequest(layout=Layout(tp=8, dcp=8), cache=settings, max_running_requests=256))
    assert with_ring.verify_states == 0 and with_ring.ring_bytes_per_slot_per_rank == 20_401_920
    window = 69 * 3 * 3 * 12 * 128 * 2 * 8                     # 69 KDA layers, 12 heads per rank, DSPARK's W = 8
    assert with_ring.window_bytes_per_request_per_rank == window == 15_261_696
    pools, state = with_ring.pools, with_ring.state_bytes_per_slot_per_rank + with_ring.ring_bytes_per_slot_per_rank
    s = with_ring.slots_per_request
    budget = pools.rest_bytes * with_ring.ratio / (1 + with_ring.ratio)
    assert pools.state_slots == int((budget - state - window) // (state + window / s))
    capped = min(256, pools.state_slots // s)
    kv_per_token = 27_648 / 8 + 1400
    scratch = (capped + 1) * window
    assert pools.kv_tokens == int((pools.rest_bytes - scratch - (pools.state_slots + 1) * state) // kv_per_token)
    # a PD prefill server never verifies: no windows
    prefill = plan(PlanRequest(layout=Layout(tp=8), cache=dataclasses.replace(settings, mode="prefill")))
    assert prefill.window_bytes_per_request_per_rank == 0


def test_the_drafts_own_kv_per_token():
    """DSPARK: the page calculator's 1,400 B; DFLASH: SGLang's help figure for a 5-layer draft, 10,240 B (bf16)."""
    dspark = make_recipe(RecipeRequest.from_id("k3/b300/unified/low-latency,spec=mtp")).plan
    dflash = make_recipe(RecipeRequest.from_id("k3/b300/unified/low-latency,spec=dflash")).plan
    assert dspark.kv_bytes_per_token_per_rank == 27_648 + 1400
    assert dflash.kv_bytes_per_token_per_rank == 27_648 + 10_240


def test_dp_attention_divides_the_caps_per_worker():
    """kv_cache_configurator: resolve_max_num_reqs gives each DP worker --max-running-requests // dp, and
    _handle_max_mamba_cache --max-mamba-cache-size // dp slots. The Atlas A3 cell (TP64, DP4, 64 and 64, S = 5):
    min(64 // 4, (64 // 4) // 5) = 3 requests per worker, 12 in all (the planner used to say 92)."""
    a3 = make_recipe(RecipeRequest.from_id("k3/ascend-a3/unified/balanced,spec=mtp")).plan
    assert (a3.request.layout.dp, a3.request.max_running_requests, a3.request.max_mamba_cache_size) == (4, 64, 64)
    assert a3.slots_per_request == 5 and a3.pools.state_slots == 16
    assert a3.pools.max_running_requests == 3 and a3.admitted_requests == 12


def test_the_roofline_is_hypothetical_when_nothing_fits():
    from kestrel.cookbook.text import plan_text
    assert "hypothetical: the plan does not fit" in plan_text(plan(PlanRequest(layout=Layout(tp=4))))
    assert "memory reads and collectives: upper bounds" in plan_text(plan(PlanRequest(layout=Layout(tp=8))))
