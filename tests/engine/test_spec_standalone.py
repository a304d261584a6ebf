"""STANDALONE speculation: a separate draft model of the family, its caches mirroring the target's slots and pages.

Oracles: plain greedy decoding (speculation must not change a token), the target drafting for itself (every draft
must be accepted: the draft caches follow each sequence exactly), and a plain forward of the draft model over a
sequence's confirmed tokens (after verifications that rejected drafts, the draft's KDA state in the slot must be
the state after the last confirmed token). The near draft is the bundled model with a perturbed LM head: it agrees
with the target often, not always, so verifications accept 0 to k drafts.
"""

from __future__ import annotations

import json

import pytest
import torch

from kestrel import LLM
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.engine.sampling import SamplingParams
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.models.checkpoint import load_model, save_model

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 17, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
ARGS = dict(dtype="float32", max_total_tokens=4096, max_mamba_cache_size=16, chunked_prefill_size=16)


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return tokens(LLM(str(BUNDLED_MODEL), **ARGS))


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory) -> str:
    """The bundled model with noise on its LM head (float32)."""
    model = load_model(BUNDLED_MODEL, torch.float32)
    noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
    model.lm_head.weight.data += 0.6 * model.lm_head.weight.std() * noise
    folder = tmp_path_factory.mktemp("near-draft")
    save_model(model, folder, config_json=json.loads((BUNDLED_MODEL / "config.json").read_text()))
    return str(folder)


def standalone(draft: str, **args) -> LLM:
    return LLM(str(BUNDLED_MODEL), speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
               **(ARGS | args))


def test_the_target_drafting_for_itself_has_every_draft_accepted(plain):
    llm = standalone(str(BUNDLED_MODEL))
    assert tokens(llm) == plain
    stats = llm.engine.spec_stats
    assert stats.draft_tokens > 40 and stats.accepted_tokens == stats.draft_tokens


def test_greedy_output_is_plain_greedy_and_the_draft_state_is_the_confirmed_tokens(plain, near_draft):
    """Mixed prompts (chunked prefill), k = 4, then after the run each slot's draft KDA state against the draft
    model's plain forward over that sequence's confirmed tokens."""
    llm = standalone(near_draft)
    assert tokens(llm) == plain
    stats = llm.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.accepted_histogram[0] > 0 and sum(stats.accepted_histogram[1:-1]) > 0    # rejections, partial
    drafter = llm.engine.standalone
    draft, cache = drafter.model, drafter.cache
    sequences = {str(i): PROMPTS[i]["prompt_token_ids"] + plain[i] for i in range(len(PROMPTS))}
    checked = 0
    for slot, track in drafter.tracks.items():
        ids = sequences[track.owner[0]][:track.valid]
        fresh = HybridCache.allocate(draft.config, 1, -(-len(ids) // 4) + 1, 4, torch.float32)
        with torch.inference_mode():
            draft(torch.tensor(ids), ForwardBatch.build([len(ids)], None, [0], [list(range(len(ids) // 4 + 1))], 4),
                  fresh)
        held = track.kept[0] if track.fed else [(s.conv[slot], s.recurrent[slot]) for s in cache.kda]
        for (conv, recurrent), state in zip(held, fresh.kda, strict=True):
            torch.testing.assert_close(recurrent, state.recurrent[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(conv, state.conv[0], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == len(PROMPTS)


def test_sampled_requests_and_n_above_one_speculate(near_draft):
    """Seeded sampling with n = 2 (the forks draft from caches of their own) answers, and drafts are accepted."""
    llm = standalone(near_draft)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, n=2, seed=3)
    outputs = llm.generate(PROMPTS[:2], params)
    assert all(len(c.token_ids) == 12 for o in outputs for c in o.outputs)
    assert llm.engine.spec_stats.accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from kestrel.models.init import init_weights
    from kestrel.models.checkpoint import build_model
    from kestrel.config import parse_config
    from kestrel.models.presets import tiny_config

    raw = tiny_config("kimi-linear-tiny")
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=0), tmp_path, config_json=raw)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        standalone(str(tmp_path))
