"""kestrel.LLM with tp_size=2 (and dcp_size=2, or DP attention) or pp_size=2 (one spawned rank process, gloo):
greedy tokens equal one process's; a rank that dies fails the requests with an error naming it, every later step
fails at once, and no process is left."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from kestrel import LLM
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.engine import LLMEngine
from kestrel.engine.sampling import SamplingParams
from helpers import write_draft

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 17)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ARGS = dict(dtype="float32", chunked_prefill_size=16, max_total_tokens=4096, max_mamba_cache_size=8)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return tokens(LLM(str(BUNDLED_MODEL), **ARGS))


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}], ids=["tp2", "pp2"])
def test_deterministic_inference_batched_equals_alone(layout):
    """--enable-deterministic-inference at TP2 and PP2: both ranks run the batch-invariant operators (TP2 sums over
    ranks in rank order), so requests batched together (prompts in chunks of 16) give the tokens and logprobs each
    gives alone on the same layout, bit for bit."""
    llm = LLM(str(BUNDLED_MODEL), enable_deterministic_inference=True, disable_radix_cache=True, **layout, **ARGS)
    params = [SamplingParams(temperature=t, seed=7, max_tokens=8, ignore_eos=True, logprobs=2) for t in (0, 1, 0)]
    try:
        together = llm.generate(PROMPTS, params)
        for prompt, p, got in zip(PROMPTS, params, together):
            alone = llm.generate([prompt], p)[0].outputs[0]
            assert got.outputs[0].token_ids == alone.token_ids
            assert [{t: lp.logprob for t, lp in step.items()} for step in got.outputs[0].logprobs] == \
                   [{t: lp.logprob for t, lp in step.items()} for step in alone.logprobs]
    finally:
        llm.engine.shutdown()
    assert not multiprocessing.active_children()


def test_pp2_greedy_tokens_equal_one_process(expected):
    """Two pipeline stages of the bundled model (layers 0-2, all KDA, then 3-5 with both MLA layers, the LM head
    and the MTP layer), steps in two micro-batches, NGRAM drafts verified whole (every stage keeps and commits its
    layers' token states), n > 1 sharing a prompt's pages and state."""
    llm = LLM(str(BUNDLED_MODEL), pp_size=2, speculative_algorithm="NGRAM", **ARGS)
    try:
        assert tokens(llm) == expected
        assert llm.engine.spec_stats.draft_tokens > 0
        twins = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))
        assert [o.token_ids for o in twins[0].outputs] == [expected[1]] * 2
        assert llm.engine.scheduler.state_pool.num_slots == 8
        assert (len(llm.engine.cache.kda), len(llm.engine.cache.mla)) == (3, 0)      # rank 0: the first stage
    finally:
        llm.engine.shutdown()
    assert not multiprocessing.active_children()


def test_dp_attention_greedy_tokens_equal_one_process(expected):
    """TP2 with two DP attention groups: each rank attends its own group's sequences with the whole attention and
    holds their caches only (half the slots: --max-mamba-cache-size counts both groups'), the experts split over
    both ranks compute every group's tokens; the three prompts land in both groups, n > 1 forks inside one, a
    repeated prompt hits its group's prefix cache; PD handoffs are refused."""
    llm = LLM(str(BUNDLED_MODEL), tp_size=2, dp_size=2, enable_dp_attention=True, **ARGS)
    try:
        assert tokens(llm) == expected
        groups = llm.engine.scheduler.groups
        assert [g.state_pool.num_slots for g in groups] == [4, 4]
        assert all(g.prefix_cache.stats.prompt_tokens > 0 for g in groups)         # both groups ran prompts
        twins = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))
        assert [o.token_ids for o in twins[0].outputs] == [expected[1]] * 2
        assert sum(g.prefix_cache.stats.cached_tokens for g in groups) > 0
        with pytest.raises(ValueError, match="PD handoffs do not run with DP attention"):
            llm.engine.add_request("pd", [5, 6, 7], GREEDY, handoff=lambda handoff: None)
        # a step that raises on rank 0 while rank 1 computes it (and waits in a collective rank 0 never joins):
        # the requests fail, and shutdown stops rank 1 unasked (a stop message would wait out the collective)
        def fail(*args):
            raise RuntimeError("boom")

        llm.engine.model.forward = fail
        outputs = llm.generate(PROMPTS[:1], GREEDY)
        assert outputs[0].outputs[0].finish_reason == "error" and "boom" in outputs[0].outputs[0].stop_reason
        sent = []
        llm.engine.ranks.channel.send = sent.append
    finally:
        llm.engine.shutdown()
    assert sent == [] and not multiprocessing.active_children()


