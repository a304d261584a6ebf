"""The serving engine on the GPU with the bundled model (models/k3.1-tiny): seeded sampling, decode steps replayed
from CUDA graphs against eager decode at every captured batch size, token for token, and tensor parallelism (TP2
over two rank processes) against one process.

- Seeded sampling: a seeded request's torch.Generator must live on the logits' device. One sampled request
  (temperature 1, seed SEED) runs alone twice and once among unseeded requests; it passes when no run
  fails and all three give the same tokens, while seed SEED + 1 gives others (so the seed is used at all).
- CUDA graphs: for each captured batch size b (decode_graphs.batch_sizes: 1, 2, 4, 8, ...), b greedy requests with
  prompts of different lengths and the same output length (so every decode step holds exactly b sequences) run
  through an engine that replays decode from graphs and through one with disable_cuda_graph. It passes when every
  request's tokens are equal and the graph engine replayed steps of batch size b; the largest difference of the
  chosen tokens' logprobs is recorded too (graphs pad the page-table width to a power of two). A known bug class
  elsewhere: graphs silently corrupting batch 1.
Both engines are small (GRAPH_MAX_BS state slots, a few thousand KV tokens) and freed when a check returns. The
checks take the device as an argument, so the CPU tests run them too (with graphs forced on, each replay runs the
captured static step eagerly).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kestrel import LLM, SamplingParams
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.engine.decode_graphs import batch_sizes

SEED = 1234
GRAPH_MAX_BS = 16
NEW_TOKENS = 48
"""Decode steps per graph check: enough for every sequence to cross a page boundary (page size 16)."""


def engine(device: str, max_batch_size: int, graphs: bool) -> LLM:
    """The bundled model on `device` with pools for max_batch_size sequences of up to 512 tokens each (no prefix
    cache: it computes a prompt's last token as a step of its own, which would count as a decode replay)."""
    return LLM(str(BUNDLED_MODEL), device=device, max_mamba_cache_size=max_batch_size,
               max_total_tokens=max_batch_size * 512, max_running_requests=max_batch_size,
               cuda_graph_max_bs=max_batch_size, disable_cuda_graph=not graphs, disable_radix_cache=True)


def sample_prompts(llm: LLM, count: int) -> list[list[int]]:
    """count prompts of 20, 27, 34, ... token ids of the bundled model's held-out sample, from different places."""
    ids = llm.engine.tokenizer.encode((BUNDLED_MODEL / "heldout_sample.txt").read_text(), add_special_tokens=False)
    return [ids[50 * i:50 * i + 20 + 7 * i] for i in range(count)]


def token_ids(outputs: list) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def first_mismatch(graphed: list[list[int]], eager: list[list[int]]) -> dict[str, int] | None:
    """The first request whose tokens differ and the index of its first differing token, or None."""
    for request, (a, b) in enumerate(zip(graphed, eager)):
        if a != b:
            token = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"request": request, "token": token}
    return None


