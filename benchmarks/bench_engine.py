"""The engine on the CPU with the bundled model (models/k3.1-tiny): offline throughput against transformers'
generate, engine overhead, memory promises.

One run, same machine; kestrel serves the bundled model in float32 (its routed experts stay MXFP4), and every
prompt is a stretch of the model's held-out sample (heldout_sample.txt):
1. Throughput: 1 request, and 32 requests of mixed prompt (16-256) and output (16-128) lengths, greedy, ignoring
   EOS. transformers cannot load the bundled model (AttnRes, latent SiTU MoE, indexer), so its baseline is
   `KimiLinearForCausalLM` with the closest configuration it can express, random weights, float32
   (transformers_kimi_linear.closest_model: less work per token than kestrel's), run as one left-padded batch that
   generates the longest output length for all; both are credited only with the requested output tokens. "same
   tokens" counts requests whose engine tokens equal the argmax of a plain full forward pass of the same model
   over the prompt and the earlier tokens (no cache, one sequence at a time).
2. Engine overhead: the share of step time spent outside the model forward and logits, at 64 running requests.
3. Memory: the concurrency the planner promises for a budget against the concurrency actually admitted.
Other work shares these machines' cores, so every process runs one torch thread (report.THREADS), the two sides of
each throughput workload run alternately, ROUNDS times each, and the best time of each is kept; the load average
before and after is printed with the tables.
Writes the section "engine" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformers_kimi_linear  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402
from kestrel.layers.batch import ForwardBatch  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_engine.py"
MODEL = str(BUNDLED_MODEL)
ROUNDS = 2


def text_config() -> dict:
    return json.loads((BUNDLED_MODEL / "config.json").read_text())["text_config"]


def sample_ids(llm: LLM) -> list[int]:
    """The held-out sample's token ids (no [BOS])."""
    return llm.engine.tokenizer.encode((BUNDLED_MODEL / "heldout_sample.txt").read_text(), add_special_tokens=False)


def workload(ids: list[int], count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """count prompts of 16-256 consecutive ids from random places of `ids`, and output lengths of 16-128."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 257, (count,), generator=gen).tolist()
    starts = [int(torch.randint(0, len(ids) - n, (1,), generator=gen)) for n in lengths]
    outputs = torch.randint(16, 129, (count,), generator=gen).tolist()
    return [ids[s:s + n] for s, n in zip(starts, lengths)], outputs


def run_kestrel(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, [r.outputs[0].token_ids for r in results]


def run_transformers(model, prompts: list[list[int]], outputs: list[int], pad: int) -> float:
    """Seconds for one left-padded greedy generate of max(outputs) tokens for every prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outputs), min_new_tokens=max(outputs),
                       do_sample=False, pad_token_id=pad, eos_token_id=None)
    return time.perf_counter() - start


@torch.inference_mode()
def matches_full_forward(llm: LLM, prompt: list[int], tokens: list[int]) -> bool:
    """Whether tokens are the argmax of one plain forward pass over prompt + tokens at every generated position."""
    model = llm.engine.model
    sequence = torch.tensor(prompt + tokens)
    logits = model.compute_logits(model(sequence, ForwardBatch.build([len(sequence)])))
    return logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens


def throughput_rows(llm: LLM, ids: list[int]) -> list[list[object]]:
    text = text_config()
    baseline = transformers_kimi_linear.closest_model(text).eval()
    rows = []
    for label, (prompts, outputs) in (("1 request", ([ids[:64]], [64])), ("32 mixed requests", workload(ids, 32, 0))):
        run_kestrel(llm, prompts[:1], [4])                               # warm-ups
        run_transformers(baseline, prompts[:1], [4], text["pad_token_id"])
        ours, theirs = float("inf"), float("inf")
        for _ in range(ROUNDS):
            seconds, our_tokens = run_kestrel(llm, prompts, outputs)
            ours = min(ours, seconds)
            theirs = min(theirs, run_transformers(baseline, prompts, outputs, text["pad_token_id"]))
        produced = sum(outputs)
        same = sum(matches_full_forward(llm, p, t) for p, t in zip(prompts, our_tokens))
        rows.append([label, produced, f"{produced / ours:,.1f}", f"{produced / theirs:,.1f}",
                     f"{theirs / ours:.2f}x", f"{same}/{len(prompts)}"])
        print(rows[-1], flush=True)
    return rows


