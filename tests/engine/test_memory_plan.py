"""The memory plan counts, and the engine allocates, KV pages for the decoder's MLA layers only: the MTP layer,
which serving never runs, gets pages only when asked for (a drafter's). Byte counts are written out from the
bundled model's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import load_config
from kestrel.engine.args import EngineArgs
from kestrel.engine.cache.planner import MemoryPlanError, plan_memory
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import FP8, HybridCache, kv_bytes_per_token

BUNDLED = Path(__file__).parents[2] / "models" / "k3.1-tiny"
TEXT = json.loads((BUNDLED / "config.json").read_text())["text_config"]
MLA_LAYERS = len(TEXT["linear_attn_config"]["full_attn_layers"])                  # 2
LATENT = TEXT["kv_lora_rank"] + TEXT["qk_rope_head_dim"]                           # 128 + 32 values
INDEX_KEY = TEXT["dsa_config"]["index_head_dim"]                                  # 32 values
BF16_PER_TOKEN = MLA_LAYERS * (LATENT + INDEX_KEY) * 2                             # 768 B
FP8_PER_TOKEN = MLA_LAYERS * ((LATENT + 4) + (INDEX_KEY + 4))                      # a 4-byte scale per vector
MTP_BF16_PER_TOKEN = TEXT["num_nextn_predict_layers"] * LATENT * 2                 # 320 B; no indexer keys


def test_the_bundled_models_kv_bytes_per_token_leave_out_the_mtp_layer():
    config = load_config(BUNDLED)
    assert TEXT["num_nextn_predict_layers"] == 1 and BF16_PER_TOKEN == 768
    assert kv_bytes_per_token(config, torch.bfloat16) == BF16_PER_TOKEN
    assert kv_bytes_per_token(config, FP8) == FP8_PER_TOKEN == 400
    assert kv_bytes_per_token(config, torch.bfloat16, mtp_layers=1) == BF16_PER_TOKEN + MTP_BF16_PER_TOKEN == 1088
    with pytest.raises(ValueError, match="mtp_layers is 2, but the model has 1 MTP layers"):
        kv_bytes_per_token(config, torch.bfloat16, mtp_layers=2)


def test_the_plan_gives_the_mtp_layers_share_to_more_tokens():
    """Same budget, same state slots; the KV bytes the MTP layer would take hold 1088/768 as many tokens."""
    config = load_config(BUNDLED)
    args = EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5)
    memory, weights, dtypes = 2**30, 12 * 2**20, (torch.bfloat16, torch.float32, torch.bfloat16)
    serving = plan_memory(config, args, weights, memory, *dtypes)
    drafting = plan_memory(config, args, weights, memory, *dtypes, mtp_layers=1)
    assert serving.kv_bytes_per_token == BF16_PER_TOKEN and serving.mtp_layers == 0
    assert drafting.kv_bytes_per_token == BF16_PER_TOKEN + MTP_BF16_PER_TOKEN and drafting.mtp_layers == 1
    assert serving.num_slots == drafting.num_slots
    kv_budget = memory // 2 - weights - serving.num_slots * serving.state_bytes_per_slot
    page = args.page_size
    assert serving.kv_tokens == kv_budget // (BF16_PER_TOKEN * page) * page
    assert drafting.kv_tokens == kv_budget // ((BF16_PER_TOKEN + MTP_BF16_PER_TOKEN) * page) * page
    assert serving.kv_tokens / drafting.kv_tokens == pytest.approx(1088 / 768, rel=1e-3)
    assert "MTP layers: 1" in drafting.describe() and "MTP" not in serving.describe()


def test_a_context_length_the_kv_pool_cannot_hold_is_refused():
    """--context-length beyond the trained length runs while the KV pool holds it (no RoPE to rescale), and is refused
    with the sizes when it does not; without the flag the context is the model's, capped by the pool."""
    config = load_config(BUNDLED)
    memory, weights, dtypes = 2**30, 12 * 2**20, (torch.bfloat16, torch.float32, torch.bfloat16)
    held = plan_memory(config, EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5), weights, memory,
                       *dtypes).kv_tokens
    assert held > config.max_position_embeddings
    longer = plan_memory(config, EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5, context_length=held),
                         weights, memory, *dtypes)
    assert longer.context_length == held
    with pytest.raises(MemoryPlanError, match=f"--context-length {held + 1:,} needs .* but the plan holds {held:,}"):
        plan_memory(config, EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5, context_length=held + 1),
                    weights, memory, *dtypes)
    small = EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5, max_total_tokens=1024)
    assert plan_memory(config, small, weights, memory, *dtypes).context_length == 1024


