"""STANDALONE speculation: a separate draft model of the family, its caches mirroring the target's slots and pages.

Oracles: plain greedy decoding (speculation must not change a token), the target drafting for itself (every draft
must be accepted: the draft caches follow each sequence exactly), a plain forward of the draft model over a
sequence's confirmed tokens (after verifications that rejected drafts, the draft's KDA state in the slot must be
the state after the last confirmed token), and for seeded sampling the same tokens from the same seed whatever the
batch around the request. The near draft is the bundled model with a perturbed LM head: it agrees with the target
often, not always, so verifications accept 0 to k drafts.
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


def assert_draft_states(llm: LLM, sequences: dict[tuple[str, int], list[int]]) -> None:
    """Each of sequences' slots, (request id, fork index) -> its whole token ids, holds the draft KDA state of the
    draft model's plain forward over the sequence's tokens the draft cache holds as confirmed."""
    drafter = llm.engine.standalone
    draft, cache = drafter.model, drafter.cache
    owners = {track.owner: (slot, track) for slot, track in drafter.tracks.items()}
    assert owners.keys() == sequences.keys()
    for owner, (slot, track) in owners.items():
        ids = sequences[owner][:track.valid]
        fresh = HybridCache.allocate(draft.config, 1, -(-len(ids) // 4) + 1, 4, torch.float32)
        with torch.inference_mode():
            draft(torch.tensor(ids), ForwardBatch.build([len(ids)], None, [0], [list(range(len(ids) // 4 + 1))], 4),
                  fresh)
        held = track.kept[0] if track.fed else [(s.conv[slot], s.recurrent[slot]) for s in cache.kda]
        for (conv, recurrent), state in zip(held, fresh.kda, strict=True):
            torch.testing.assert_close(recurrent, state.recurrent[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(conv, state.conv[0], rtol=1e-4, atol=1e-4)


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
    assert_draft_states(llm, {(str(i), 0): PROMPTS[i]["prompt_token_ids"] + plain[i] for i in range(len(PROMPTS))})


def test_seeded_sampling_with_n_above_one_speculates_reproducibly(plain, near_draft):
    """verify.py keeps a draft by rejection sampling (with the target's probability of it, from the request's
    generator), so speculative seeded output is plain seeded output in distribution only
    (test_speculative.py::test_the_acceptance_rule_keeps_the_target_distribution), not token for token. What holds
    exactly, with n = 2 (fork i seeded seed + i): a seeded request's tokens depend on its seed alone, not on the
    batch around it (here reordered, beside an unseeded request drawing from the shared generator); top_k = 1 (the
    sampled path with one token to draw) gives plain greedy's tokens; and each fork's draft state is the draft
    model's plain forward over that fork's own tokens (the forks draft from caches of their own)."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, n=2, seed=3)
    first = standalone(near_draft)
    outputs = [[c.token_ids for c in o.outputs] for o in first.generate(PROMPTS[:2], seeded)]
    assert all(len(t) == 12 for forks in outputs for t in forks) and all(a != b for a, b in outputs)
    stats = first.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert_draft_states(first, {(str(i), f): PROMPTS[i]["prompt_token_ids"] + outputs[i][f]
                                for i in range(2) for f in range(2)})
    top_1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True)
    second = standalone(near_draft).generate([PROMPTS[2], PROMPTS[1], PROMPTS[0]], [top_1, seeded, seeded])
    assert [c.token_ids for c in second[0].outputs] == [plain[2][:12]]
    assert [[c.token_ids for c in o.outputs] for o in second[:0:-1]] == outputs


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from kestrel.models.init import init_weights
    from kestrel.models.checkpoint import build_model
    from kestrel.config import parse_config
    from kestrel.models.presets import tiny_config

    raw = tiny_config("kimi-linear-tiny")
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=0), tmp_path, config_json=raw)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        standalone(str(tmp_path))
