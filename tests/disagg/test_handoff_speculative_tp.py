"""PD handoffs between a one-process plain instance and a two-rank (TP2, one spawned rank process, gloo) NEXTN or
DFLASH instance, both ways, and from the two-rank instance to itself: the decode side answers as one plain
instance (greedy). A two-rank decode instance handed no draft context computes the prompt itself; a two-rank
prefill instance's handoff carries its draft context gathered from the ranks, which a plain decode instance leaves
out and a two-rank one of the same drafter shards to its ranks and loads."""

from __future__ import annotations

import multiprocessing

import pytest

from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.engine import LLMEngine
from kestrel.engine.handoff import Handoff, split_context
from kestrel.engine.sampling import SamplingParams
from helpers import assert_idle, write_draft

PROMPTS = [list(range(5, 5 + n)) for n in (3, 21)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ARGS = dict(model=str(BUNDLED_MODEL), dtype="float32", chunked_prefill_size=16, max_total_tokens=4096,
            max_mamba_cache_size=8, speculative_num_draft_tokens=3)


def finals(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return done


def hand_over(prefill: LLMEngine, decode: LLMEngine) -> tuple[list[Handoff], list[list[int]]]:
    """Each prompt's handoff from prefill, and decode's greedy tokens continuing it."""
    handed: list[Handoff] = []
    for i, ids in enumerate(PROMPTS):
        prefill.add_request(f"p{i}", ids, GREEDY, handoff=handed.append)
    finals(prefill)
    for i, handoff in enumerate(handed):
        decode.add_prefilled_request(f"d{i}", handoff, GREEDY)
    tokens = finals(decode)
    return handed, [tokens[f"d{i}"] for i in range(len(handed))]


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return LLMEngine(EngineArgs(**ARGS))


@pytest.mark.parametrize("algorithm", ["NEXTN", "DFLASH"])
def test_two_rank_speculative_and_one_process_plain_instances_hand_off_both_ways(plain, algorithm, tmp_path,
                                                                                  caplog):
    for i, ids in enumerate(PROMPTS):
        plain.add_request(f"u{i}", ids, GREEDY)
    unified = finals(plain)
    expected = [unified[f"u{i}"] for i in range(len(PROMPTS))]
    write_draft(tmp_path)
    speculative = LLMEngine(EngineArgs(**ARGS, tp_size=2, speculative_algorithm=algorithm,
                                       speculative_draft_model_path=str(tmp_path)))
    try:
        with caplog.at_level("INFO", logger="kestrel"):
            _, tokens = hand_over(plain, speculative)
            assert tokens == expected and caplog.text.count("computing its prompt here") == len(PROMPTS)
            assert speculative.spec_stats.verifications > 0
            handed, tokens = hand_over(speculative, plain)
            assert tokens == expected
            assert all(split_context(h.tensors)[1] for h in handed)
            caplog.clear()
            verified = speculative.spec_stats.verifications
            _, tokens = hand_over(speculative, speculative)
            assert tokens == expected and "computing its prompt here" not in caplog.text
            assert speculative.spec_stats.verifications > verified
        assert_idle(speculative.scheduler)
    finally:
        speculative.shutdown()
    assert_idle(plain.scheduler)
    assert not multiprocessing.active_children()
