"""The engine against the plain computation: batching, chunking, preemption, aborts, sampling controls, logprobs."""

from __future__ import annotations

import logging

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.tokenizer import Tokenizer
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.moe import RoutedExperts
from helpers import assert_idle, greedy_generate

VOCAB = 320


def random_prompts(count: int, seed: int = 0, low: int = 1, high: int = 60) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids_of(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pools_free(llm: LLM) -> None:
    assert_idle(llm.engine.scheduler)
    assert not llm.engine.requests


def test_batch_of_16_mixed_requests_equals_each_alone_and_the_plain_computation(model_dir):
    llm = LLM(str(model_dir), page_size=4)
    prompts = random_prompts(16)
    batched = tokens(llm.generate(ids_of(prompts), greedy()))
    alone = [tokens(llm.generate(ids_of([p]), greedy()))[0] for p in prompts]
    assert batched == alone
    assert batched == greedy_generate(llm.engine.model, prompts, 12)
    assert_pools_free(llm)


def test_chunked_prefill_equals_unchunked(model_dir):
    prompts = random_prompts(4, seed=1, low=30, high=60)
    params = greedy(8, prompt_logprobs=0)
    whole = LLM(str(model_dir)).generate(ids_of(prompts), params)
    chunked = LLM(str(model_dir), chunked_prefill_size=7, max_prefill_tokens=16).generate(ids_of(prompts), params)
    assert tokens(chunked) == tokens(whole)
    for a, b in zip(chunked, whole):
        got = [next(iter(e.values())).logprob for e in a.prompt_logprobs[1:]]
        expected = [next(iter(e.values())).logprob for e in b.prompt_logprobs[1:]]
        assert got == pytest.approx(expected, abs=1e-4)


def test_preempted_requests_resume_with_identical_greedy_output(model_dir):
    prompts = random_prompts(6, seed=2, low=8, high=12)
    roomy = tokens(LLM(str(model_dir), page_size=4).generate(ids_of(prompts), greedy(24)))
    tight = LLM(str(model_dir), page_size=4, max_total_tokens=72)          # 18 pages; each request needs 9
    assert tokens(tight.generate(ids_of(prompts), greedy(24))) == roomy
    assert tight.engine.scheduler.num_preemptions > 0
    assert_pools_free(tight)


def test_more_requests_than_slots_are_all_served(model_dir):
    llm = LLM(str(model_dir), page_size=4, max_mamba_cache_size=3)
    prompts = random_prompts(20, seed=3)
    outputs = llm.generate(ids_of(prompts), greedy(5))
    assert [len(t) for t in tokens(outputs)] == [5] * 20
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert_pools_free(llm)


def test_abort_frees_memory_whether_queued_prefilling_or_decoding(model_dir):
    llm = LLM(str(model_dir), page_size=4, max_mamba_cache_size=2, chunked_prefill_size=8, max_prefill_tokens=9)
    engine = llm.engine
    engine.add_request("decoding", [5] * 4, greedy(50))
    engine.add_request("prefilling", [6] * 40, greedy(50))
    engine.add_request("queued", [7] * 4, greedy(50))
    for _ in range(3):
        engine.step()
    seqs = {rid: r.sequences[0] for rid, r in engine.requests.items()}
    assert seqs["decoding"].output_ids and seqs["prefilling"].num_computed < 40
    assert seqs["queued"].slot is None
    for request_id in ("queued", "prefilling", "decoding"):
        output = engine.abort_request(request_id)
        assert output.outputs[0].finish_reason == "abort" and output.finished
    assert_pools_free(llm)
    assert engine.step() == []


def test_prompt_past_the_context_is_rejected_before_taking_memory(model_dir):
    llm = LLM(str(model_dir), context_length=64)
    with pytest.raises(ValueError, match="70 tokens.*context length of 64"):
        llm.generate({"prompt_token_ids": [5] * 70})
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) plus max_tokens \(30\) exceeds the context length of 64"):
        llm.generate(ids_of([[5] * 10, [5] * 40]), greedy(30))
    with pytest.raises(ValueError, match=r"integers in \[0, 320\)"):
        llm.generate({"prompt_token_ids": [5, 400]})
    assert_pools_free(llm)


def test_generation_stops_at_the_context_length(model_dir):
    llm = LLM(str(model_dir), context_length=20)
    output = llm.generate({"prompt_token_ids": [5] * 15}, SamplingParams(temperature=0, max_tokens=None,
                                                                          ignore_eos=True))[0].outputs[0]
    assert len(output.token_ids) == 5 and output.finish_reason == "length"


