"""PD disaggregation's engine hooks: a prefill engine hands a request's state over after its first token, a
decode engine continues from it, and the pair answers as one engine does."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.cache.device_ops import apply_ops
from kestrel.engine.cache.hicache import pages_to_entry, slot_to_entry
from kestrel.engine.engine import LLMEngine
from kestrel.engine.handoff import Handoff, split_context
from kestrel.engine.structured import StructuredOutputsParams
from helpers import assert_idle, write_draft

VOCAB, PAGE = 320, 4


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def prefill(engine: LLMEngine, request_id: str, ids: list[int], params: SamplingParams) -> Handoff:
    handed: list[Handoff] = []
    engine.add_request(request_id, ids, params, handoff=handed.append)
    output = run(engine)[request_id]
    assert len(handed) == 1 and output.outputs[0].token_ids == [handed[0].first_token]
    return handed[0]


@pytest.fixture(scope="module")
def engines(model_dir):
    args = dict(model=str(model_dir), page_size=PAGE, chunked_prefill_size=8)
    return LLMEngine(EngineArgs(**args)), LLMEngine(EngineArgs(**args))


def test_prefill_then_decode_equals_one_engine(engines, model_dir):
    prefiller, decoder = engines
    unified = LLM(str(model_dir), page_size=PAGE)
    prompts = [prompt(1, 3), prompt(2, 17), prompt(3, 30)]
    expected = [o.outputs[0].token_ids for o in unified.generate([{"prompt_token_ids": p} for p in prompts],
                                                                 greedy())]
    handoffs = [prefill(prefiller, f"p{i}", p, greedy()) for i, p in enumerate(prompts)]
    for i, handoff in enumerate(handoffs):
        decoder.add_prefilled_request(f"d{i}", handoff, greedy())
    finals = run(decoder)
    assert [finals[f"d{i}"].outputs[0].token_ids for i in range(3)] == expected
    assert_idle(prefiller.scheduler)
    assert_idle(decoder.scheduler)


def test_prompt_logprobs_computed_by_the_prefill_side_reach_the_decode_sides_output(engines, model_dir):
    """A chunked prompt's logprobs (every position's, top 2) travel with the handoff; the decode side's output
    carries them as one engine's does, and a handoff without them is refused for a request that asks."""
    prefiller, decoder = engines
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    ids = prompt(5, 19)
    one = LLM(str(model_dir), page_size=PAGE).generate({"prompt_token_ids": ids}, params)[0]
    handoff = prefill(prefiller, "pl", ids, params)
    assert len(handoff.prompt_logprobs) == len(ids) and handoff.prompt_logprobs[0] is None
    decoder.add_prefilled_request("pl", handoff, params)
    got = run(decoder)["pl"]
    assert got.outputs[0].token_ids == one.outputs[0].token_ids
    assert [None if e is None else sorted(e) for e in got.prompt_logprobs] == \
        [None if e is None else sorted(e) for e in one.prompt_logprobs]
    for mine, theirs in zip(got.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-5 for t in theirs)
    with pytest.raises(ValueError, match="asks for prompt logprobs, but the prefill instance sent none"):
        decoder.add_prefilled_request("none", prefill(prefiller, "np", ids, greedy(3)), params)


def test_the_decode_side_holds_exactly_what_the_prefill_side_sent(engines):
    prefiller, decoder = engines
    handoff = prefill(prefiller, "bits", prompt(4, 21), greedy())
    decoder.add_prefilled_request("bits", handoff, greedy())
    decoder.scheduler.schedule()                              # admitted: the load is journaled
    apply_ops(decoder.cache, decoder.runner.ops.take())
    seq = decoder.requests["bits"].sequences[0]
    received = {f"0.{k}": v for k, v in slot_to_entry(decoder.cache, seq.slot).items()}
    for p, page in enumerate(seq.pages[:handoff.num_pages], 1):
        received.update({f"{p}.{k}": v for k, v in pages_to_entry(decoder.cache, page).items()})
    assert received.keys() == handoff.tensors.keys()
    assert all(torch.equal(received[k], handoff.tensors[k]) for k in received)
    assert any(k.endswith("recurrent") and handoff.tensors[k].abs().sum() > 0 for k in received)
    decoder.abort_request("bits")
    assert_idle(decoder.scheduler)