def overhead_row(ids: list[int]) -> list[object]:
    """Decode steps at 64 running requests: time inside model forward + logits against the whole step."""
    llm = LLM(MODEL, dtype="float32", max_prefill_tokens=16384, chunked_prefill_size=16384)
    engine, model = llm.engine, llm.engine.model
    inside = 0.0
    for name in ("forward", "compute_logits"):
        original = getattr(model, name)

        def timed(*args, _original=original, **kwargs):
            nonlocal inside
            start = time.perf_counter()
            result = _original(*args, **kwargs)
            inside += time.perf_counter() - start
            return result
        setattr(model, name, timed)
    prompts, _ = workload(ids, 64, seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()                                                        # prefill all 64
    inside, total, steps = 0.0, 0.0, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        total += time.perf_counter() - start
        steps += 1
    return [64, steps, f"{1000 * total / steps:.1f}", f"{1000 * inside / steps:.1f}",
            f"{100 * (total - inside) / total:.1f}%"]


def memory_row(ids: list[int]) -> list[object]:
    """A budget whose state pool holds a few dozen slots; more requests than that, each short."""
    llm = LLM(MODEL, dtype="float32", max_mamba_cache_size=24, max_total_tokens=24 * 512, page_size=16)
    engine, plan = llm.engine, llm.engine.plan
    prompts, _ = workload(ids, 60, seed=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    admitted = 0
    while engine.has_unfinished_requests():
        engine.step()
        admitted = max(admitted, len(engine.scheduler.running))
    return [plan.num_slots, plan.kv_tokens, plan.max_running_requests, admitted,
            engine.scheduler.num_preemptions]


def main() -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    llm = LLM(MODEL, dtype="float32")
    ids = sample_ids(llm)
    throughput = throughput_rows(llm, ids)
    overhead = overhead_row(ids)
    print(overhead, flush=True)
    memory = memory_row(ids)
    print(memory, flush=True)
    load_after = os.getloadavg()[0]
    body = "\n\n".join([
        "## Engine (CPU)",
        "The bundled model, `models/k3.1-tiny`, served in float32 (routed experts stay MXFP4); every prompt is a "
        "stretch of its held-out sample. Greedy decoding, EOS ignored. transformers cannot load this model (AttnRes, "
        "latent SiTU MoE, indexer), so its column is `KimiLinearForCausalLM` with the closest configuration it can "
        "express (same widths, layer pattern, heads, latents and experts; no AttnRes, experts at the hidden size, "
        "SwiGLU, no indexer, no MTP layer: less work per token than kestrel's), random weights, float32, its torch "
        "paths (fla hidden), each workload as one left-padded `generate` batch producing the longest requested "
        "length for every row; both are credited with the requested output tokens only. \"same tokens\" counts "
        "requests whose engine tokens equal the argmax of a plain full forward pass of the same model over the "
        "prompt and the earlier tokens (no cache, one sequence at a time). The two sides of each workload ran "
        f"alternately, {ROUNDS} times each; the table keeps each side's best time.",
        f"{machine()}; load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores "
        "shared with other work (one torch thread per process, which keeps steps from waiting on the busier core), "
        "so compare the ratios, not the absolute rates.",
        markdown_table(["workload", "output tokens", "kestrel tok/s", "transformers tok/s", "kestrel / transformers",
                        "same tokens"], throughput),
        "Engine overhead: decode steps with 64 running requests; \"inside\" is time in the model forward and "
        "logits, the rest is scheduling, batch building, sampling and output bookkeeping.",
        markdown_table(["running", "steps", "ms / step", "ms inside model", "outside share"], [overhead]),
        "Memory: a budget fixed at 24 state slots and 12,288 KV tokens (page 16); 60 requests of 16-256 "
        "prompt tokens and 32 output tokens. \"admitted\" is the most requests ever running at once.",
        markdown_table(["state slots", "KV tokens", "promised cap", "admitted", "preemptions"], [memory]),
        f"Rerun: `{COMMAND}`",
    ])
    write_section("engine", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
