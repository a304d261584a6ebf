"""Speculative decoding with the block draft (DFLASH) on the bundled model: greedy output equals plain greedy
output token for token, on the engine's fused projections and column-major weights. In float32: in bfloat16 the
verification's batched arithmetic rounds differently from one-token steps, so near-ties can go the other way."""

from __future__ import annotations

import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.layers.linear import Linear, LinearGroup, column_major_pays
from kestrel.layers.moe import MoE
from helpers import assert_idle

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


def test_the_block_drafts_weights_are_in_the_memory_plan():
    plain = LLM(str(BUNDLED_MODEL), dtype="float32").engine.plan.weight_bytes
    engine = LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="DFLASH",
                 speculative_draft_model_path=str(DRAFT)).engine
    draft = sum(t.numel() * t.element_size() for t in engine.drafter.draft_model.state_dict().values())
    assert draft > 0 and engine.plan.weight_bytes == plain + draft


def test_dflash_needs_a_draft_model_path():
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineArgs(model=str(BUNDLED_MODEL), speculative_algorithm="DFLASH")
