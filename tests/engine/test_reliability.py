"""Nothing hangs and one bad request never takes others down: refusals of what can never run, faults injected in
the model, the sampler and the detokenizer, non-finite logits, allocation failures, and seeded sampling's devices."""

from __future__ import annotations

import pytest
import torch

import kestrel.engine.engine as engine_module
from kestrel import LLM, SamplingParams
from kestrel.engine.args import EngineArgs
from kestrel.engine.cache.planner import MemoryPlanError
from kestrel.engine.engine import LLMEngine
from kestrel.layers.cache import HybridCache
from test_engine import assert_pools_free, greedy, tokens


def run(engine: LLMEngine) -> dict:
    """Step until every request is done; {request_id: final output}."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("limits, needed", [({"max_running_requests": 2}, "at most 2"),
                                            ({"max_mamba_cache_size": 3}, "at most 3"),
                                            ({"max_total_tokens": 8, "page_size": 4}, "KV pool has 2")])
def test_n_past_the_engines_limits_is_refused_at_once(model_dir, limits, needed):
    llm = LLM(str(model_dir), **limits)
    with pytest.raises(ValueError, match=needed):
        llm.generate({"prompt_token_ids": [5, 6]}, greedy(4, n=4))
    assert_pools_free(llm)
    assert len(tokens(llm.generate({"prompt_token_ids": [5, 6]}, greedy(2, n=2)))) == 1


def test_prompts_past_max_prompt_tokens_are_refused(model_dir):
    llm = LLM(str(model_dir), max_prompt_tokens=8)
    with pytest.raises(ValueError, match="9 tokens, more than this server's limit of 8"):
        llm.generate({"prompt_token_ids": [5] * 9})
    assert len(tokens(llm.generate({"prompt_token_ids": [5] * 8}, greedy(2)))[0]) == 2


def test_a_schedule_that_can_never_run_raises_instead_of_looping(model_dir, monkeypatch):
    llm = LLM(str(model_dir))
    monkeypatch.setattr(llm.engine.scheduler, "schedule", lambda *limit: [])
    with pytest.raises(RuntimeError, match="cannot schedule"):
        llm.generate({"prompt_token_ids": [5, 6]}, greedy(2))


def test_seeded_generators_are_made_on_the_logits_device(model_dir, monkeypatch):
    engine = LLM(str(model_dir)).engine
    devices = []
    monkeypatch.setattr(engine_module, "new_generator", lambda seed, device="cpu": devices.append(device))
    engine.runner.device = torch.device("meta")          # stands for a GPU: where the logits will be
    engine.add_request("r", [4, 5, 6], SamplingParams(temperature=1.0, seed=5))
    assert devices == [torch.device("meta")]


def test_seeds_of_later_sequences_wrap_at_2_to_the_64(model_dir):
    llm = LLM(str(model_dir))
    sampled = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}
    wrapped = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(seed=2**64 - 1, n=2, **sampled))
    zero = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(seed=0, **sampled))
    assert wrapped[0].outputs[1].token_ids == zero[0].outputs[0].token_ids      # torch reads seeds modulo 2**64


def test_a_failing_forward_fails_the_requests_in_its_batch_only(model_dir, monkeypatch):
    llm = LLM(str(model_dir), max_running_requests=1)
    engine = llm.engine
    alone = tokens(llm.generate({"prompt_token_ids": [7, 8, 9]}, greedy(6)))[0]
    real_run, steps = engine.runner.run, []

    def run_failing_once(chunks, all_rows, verify=False):
        steps.append([c.seq.request.request_id for c in chunks])
        if len(steps) == 3:
            raise RuntimeError("injected model fault")
        return real_run(chunks, all_rows, verify)
    monkeypatch.setattr(engine.runner, "run", run_failing_once)
    engine.add_request("victim", [5, 6], greedy(6))
    engine.add_request("bystander", [7, 8, 9], greedy(6))
    done = run(engine)
    assert steps[2] == ["victim"]
    victim = done["victim"].outputs[0]
    assert victim.finish_reason == "error" and "injected model fault" in victim.stop_reason
    assert done["bystander"].outputs[0].token_ids == alone
    assert_pools_free(llm)


def test_a_sampler_fault_or_nan_logits_fail_only_their_request(model_dir, monkeypatch):
    llm = LLM(str(model_dir))
    engine = llm.engine
    prompts = {"sampler": [5, 6], "nan": [6, 7], "ok": [7, 8, 9]}
    alone = tokens(llm.generate({"prompt_token_ids": prompts["ok"]}, greedy(6)))[0]
    real_sample, real_run = engine_module.sample, engine.runner.run

    def sample_failing_on_seed_13(logits, rows):
        if any(row.params.seed == 13 for row in rows):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, rows)

    def run_with_nan(chunks, all_rows, verify=False):
        logits = real_run(chunks, all_rows, verify)
        for chunk, chunk_logits in zip(chunks, logits):
            if chunk.seq.request.request_id == "nan" and chunk_logits is not None and chunk.seq.output_ids:
                with torch.inference_mode():
                    chunk_logits[-1, 3] = float("nan")
        return logits
    monkeypatch.setattr(engine_module, "sample", sample_failing_on_seed_13)
    monkeypatch.setattr(engine.runner, "run", run_with_nan)
    engine.add_request("sampler", prompts["sampler"], greedy(6, seed=13))
    engine.add_request("nan", prompts["nan"], greedy(6, n=2))
    engine.add_request("ok", prompts["ok"], greedy(6))
    done = run(engine)
    assert "injected sampler fault" in done["sampler"].outputs[0].stop_reason
    assert [c.finish_reason for c in done["nan"].outputs] == ["error", "error"]
    assert "NaN or infinite logits" in done["nan"].outputs[0].stop_reason
    assert len(done["nan"].outputs[0].token_ids) == 1        # the first token's logits were finite
    assert done["ok"].outputs[0].token_ids == alone
    assert_pools_free(llm)


def test_a_detokenizer_fault_fails_only_its_request(model_dir):
    llm = LLM(str(model_dir))
    engine = llm.engine
    alone = tokens(llm.generate({"prompt_token_ids": [7, 8, 9]}, greedy(6)))[0]
    engine.add_request("broken", [5, 6], greedy(6))
    engine.add_request("ok", [7, 8, 9], greedy(6))

    def add(token):
        raise UnicodeError("injected detokenizer fault")
    engine.requests["broken"].sequences[0].detokenizer.add = add
    done = run(engine)
    assert "injected detokenizer fault" in done["broken"].outputs[0].stop_reason
    assert done["ok"].outputs[0].token_ids == alone
    assert_pools_free(llm)


def test_abort_with_a_reason_ends_every_sequence_with_it(model_dir):
    llm = LLM(str(model_dir))
    engine = llm.engine
    engine.add_request("r", [5, 6], greedy(50, n=3))
    engine.step()
    engine.step()
    output = engine.abort_request("r", "shutting down")
    assert {(c.finish_reason, c.stop_reason) for c in output.outputs} == {("abort", "shutting down")}
    assert_pools_free(llm)


def test_running_out_of_memory_while_allocating_the_caches_is_a_clear_error(model_dir, monkeypatch):
    def allocate(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
    monkeypatch.setattr(HybridCache, "allocate", allocate)
    with pytest.raises(MemoryPlanError, match=r"allocating the caches \(.* GiB\) ran out of memory; lower"):
        LLMEngine(EngineArgs(model=str(model_dir)))
