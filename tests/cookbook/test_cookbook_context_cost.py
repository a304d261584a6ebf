"""A token's context-dependent cost: flops as torch counts them on the engine's own reference ops, bytes as the cache
stores them, prefill as the mean of the decode tokens it is made of, and `kestrel plan`'s rendering."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kestrel.cookbook.calculator import CacheSettings
from kestrel.cookbook.context_cost import context_cost, mean_selected
from kestrel.cookbook.hardware import CPU, measure_cpu
from kestrel.cookbook.layout import Layout
from kestrel.cookbook.model import model_facts
from kestrel.ops.torch.attention import sparse_attention
from kestrel.ops.torch.indexer import indexer_scores
from test_cookbook_cli import run

KESTREL = CacheSettings(kv_layout="kestrel")


def counted_flops(config, context: int, heads_split: int = 1) -> tuple[int, int]:
    """torch's flop count of one decode token's indexer scores over `context` keys and its attention over the
    selected ones, in one MLA layer (the torch reference ops the engine's kernels equal)."""
    hi, d = config.index_n_heads // heads_split, config.index_head_dim
    h, latent = config.num_attention_heads // heads_split, config.kv_lora_rank + config.qk_rope_head_dim
    selected = min(context, config.index_topk)
    with FlopCounterMode(display=False) as index:
        indexer_scores(torch.randn(1, 1, hi, d), torch.randn(1, context, d), torch.rand(1, 1, hi),
                       torch.ones(1, 1, context, dtype=torch.bool))
    keys = torch.randn(1, context, 1, latent)
    with FlopCounterMode(display=False) as attention:
        sparse_attention(torch.randn(1, 1, h, latent), keys, keys[..., :config.kv_lora_rank],
                         torch.arange(selected).view(1, 1, selected), 1.0)
    return index.get_total_flops(), attention.get_total_flops()


@pytest.mark.parametrize("name, layout, contexts", [("k3.1-tiny", Layout(tp=1), (3, 40)),
                                                     ("k3.1-pro", Layout(tp=8), (40, 3000))], ids=["tiny", "pro-tp8"])
@pytest.mark.parametrize("which", [0, 1], ids=["below-topk", "above-topk"])
def test_decode_flops_are_torchs_count_of_the_reference_ops(name, layout, contexts, which):
    facts = model_facts(name)
    config = facts.config
    context = contexts[which]
    assert contexts[0] < config.index_topk < contexts[1]
    index, attention = counted_flops(config, context, layout.attention_tp)
    cost = context_cost(facts, context, KESTREL, layout)
    layers = len(config.mla_layers)
    assert cost.index_scan.flops == layers * index
    assert cost.attention.flops == layers * attention
    assert cost.selected == min(context, config.index_topk)


def test_bytes_are_the_cached_rows_read():
    facts = model_facts("k3.1-tiny")
    topk = facts.config.index_topk
    keys, latents = facts.index_key_bytes_per_token("bf16", row_scales=True), \
        facts.latent_bytes_per_token("bf16", row_scales=True)
    below, above = context_cost(facts, topk, KESTREL), context_cost(facts, 10 * topk, KESTREL)
    assert below.index_scan.bytes + below.attention.bytes == topk * facts.kv_bytes_per_token("bf16", row_scales=True)
    assert above.index_scan.bytes == 10 * topk * keys and above.attention.bytes == topk * latents
    assert above.kda_state == below.kda_state and above.kda_state.bytes == 2 * facts.state_bytes_per_slot("fp32")
    split = context_cost(facts, 10 * topk, KESTREL, Layout(tp=2, dcp=2))
    assert split.index_scan.bytes == above.index_scan.bytes / 2     # DCP splits the cached keys
    k3 = context_cost(model_facts("k3"), 5000)                      # no indexer: every latent, no scan
    assert k3.index_scan.flops == 0 and k3.selected == 5000 and k3.prefill_index_flops == 0


@pytest.mark.parametrize("name, context", [("k3.1-tiny", 7), ("k3.1-tiny", 200), ("k3", 50)])
def test_a_prompt_token_costs_the_mean_of_the_decode_tokens_it_is_made_of(name, context):
    facts = model_facts(name)
    decode = [context_cost(facts, t) for t in range(1, context + 1)]
    prompt = context_cost(facts, context)
    assert prompt.prefill_index_flops == pytest.approx(sum(c.index_scan.flops for c in decode) / context, rel=1e-12)
    assert prompt.prefill_attention_flops == pytest.approx(sum(c.attention.flops for c in decode) / context,
                                                           rel=1e-12)


def test_mean_selected_counts_each_position():
    for context in (1, 5, 64, 65, 300):
        assert mean_selected(context, 64) == pytest.approx(sum(min(t, 64) for t in range(1, context + 1)) / context)
    assert mean_selected(9, None) == 5


def test_times_grow_with_the_context_and_take_the_slower_bound():
    facts = model_facts("k3.1-pro")
    costs = [context_cost(facts, c) for c in (1024, 8192, 131072, 1_048_576)]
    times = [c.decode_seconds(8e12, 2e15) for c in costs]
    assert times == sorted(times) and times[0] < times[-1]
    scan = costs[-1].index_scan
    assert scan.seconds(8e12, 2e15) == max(scan.bytes / 8e12, scan.flops / 2e15)
    assert costs[-1].prefill_seconds(2e15) > costs[0].prefill_seconds(2e15)
    with pytest.raises(ValueError, match="at least 1 token"):
        context_cost(facts, 0)


def test_measure_cpu_restores_the_thread_count():
    threads = torch.get_num_threads()
    speed = measure_cpu(1, repeats=1)
    assert speed.threads == 1 and speed.bandwidth > 0 and speed.flop_rate > 0
    assert torch.get_num_threads() == threads


def test_plan_prints_the_per_token_costs_and_times_them_when_measured(capsys):
    assert run("plan", "--model", "k3.1-pro", "--context", "131072", "--batch", "1") == 0
    out = capsys.readouterr().out
    assert "per token at context 131,072" in out and "indexer scan" in out and "prompt token (131,072)" in out
    assert run("plan", "--model", "k3.1-tiny", "--hardware", CPU, "--engine", "kestrel", "--tp", "1", "--context",
               "4096", "--batch", "1", "--measure", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"]["facts"]["memory_bandwidth"]["flag"] == "measured"
    assert result["context_cost"]["index_scan"]["flops"] > 0
    assert not any("bandwidth" in u["fact"] for u in result["unknowns"])
    with pytest.raises(ValueError, match="--measure measures this machine"):
        run("plan", "--hardware", "b300", "--measure")
