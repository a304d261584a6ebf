"""WideEP in the cookbook: the MoE paths' bytes per token (moe_traffic.py) against hand arithmetic and the engine's
traffic formula, `kestrel plan --moe-a2a-backend`, and kestrel's recipe commands for SGLang cells with an
all-to-all backend and EPLB, read back by kestrel's own `kestrel serve` parser."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from kestrel.cookbook.anchors import anchors
from kestrel.cookbook.calculator import CacheSettings
from kestrel.cookbook.layout import Layout
from kestrel.cookbook.model import EXPERTS, model_facts, resolve_config
from kestrel.cookbook.moe_traffic import moe_bytes_per_token
from kestrel.cookbook.planner import PlanRequest, plan
from kestrel.cookbook.publish import wide_ep_markdown
from kestrel.cookbook.recipe_request import RecipeRequest
from kestrel.cookbook.recipes import make_recipe, wide_ep_cells
from kestrel.cookbook.roofline import decode_step
from kestrel.cookbook.text import plan_text
from kestrel.distributed.layout import ParallelLayout
from kestrel.distributed.traffic import Forward, a2a_traffic, expected_a2a_pairs
from kestrel.engine.args import EngineArgs

TINY = resolve_config("k3.1-tiny")
"""hidden 64, expert_dim 32 (latent MoE), 8 experts, top-2, 2 shared experts, 5 MoE layers of 6."""


def test_the_tiny_configs_shape_is_what_the_hand_arithmetic_assumes():
    assert (TINY.hidden_size, TINY.expert_dim, TINY.num_experts, TINY.num_experts_per_token) == (64, 32, 8, 2)
    assert TINY.num_shared_experts == 2 and sum(map(TINY.is_moe_layer, range(TINY.num_hidden_layers))) == 5


def test_bytes_per_token_match_hand_arithmetic():
    """TP4 x EP4, DP2 attention (groups of 2 ranks), bf16, a forward of 8 tokens."""
    # All-reduce: each rank puts 5 layers x 8 tokens x (32 latent + 64 shared) x 2 B = 7,680 B into the ring, which
    # sends 2 x 3 / 4 of it: 11,520 B per rank, 46,080 B over 4 ranks, 5,760 B per token.
    assert moe_bytes_per_token(TINY, 4, 4, 2, "all_reduce", 2, tokens=8) == pytest.approx(5760)
    # All-to-all: an EP rank holds 8 / 4 = 2 experts; a token's 2 experts miss them with probability
    # C(6, 2) / C(8, 2) = 15 / 28, so 3 other ranks x 13 / 28 are reached per token and layer. Each group holds
    # 4 tokens, each of its 2 ranks dispatches 2: 39 / 28 x 2 x 5 = 390 / 28 pairs per rank, each 32 x 2 + 8 x 2 = 80
    # bytes out and 64 back; counts 5 x 8 x 3 = 120; the shared experts' all-reduce over the group of 2,
    # 5 x 4 x 64 x 2 = 2,560 B with ring factor 2 x 1 / 2; the routed sums' all-gather, 5 x 2 x 32 x 2 = 640 B sent
    # to the one other rank.
    per_rank = 390 / 28 * (80 + 64) + 120 + 2560 + 640
    assert moe_bytes_per_token(TINY, 4, 4, 2, "a2a", 2, tokens=8) == pytest.approx(per_rank * 4 / 8)
    # Attention TP 1 (dp 4): each rank dispatches its own 2 tokens, nothing moves within a group.
    assert moe_bytes_per_token(TINY, 4, 4, 4, "a2a", 2, tokens=8) == pytest.approx((390 / 28 * 144 + 120) * 4 / 8)
    # The all-reduce path does not depend on DP attention or EP.
    assert moe_bytes_per_token(TINY, 4, 1, 1, "all_reduce", 2, tokens=8) == pytest.approx(5760)


def test_the_a2a_bytes_are_the_engine_formulas():
    """At attention TP 1 the MoE layers' bytes are kestrel.distributed.traffic.a2a_traffic's dispatch, combine and
    counts (the formula the engine's byte counters are tested against) at the expected pairs."""
    config, tp, tokens = resolve_config("k3.1-pro"), 32, 256
    own = Forward.decode(tokens // tp, 4096)
    pairs = expected_a2a_pairs(config, tp, tp) * own.tokens * 92
    traffic = a2a_traffic(config, tp, tp, [own] * tp, 0, 2, pairs, pairs)
    per_rank = traffic["a2a_dispatch"] + traffic["a2a_combine"] + traffic["a2a_counts"]
    assert moe_bytes_per_token(config, tp, tp, tp, "a2a", 2, tokens) == pytest.approx(per_rank * tp / tokens)


@pytest.mark.parametrize("ep", [32, 64])
def test_k31_pro_target_the_all_to_all_path_moves_at_most_a_quarter(ep):
    """Issue 61's target at EP32 (and EP64): with DP attention down to attention TP 4, the all-to-all path moves at
    most a quarter of the all-reduce path's MoE bytes per token; with attention TP 8 at EP32 the group's own
    collectives (shared experts, routed sums) take it above a quarter."""
    config = resolve_config("k3.1-pro")
    assert (config.num_experts, config.num_experts_per_token) == (896, 16)
    reduce = moe_bytes_per_token(config, ep, ep, ep, "all_reduce", 2)
    ratios = [moe_bytes_per_token(config, ep, ep, ep // attn, "a2a", 2) / reduce for attn in (1, 2, 4, 8)]
    assert ratios == sorted(ratios)
    assert all(r <= 0.25 for r in ratios[:3])
    assert (ratios[3] > 0.25) == (ep == 32)


def test_bad_paths_and_layouts_raise_one_sentence():
    with pytest.raises(ValueError, match="unknown MoE path"):
        moe_bytes_per_token(TINY, 4, 4, 4, "deepep", 2)
    with pytest.raises(ValueError, match="needs expert parallelism"):
        moe_bytes_per_token(TINY, 4, 1, 1, "a2a", 2)
    with pytest.raises(ValueError, match="do not make a layout"):
        moe_bytes_per_token(TINY, 4, 3, 1, "all_reduce", 2)


def test_roofline_times_the_a2a_formula():
    """A decode step's comm time with the all-to-all MoE under DP attention is a2a_traffic at the expected pairs:
    ring factors over the attention group and the DP gather, the all-to-all's bytes as sent."""
    facts, bandwidth = model_facts("k3.1-pro"), 1e11
    layout = Layout(tp=32, dp=4, ep=32, a2a=True)
    step = decode_step(facts, layout, CacheSettings(), 7.7e12, 32, 64, 8192, interconnect_per_rank=bandwidth)
    group = Forward(16, 16, 1, 8192, 16)                        # 64 sequences over 4 groups
    pairs = round(expected_a2a_pairs(facts.config, 32, 32) * 2 * 92)     # 2 tokens per rank of a group of 8
    t = a2a_traffic(facts.config, 32, 4, [group] * 4, 0, 2, pairs, pairs)
    expected = (2 * 7 / 8 * t["all_reduce"] + 7 * t["all_gather"] + 3 * t["dp_all_gather"] + t["a2a_dispatch"]
                + t["a2a_combine"] + t["a2a_counts"]) / bandwidth
    assert step.comm_seconds == pytest.approx(expected)
    all_reduce = decode_step(facts, replace(layout, a2a=False), CacheSettings(), 7.7e12, 32, 64, 8192,
                             interconnect_per_rank=bandwidth)
    assert all_reduce.comm_seconds is None          # the all-reduce path under DP attention: not modelled


def test_plan_names_the_moe_path_and_counts_redundant_experts():
    request = PlanRequest(model="k3.1-pro", layout=Layout(tp=8, ep=8), batches=(1,), compare_devices=False)
    plain = plan(request)
    assert "MoE path                 all-reduce (--moe-a2a-backend none)" in plan_text(plain)
    wide = plan(replace(request, layout=Layout(tp=8, ep=8, a2a=True, redundant_experts=16)))
    text = plan_text(wide)
    assert "MoE path                 all-to-all (--moe-a2a-backend torch)" in text and "EPLB: 16 redundant" in text
    assert wide.weight_bytes_per_rank["redundant_experts"] == wide.weight_bytes_per_rank[EXPERTS] * 16 // 896
    assert set(wide.moe_bytes_per_token) == {"all_reduce", "a2a"}


def test_plan_cli_flag_and_its_validation(capsys):
    from kestrel.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--moe-a2a-backend {none,torch}" in capsys.readouterr().out
    assert main(["plan", "--model", "k3.1-pro", "--tp", "8", "--moe-a2a-backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert "--moe-a2a-backend torch needs --ep above 1" in err and err.count("\n") == 1
    assert main(["plan", "--model", "k3.1-pro", "--tp", "8", "--ep", "8", "--ep-num-redundant-experts", "4"]) == 2
    assert "must be a multiple of --ep 8" in capsys.readouterr().err
    assert main(["plan", "--model", "k3.1-pro", "--tp", "8", "--ep", "8", "--moe-a2a-backend", "torch", "--batch",
                 "1"]) == 0
    assert "all-to-all (--moe-a2a-backend torch)" in capsys.readouterr().out


def _cell(model: str, hw: str, mode: str, strategy: str) -> dict:
    return next(c for c in anchors()["cells"] if (c.get("model", "k3"), c["hw"], c["mode"], c["strategy"])
                == (model, hw, mode, strategy))


def _serve(line: str) -> EngineArgs:
    """The `kestrel serve` line read by kestrel's own parser (node 0's placeholders filled)."""
    from kestrel.cli import _parser

    argv = shlex.split(line.replace("<rank>", "0").replace("<head-node-ip>", "10.0.0.1"))
    assert argv[:2] == ["kestrel", "serve"]
    return EngineArgs.from_cli(_parser().parse_args(argv[1:]))


def test_a_deepep_eplb_cell_gets_kestrels_all_to_all_and_eplb(monkeypatch):
    """An NVIDIA cell with DeepEP and EPLB (none is catalogued: the H100 High-Throughput cell with them added) gives
    kestrel's command --moe-a2a-backend torch and --enable-eplb with one redundant slot per EP rank; SGLang's command
    keeps the cell's flags as they are."""
    cell = _cell("k3", "h100", "unified", "high-throughput")
    monkeypatch.setitem(cell, "flags", cell["flags"] + " --moe-a2a-backend deepep --enable-eplb")
    recipe = make_recipe(RecipeRequest("k3", "h100", "unified", "high-throughput"))
    serve = recipe.commands["kestrel"].lines[1]
    assert "--moe-a2a-backend torch --enable-eplb --ep-num-redundant-experts 32" in serve
    assert "--moe-a2a-backend deepep --enable-eplb" in recipe.commands["sglang"].lines[0]
    args = _serve(serve)
    layout = ParallelLayout.from_args(args)
    assert (args.moe_a2a_backend, args.enable_eplb, args.ep_num_redundant_experts) == ("torch", True, 32)
    assert (layout.tp_size, layout.ep_size, layout.moe_a2a, layout.redundant_experts) == (32, 32, True, 32)


def test_a_dp_attention_deepep_cell_without_ep_size_runs_at_ep_tp(monkeypatch):
    """DeepEP without --ep-size under DP attention (as the Ascend cells spell it): EP = TP, as SGLang sets it; the
    cell's redundant experts rounded up to a multiple of EP; kestrel's line carries the DP attention it plans."""
    cell = _cell("k3", "h200", "decode", "high-throughput")
    flags = cell["flags"].replace("--ep-size 16 ", "")
    monkeypatch.setitem(cell, "flags", flags + " --enable-dp-attention --dp-size 2 --moe-a2a-backend deepep "
                                               "--enable-eplb --ep-num-redundant-experts 20 "
                                               "--eplb-rebalance-num-iterations 500")
    command = make_recipe(RecipeRequest("k3", "h200", "decode", "high-throughput")).commands["kestrel"]
    args = _serve(command.lines[1])
    layout = ParallelLayout.from_args(args)
    assert (layout.tp_size, layout.dp_size, layout.ep_size, layout.moe_a2a, layout.redundant_experts) == \
        (16, 2, 16, True, 32)
    assert args.eplb_rebalance_num_iterations == 500
    assert any("rounded up to a multiple of EP16" in note for note in command.notes)


@pytest.mark.parametrize("recipe_id", ["k3/h100/unified/high-throughput", "k3/b200/unified/balanced",
                                       "k3.1-pro/b300/decode/balanced"])
def test_lanes_without_them_do_not_get_them(recipe_id):
    serve = make_recipe(RecipeRequest.from_id(recipe_id)).commands["kestrel"].lines[1]
    assert "--moe-a2a-backend" not in serve and "eplb" not in serve
    assert not ParallelLayout.from_args(_serve(serve)).moe_a2a


def test_the_catalogued_deepep_cells_are_the_ascend_ones_and_the_page_says_so():
    assert wide_ep_cells() == [("k3/a3/unified/balanced", False), ("k3/a5/unified/balanced", False)]
    assert "2 do (`k3/a3/unified/balanced`, `k3/a5/unified/balanced`), none on NVIDIA GPUs" in wide_ep_markdown()
