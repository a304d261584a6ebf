"""K3 (dense MLA) at 8K and 16K tokens against the float64 spec (issue 62): the engine's chunked prefill in float32
gives every prompt token's logprob within the bound the whole-model oracle uses at short context.

The oracle is test_k3_math_oracles' spec 3 loop with every sublayer in float64 (KDA's recurrence token by token,
MLA's causal softmax over all keys, the latent MoE token by token), over the whole sequence at once; the engine
computes the same prompt in chunks of 2,048 through its paged cache and KDA state. Slow (about 2 minutes on 2 cores,
most of it the float64 oracle), so not in `make test`:

    .venv/bin/python -m pytest -m slow tests/models/test_k3_long_context_oracle.py
"""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from kestrel import LLM, SamplingParams
from kestrel.layers.batch import ForwardBatch
from kestrel.models.checkpoint import save_model
from test_k3_math_oracles import MODEL_REL, attn_res_logits, randomize_norm_weights, spec_sublayers

CHUNK = 2048


@pytest.mark.slow
@pytest.mark.parametrize("context", [512, 8192, 16384])
@torch.no_grad()
def test_k3_prompt_logprobs_at_long_context_match_the_float64_spec(context, tmp_path):
    """Bound: a logprob is a logit minus the log-sum-exp of all logits, so it moves by at most twice the largest
    logit error; the oracle's whole-model bound is MODEL_REL of the logits' scale, the same at 512 tokens as at
    16K."""
    model, raw = tiny_model("k3-tiny")
    randomize_norm_weights(model, seed=15)
    save_model(model, tmp_path, config_json=raw)
    llm = LLM(str(tmp_path), dtype="float32", context_length=context + 1, chunked_prefill_size=CHUNK,
              disable_radix_cache=True)
    ids = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(16))
    out = llm.generate({"prompt_token_ids": ids.tolist()},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:].tolist())],
                       dtype=torch.float64)
    logits = attn_res_logits(model, ids, ForwardBatch.build([context]), sublayers=spec_sublayers)[:-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(context - 1), ids[1:]]
    error, bound = (got - expected).abs().max().item(), 2 * MODEL_REL * logits.abs().max().item()
    print(f"context {context}: largest logprob error {error:.3g}, bound {bound:.3g}")
    assert error <= bound
