"""Deterministic inference: with --enable-deterministic-inference a request's tokens and logprobs are bit for bit
those of the same request run alone, cold and in one prefill chunk, however the engine batched it (seeded random
workloads: concurrency, arrival order, chunked-prefill splits, page boundaries, prefix-cache hits, n > 1,
preemption), with speculative decoding on or off, and teacher forcing reports exactly what sampling reported."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.engine import LLMEngine
from kestrel.engine.outputs import RequestOutput
from helpers import VOCAB, write_model

PAGE = 4


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3-tiny")
    write_model(folder, "k3-tiny")
    return folder


@pytest.fixture(params=["k3.1", "k3", "kimi-linear", "bundled"])
def family_dir(request, model_dir, k3_dir, kimi_linear_dir):
    """Random models of the family: K3.1 (sparse MLA, the indexer keeps 4 keys), K3 (dense MLA), Kimi-Linear; and
    the bundled k3.1-tiny (trained; its indexer keeps 64 keys)."""
    return {"k3.1": model_dir, "k3": k3_dir, "kimi-linear": kimi_linear_dir, "bundled": BUNDLED_MODEL}[request.param]


def engine(folder, dtype: str = "float32", **overrides) -> LLMEngine:
    args = dict(model=str(folder), dtype=dtype, page_size=PAGE, enable_deterministic_inference=True)
    return LLMEngine(EngineArgs(**(args | overrides)))


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    arrival: int                    # the step at which the workload adds it


def workload(seed: int, count: int = 10) -> list[Job]:
    """Prompts of lengths around the page size and the chunk sizes below, greedy or seeded sampling (n = 2 for
    some), arriving over the first steps; some are a follow-up of an earlier one (its prompt and more), arriving
    after it has finished, so that they hit the prefix cache."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    for _ in range(count):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 3, 4, 5, 7, 8, 9, 12, 16, 17]))]
        sampled = rng.random() < 0.5
        params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=rng.randrange(1000) if sampled else None,
                                n=2 if sampled and rng.random() < 0.5 else 1, max_tokens=rng.randrange(1, 10),
                                ignore_eos=True, logprobs=2)
        if jobs and rng.random() < 0.4:
            earlier = rng.choice(jobs)
            jobs.append(Job(earlier.prompt + own, params, earlier.arrival + 20))
        else:
            jobs.append(Job(own, params, rng.randrange(6)))
    return jobs


def run(eng: LLMEngine, jobs: list[Job]) -> list[RequestOutput]:
    """Every job through eng, each added at its arrival step; their final outputs in job order."""
    done: dict[str, RequestOutput] = {}
    step = 0
    while len(done) < len(jobs):
        for i, job in enumerate(jobs):
            if job.arrival == step:
                eng.add_request(str(i), job.prompt, job.params)
        for output in eng.step():
            if output.finished:
                done[output.request_id] = output
        step += 1
    return [done[str(i)] for i in range(len(jobs))]


def alone(folder, jobs: list[Job], dtype: str = "float32") -> list[RequestOutput]:
    """Each job run by itself, cold (no prefix cache), its prompt in one chunk."""
    eng = engine(folder, dtype, disable_radix_cache=True)
    return [run(eng, [Job(job.prompt, job.params, 0)])[0] for job in jobs]


def assert_same(got: RequestOutput, expected: RequestOutput) -> None:
    assert len(got.outputs) == len(expected.outputs)
    for a, b in zip(got.outputs, expected.outputs):
        assert a.token_ids == b.token_ids
        assert [{t: p.logprob for t, p in step.items()} for step in a.logprobs] == \
               [{t: p.logprob for t, p in step.items()} for step in b.logprobs]        # bit for bit


@pytest.mark.parametrize("seed, dtype", [(0, "float32"), (1, "bfloat16")])
def test_batched_equals_alone(family_dir, seed, dtype):
    jobs = workload(seed)
    eng = engine(family_dir, dtype, chunked_prefill_size=6, max_prefill_tokens=12, max_running_requests=5)
    batched = run(eng, jobs)
    assert any(out.num_cached_tokens for out in batched)                # the prefix cache took part
    for got, expected in zip(batched, alone(family_dir, jobs, dtype)):
        assert_same(got, expected)