def test_a_state_that_does_not_fit_is_refused(engines):
    prefiller, decoder = engines
    handoff = prefill(prefiller, "fit", prompt(5, 9), greedy())
    name = next(k for k in handoff.tensors if k.startswith("1."))
    bad = [Handoff(handoff.prompt_ids, handoff.first_token, handoff.tensors, handoff.num_pages + 1),
           Handoff(handoff.prompt_ids, handoff.first_token,
                   {**handoff.tensors, name: handoff.tensors[name][:-1]}, handoff.num_pages),
           Handoff(handoff.prompt_ids, VOCAB + 5, handoff.tensors, handoff.num_pages)]
    for h in bad:
        with pytest.raises(ValueError, match="does not fit this engine's caches"):
            decoder.add_prefilled_request("fit", h, greedy())
    with pytest.raises(ValueError, match="n=1"):
        prefiller.add_request("two", [5, 6], SamplingParams(n=2), handoff=print)
    assert not decoder.requests and not prefiller.requests


def test_a_first_token_that_ends_the_request_finishes_it_on_arrival(engines):
    prefiller, decoder = engines
    handoff = prefill(prefiller, "one", prompt(6, 7), greedy(1))
    decoder.add_prefilled_request("one", handoff, greedy(1))
    finals = run(decoder)
    assert finals["one"].outputs[0].token_ids == [handoff.first_token]
    assert finals["one"].outputs[0].finish_reason == "length"
    assert_idle(decoder.scheduler)


def test_json_mode_across_the_handoff(engines, model_dir):
    """The prefill side samples the first token under the grammar; the decode side compiles it again, advances it
    by that token and goes on: the pair answers as one engine does."""
    prefiller, decoder = engines
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json_object=True))
    ids = prompt(7, 15)
    expected = LLM(str(model_dir), page_size=PAGE).generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    handoff = prefill(prefiller, "json", ids, params)
    decoder.add_prefilled_request("json", handoff, params)
    got = run(decoder)["json"].outputs[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert_idle(decoder.scheduler)


def test_logprobs_across_the_handoff(engines, model_dir):
    """The first token's logprobs come from the prefill side, the rest from the decode side: together the same
    entries and cumulative logprob as one engine's."""
    prefiller, decoder = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    ids = prompt(8, 13)
    expected = LLM(str(model_dir), page_size=PAGE).generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    handoff = prefill(prefiller, "lp", ids, params)
    decoder.add_prefilled_request("lp", handoff, params)
    got = run(decoder)["lp"].outputs[0]
    assert got.token_ids == expected.token_ids
    for a, b in zip(expected.logprobs, got.logprobs, strict=True):
        assert a.keys() == b.keys() and all(b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) for t in a)
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)
    with pytest.raises(ValueError, match="sent none for its first token"):
        decoder.add_prefilled_request("lp2", prefill(prefiller, "plain", ids, greedy()), params)


def test_seeded_sampling_across_the_handoff(engines, model_dir):
    """A seeded request's generator travels with the handoff, so the decode side draws what one engine would."""
    prefiller, decoder = engines
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)
    ids = prompt(9, 11)
    expected = LLM(str(model_dir), page_size=PAGE).generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    handoff = prefill(prefiller, "seeded", ids, params)
    assert handoff.generator_state is not None
    decoder.add_prefilled_request("seeded", handoff, params)
    assert run(decoder)["seeded"].outputs[0].token_ids == expected.token_ids