def test_tp2_dcp2_greedy_tokens_equal_one_process_then_a_killed_rank_fails_requests(expected):
    """The bundled model at TP2 (its MXFP4 experts' 96-wide intermediate split 64 + 32) with its MLA cache split
    by position over both ranks (DCP2), mixed-length prompts with chunked prefill, then decode verifying the drafts
    of a STANDALONE draft model in rank 0's process (the target itself: every draft is accepted); then SIGKILL the
    spawned rank (one group for all, to keep the suite short). `kestrel serve --tp-size 2` runs without DCP."""
    llm = LLM(str(BUNDLED_MODEL), tp_size=2, dcp_size=2, speculative_algorithm="STANDALONE",
              speculative_draft_model_path=str(BUNDLED_MODEL), **ARGS)
    worker = llm.engine.ranks.workers.processes[0]
    try:
        assert tokens(llm) == expected
        stats = llm.engine.spec_stats
        assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens
        assert llm.engine.scheduler.state_pool.num_slots == 8
        pages = llm.engine.scheduler.kv_pool.num_pages
        assert llm.engine.cache.mla[0].latent.values.shape[0] == pages * llm.engine.cache.page_size // 2
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        for _ in range(2):                          # the step that finds the rank gone, then every later one
            outputs = llm.generate(PROMPTS[:1], GREEDY)
            assert outputs[0].outputs[0].finish_reason == "error"
            assert "rank 1 exited with code -9" in outputs[0].outputs[0].stop_reason
        assert "rank 1 exited with code -9" in llm.engine.rank_failure()
    finally:
        llm.engine.shutdown()
    assert not multiprocessing.active_children()
    with pytest.raises(ProcessLookupError):
        os.kill(worker.pid, 0)


def drafting(algorithm: str) -> dict:
    """NEXTN drafts among the shipped token map's tokens (its MTP head cut to them, per rank), DFLASH among all."""
    spec = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=3, **ARGS)
    if algorithm == "DFLASH":
        spec["speculative_draft_model_path"] = str(BUNDLED_MODEL.parent / "k3.1-tiny-dflash")
    else:
        spec["speculative_token_map"] = str(BUNDLED_MODEL / "token_map.pt")
    return spec


@pytest.fixture(scope="module")
def one_process_acceptance(expected) -> dict[str, list[int]]:
    """Per model drafter: one process's acceptance histogram over PROMPTS (its greedy tokens checked)."""
    histograms = {}
    for algorithm in ("NEXTN", "DFLASH"):
        one = LLM(str(BUNDLED_MODEL), **drafting(algorithm))
        assert tokens(one) == expected
        histograms[algorithm] = one.engine.spec_stats.accepted_histogram
    return histograms


@pytest.mark.parametrize("algorithm,layout", [("NEXTN", {"tp_size": 2, "dcp_size": 2}),
                                              ("DFLASH", {"tp_size": 2, "ep_size": 2, "moe_a2a_backend": "torch"}),
                                              ("NEXTN", {"pp_size": 2}), ("DFLASH", {"pp_size": 2})])
def test_model_drafters_distributed_draft_what_one_process_drafts(expected, one_process_acceptance, algorithm,
                                                                   layout):
    """NEXTN (the MTP layer, its attention cache split by position under DCP2, its head cut to a token map) and
    DFLASH (the block draft) at TP2 (the experts over both ranks, tokens dispatched all-to-all, which verification
    steps go through too): every rank drafts from its own kept hidden states through the sharded
    embedding, layers and LM heads (each rank the map's rows of its share of the vocabulary); over two
    pipeline stages the last stage drafts (with its copy of the embedding) and sends rank 0 the drafts. Greedy
    tokens equal one process's plain ones, and the drafts one process's with the same drafter (equal counts)."""
    llm = LLM(str(BUNDLED_MODEL), **layout, **drafting(algorithm))
    try:
        assert tokens(llm) == expected
        stats = llm.engine.spec_stats
        assert stats.accepted_tokens > 0
        assert stats.accepted_histogram == one_process_acceptance[algorithm]
    finally:
        llm.engine.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("layout", ["nemo", "dspark"])