def test_preemption_equals_alone(model_dir):
    """A KV pool too small for every request at once: the scheduler preempts and recomputes, to the same bits."""
    jobs = [Job(job.prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1), 0)
            for job in workload(2, count=6)]
    eng = engine(model_dir, max_total_tokens=48, disable_radix_cache=True)
    batched = run(eng, jobs)
    assert eng.scheduler.num_preemptions > 0
    for got, expected in zip(batched, alone(model_dir, jobs)):
        assert_same(got, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_teacher_forcing_equals_sampling(family_dir, dtype):
    """echo + logprobs: the prompt logprobs of prompt + generated text are the logprobs sampling reported."""
    llm = LLM(str(family_dir), dtype=dtype, page_size=PAGE, enable_deterministic_inference=True)
    jobs = workload(3, count=4)
    for job in jobs:
        params = SamplingParams(temperature=job.params.temperature, seed=job.params.seed, max_tokens=8,
                                ignore_eos=True, logprobs=0)
        out = llm.generate({"prompt_token_ids": job.prompt}, params)[0].outputs[0]
        forced = llm.generate({"prompt_token_ids": job.prompt + out.token_ids},
                              SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
        sampled = [step[token].logprob for step, token in zip(out.logprobs, out.token_ids)]
        assert [forced[len(job.prompt) + i][t].logprob for i, t in enumerate(out.token_ids)] == sampled


def test_speculative_greedy_equals_plain(model_dir):
    """NEXTN drafts, verified a few tokens per sequence at once: the same tokens and logprobs as plain decoding."""
    jobs = [Job(job.prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2), job.arrival)
            for job in workload(4, count=6)]
    speculative = run(engine(model_dir, speculative_algorithm="NEXTN", speculative_num_draft_tokens=3), jobs)
    for got, expected in zip(speculative, alone(model_dir, jobs)):
        assert_same(got, expected)


def test_dflash_in_bfloat16_equals_plain():
    """The bundled model's block draft (DFLASH) in bfloat16, where without the mode a verification's batched
    arithmetic rounds differently from one-token steps (tests/engine/test_spec_block.py keeps float32 for that):
    the same tokens and logprobs as plain decoding alone."""
    draft = BUNDLED_MODEL.parent / "k3.1-tiny-dflash"
    texts = ["KING.\nWhat news from France?\n\nMESSENGER.\n", "ROMEO.\nBut soft,", "To be, or not to be"]
    speculative = engine(BUNDLED_MODEL, "bfloat16", speculative_algorithm="DFLASH", speculative_num_draft_tokens=4,
                         speculative_draft_model_path=str(draft))
    jobs = [Job(speculative.tokenizer.encode(text), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                   logprobs=1), 0) for text in texts]
    for got, expected in zip(run(speculative, jobs), alone(BUNDLED_MODEL, jobs, "bfloat16")):
        assert_same(got, expected)
    assert speculative.spec_stats.accepted_tokens > 0


def test_pd_handoff_equals_alone(model_dir):
    """A prefill instance (prompts in chunks of 6) hands each request to a decode instance, which runs them all at
    once: the same tokens and logprobs as each alone in one instance."""
    jobs = [Job(job.prompt, SamplingParams(temperature=job.params.temperature, seed=job.params.seed, max_tokens=8,
                                           ignore_eos=True, logprobs=2), 0) for job in workload(5, count=5)]
    prefiller, decoder = engine(model_dir, chunked_prefill_size=6), engine(model_dir)
    for i, job in enumerate(jobs):
        handed = []
        prefiller.add_request(f"p{i}", job.prompt, job.params, handoff=handed.append)
        while prefiller.has_unfinished_requests():
            prefiller.step()
        decoder.add_prefilled_request(str(i), handed[0], job.params)
    done = {}
    while decoder.has_unfinished_requests():
        done |= {output.request_id: output for output in decoder.step() if output.finished}
    for i, expected in enumerate(alone(model_dir, jobs)):
        assert_same(done[str(i)], expected)


@pytest.mark.parametrize("flags, named", [
    ({"enable_torch_compile": True}, "--enable-torch-compile"),
    ({"enable_background_compile": True}, "--enable-background-compile"),
    ({"dp_size": 2}, "--dp-size 2"),
    ({"moe_mxfp8_activations": True}, "--moe-mxfp8-activations"),
])
def test_refuses_what_it_cannot_hold(model_dir, flags, named):
    with pytest.raises(ValueError, match="runs on the CPU, eagerly, with tensor and pipeline parallelism only") \
            as refused:
        engine(model_dir, **flags)
    assert named in str(refused.value)


def test_paced_prefill_equals_alone(model_dir):
    """While sequences decode, the pacer's limit (here 3 prompt tokens a step) spreads the prompts arriving over
    more steps; each forward holds either decode tokens or prompt chunks, never both; the outputs are those of
    every request run alone."""
    jobs = [Job(job.prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1), job.arrival)
            for job in workload(5, count=6)]
    eng = engine(model_dir)
    eng.pacer.limit = lambda decoding: 3
    steps, forwards = [], []
    schedule, run_forward = eng.scheduler.schedule, eng.runner.run

    def scheduling(*args):
        chunks = schedule(*args)
        steps.append([(c.decodes, c.length) for c in chunks])
        return chunks

    def recording(chunks, *args):
        forwards.append({c.decodes for c in chunks})
        return run_forward(chunks, *args)
    eng.scheduler.schedule, eng.runner.run = scheduling, recording
    for got, expected in zip(run(eng, jobs), alone(model_dir, jobs)):
        assert_same(got, expected)
    mixed = [step for step in steps if {decodes for decodes, _ in step} == {True, False}]
    assert mixed and all(sum(length for decodes, length in step if not decodes) <= 3 for step in mixed)
    assert all(len(kinds) == 1 for kinds in forwards) and len(forwards) == sum(map(bool, steps)) + len(mixed)
