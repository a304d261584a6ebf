"""Speculative decoding with the block draft (DFLASH) on the bundled model: greedy output equals plain greedy
output token for token, on the engine's fused projections and column-major weights, and every draft is the one
the draft model makes from the whole sequence computed plainly (the hidden state the drafter reads is right). In
float32: in bfloat16 the verification's batched arithmetic rounds differently from one-token steps, so near-ties
can go the other way."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.handoff import Handoff
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.layers.linear import Linear, LinearGroup, column_major_pays
from kestrel.layers.moe import MoE
from kestrel.models.block_draft import block_logits
from helpers import assert_idle, check_drafts

DRAFT = BUNDLED_MODEL.parent / "k3.1-tiny-dflash"
PROMPTS = ["KING.\nWhat news from France?\n\nMESSENGER.\n", "ROMEO.\nBut soft,", "To be, or not to be"]


def test_dflash_greedy_speculation_equals_plain_greedy():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(BUNDLED_MODEL), dtype="float32")
    spec = LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(DRAFT), speculative_num_draft_tokens=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == expected
    stats = spec.engine.spec_stats
    assert stats.verifications > 0 and stats.accepted_tokens > 0
    assert_idle(spec.engine.scheduler)
    for model in (spec.engine.model, spec.engine.drafter.draft_model):      # both held as column_major_pays says
        held = [m.weight.stride(0) == 1 for m in model.modules()
                if isinstance(m, Linear) and column_major_pays(m.weight)]
        assert held and all(held)
    groups = [m for m in spec.engine.model.modules() if isinstance(m, LinearGroup)]
    fused = [g for g in groups if g.weight is not None]           # every layer's; the shared experts' go in MoE's
    assert len(fused) == len(groups) - sum(isinstance(m, MoE) for m in spec.engine.model.modules()) > 0
    assert all(m.weight.untyped_storage().data_ptr() == g.weight.untyped_storage().data_ptr()
               for g in fused for m in g.members)


def test_a_confidence_cut_drafts_fewer_tokens_and_the_output_stays_plain():
    """--speculative-draft-min-confidence: blocks of up to 6 drafts cut where the draft's confidence falls; greedy
    output is plain greedy output, and fewer drafts are verified than without the cut."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(BUNDLED_MODEL), dtype="float32").generate(PROMPTS, params)]
    drafted = []
    for min_confidence in (0.0, 0.3):
        spec = dflash(speculative_num_draft_tokens=6, speculative_draft_min_confidence=min_confidence)
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == expected
        stats = spec.engine.spec_stats
        drafted.append(stats.draft_tokens / stats.verifications)
    assert drafted[0] > drafted[1] + 1


@pytest.mark.parametrize("changes, message", [
    ({"speculative_draft_min_confidence": 1.0}, "speculative_draft_min_confidence must be in \\[0, 1\\)"),
    ({"speculative_algorithm": "NEXTN", "speculative_draft_min_confidence": 0.2},
     "set only with --speculative-algorithm DFLASH"),
])
def test_a_confidence_cut_is_checked(changes, message):
    args = {"model": str(BUNDLED_MODEL), "speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(DRAFT)}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**(args | changes))


def plain_block_logits(engine, tokens: list[int]) -> torch.Tensor:
    """The draft's logits [block_size, vocab] at the last position whose next token is known (tokens[-2]), from
    the hidden state there of one plain forward over tokens[:-1] in a fresh cache."""
    model, length = engine.model, len(tokens) - 1
    cache = HybridCache.allocate(model.config, 1, length, 1, torch.float32)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens[:-1]), ForwardBatch.build([length], None, [0], torch.arange(length)[None],
                                                                     1), cache)
        return block_logits(model, engine.drafter.draft_model, hidden[-1:], torch.tensor(tokens[-1:]))[0]


def dflash(**kw) -> LLM:
    return LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(DRAFT), **{"speculative_num_draft_tokens": 4, "page_size": 4, **kw})


def test_dflash_drafts_are_the_draft_over_the_whole_sequence():
    """After every step, each sequence's drafts are the block draft's argmax from its whole sequence computed
    plainly: the hidden state the drafter reads is the sequence's own, through chunked prefill, prefix-cache hits,
    preemption and rejected drafts, and for a one-token prompt."""
    engine = dflash(chunked_prefill_size=8, max_total_tokens=96, mamba_scheduler_strategy="extra_buffer",
                    mamba_track_interval=4).engine
    checked = 0
    for turn in range(2):                                   # the second turn starts from the prefix cache
        for i, prompt in enumerate(PROMPTS + ["A"]):
            engine.add_request(f"{turn}.{i}", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        checked += check_drafts(engine, plain_block_logits)[0]
    assert checked >= 100
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache.stats.hits > 0
    assert_idle(engine.scheduler)


def test_dflash_continues_a_pd_handoff_from_a_plain_prefill_instance():
    """A decode instance drafting with DFLASH continues requests that a plain prefill instance (no draft) computed:
    its drafts are the draft's from the whole sequence, and its output is plain greedy output."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prefiller, decoder = LLM(str(BUNDLED_MODEL), dtype="float32", page_size=4).engine, dflash().engine
    handed: list[Handoff] = []
    for i, prompt in enumerate(PROMPTS):
        prefiller.add_request(f"p{i}", prompt, params, handoff=handed.append)
    while prefiller.has_unfinished_requests():
        prefiller.step()
    for i, handoff in enumerate(handed):
        decoder.add_prefilled_request(f"d{i}", handoff, params)
    checked, finished = check_drafts(decoder, plain_block_logits)
    expected = [o.outputs[0].token_ids for o in LLM(str(BUNDLED_MODEL), dtype="float32").generate(PROMPTS, params)]
    assert [finished[f"d{i}"] for i in range(len(PROMPTS))] == expected
    assert checked >= 20 and decoder.spec_stats.accepted_tokens > 0
    assert_idle(decoder.scheduler)


def test_the_block_drafts_weights_are_in_the_memory_plan():
    plain = LLM(str(BUNDLED_MODEL), dtype="float32").engine.plan.weight_bytes
    engine = LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="DFLASH",
                 speculative_draft_model_path=str(DRAFT)).engine
    draft = sum(t.numel() * t.element_size() for t in engine.drafter.draft_model.state_dict().values())
    assert draft > 0 and engine.plan.weight_bytes == plain + draft


def test_dflash_needs_a_draft_model_path():
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineArgs(model=str(BUNDLED_MODEL), speculative_algorithm="DFLASH")
