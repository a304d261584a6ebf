"""The rank layout's checks and the sharding rules, without processes: what is refused, and that the ranks' slices
tile every split tensor and count the bytes a rank really holds."""

from __future__ import annotations

import re

import pytest

from kestrel import LLM
from kestrel.config import parse_config
from kestrel.distributed.layout import ParallelLayout, partition
from kestrel.distributed.sharding import RULES, local_slices, shard_bytes, shard_model_
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.models.checkpoint import build_model
from kestrel.models.presets import tiny_config

LAYOUTS = [(2, 1), (2, 2)]


def meta_model(preset: str, **overrides):
    raw = tiny_config(preset)
    raw.get("text_config", raw).update(overrides)
    return build_model(parse_config(raw), device="meta")


def test_every_rule_names_a_tensor_of_the_family():
    names = [n for preset in ("k3.1-tiny", "kimi-linear-tiny") for n in meta_model(preset).state_dict()]
    unused = [pattern for pattern, _ in RULES if not any(re.search(pattern, n) for n in names)]
    assert not unused


@pytest.mark.parametrize("tp,ep", LAYOUTS)
@pytest.mark.parametrize("preset", ["k3.1-tiny", "kimi-linear-tiny"])
def test_ranks_slices_tile_every_tensor(preset, tp, ep):
    """Along each split dim the ranks' ranges are disjoint and cover it; other dims are whole on every rank."""
    model = meta_model(preset, moe_intermediate_size=64)
    for name, tensor in model.state_dict().items():
        per_rank = [local_slices(name, tuple(tensor.shape), ParallelLayout(tp, ep, r)) for r in range(tp)]
        for dim, size in enumerate(tensor.shape):
            ranges = {(s[dim].start or 0, size if s[dim].stop is None else s[dim].stop) for s in per_rank}
            covered = sorted(i for lo, hi in ranges for i in range(lo, hi))
            assert covered == list(range(size)), (name, dim, ranges)


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_shard_bytes_count_what_a_rank_holds(tp, ep):
    full = meta_model("k3.1-tiny", moe_intermediate_size=64)
    for rank in range(tp):
        layout = ParallelLayout(tp, ep, rank)
        held = shard_model_(meta_model("k3.1-tiny", moe_intermediate_size=64), layout)
        assert shard_bytes(full, layout) == sum(t.nbytes for t in held.state_dict().values())   # nothing tied


def test_partition_keeps_whole_units():
    assert [partition(96, 2, r, 32) for r in range(2)] == [(0, 64), (64, 96)]
    assert [partition(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_the_all_to_all_moe_splits_dense_mlps_and_shared_experts_over_the_attention_group():
    """The "ffn" axis: the whole TP group on the all-reduce path, the rank's DP attention group with the
    all-to-all MoE (every rank holds them whole at DP = TP); experts by EP either way, redundant slots included."""
    layout = ParallelLayout(4, 4, 3, dp_size=2)
    a2a = ParallelLayout(4, 4, 3, dp_size=2, moe_a2a=True, redundant_experts=4)
    assert layout.axis("ffn") == (3, 4) and a2a.axis("ffn") == (1, 2) and a2a.axis("ep") == layout.axis("ep")
    assert ParallelLayout(4, 4, 3, dp_size=4, moe_a2a=True).axis("ffn") == (0, 1)
    assert (layout.slots_per_rank(8), a2a.slots_per_rank(8)) == (2, 3)
    mlp = "model.layers.0.mlp.gate_proj.weight"
    assert local_slices(mlp, (96, 64), layout)[0] == slice(72, 96)
    assert local_slices(mlp, (96, 64), a2a)[0] == slice(48, 96)


def test_layouts_kestrel_cannot_run_are_refused():
    config = parse_config(tiny_config("k3.1-tiny"))            # 32-wide MXFP4 experts: one block
    with pytest.raises(ValueError, match="intermediate width 32 into 2 parts of whole MXFP4 blocks"):
        ParallelLayout(2, 1).check_model(config)
    ParallelLayout(2, 2).check_model(config)                    # whole experts per rank instead
    with pytest.raises(ValueError, match="2 KDA heads"):
        ParallelLayout(4, 4).check_model(config)
    with pytest.raises(ValueError, match="ep_size .3. must divide tp_size .2."):
        ParallelLayout(2, 3)


@pytest.mark.parametrize("kwargs,message", [
    ({"dp_size": 2}, "without --enable-dp-attention runs whole replicas"),
    ({"dp_size": 3, "enable_dp_attention": True}, r"dp_size \(3\) must divide tp_size \(2\)"),
    ({"dp_size": 2, "enable_dp_attention": True, "pp_size": 2}, "DP attention does not run with --pp-size"),
    ({"dp_size": 2, "enable_dp_attention": True, "speculative_algorithm": "NGRAM"},
     "DP attention does not run with --speculative-algorithm"),
    ({"dcp_size": 4}, r"dcp_size \(4\) must divide the attention TP size \(2\)"),
    ({"dcp_size": 2, "page_size": 3}, "must be a multiple of --dcp-size 2"), ({"nnodes": 2}, "needs --dist-init-addr"),
    ({"moe_a2a_backend": "torch"}, "does not run with --ep-size 1"),
    ({"moe_a2a_backend": "torch", "ep_size": 2, "dcp_size": 2}, "does not run with --dcp-size"),
    ({"moe_a2a_backend": "deepep"}, "moe_a2a_backend must be none or torch"),
    ({"enable_eplb": True}, "enable_eplb must be set only with --ep-size above 1"),
    ({"ep_size": 2, "ep_num_redundant_experts": 2}, "set only with --enable-eplb"),
    ({"ep_size": 2, "enable_eplb": True, "ep_num_redundant_experts": 3}, "must split evenly over ep_size 2"),
    ({"ep_size": 2, "moe_a2a_backend": "torch", "enable_torch_compile": True}, "run eagerly")])
def test_engine_refuses_parallelism_it_does_not_implement(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(BUNDLED_MODEL), tp_size=2, **kwargs)
