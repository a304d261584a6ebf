"""Logits of tensor-, expert- and pipeline-parallel ranks (gloo, 2 and 4 processes) equal the single-process
model's (float32), and the pools every rank allocates are what `kestrel plan --engine kestrel` says for that layout.

One spawned group per world size runs its cases: K3.1-tiny (indexer, AttnRes, latent MXFP4 MoE, MTP) and a
Kimi-Linear-shaped model, at TP2 (experts split by intermediate width), TP2 with EP2 (experts split by expert) and
PP2 (K3.1's first stage has no MLA layer, its AttnRes blocks cross the cut) and TP2 x DCP2, K3.1 at TP2 x PP2 and
a K3.1 whose every width splits four ways at TP4 x DCP2 (two DCP groups); with DP attention K3.1 at TP2 x DP2,
Kimi-Linear at TP2 x EP2 x DP2 and the four-way K3.1 at TP4 x EP2 x DP2 (two ranks per DP group; sequences A, C in
group 0 and B, D in group 1, each group's caches holding its own), through the
scripted steps of tp_script.py: mixed-length chunked prefill, decode, and a fork whose state slot and page are
copied by the DeviceOps journal; then the engine's load_shard plans and allocates each case's pools.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kestrel.config import load_config, parse_config
from kestrel.cookbook.calculator import CacheSettings
from kestrel.cookbook.layout import Layout
from kestrel.cookbook.planner import PlanRequest, plan
from kestrel.distributed import eplb
from kestrel.distributed.launch import RankSpec, Workers
from kestrel.distributed.traffic import a2a_traffic, dp_attention_traffic, kestrel_dcp_traffic, pp_traffic, tp_traffic
from kestrel.engine.cache.planner import device_memory
from kestrel.models.checkpoint import build_model, load_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config
from kestrel.distributed.layout import ParallelLayout
from kestrel.engine.model_runner import Save
from helpers import computed_once
from tp_script import CHUNKS, FORK_AT, SEQUENCES, a2a_pairs, forwards, handoff_parts_of_a, mtp_logits, oracle, rank_main, run_script

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
"""float32: the ranks sum partial projections in another order than one process does (measured: at most 2e-5
absolute; dropping the indexer's score reduction moves logits by 2.1)."""
MODELS = {"k3.1": ("k3.1-tiny", {"moe_intermediate_size": 64}),        # two MXFP4 blocks: one per rank at TP2
          "kimi-linear": ("kimi-linear-tiny", {}),
          "k3.1-wide": ("k3.1-tiny", {"moe_intermediate_size": 128, "linear_attn_config": {"num_heads": 4},
                                      "dsa_config": {"index_n_heads": 4}}),       # every width splits 4 ways
          "k3.1-skewed": ("k3.1-tiny", {"moe_intermediate_size": 64}),
          "kimi-linear-skewed": ("kimi-linear-tiny", {})}
HOT_EXPERTS = (0, 1)
"""The -skewed models' router bias sends every token to these experts (both on EP rank 0 at load)."""
CASES = [("k3.1", 2, 1, 1, 1, 1, 0, 0), ("k3.1", 2, 2, 1, 1, 1, 0, 0), ("kimi-linear", 2, 1, 1, 1, 1, 0, 0),
         ("kimi-linear", 2, 2, 1, 1, 1, 0, 0), ("k3.1", 1, 1, 2, 1, 1, 0, 0), ("kimi-linear", 1, 1, 2, 1, 1, 0, 0),
         ("k3.1", 2, 1, 2, 1, 1, 0, 0), ("k3.1", 2, 1, 1, 2, 1, 0, 0), ("kimi-linear", 2, 1, 1, 2, 1, 0, 0),
         ("k3.1-wide", 4, 1, 1, 2, 1, 0, 0), ("k3.1", 2, 1, 1, 1, 2, 0, 0), ("kimi-linear", 2, 2, 1, 1, 2, 0, 0),
         ("k3.1-wide", 4, 2, 1, 1, 2, 0, 0),
         ("k3.1", 2, 2, 1, 1, 1, 1, 0), ("k3.1-wide", 4, 4, 1, 1, 4, 1, 0), ("kimi-linear", 4, 4, 1, 1, 4, 1, 0),
         ("k3.1-wide", 4, 2, 1, 1, 2, 1, 0),
         ("k3.1-skewed", 2, 2, 1, 1, 1, 1, 2), ("kimi-linear-skewed", 2, 2, 1, 1, 1, 0, 2),
         ("k3.1-wide", 4, 4, 1, 1, 4, 1, 4)]
"""(model, tp, ep, pp, dcp, dp: DP attention groups, a2a: the all-to-all MoE, redundant: redundant experts, with
EPLB rebalancing every EPLB_WINDOW steps)"""
EPLB_WINDOW = 2
RANK_TIMEOUT_S = 240
POOL_BUDGET = 256 * 2**20
"""Bytes of memory x fraction per rank in the pool check: room for a tiny model and pools (allocated, not touched)."""
RATIO = 0.05


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, (preset, overrides) in MODELS.items():
        raw = tiny_config(preset)
        text = raw.get("text_config", raw)
        for key, value in overrides.items():
            text[key] = {**text[key], **value} if isinstance(value, dict) else value
        model = init_weights(build_model(parse_config(raw), torch.float32), seed=1, std=0.1)
        for param_name, p in model.named_parameters():     # a router bias that steers selection
            if param_name.endswith("e_score_correction_bias"):
                p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
                if name.endswith("-skewed"):
                    p.data[list(HOT_EXPERTS)] += 1.0
        folder = tmp_path_factory.mktemp(name)
        save_model(model, folder, config_json=raw)
        out[name] = str(folder)
    return out


def pool_fraction(ranks: int) -> float:
    """--mem-fraction-static that gives each of `ranks` CPU ranks POOL_BUDGET (the ranks split the machine's
    memory)."""
    return POOL_BUDGET / (device_memory(torch.device("cpu")) // ranks)


def case_name(model: str, tp: int, ep: int, pp: int, dcp: int, dp: int, a2a: int, redundant: int) -> str:
    return f"{model}-tp{tp}-ep{ep}-pp{pp}-dcp{dcp}-dp{dp}" + ("-a2a" if a2a else "") + \
        (f"-eplb{redundant}" if redundant else "")


@pytest.fixture(scope="module")
def rank_results(folders, tmp_path_factory) -> dict:
    """Every case's logits and every rank's pools, from one spawned group per world size (2 and 4 ranks), once per
    test run (the models are the same in every worker: fixed seeds)."""
    return computed_once(tmp_path_factory, "tp_logits_rank_results", lambda: spawn_cases(folders, tmp_path_factory))


def spawn_cases(folders: dict[str, str], tmp_path_factory) -> dict:
    results = {}
    for world in sorted({tp * pp for _, tp, _, pp, _, _, _, _ in CASES}):
        out = tmp_path_factory.mktemp("ranks") / "logits.pt"
        cases = [(case_name(*case), folders[case[0]], *case[1:]) for case in CASES if case[1] * case[3] == world]
        port = __import__("kestrel.distributed.launch", fromlist=["_free_port"])._free_port()
        specs = [RankSpec(r, world, r, f"tcp://127.0.0.1:{port}", True) for r in range(world)]
        pool_args = dict(dtype="float32", mem_fraction_static=pool_fraction(world), mamba_full_memory_ratio=RATIO)
        workers = Workers(rank_main, specs, cases, str(out), pool_args, EPLB_WINDOW)
        try:
            for p in workers.processes:
                p.join(RANK_TIMEOUT_S)
            assert [p.exitcode for p in workers.processes] == [0] * world, workers.failures()
        finally:
            workers.stop(timeout=0)
        results |= torch.load(out)
    return results


@pytest.mark.parametrize("model,tp,ep,pp,dcp,dp,a2a,redundant", CASES)
def test_rank_logits_equal_single_process(folders, rank_results, model, tp, ep, pp, dcp, dp, a2a, redundant):
    single = load_model(folders[model], torch.float32)
    expected = oracle(single)
    got = rank_results[case_name(model, tp, ep, pp, dcp, dp, a2a, redundant)]
    for name in SEQUENCES:
        first = FORK_AT if name == "D" else 0          # the fork's own tokens (its prompt is B's)
        torch.testing.assert_close(got[name], expected[name][first:], **TOLERANCE,
                                   msg=lambda m, name=name: f"sequence {name}: {m}")
    if single.config.num_nextn_predict_layers and pp == 1:
        torch.testing.assert_close(got["mtp"], mtp_logits(single), **TOLERANCE)


@pytest.mark.parametrize("model,tp,ep,pp,dcp,dp,a2a,redundant", [case for case in CASES if case[5] == 1])   # PD refuses DP
def test_a_handoff_gathered_from_the_ranks_is_one_process_state(folders, rank_results, model, tp, ep, pp, dcp, dp, a2a, redundant):
    """Sequence A's state and pages, read on every rank and gathered (kestrel.engine.cache.shards), equal what one
    process's caches hold after the same steps: what a PD handoff sends, in any layout."""
    single = load_model(folders[model], torch.float32)
    _, runner = run_script(single, ParallelLayout())
    expected = runner.read(Save([[]], handoff_parts_of_a()))
    got = rank_results[case_name(model, tp, ep, pp, dcp, dp, a2a, redundant)]["handoff"]
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("model,tp,ep,pp,dcp,dp,a2a,redundant", [case for case in CASES if not case[7]])
def test_every_ranks_pools_are_what_kestrel_plan_says(folders, rank_results, model, tp, ep, pp, dcp, dp, a2a, redundant):
    """`kestrel plan --engine kestrel` plans each stage's rank 0, the heaviest of its stage (uneven splits give
    the first rank more): the heaviest rank's weights, and the pools all ranks agree on; each rank allocates them
    for its own stage's layers only (under DP attention, for its DP group's sequences)."""
    planned = plan(PlanRequest(model=folders[model], hardware="cpu", dtype="fp32",
                               layout=Layout(tp=tp, dp=dp, ep=ep, pp=pp, dcp=dcp, a2a=bool(a2a)),
                               cache=CacheSettings(kv_dtype="fp32"),
                               mem_fraction=pool_fraction(tp * pp), ratio=RATIO, engine="kestrel", batches=(1,),
                               compare_devices=False))
    ranks = rank_results[case_name(model, tp, ep, pp, dcp, dp, a2a, redundant)]["pools"]
    assert max(rank["weight_bytes"] for rank in ranks) == planned.weight_bytes_per_rank_total
    slots, kv_tokens = planned.pools.state_slots, planned.pools.kv_tokens
    for rank in ranks:
        assert (rank["plan_slots"], rank["plan_kv_tokens"], rank["table_rows"]) == (slots, kv_tokens, slots)
        assert set(rank["slots"]) <= {slots} and set(rank["kv_tokens"]) <= {kv_tokens // dcp}   # rows held
    config = load_config(folders[model])
    first_tp_ranks = ranks[::tp]          # one rank per stage
    assert sum(len(rank["slots"]) for rank in first_tp_ranks) == len(config.kda_layers)
    assert sum(len(rank["kv_tokens"]) for rank in first_tp_ranks) == len(config.mla_layers)


@pytest.mark.parametrize("model,tp,ep,pp,dcp,dp,a2a,redundant", [case for case in CASES if not case[7]])
def test_collective_bytes_are_what_the_traffic_formula_says(folders, rank_results, model, tp, ep, pp, dcp, dp, a2a, redundant):
    """Parallel.bytes_sent (one stage: the TP collectives; rank 0's, of DP group 0) and the stage link's bytes
    (rank 0's stream to the second stage) over the scripted steps equal kestrel/distributed/traffic.py (float32
    activations)."""
    config = load_config(folders[model])
    got = rank_results[case_name(model, tp, ep, pp, dcp, dp, a2a, redundant)]
    if a2a:
        layout = ParallelLayout(tp, ep, 0, pp, dcp, dp, True)
        expected = Counter()
        for groups, (sent, returned) in zip(forwards(dp), a2a_pairs(load_model(folders[model], torch.float32), layout)):
            expected.update(a2a_traffic(config, tp, dp, groups, 0, 4, sent, returned))
        assert got["bytes_sent"] == {kind: n for kind, n in expected.items() if n}
        return
    if pp == 1:
        expected = Counter()
        for groups in forwards(dp):
            if dp > 1:
                expected.update(dp_attention_traffic(config, tp, dp, groups, 0, 4))
            else:
                expected.update(tp_traffic(config, tp, groups[0], 4, dcp) |
                                kestrel_dcp_traffic(config, tp, dcp, groups[0], 4))
        assert got["bytes_sent"] == {kind: n for kind, n in expected.items() if n}
        return
    second_stage = config.num_hidden_layers // pp
    assert got["stage_bytes_sent"] == {"stream": sum(pp_traffic(config, second_stage, f, 4)["stream"]
                                                     for [f] in forwards())}


@pytest.mark.parametrize("model,tp,ep,pp,dcp,dp,a2a,redundant", [case for case in CASES if "skewed" in case[0]])
def test_eplb_balances_a_skewed_router_and_keeps_the_logits(folders, rank_results, model, tp, ep, pp, dcp, dp, a2a,
                                                            redundant):
    """Every token of the -skewed models picks HOT_EXPERTS, which start on EP rank 0: over the first window that
    rank computes every pair (max / mean = ep_size); the rebalance gives each hot expert a replica on each rank
    (redundant = ep), and the next window's pairs split evenly (max / mean 1.0, as eplb.rank_load predicts). The
    logits of every step, before and after the rebalance, are one process's (test_rank_logits_equal_single_process
    runs the same case)."""
    windows = rank_results[case_name(model, tp, ep, pp, dcp, dp, a2a, redundant)]["rank_load"]
    config = load_config(folders[model])
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    tokens = [sum(length for chunks in CHUNKS[w:w + EPLB_WINDOW] for _, _, length in chunks)
              for w in range(0, len(CHUNKS) - 1, EPLB_WINDOW)]
    assert [sum(w) for w in windows] == [len(HOT_EXPERTS) * t * moe_layers for t in tokens]     # every pair, once
    before, after = (torch.tensor(w, dtype=torch.float64) for w in windows)
    assert eplb.imbalance(before) == ep and before[1:].sum() == 0
    assert eplb.imbalance(after) == 1.0