SPECULATIVE = {"plain": {}, "NEXTN": {"speculative_algorithm": "NEXTN"}, "DFLASH": {"speculative_algorithm": "DFLASH"}}
"""Instances of the bundled model (float32) that hand off to each other; DFLASH drafts with a published-layout
DFlash draft, whose context rows are paged beside the target's latents (NEXTN's MTP layer has its own latents)."""


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    draft = tmp_path_factory.mktemp("dflash-draft")
    write_draft(draft)
    common = dict(model=str(BUNDLED_MODEL), dtype="float32", page_size=PAGE, chunked_prefill_size=8,
                  speculative_num_draft_tokens=3, speculative_draft_model_path=str(draft))
    return {name: LLMEngine(EngineArgs(**common, **kw)) for name, kw in SPECULATIVE.items()}


@pytest.mark.parametrize("sender, receiver", [("plain", "NEXTN"), ("NEXTN", "plain"), ("plain", "DFLASH"),
                                              ("DFLASH", "plain"), ("NEXTN", "NEXTN"), ("DFLASH", "DFLASH"),
                                              ("NEXTN", "DFLASH")])
def test_plain_and_speculative_instances_hand_off_to_each_other(instances, sender, receiver, caplog):
    """The decode side answers as one plain instance (speculative greedy == plain greedy): the draft context
    (MTP latents, DFlash rows) is no part of the contract; it is loaded where both sides have the same, and the
    decode side computes the prompt itself where only it drafts from one."""
    plain, prefiller, decoder = instances["plain"], instances[sender], instances[receiver]
    tokenizer = plain.tokenizer
    prompts = [tokenizer.encode(text) for text in ("KING.\nWhat news from France?\n\nMESSENGER.\n", "To be, or")]
    for i, ids in enumerate(prompts):
        plain.add_request(f"u{i}", ids, greedy(12))
    unified = run(plain)
    expected = {i: unified[f"u{i}"].outputs[0].token_ids for i in range(len(prompts))}
    handoffs = [prefill(prefiller, f"p{i}", ids, greedy(12)) for i, ids in enumerate(prompts)]
    context = {"NEXTN": ".mtp.", "DFLASH": ".dflash."}.get(sender)
    assert all(any(context in k for k in h.tensors) if context else not split_context(h.tensors)[1]
               for h in handoffs)
    verified = decoder.spec_stats.verifications
    with caplog.at_level("INFO", logger="kestrel"):
        for i, handoff in enumerate(handoffs):
            decoder.add_prefilled_request(f"d{i}", handoff, greedy(12))
        finals = run(decoder)
    assert {i: finals[f"d{i}"].outputs[0].token_ids for i in range(len(prompts))} == expected
    assert ("computing its prompt here" in caplog.text) == (receiver not in ("plain", sender))
    assert (decoder.spec_stats.verifications > verified) == (receiver != "plain")
    for engine in (prefiller, decoder):
        assert_idle(engine.scheduler)


def test_a_nextn_handoff_carries_the_mtp_rows_of_every_prompt_position(instances):
    """The MTP layer writes a position's row once the token after it is known: the rows of the prompt's last chunk
    after the first token is sampled. A handoff holds every prompt position's row, as a prefill of the prompt and
    that token writes them."""
    engine = instances["NEXTN"]
    ids = engine.tokenizer.encode("To be, or not to be, that is")
    short = prefill(engine, "short", ids, greedy(1))
    long = prefill(engine, "long", ids + [short.first_token], greedy(1))
    rows = [(short.tensors[f"{p // PAGE + 1}.mtp.0.latent"][p % PAGE],
             long.tensors[f"{p // PAGE + 1}.mtp.0.latent"][p % PAGE]) for p in range(len(ids))]
    assert len(ids) > 8 and all(mine.abs().sum() > 0 and torch.allclose(mine, theirs, atol=1e-5)
                                for mine, theirs in rows)