def seeded_sampling(device: str, new_tokens: int = 32) -> dict[str, Any]:
    """The seeded-sampling check (see the module docstring)."""
    llm = engine(device, max_batch_size=8, graphs=True)
    prompt, *others = [{"prompt_token_ids": p} for p in sample_prompts(llm, 5)]
    seeded = SamplingParams(temperature=1.0, seed=SEED, max_tokens=new_tokens, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    other_seed = SamplingParams(temperature=1.0, seed=SEED + 1, max_tokens=new_tokens, ignore_eos=True)
    runs = {"alone": llm.generate(prompt, seeded), "alone again": llm.generate(prompt, seeded),
            "among unseeded": llm.generate([prompt, *others], [seeded] + [unseeded] * len(others)),
            "other seed": llm.generate(prompt, other_seed)}
    reasons = {name: [o.outputs[0].finish_reason for o in outputs] for name, outputs in runs.items()}
    tokens = {name: token_ids(outputs)[0] for name, outputs in runs.items()}
    failed = sorted(name for name, finished in reasons.items() if any(r != "length" for r in finished))
    same = tokens["alone"] == tokens["alone again"] == tokens["among unseeded"]
    differs = tokens["other seed"] != tokens["alone"]
    return dict(seed=SEED, new_tokens=new_tokens, finish_reasons=reasons, failed_runs=failed,
                same_seed_same_tokens=same, other_seed_differs=differs, tokens=tokens["alone"],
                passed=not failed and same and differs)


def graph_row(graph_llm: LLM, eager_llm: LLM, prompts: list[list[int]], new_tokens: int,
              replays: Counter) -> dict[str, Any]:
    """One batch size's comparison: len(prompts) greedy requests through both engines."""
    size = len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    before = replays[size]
    graphed, eager = graph_llm.generate(requests, params), eager_llm.generate(requests, params)
    equal = [a == b for a, b in zip(token_ids(graphed), token_ids(eager))]
    differences = [abs(g.outputs[0].logprobs[j][t].logprob - e.outputs[0].logprobs[j][t].logprob)
                   for g, e, same in zip(graphed, eager, equal) if same
                   for j, t in enumerate(g.outputs[0].token_ids)]
    graphs = graph_llm.engine.runner.decode_graphs
    return dict(batch=size, new_tokens=new_tokens, equal_requests=sum(equal), replays=replays[size] - before,
                widths=sorted(width for b, width, _ in graphs.steps if b == size),
                first_mismatch=first_mismatch(token_ids(graphed), token_ids(eager)),
                max_logprob_diff=float(f"{max(differences, default=0.0):.2e}"),
                passed=all(equal) and replays[size] > before)


def graphs_against_eager(device: str, max_batch_size: int = GRAPH_MAX_BS,
                         new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """The CUDA-graph check (see the module docstring), one row per captured batch size."""
    graph_llm, eager_llm = engine(device, max_batch_size, graphs=True), engine(device, max_batch_size, graphs=False)
    graphs = graph_llm.engine.runner.decode_graphs
    if graphs is None:
        raise RuntimeError(f"the engine on {device} replays no decode from graphs, so there is nothing to compare.")
    replays: Counter = Counter()
    replay = graphs.run

    def counted(token_ids: list[int], *args: Any) -> Any:
        replays[len(token_ids)] += 1
        return replay(token_ids, *args)

    graphs.run = counted
    prompts = sample_prompts(graph_llm, max_batch_size)
    rows = [graph_row(graph_llm, eager_llm, prompts[:size], new_tokens, replays)
            for size in batch_sizes(max_batch_size)]
    return dict(max_batch_size=max_batch_size, rows=rows, passed=all(r["passed"] for r in rows))


def tensor_parallel(device: str, new_tokens: int = 16, requests: int = 4) -> dict[str, Any]:
    """TP2 against one process: greedy requests of different prompt lengths through the bundled model split over 2
    rank processes (2 GPUs when there are, else both sharing one) and through one process; passes when every request's
    tokens are equal. Records the largest difference of the chosen tokens' logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    results = {}
    for tp in (1, 2):
        llm = LLM(str(BUNDLED_MODEL), device=device, tp_size=tp, max_mamba_cache_size=requests,
                  max_total_tokens=requests * 512, disable_radix_cache=True)
        try:
            results[tp] = llm.generate([{"prompt_token_ids": p} for p in sample_prompts(llm, requests)], params)
        finally:
            llm.engine.shutdown()
    single, split = token_ids(results[1]), token_ids(results[2])
    differences = [abs(a.outputs[0].logprobs[j][t].logprob - b.outputs[0].logprobs[j][t].logprob)
                   for a, b, same in zip(results[1], results[2], (x == y for x, y in zip(single, split))) if same
                   for j, t in enumerate(a.outputs[0].token_ids)]
    return dict(tp_size=2, requests=requests, new_tokens=new_tokens,
                equal_requests=sum(a == b for a, b in zip(single, split)), first_mismatch=first_mismatch(split, single),
                max_logprob_diff=float(f"{max(differences, default=0.0):.2e}"), passed=single == split)


def summary(checks: dict[str, Any]) -> dict[str, Any]:
    """The checks' verdicts, for the evidence record: seeded sampling, and graphs against eager per batch size."""
    seeded, graphs = checks.get("seeded_sampling", {}), checks.get("cuda_graphs", {})
    return {"seeded_sampling_passed": seeded.get("passed", False),
            "cuda_graphs_equal_eager": {str(r["batch"]): r["passed"] for r in graphs.get("rows", [])},
            "tp2_equals_one_process": checks.get("tensor_parallel", {}).get("passed", False)}