def test_seeds_reproduce_regardless_of_batch_company(model_dir):
    llm = LLM(str(model_dir))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = tokens(llm.generate({"prompt_token_ids": [4, 5, 6]}, params))
    crowd = llm.generate(ids_of(random_prompts(5, seed=4)) + [{"prompt_token_ids": [4, 5, 6]}],
                         [SamplingParams(temperature=1.0, max_tokens=10)] * 5 + [params])
    assert tokens(crowd)[-1] == alone[0]
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=10, ignore_eos=True)
    assert tokens(llm.generate({"prompt_token_ids": [4, 5, 6]}, other)) != alone


def test_stop_token_ids_and_eos(model_dir):
    llm = LLM(str(model_dir))
    prompt = {"prompt_token_ids": [9, 10, 11]}
    free = tokens(llm.generate(prompt, greedy(12)))[0]
    stop_at = next(i for i, t in enumerate(free) if t not in free[:i])   # first occurrence of its token
    stop_at = max(stop_at, 3) if free[3] not in free[:3] else stop_at
    stop_token = free[stop_at]
    output = llm.generate(prompt, greedy(12, stop_token_ids=[stop_token]))[0].outputs[0]
    assert output.token_ids == free[: free.index(stop_token) + 1]
    assert output.finish_reason == "stop" and output.stop_reason == stop_token
    eos = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert 2 not in eos.token_ids[:-1]


def test_stop_strings_spanning_tokens_are_cut_and_not_returned(model_dir):
    llm = LLM(str(model_dir))
    prompt = "the quick brown fox"
    full = llm.generate(prompt, greedy(16))[0].outputs[0]
    tokenizer = Tokenizer.from_folder(model_dir)
    assert full.text == tokenizer.decode(full.token_ids)
    pieces = [tokenizer.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    start = next(i for i in range(2, len(pieces)) if len(pieces[i]) - len(pieces[i - 2]) >= 3)
    stop = full.text[len(pieces[start - 2]) + 1: len(pieces[start]) + 1][:4]   # spans a token boundary
    output = llm.generate(prompt, greedy(16, stop=[stop]))[0].outputs[0]
    assert output.text == full.text[: full.text.index(stop)]
    assert output.finish_reason == "stop" and output.stop_reason == stop


def test_logprobs_equal_log_softmax_of_the_model_logits(model_dir):
    llm = LLM(str(model_dir))
    prompt = [4, 8, 15, 16, 23, 42]
    result = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=3, prompt_logprobs=2,
                                         ignore_eos=True))[0]
    out = result.outputs[0]
    seq = torch.tensor(prompt + out.token_ids)
    model = llm.engine.model
    with torch.no_grad():
        expected = torch.log_softmax(model.compute_logits(model(seq, ForwardBatch.build([len(seq)]))), -1)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    for pos in range(1, len(seq)):
        entry = result.prompt_logprobs[pos] if pos < len(prompt) else out.logprobs[pos - len(prompt)]
        token = int(seq[pos])
        row = expected[pos - 1]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = row.topk(3 if pos >= len(prompt) else 2)
        for rank, (value, index) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert entry[index].logprob == pytest.approx(value, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_n_continuations_share_the_prompt_and_match_separate_requests(model_dir):
    llm = LLM(str(model_dir), page_size=4)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5, low=10, high=11)[0]}
    single = tokens(llm.generate(prompt, greedy(8)))[0]
    assert [c.token_ids for c in llm.generate(prompt, greedy(8, n=3))[0].outputs] == [single] * 3
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    children = [c.token_ids for c in llm.generate(prompt, sampled)[0].outputs]
    separate = [tokens(llm.generate(prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8,
                                                           ignore_eos=True)))[0] for i in range(3)]
    assert children == separate and len({tuple(c) for c in children}) > 1

    engine = llm.engine
    engine.add_request("fork", prompt["prompt_token_ids"], sampled)
    engine.step()
    pool = engine.scheduler.kv_pool
    assert pool.num_used == 2 + 3       # 2 shared full pages + a copied partial page each
    assert engine.abort_request("fork").finished
    engine.add_request("queued", prompt["prompt_token_ids"], sampled)
    aborted = engine.abort_request("queued")                # before its prompt ran: no forks yet
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"]
    assert_pools_free(llm)