@pytest.mark.parametrize("kv_dtype,per_token", [(torch.bfloat16, BF16_PER_TOKEN), (FP8, FP8_PER_TOKEN)])
def test_the_cache_stores_what_the_plan_counts(kv_dtype, per_token):
    """HybridCache rows: MLA pages of the decoder's layers by default, and the MTP layer's latents (no indexer
    keys) when asked for."""
    config = load_config(BUNDLED)
    serving = HybridCache.allocate(config, 1, 3, 4, kv_dtype=kv_dtype)
    drafting = HybridCache.allocate(config, 1, 3, 4, kv_dtype=kv_dtype, mtp_layers=1)
    assert len(serving.mla) == MLA_LAYERS and len(drafting.mla) == MLA_LAYERS + 1
    assert drafting.mla[-1].index_keys is None
    for cache, mtp in ((serving, 0), (drafting, 1)):
        assert row_bytes(cache) == kv_bytes_per_token(config, kv_dtype, mtp)
    assert row_bytes(serving) == per_token


def row_bytes(cache: HybridCache) -> int:
    """Bytes one token (one row of every MLA layer's paged storage) takes in cache."""
    rows = [r for pages in cache.mla for r in (pages.latent, pages.index_keys) if r is not None]
    return sum(r.values[0].nbytes + (r.scales[0].nbytes if r.scales is not None else 0) for r in rows)


@torch.inference_mode()
def test_serving_the_bundled_model_allocates_no_mtp_pages_and_decodes_right():
    """The engine's cache holds the decoder's MLA layers only, its pool is what the plan counts, and greedy decoding
    (which never runs the MTP layer) picks at every step the argmax of a plain forward over the sequence."""
    llm = LLM(str(BUNDLED), max_total_tokens=1024, max_mamba_cache_size=4, dtype="float32")
    engine = llm.engine
    assert engine.plan.kv_bytes_per_token == MLA_LAYERS * (LATENT + INDEX_KEY) * 4       # fp32 KV
    assert len(engine.cache.mla) == MLA_LAYERS and row_bytes(engine.cache) == engine.plan.kv_bytes_per_token
    assert engine.plan.kv_tokens == 1024
    prompt = torch.randint(0, 4000, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    seq = torch.tensor(prompt + out)
    logits = engine.model.compute_logits(engine.model(seq, ForwardBatch.build([len(seq)])))
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out       # each token the argmax after its prefix


@pytest.mark.parametrize("running", [None, 3])
def test_speculative_verification_states_are_reserved_per_running_request(running):
    """Each running request keeps draft tokens + 1 KDA states (recurrent in fp32) while its draft is verified:
    the plan takes them off the state share, and the whole plan still fits the budget."""
    config = load_config(BUNDLED)
    memory, weights, dtypes = 2**30, 12 * 2**20, (torch.bfloat16, torch.float32, torch.bfloat16)
    plain = plan_memory(config, EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5,
                                           max_running_requests=running), weights, memory, *dtypes)
    spec = plan_memory(config, EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5, max_running_requests=running,
                                          speculative_algorithm="NGRAM", speculative_num_draft_tokens=3),
                       weights, memory, *dtypes)
    kda_layers = len(config.kda_layers)
    h, d = config.kda_num_heads, config.kda_head_dim
    assert spec.verify_tokens == 4 and plain.verify_tokens == plain.verify_bytes == 0
    assert spec.token_state_bytes == kda_layers * (h * d * d * 4 + (config.conv_kernel_size - 1) * 3 * h * d * 2)
    assert spec.num_slots < plain.num_slots
    used = spec.state_pool_bytes + spec.verify_bytes + spec.kv_pool_bytes
    assert used <= memory // 2 - weights < used + spec.state_bytes_per_slot + spec.token_state_bytes * 4 + \
        spec.kv_bytes_per_token * spec.page_size
    assert "4 token states" in spec.describe() and "speculative" not in plain.describe()


def test_a_standalone_draft_models_caches_are_planned_with_the_pools():
    """Each slot holds the draft's state too, each token the draft's latents, and each running request k copies
    of the draft's slot state to roll back to; the whole plan still fits the budget."""
    config, draft = load_config(BUNDLED), load_config(BUNDLED)
    memory, weights, dtypes = 2**30, 24 * 2**20, (torch.bfloat16, torch.float32, torch.bfloat16)
    args = EngineArgs(model=str(BUNDLED), mem_fraction_static=0.5, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=str(BUNDLED), speculative_num_draft_tokens=3)
    alone = plan_memory(config, args, weights, memory, *dtypes)
    both = plan_memory(config, args, weights, memory, *dtypes, draft=draft)
    assert both.draft_state_bytes_per_slot == alone.state_bytes_per_slot
    assert both.state_bytes_per_slot == 2 * alone.state_bytes_per_slot
    assert both.kv_bytes_per_token == 2 * alone.kv_bytes_per_token
    rollback = both.max_running_requests * 3 * both.draft_state_bytes_per_slot
    used = both.state_pool_bytes + both.verify_bytes + rollback + both.kv_pool_bytes
    assert used <= memory // 2 - weights < used + both.state_bytes_per_slot + both.token_state_bytes * 4 + \
        3 * both.draft_state_bytes_per_slot + both.kv_bytes_per_token * both.page_size
    assert "draft model" in both.describe() and "draft model" not in alone.describe()
