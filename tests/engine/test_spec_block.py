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


def test_a_confidence_cut_drafts_exactly_the_slots_the_average_confidence_keeps():
    """--speculative-draft-min-confidence 0.3, blocks of up to 6: after every step, each drafting sequence's drafts
    are its block's argmax cut to min(its room, L), L the number of slots at which the product of the draft's
    probabilities of a block's drafts so far, from each sequence computed plainly and averaged over the step's
    drafting sequences, is at least 0.3 (steps with an average within 1e-4 of it, where rounding decides, are
    skipped); cuts of several lengths happen, and greedy output is plain greedy output."""
    cut, params = 0.3, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dflash(speculative_num_draft_tokens=6, speculative_draft_min_confidence=cut).engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    lengths, finished = [], {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        drafting = [(seq, room) for seq in engine.scheduler.running if (room := engine._draft_room(seq))]
        if not drafting:
            continue
        slots = min(max(room for _, room in drafting), 6)
        logits = [plain_block_logits(engine, seq.tokens(0, seq.num_tokens))[:slots] for seq, _ in drafting]
        average = torch.stack([x.double().softmax(-1).amax(-1).cumprod(0) for x in logits]).mean(0)
        if ((average - cut).abs() < 1e-4).any():
            continue
        length = int((average >= cut).sum())
        lengths.append(length)
        for (seq, room), x in zip(drafting, logits):
            top2 = x.topk(2).values
            clear = (top2[:, 0] - top2[:, 1] > 1e-3).tolist()
            assert len(seq.draft) == min(room, length)
            assert all(d == e for d, e, c in zip(seq.draft, x.argmax(-1).tolist(), clear) if c)
    assert len(set(lengths) - {0, 6}) >= 2 and len(lengths) >= 8
    expected = [o.outputs[0].token_ids for o in LLM(str(BUNDLED_MODEL), dtype="float32").generate(PROMPTS, params)]
    assert [finished[str(i)] for i in range(len(PROMPTS))] == expected
    assert_idle(engine.scheduler)


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
