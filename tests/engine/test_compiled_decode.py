"""The CPU's compiled decode steps (`--enable-torch-compile`: torch.compile with inductor's C++ backend) against eager
decoding, through the engine: the same greedy tokens, and logprobs within float32 tolerance, for the bundled model
(MXFP4 experts, indexer, AttnRes) and for a random Kimi-Linear-format model, with FP8 KV, over batches that shrink
from 64 sequences to 1 (every compiled batch size: 64, 56, ..., 8, 4, 2, 1); and prefills whose KDA chunk terms
run compiled against eager prefills.

Inductor compiles C++ for every batch size and page-table width (30-80 s each on two busy cores, then cached on
disk; pages of 64 tokens keep every step at one width), so these run outside `make test`: `.venv/bin/python -m pytest -m slow tests/engine/test_compiled_decode.py`.
`make test` traces the same graphs without generating code (test_decode_graphs.py, aot_eager).
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_idle
from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.ops.torch import kda

pytestmark = pytest.mark.slow

SEQUENCES = 64


def workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    """64 prompts of 1-12 tokens; sequence i < 56 stops after 1 + i // 4 tokens, the last 8 one by one after 15-22,
    so the batch shrinks through every size."""
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 13, (SEQUENCES,), generator=gen)]
    params = [SamplingParams(temperature=0, max_tokens=1 + min(i // 4, 13) + max(0, i - 55), ignore_eos=True, logprobs=0)
              for i in range(SEQUENCES)]
    return prompts, params


def run(folder: str, compile: bool, **args) -> tuple[list[list[int]], list[list[float]], LLM]:
    llm = LLM(folder, dtype="float32", enable_torch_compile=compile, torch_compile_max_bs=SEQUENCES,
              max_running_requests=SEQUENCES, page_size=64, **args)
    prompts, params = workload(llm.engine.config.vocab_size)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    return [o.token_ids for o in outputs], logprobs, llm


@pytest.mark.parametrize("model,args", [("bundled", {}), ("bundled", {"kv_cache_dtype": "fp8_e4m3"}),
                                        ("kimi-linear", {})])
def test_compiled_steps_decode_the_eager_tokens(model, args, kimi_linear_dir):
    folder = str(BUNDLED_MODEL if model == "bundled" else kimi_linear_dir)
    eager_tokens, eager_logprobs, _ = run(folder, False, **args)
    tokens, logprobs, llm = run(folder, True, **args)
    assert tokens == eager_tokens
    for got, expected in zip(logprobs, eager_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-4)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.forward is not graphs._forward, "the compiled step fell back to eager"
    assert {size for size, _, _ in graphs.steps} == {1, 2, 4, *range(8, SEQUENCES + 1, 8)}
    assert_idle(llm.engine.scheduler)


def test_compiled_prefill_chunk_terms_give_the_eager_logprobs(torch_paths):
    """Prompts of 65 to 300 tokens (2 to 5 KDA chunks, one compiled graph) prefilled with --enable-torch-compile
    and the CPU kernels off, where inductor compiles the KDA chunk terms: every prompt position's logprob and the
    first token as eager."""
    gen = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 4000, (n,), generator=gen).tolist()} for n in (65, 130, 300)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    runs = []
    for compile in (False, True):
        llm = LLM(str(BUNDLED_MODEL), dtype="float32", enable_torch_compile=compile, disable_radix_cache=True)
        outputs = llm.generate(prompts, params)
        runs.append([(o.outputs[0].token_ids, torch.tensor([entry[token].logprob for entry, token in
                                                            zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]))
                     for o in outputs])
    assert kda._compiled_intra_chunk_terms.cache_info().currsize and "inductor" not in kda._failed_backends
    for (eager_tokens, eager_logprobs), (tokens, logprobs) in zip(*runs, strict=True):
        assert tokens == eager_tokens
        torch.testing.assert_close(logprobs, eager_logprobs, rtol=0, atol=1e-4)