def test_a_k3_dflash_draft_at_tp2_drafts_what_one_process_drafts(expected, tmp_path, layout):
    """A K3 DFlash or DSpark draft in NeMo's layout (random) at TP2: every rank holds the whole draft and writes its
    context latents from its own full hidden states (DFlash's logits by the target's vocabulary-split lm_head,
    DSpark's by its own, through its Markov head); rank 0's drafts, step by step, are one process's, and greedy
    tokens are plain ones."""
    write_draft(tmp_path, layout, markov="gated")
    spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path),
                speculative_num_draft_tokens=3, **ARGS)
    drafts = []
    for layout in ({}, {"tp_size": 2}):
        llm = LLM(str(BUNDLED_MODEL), **layout, **spec)
        recorded, draft = [], llm.engine.runner.drafter.draft
        llm.engine.runner.drafter.draft = lambda inputs, kept: recorded.append(draft(inputs, kept)) or recorded[-1]
        try:
            assert tokens(llm) == expected
        finally:
            llm.engine.shutdown()
        drafts.append(recorded)
    assert drafts[0] == drafts[1] and sum(len(d) for step in drafts[0] for d in step) >= 30
    assert not multiprocessing.active_children()


def test_pd_handoffs_between_instances_of_different_layouts(expected):
    """A prefill instance at TP2 x DCP2 hands each prompt's state over gathered into one process's layout; a decode
    instance at PP2 splits it over its stages and continues: one process's greedy tokens (chunked prompts)."""
    prefill = LLMEngine(EngineArgs(model=str(BUNDLED_MODEL), tp_size=2, dcp_size=2, **ARGS))
    handed = []
    try:
        for i, prompt in enumerate(PROMPTS):
            prefill.add_request(f"p{i}", prompt["prompt_token_ids"], GREEDY, handoff=handed.append)
        while prefill.has_unfinished_requests():
            prefill.step()
    finally:
        prefill.shutdown()
    decode = LLMEngine(EngineArgs(model=str(BUNDLED_MODEL), pp_size=2, **ARGS))
    finals = {}
    try:
        for i, handoff in enumerate(sorted(handed, key=lambda h: len(h.prompt_ids))):
            decode.add_prefilled_request(f"d{i}", handoff, GREEDY)
        while decode.has_unfinished_requests():
            finals |= {o.request_id: o.outputs[0].token_ids for o in decode.step() if o.finished}
    finally:
        decode.shutdown()
    by_length = sorted(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]["prompt_token_ids"]))
    assert [finals[f"d{j}"] for j in range(len(PROMPTS))] == [expected[i] for i in by_length]
    assert not multiprocessing.active_children()


def test_wide_ep_all_to_all_with_eplb_greedy_tokens_equal_one_process(expected):
    """WideEP at TP2: two DP attention groups, the experts split over both ranks with two redundant slots, every
    token's routed-expert input dispatched all-to-all to the rank of the slot it chose, EPLB rebalancing every 3
    steps while the requests run (their tokens unchanged, none lost; the experts' dense float32 copies made again
    from the moved MXFP4 weights)."""
    llm = LLM(str(BUNDLED_MODEL), tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True,
              moe_a2a_backend="torch", enable_eplb=True, ep_num_redundant_experts=2, eplb_rebalance_num_iterations=3,
              moe_dense_experts="float32", **ARGS)
    try:
        assert tokens(llm) == expected
        balancer = llm.engine.runner.balancer
        assert balancer.rebalances >= 3 and len(balancer.rank_load) == 2 and sum(balancer.rank_load) > 0
    finally:
        llm.engine.shutdown()
    assert not multiprocessing.active_children()

