"""Speculative decoding (NGRAM drafts) against plain decoding: greedy output token for token, the KDA state after
every verification equal to a plain computation over the accepted tokens, and a sampled output distribution
exactly the target's."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.engine import engine as engine_module
from kestrel.engine.cache.device_ops import apply_ops
from kestrel.engine.decode_graphs import DecodeGraphs
from kestrel.engine.sampling import SamplingRow, apply_penalties, warp_logits
from kestrel.engine.speculative import ngram
from kestrel.engine.speculative.verify import verify
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from helpers import assert_idle, write_draft

VOCAB, PAGE = 320, 4


def repetitive(seed: int, length: int) -> list[int]:
    """A prompt that repeats a short random phrase, so n-gram drafts exist (and the model often follows them)."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
    return (phrase * length)[:length]


PROMPTS = [repetitive(1, 30), repetitive(6, 9), repetitive(3, 41), repetitive(4, 17)]
"""Their greedy continuations (40 tokens, both random test models) have no near-tie: the top two logits differ by
at least 2e-3 everywhere, so rounding differences between batch shapes cannot flip a token (seed 2 had a tie)."""


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def answers(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(str(model_dir), page_size=PAGE)


def spec_llm(folder, **kw) -> LLM:
    return LLM(str(folder), page_size=PAGE, **{"speculative_algorithm": "NGRAM", **kw})


@pytest.fixture
def oracle(monkeypatch, plain):
    """Drafts from the plain greedy continuation with every fifth token wrong, so that steps accept all, some
    and none of their drafts (a random model rarely follows n-gram drafts)."""
    continuations = dict(zip(map(tuple, PROMPTS), answers(plain, PROMPTS, greedy(40))))

    def propose(tokens: list[int], count: int) -> list[int]:
        for prompt, continuation in continuations.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                at = len(tokens) - len(prompt)
                return [t if (at + i) % 5 != 4 else (t + 1) % VOCAB
                        for i, t in enumerate(continuation[at:at + count])]
        return []
    monkeypatch.setattr(ngram, "propose", propose)


def test_ngram_proposes_what_followed_the_latest_match():
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3], 5) == [9, 1, 2, 3]       # up to the end
    assert ngram.propose([4, 5, 6], 3) == [] and ngram.propose([4, 4], 0) == []


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_plain_greedy(model_dir, plain, oracle, k):
    llm = spec_llm(model_dir, speculative_num_draft_tokens=k)
    assert answers(llm, PROMPTS, greedy()) == answers(plain, PROMPTS, greedy())
    stats = llm.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens            # drafts both accepted and rejected
    assert stats.accepted_histogram[-1] > 0 and sum(stats.accepted_histogram[:-1]) > 0
    assert_idle(llm.engine.scheduler)


def static_steps(monkeypatch) -> dict:
    """LLM arguments under which decode steps and verifications of equal drafts run in the padded static step that
    --enable-torch-compile compiles (here run eagerly: tests/engine/test_decode_graphs.py traces it)."""
    monkeypatch.setattr(engine_module, "DecodeGraphs",
                        lambda *args, **kw: DecodeGraphs(*args, **{**kw, "compile": None}))
    return {"enable_torch_compile": True, "torch_compile_max_bs": 4}


def test_verifications_in_the_static_step_keep_plain_greedy(model_dir, plain, oracle, monkeypatch):
    """Plain greedy's tokens, with drafts both accepted and rejected, when the static step verifies."""
    llm = spec_llm(model_dir, speculative_num_draft_tokens=3, **static_steps(monkeypatch))
    assert answers(llm, PROMPTS, greedy(20)) == answers(plain, PROMPTS, greedy(20))
    steps = llm.engine.runner.decode_graphs.steps
    assert {1, 4} <= {q for _, _, q in steps}            # decode steps and verifications of 3 drafts
    stats = llm.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert_idle(llm.engine.scheduler)


def test_ngram_drafts_pay_on_the_bundled_model():
    """In float32: in bfloat16 the verification's batched arithmetic rounds differently from one-token steps, so
    near-ties can go the other way (as they can between any two batch shapes)."""
    llm = LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="NGRAM")
    plain = LLM(str(BUNDLED_MODEL), dtype="float32")
    text = "the cat sat on the mat. the dog sat on the log. " * 3
    params = SamplingParams(temperature=0, max_tokens=32)
    assert llm.generate(text, params)[0].outputs[0].text == plain.generate(text, params)[0].outputs[0].text
    assert llm.engine.spec_stats.acceptance_length > 1.5


