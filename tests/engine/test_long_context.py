"""The engine at the model's full context length: chunked prefill into the paged cache, then decoding to the last
position, against one plain fp32 forward over the whole sequence (no cache, no chunks); with FP8 KV too.
Decoding without max_tokens ends with finish_reason "length" exactly at the context length."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams, ops
from kestrel.layers import mla
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.mla import GatedMLA

BUNDLED = Path(__file__).parents[2] / "models" / "k3.1-tiny"
DECODED = 8                                  # tokens decoded at the end of the context
TO_THE_END = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, prompt_logprobs=0, logprobs=0)


def run_to_the_end(llm: LLM, seed: int) -> tuple[list[int], list[int], torch.Tensor]:
    """A random prompt of context_length - DECODED tokens, greedy with no max_tokens: (prompt, output ids, the
    engine's logprob of every token after the first [context_length - 1] fp32). Checks where it stopped."""
    context = llm.engine.context_length
    vocab = llm.engine.config.vocab_size
    prompt = torch.randint(3, vocab, (context - DECODED,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, TO_THE_END)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(prompt) + len(completion.token_ids) == context
    entries = out.prompt_logprobs[1:] + completion.logprobs
    logprobs = torch.tensor([e[t].logprob for e, t in zip(entries, prompt[1:] + completion.token_ids)])
    assert logprobs.isfinite().all()
    return prompt, completion.token_ids, logprobs


@torch.inference_mode()
def plain_forward(llm: LLM, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One forward over prompt + output (but its last token) without caches: (the logprob of every token after
    the first [L - 1], the greedy pick after each prompt-and-output prefix that ends in the prompt's last token or
    later [len(output)])."""
    model, seq = llm.engine.model, prompt + output
    logits = model.compute_logits(model(torch.tensor(seq[:-1]), ForwardBatch.build([len(seq) - 1])))
    assert logits.isfinite().all()
    logprobs = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    return logprobs, logits[len(prompt) - 1:].argmax(-1).tolist()


class IndexerSelections:
    """The indexer's top-k choices of one sequence's run, per indexed MLA layer: the positions each token attends.

    The engine's indexed layers are called in turn on every forward (through `LightningIndexer.select` where the
    context holds more than top-k keys, else `ops.topk_mask`), so the n-th call belongs to layer n % layers and
    covers its next tokens. (The plain forward's `ops.indexer_topk` is replayed, not recorded.)"""

    def __init__(self, llm: LLM):
        self.layers = sum(1 for m in llm.engine.model.modules() if isinstance(m, GatedMLA) and m.indexer is not None)
        self.calls = 0
        self.rows: list[list[set[int]]] = [[] for _ in range(self.layers)]

    def add(self, positions: list[set[int]]) -> None:
        self.rows[self.calls % self.layers].extend(positions)
        self.calls += 1

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Record the engine's choices from now on."""
        topk_mask, select = ops.topk_mask, mla.LightningIndexer.select

        def recorded_mask(scores, mask, topk):
            chosen = topk_mask(scores, mask, topk)
            self.add([set(row.nonzero().flatten().tolist()) for row in chosen[0]])
            return chosen

        def recorded_select(indexer, *args, **kwargs):
            chosen = select(indexer, *args, **kwargs)
            self.add([set(row[row >= 0].tolist()) for row in chosen])
            return chosen

        monkeypatch.setattr(ops, "topk_mask", recorded_mask)
        monkeypatch.setattr(mla.LightningIndexer, "select", recorded_select)

    def replay(self, monkeypatch: pytest.MonkeyPatch, near: float) -> list[int]:
        """Make a plain forward over the same tokens choose what the engine chose. Where its own choice differs,
        every key chosen by one and not the other must score within `near` (relative) of the row's k-th best, a
        near-tie float32 rounding can flip. Returns the list the forward fills with the rows whose choices differ."""
        topk_mask, indexer_topk, calls, flipped = ops.topk_mask, ops.indexer_topk, itertools.count(), []

        def replayed(scores, mask, topk):
            layer, own = next(calls), topk_mask(scores, mask, topk)
            chosen = torch.zeros_like(own)
            for t, positions in enumerate(self.rows[layer][:scores.shape[1]]):
                chosen[0, t, list(positions)] = True
                differ = (chosen[0, t] ^ own[0, t]).nonzero().flatten()
                if len(differ):
                    kth = scores[0, t].topk(topk).values[-1]
                    assert ((scores[0, t, differ] - kth).abs() <= near * kth.abs()).all(), (layer, t)
                    flipped.append(t)
            return chosen & mask

        def replayed_topk(q, k, weights, last, topk, reduce=None):
            layer, own = next(calls), indexer_topk(q, k, weights, last, topk, reduce)
            chosen, scores = torch.full_like(own, -1), None
            for t, positions in enumerate(self.rows[layer][:q.shape[1]]):
                chosen[0, t, :len(positions)] = torch.tensor(sorted(positions))
                differ = list(positions ^ set(own[0, t][own[0, t] >= 0].tolist()))
                if differ:
                    if scores is None:
                        scores = ops.indexer_scores(q, k, weights, torch.arange(k.shape[1]) <= last.unsqueeze(-1))
                    kth = scores[0, t].topk(topk).values[-1]
                    assert ((scores[0, t, differ] - kth).abs() <= near * kth.abs()).all(), (layer, t)
                    flipped.append(t)
            return chosen

        monkeypatch.setattr(ops, "topk_mask", replayed)
        monkeypatch.setattr(ops, "indexer_topk", replayed_topk)
        return flipped


def test_bundled_model_at_its_full_context_equals_the_plain_forward(monkeypatch):
    """2,048 tokens (max_position_embeddings): a 2,040-token prompt in chunks of 512, then 8 decode steps, the
    last reading 2,047 cached tokens. fp32 throughout, so only the order of accumulation differs.

    That order can flip the indexer's top-k where two keys score within float32 rounding of each other (about
    35 of the 4,000 rows have a relative gap under 1e-5 at the k-th key; which of them flip depends on the CPU's
    kernels), so the plain forward replays the engine's choices, after checking that it would choose the same
    keys itself but for such near-ties."""
    llm = LLM(str(BUNDLED), dtype="float32", chunked_prefill_size=512, max_mamba_cache_size=1)
    assert llm.engine.context_length == llm.engine.config.max_position_embeddings == 2048
    selections = IndexerSelections(llm)
    selections.record(monkeypatch)
    prompt, output, logprobs = run_to_the_end(llm, seed=0)
    monkeypatch.undo()
    assert all(len(rows) == llm.engine.context_length - 1 for rows in selections.rows)
    flipped = selections.replay(monkeypatch, near=1e-5)
    expected, greedy = plain_forward(llm, prompt, output)
    assert len(flipped) <= 8
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)
    assert output == greedy


def test_kimi_linear_with_fp8_kv_at_4096_tokens(kimi_linear_dir):
    """A random Kimi-Linear-shaped model with FP8 KV at its 4,096-token context, in chunks of 1,024, against the
    plain fp32 forward (which the engine with fp32 KV equals to 1e-4: the test above).

    E4M3 keeps 3 mantissa bits: each cached value (scaled per token so that its largest is 448) is rounded to within
    2^-4 = 6.25%, independently, and the one MLA layer's attention sums those errors over its keys; 99% of positions
    move by under 0.01 nats and the mean by under 0.002 (measured: 0.0017 and 0.0004). A position whose perturbed
    hidden state flips the MoE's top-2 routing on a near-tie jumps instead (measured: 2 of 4,095 positions, by 0.24
    and 0.08, exactly the two where the last MoE layer picked other experts than in the plain forward)."""
    llm = LLM(str(kimi_linear_dir), chunked_prefill_size=1024, max_mamba_cache_size=1, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.context_length == 4096
    prompt, output, logprobs = run_to_the_end(llm, seed=1)
    expected, _ = plain_forward(llm, prompt, output)
    diffs = (logprobs - expected).abs()
    assert diffs.max() > 0                                                 # FP8 really is stored
    assert diffs.mean() < 0.002 and diffs.quantile(0.99) < 0.01
    assert (diffs > 0.05).sum() <= 8 and diffs.max() < 1.0