def test_fp8_kv_cache_stays_close(model_dir, kimi_linear_dir):
    """FP8 latents with a scale per token: close logprobs (a model without an indexer, whose top-k selection can
    flip on near-ties), and the bytes the planner counts."""
    prompt = {"prompt_token_ids": random_prompts(1, seed=6, low=40, high=41)[0]}
    params = greedy(1, prompt_logprobs=0)
    exact = LLM(str(kimi_linear_dir)).generate(prompt, params)[0]
    quantized = LLM(str(kimi_linear_dir), kv_cache_dtype="fp8_e4m3").generate(prompt, params)[0]
    diffs = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
             for a, b in zip(exact.prompt_logprobs[1:], quantized.prompt_logprobs[1:])]
    assert 0 < max(diffs) < 0.2 and sum(diffs) / len(diffs) < 0.02     # E4M3 keeps ~3% per element
    fp8 = LLM(str(model_dir), kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.plan.kv_bytes_per_token == 2 * (40 + 4) + 2 * (16 + 4)      # 2 MLA layers; no MTP pages
    assert len(fp8.generate(prompt, greedy(4))[0].outputs[0].token_ids) == 4


def test_priority_runs_first_when_slots_are_scarce(model_dir):
    llm = LLM(str(model_dir), max_mamba_cache_size=1)
    engine = llm.engine
    engine.add_request("low", [5, 6], greedy(3), priority=1)
    engine.add_request("high", [5, 6], greedy(3), priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_memory_plan_is_logged_and_matches_the_allocation(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kestrel"):
        llm = LLM(str(model_dir), page_size=8, mem_fraction_static=0.001)
    plan = llm.engine.plan
    assert "KV cache:" in caplog.text and "concurrency cap:" in caplog.text
    cache = llm.engine.cache
    kv = sum(p.values.numel() * p.values.element_size() for layer in cache.mla
             for p in (layer.latent, layer.index_keys) if p is not None)
    state = sum(t.numel() * t.element_size() for s in cache.kda for t in (s.conv, s.recurrent))
    assert kv == plan.kv_pool_bytes and state == plan.state_pool_bytes
    ratio = plan.state_pool_bytes / plan.kv_pool_bytes
    assert ratio == pytest.approx(0.9, rel=0.02)
    assert plan.state_pool_bytes + plan.kv_pool_bytes + plan.weight_bytes <= plan.budget


def test_stream_yields_growing_outputs_ending_in_the_generate_result(model_dir):
    llm = LLM(str(model_dir))
    params = greedy(6)
    steps = list(llm.stream("to be or not", params))
    assert [len(s.outputs[0].token_ids) for s in steps] == list(range(1, 7)) and steps[-1].finished
    assert steps[-1].outputs[0].token_ids == tokens(llm.generate("to be or not", params))[0]
    assert_pools_free(llm)


def test_bad_llm_inputs(model_dir):
    llm = LLM(str(model_dir))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [greedy(), greedy(), greedy()])
    with pytest.raises(ValueError, match="a prompt must be"):
        llm.generate([{"text": "a"}])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(model_dir), kv_cache_dtype="int4")
    assert_pools_free(llm)


def test_moe_mxfp8_activations_flag_runs_every_routed_expert_in_w4a8(model_dir):
    """--moe-mxfp8-activations: the engine's greedy tokens are those of the plain computation with every routed
    expert's inputs rounded to MXFP8, and its logprobs move away from the unquantized engine's."""
    prompts = random_prompts(3, seed=9)
    params = greedy(6, logprobs=0)
    plain = LLM(str(model_dir), page_size=4).generate(ids_of(prompts), params)
    llm = LLM(str(model_dir), page_size=4, moe_mxfp8_activations=True)
    quantized = llm.generate(ids_of(prompts), params)
    experts = [m for m in llm.engine.model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(m.mxfp8_activations for m in experts)
    assert tokens(quantized) == greedy_generate(llm.engine.model, prompts, 6)
    first = [o.outputs[0].logprobs[0] for o in plain], [o.outputs[0].logprobs[0] for o in quantized]
    assert any(next(iter(a.values())).logprob != next(iter(b.values())).logprob for a, b in zip(*first))


def test_packed_onednn_weights_decode_the_same_tokens_counted_in_the_plan(model_dir, monkeypatch):
    """On a CPU that takes oneDNN, the engine packs the linears oneDNN multiplies (here every one of at least 16K
    elements: this model's are small) and decodes the unpacked engine's tokens, batched (products of several rows
    read the packed copies); the copies are planned as weights."""
    import kestrel.layers.linear as linear_module
    monkeypatch.setattr(linear_module, "ONEDNN", False)
    plain = LLM(str(model_dir), page_size=4, dtype="float32")
    monkeypatch.setattr(linear_module, "ONEDNN", True)
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_WEIGHT", 1 << 14)
    packed = LLM(str(model_dir), page_size=4, dtype="float32")
    held = [m for m in packed.engine.model.modules() if getattr(m, "packed", None) is not None]
    assert held and packed.engine.plan.weight_bytes - plain.engine.plan.weight_bytes == sum(
        m.weight.numel() * 4 for m in held)
    prompts = ids_of(random_prompts(4, seed=6))
    assert tokens(packed.generate(prompts, greedy(6))) == tokens(plain.generate(prompts, greedy(6)))


def test_moe_mxfp8_activations_refuse_expert_widths_off_the_32_blocks(narrow_experts_dir):
    with pytest.raises(ValueError, match=r"multiples of 32, and .*'s are \(\d+, 40\)"):
        LLM(str(narrow_experts_dir), moe_mxfp8_activations=True)


def test_moe_dense_experts_compute_from_an_exact_copy_counted_in_the_plan(model_dir, kimi_linear_dir):
    """--moe-dense-experts bfloat16: the routed experts compute from a dense copy (bfloat16 holds every MXFP4 value
    exactly), so the engine decodes the packed engine's tokens; the copy's 2 bytes per routed weight are planned
    as weights. Models whose experts are dense already refuse it."""
    prompts, params = random_prompts(3, seed=5), greedy(6, logprobs=0)
    packed, dense = LLM(str(model_dir), page_size=4), LLM(str(model_dir), page_size=4, moe_dense_experts="bfloat16")
    a, b = packed.generate(ids_of(prompts), params), dense.generate(ids_of(prompts), params)
    assert tokens(a) == tokens(b)
    for x, y in zip(a, b):
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(next(iter(p.values())).logprob - next(iter(q.values())).logprob) < 1e-4
    config = packed.engine.config
    moe_layers = sum(isinstance(m, RoutedExperts) for m in packed.engine.model.modules())
    copy_bytes = 2 * moe_layers * config.num_experts * 3 * config.moe_intermediate_size * config.expert_dim
    assert dense.engine.plan.weight_bytes - packed.engine.plan.weight_bytes == copy_bytes
    with pytest.raises(ValueError, match="--moe-dense-experts is for MXFP4 experts on the CPU"):
        LLM(str(kimi_linear_dir), moe_dense_experts="bfloat16")


def test_moe_onednn_experts_decode_the_same_tokens_counted_in_the_plan(model_dir, monkeypatch):
    """--moe-onednn-experts with a float32 copy of the MXFP4 experts: every expert layer holds oneDNN copies of its
    weights (here of any size: this model's are under EXPERT_PACKED_MIN_WEIGHT), planned as weights (4 bytes per
    routed weight), and the engine decodes the plain copy's tokens, batched. Experts that would get no copy (these,
    at the real threshold; MXFP4 ones without a float32 copy) and Intel's CPUs, where the copies are slower, refuse
    the flag at once."""
    import kestrel.layers.linear as linear_module
    import kestrel.layers.moe as moe_layers
    monkeypatch.setattr(linear_module, "ONEDNN", False)
    with pytest.raises(ValueError, match="on this Intel CPU"):
        LLM(str(model_dir), dtype="float32", moe_dense_experts="float32", moe_onednn_experts=True)
    monkeypatch.setattr(linear_module, "ONEDNN", True)
    refusal = "--moe-onednn-experts packs float32 routed experts"
    with pytest.raises(ValueError, match=refusal):
        LLM(str(model_dir), dtype="float32", moe_dense_experts="float32", moe_onednn_experts=True)
    monkeypatch.setattr(moe_layers, "EXPERT_PACKED_MIN_WEIGHT", 1)
    with pytest.raises(ValueError, match=refusal):
        LLM(str(model_dir), dtype="float32", moe_onednn_experts=True)
    plain = LLM(str(model_dir), page_size=4, dtype="float32", moe_dense_experts="float32")
    packed = LLM(str(model_dir), page_size=4, dtype="float32", moe_dense_experts="float32", moe_onednn_experts=True)
    experts = [m for m in packed.engine.model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(m.onednn is not None for m in experts)
    config = packed.engine.config
    copy_bytes = 4 * len(experts) * config.num_experts * 3 * config.moe_intermediate_size * config.expert_dim
    assert packed.engine.plan.weight_bytes - plain.engine.plan.weight_bytes == copy_bytes
    prompts = ids_of(random_prompts(4, seed=6))
    assert tokens(packed.generate(prompts, greedy(6))) == tokens(plain.generate(prompts, greedy(6)))