def test_greedy_speculation_equals_plain_on_kimi_linear(kimi_linear_dir, monkeypatch):
    expected = answers(LLM(str(kimi_linear_dir), page_size=PAGE), PROMPTS, greedy())
    table = dict(zip(map(tuple, PROMPTS), expected))
    monkeypatch.setattr(ngram, "propose", lambda tokens, count: next(
        (c[len(tokens) - len(p):][:count] for p, c in table.items() if tuple(tokens[:len(p)]) == p), []))
    llm = spec_llm(kimi_linear_dir)
    assert answers(llm, PROMPTS, greedy()) == expected and llm.engine.spec_stats.accepted_tokens > 0


def test_the_state_after_every_verification_is_the_plain_state_of_the_accepted_tokens(model_dir, oracle):
    llm = spec_llm(model_dir, disable_radix_cache=True)
    engine, model = llm.engine, llm.engine.model
    engine.add_request("r", PROMPTS[0], greedy(20))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        apply_ops(engine.cache, engine.runner.ops.take())          # the committed states, as the next step sees
        request = engine.requests.get("r")
        if request is None or request.sequences[0].num_computed <= len(PROMPTS[0]):
            continue
        seq = request.sequences[0]
        tokens = seq.tokens(0, seq.num_computed)
        cache = HybridCache.allocate(model.config, 1, -(-len(tokens) // PAGE), PAGE, torch.float32)
        batch = ForwardBatch.build([len(tokens)], [0], [0], [list(range(cache.mla[0].latent.values.shape[0]
                                                                         // PAGE))], PAGE)
        with torch.inference_mode():
            model(torch.tensor(tokens), batch, cache)
        for mine, reference in zip(engine.cache.kda, cache.kda):
            torch.testing.assert_close(mine.recurrent[seq.slot], reference.recurrent[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine.conv[seq.slot], reference.conv[0], rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked >= 3 and engine.spec_stats.accepted_tokens > 0


def test_stops_and_max_tokens_inside_a_verified_block(model_dir, plain, oracle):
    base = answers(plain, PROMPTS, greedy(20))
    stop_token = base[0][5]                               # emitted mid-output by the first prompt
    for params in (greedy(20, stop_token_ids=[stop_token]), greedy(7), greedy(1)):
        llm = spec_llm(model_dir)
        assert answers(llm, PROMPTS, params) == answers(plain, PROMPTS, params)
        assert_idle(llm.engine.scheduler)


def test_logprobs_of_the_emitted_tokens(model_dir, plain, oracle):
    params = greedy(10, logprobs=2)
    expected = plain.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0]
    got = spec_llm(model_dir).generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    for a, b in zip(expected.logprobs, got.logprobs):
        assert a.keys() == b.keys()
        assert all(b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) and b[t].rank == a[t].rank for t in a)


def test_preemption_n_and_the_prefix_cache_with_speculation(model_dir, plain, oracle):
    expected = answers(plain, PROMPTS, greedy(24))
    tight = spec_llm(model_dir, max_total_tokens=96, mamba_scheduler_strategy="extra_buffer",
                     mamba_track_interval=4)
    assert answers(tight, PROMPTS, greedy(24)) == expected and tight.engine.scheduler.num_preemptions > 0
    assert answers(tight, PROMPTS, greedy(24)) == expected              # again, from the prefix cache
    assert tight.engine.scheduler.prefix_cache.stats.hits > 0
    assert_idle(tight.engine.scheduler)
    forked = spec_llm(model_dir).generate({"prompt_token_ids": PROMPTS[2]}, greedy(12, n=3))[0]
    assert [c.token_ids for c in forked.outputs] == [expected[2][:12]] * 3


def test_an_abort_between_verifications_frees_everything_and_later_requests_decode_as_alone(model_dir, plain,
                                                                                             oracle):
    """A request aborted between verifications: its memory is free at once, and later requests, one with its prompt
    (from the prefix cache) and one another, decode (and speculate) as each does alone on a plain engine."""
    llm = spec_llm(model_dir)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy(30))
    for _ in range(4):
        engine.step()
    verified = engine.spec_stats.verifications
    assert verified > 0
    held = sum(s.token_states.recurrent.nbytes + s.token_states.conv.nbytes for s in engine.cache.kda)
    assert 0 < held <= engine.plan.verify_bytes            # the per-token states fit what the plan reserved
    engine.abort_request("a")
    assert_idle(engine.scheduler)
    later = [PROMPTS[0], PROMPTS[2]]
    assert answers(llm, later, greedy(20)) == [answers(plain, [p], greedy(20))[0] for p in later]
    assert engine.scheduler.prefix_cache.stats.hits > 0 and engine.spec_stats.verifications > verified
    assert_idle(engine.scheduler)


def test_the_acceptance_rule_keeps_the_target_distribution():
    """Every emitted token, whatever the draft, has the distribution plain sampling gives it (sampled 4,000
    times with a seeded generator; the bound is 6 standard deviations)."""
    gen = torch.Generator().manual_seed(0)
    vocab, draws = 6, 4_000
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, max_tokens=8)
    prompt = [0, 1]

    def target(i: int, history: list[int]) -> torch.Tensor:
        row = SamplingRow(params, prompt, history, None)
        return warp_logits(apply_penalties(logits[i:i + 1].clone(), [row]), [params]).softmax(-1)[0]

    for draft in ([2, 3], [4, 4]):
        counts, second = torch.zeros(vocab), torch.zeros(vocab)
        for _ in range(draws):
            out = verify(logits, draft, SamplingRow(params, prompt, [], gen))
            counts[out[0]] += 1
            if out[0] == draft[0] and len(out) > 1:
                second[out[1]] += 1
        assert second.sum() > 1000
        for observed, n, expected in ((counts, draws, target(0, [])), (second, second.sum(), target(1, [draft[0]]))):
            observed = observed / n
            bound = 6 * (expected * (1 - expected) / n).sqrt() + 1e-3
            assert ((observed - expected).abs() <= bound).all(), (observed, expected)


@pytest.mark.parametrize("case", ["plain", "min_tokens pending", "repetition penalty"])
def test_greedy_acceptance_is_the_longest_run_of_drafts_equal_to_the_argmax(case):
    """Greedy verification emits the drafts while each is the argmax of the target's (masked, penalised) logits at
    its position, then the argmax where one is not; the one-argmax path (nothing position-dependent) and the
    position-by-position path agree with that definition, computed here step by step."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 8, generator=gen)
    logits[:, 7] += 3.0                                  # EOS (id 7) would win wherever it is not masked
    kw = {"min_tokens": 3} if case == "min_tokens pending" else {}
    if case == "repetition penalty":
        kw["repetition_penalty"] = 4.0
    params = SamplingParams(temperature=0, max_tokens=8, **kw)

    def argmax_after(history: list[int], i: int) -> int:
        row = logits[i:i + 1].clone()
        if len(history) < params.min_tokens:
            row[0, 7] = float("-inf")
        return int(apply_penalties(row, [SamplingRow(params, [7], history, None, (7,))]).argmax())

    for draft in ([], [argmax_after([], 0)], [argmax_after([], 0), 0, 1, 2], [3, 2, 1, 0]):
        expected: list[int] = []
        for i in range(len(draft) + 1):
            expected.append(argmax_after(expected, i))
            if i == len(draft) or expected[-1] != draft[i]:
                break
        assert verify(logits, draft, SamplingRow(params, [7], [], None, (7,))) == expected


# NEXTN: the model's MTP layer drafts.

def test_mtp_greedy_speculation_equals_plain_greedy(model_dir, plain):
    llm = spec_llm(model_dir, speculative_algorithm="NEXTN", speculative_num_draft_tokens=3)
    assert answers(llm, PROMPTS, greedy(20)) == answers(plain, PROMPTS, greedy(20))
    assert llm.engine.spec_stats.verifications > 10
    assert llm.engine.plan.mtp_layers == 1
    tight = spec_llm(model_dir, speculative_algorithm="NEXTN", max_total_tokens=96)
    assert answers(tight, PROMPTS, greedy(24)) == answers(plain, PROMPTS, greedy(24))
    assert tight.engine.scheduler.num_preemptions > 0
    assert_idle(tight.engine.scheduler)


@pytest.mark.parametrize("static", [False, True])
def test_mtp_drafts_are_the_mtp_layer_over_the_whole_sequence(model_dir, monkeypatch, static):
    """After every step, the first draft is the MTP layer's prediction at the last computed position, computed
    plainly over the whole sequence (the incremental MTP cache, written over every prompt chunk and rewritten over
    rejected positions, is exact); also when the static step decodes and verifies (it hands over its hidden
    states)."""
    llm = spec_llm(model_dir, speculative_algorithm="NEXTN", speculative_num_draft_tokens=2, disable_radix_cache=True,
                   chunked_prefill_size=8, **(static_steps(monkeypatch) if static else {}))
    engine, model = llm.engine, llm.engine.model
    engine.add_request("r", PROMPTS[2], greedy(24))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.requests.get("r")
        seq = request.sequences[0] if request else None
        if seq is None or not seq.draft:
            continue
        tokens = seq.tokens(0, seq.num_tokens)
        with torch.inference_mode():
            batch = ForwardBatch.build([len(tokens) - 1])
            hidden = model(torch.tensor(tokens[:-1]), batch)
            logits = model.mtp_logits(hidden, torch.tensor(tokens[1:]), batch)[-1]
        top2 = logits.topk(2).values
        if top2[0] - top2[1] > 1e-3:                          # not a near-tie that rounding may flip
            assert seq.draft[0] == int(logits.argmax())
            checked += 1
    assert checked >= 5
    if static:
        assert {1, 3} <= {q for _, _, q in engine.runner.decode_graphs.steps}


def test_mtp_drafts_pay_on_the_bundled_model():
    params = SamplingParams(temperature=0, max_tokens=40)
    text = "Once upon a time, there was a little girl who"
    llm = LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="NEXTN", speculative_num_draft_tokens=2)
    plain = LLM(str(BUNDLED_MODEL), dtype="float32")
    assert llm.generate(text, params)[0].outputs[0].text == plain.generate(text, params)[0].outputs[0].text
    assert llm.engine.spec_stats.acceptance_length > 1.3


def test_draft_tokens_count_against_the_step_budget(model_dir, plain, oracle, monkeypatch):
    llm = spec_llm(model_dir, max_prefill_tokens=7)
    scheduler, totals = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def counted(*limit):
        chunks = schedule(*limit)
        totals.append(sum(c.length for c in chunks))
        return chunks
    monkeypatch.setattr(scheduler, "schedule", counted)
    assert answers(llm, PROMPTS, greedy()) == answers(plain, PROMPTS, greedy())
    assert max(totals) == 7 and llm.engine.spec_stats.accepted_tokens > 0


def test_speculation_pauses_while_more_sequences_run_than_the_limit(model_dir, plain, oracle, monkeypatch):
    """--speculative-disable-by-batch-size 2: no step verifies drafts while more than two sequences run (the four
    prompts with max_tokens 16, 8, 24 and 12 finish in turn), and drafting resumes once two or fewer are left."""
    llm = spec_llm(model_dir, speculative_disable_by_batch_size=2)
    running, verified = [], []
    schedule = llm.engine.scheduler.schedule

    def recorded(*limit):
        chunks = schedule(*limit)
        running.append(len(llm.engine.scheduler.running))
        verified.append(any(c.draft for c in chunks))
        return chunks
    monkeypatch.setattr(llm.engine.scheduler, "schedule", recorded)
    params = [greedy(n) for n in (16, 8, 24, 12)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [answers(plain, [p], q)[0] for p, q in zip(PROMPTS, params)]
    assert not any(v for v, n in zip(verified, running) if n > 2)
    assert any(verified) and llm.engine.spec_stats.accepted_tokens > 0


def test_a_failed_draft_fails_its_requests_and_the_engine_serves_on(model_dir, plain, monkeypatch):
    """The MTP drafter raising once: the requests it drafted for end with an error naming it (nothing left
    behind), and the next requests decode as plain greedy decoding does."""
    llm = spec_llm(model_dir, speculative_algorithm="NEXTN", speculative_num_draft_tokens=2)
    draft, calls = llm.engine.drafter.draft, []

    def fails_once(inputs, kept):
        calls.append(len(inputs))
        if len(calls) == 1:
            raise RuntimeError("draft boom")
        return draft(inputs, kept)

    monkeypatch.setattr(llm.engine.drafter, "draft", fails_once)
    (failed,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(8))
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].stop_reason == "drafting failed: RuntimeError: draft boom"
    assert_idle(llm.engine.scheduler)
    assert answers(llm, PROMPTS, greedy(8)) == answers(plain, PROMPTS, greedy(8))
    assert len(calls) > 2 and llm.engine.spec_stats.verifications > 0             # drafting went on


@pytest.mark.parametrize("algorithm", ["NGRAM", "NEXTN", "DFLASH", "DFLASH (published layout)"])
def test_every_drafter_runs_in_bfloat16_with_an_fp8_cache(algorithm, tmp_path):
    """The bundled model in bfloat16 (how real checkpoints serve) with FP8 latents: every request completes with
    its tokens and drafts are verified. (Equality with plain decoding is proven in float32: bfloat16 verifications
    round near-ties differently.) bfloat16 verifications once failed on every step: the KDA closed form returned
    float32 outputs."""
    draft = {"DFLASH": str(BUNDLED_MODEL.parent / "k3.1-tiny-dflash"), "DFLASH (published layout)": str(tmp_path)}
    if algorithm == "DFLASH (published layout)":
        write_draft(tmp_path)
    llm = LLM(str(BUNDLED_MODEL), dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
              speculative_algorithm=algorithm.split()[0], speculative_num_draft_tokens=3,
              speculative_draft_model_path=draft.get(algorithm))
    prompts = ["KING.\nWhat news from France?\n\nMESSENGER.\n", "To be, or not to be"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.spec_stats.verifications > 0
    assert_idle(llm.engine.scheduler)
