"""The engine on the CPU: offline throughput against transformers' generate, engine overhead, memory promises.

One run, same machine, one Kimi-Linear-format checkpoint written by transformers' own KimiLinearForCausalLM
(random weights, float32):
1. Throughput: 1 request, and 32 requests of mixed prompt (16-256) and output (16-128) lengths, greedy.
   transformers runs the 32 as one left-padded batch (generating the longest output length for all);
   both are credited only with the requested output tokens.
2. Engine overhead: the share of step time spent outside the model forward and logits, at 64 running requests.
3. Memory: the concurrency the planner promises for a budget against the concurrency actually admitted.
Writes the section "engine" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformers_kimi_linear  # noqa: E402
from benchmarks.report import machine, markdown_table, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_engine.py"
VOCAB = 4096


def write_checkpoint(folder: Path) -> None:
    modeling = transformers_kimi_linear.load()
    config = modeling.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_local_experts=16, num_experts_per_tok=2, n_shared_experts=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]})
    torch.manual_seed(0)
    modeling.KimiLinearForCausalLM(config).save_pretrained(folder)


def workload(count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 257, (count,), generator=gen)]
    outputs = torch.randint(16, 129, (count,), generator=gen).tolist()
    return prompts, outputs


def run_kestrel(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, [r.outputs[0].token_ids for r in results]


def run_transformers(model, prompts: list[list[int]], outputs: list[int]) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outputs), min_new_tokens=max(outputs),
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    elapsed = time.perf_counter() - start
    return elapsed, [out[i, width:width + n].tolist() for i, n in enumerate(outputs)]


def throughput_rows(folder: Path) -> list[list[object]]:
    modeling = transformers_kimi_linear.load()
    reference = modeling.KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32")
    rows = []
    for label, (prompts, outputs) in (("1 request", ([list(range(3, 67))], [64])),
                                      ("32 mixed requests", workload(32, seed=0))):
        run_kestrel(llm, prompts[:1], [4])                               # warm-up
        ours, our_tokens = run_kestrel(llm, prompts, outputs)
        theirs, their_tokens = run_transformers(reference, prompts, outputs)
        produced = sum(outputs)
        same = sum(a == b for a, b in zip(our_tokens, their_tokens))
        rows.append([label, produced, f"{produced / ours:,.1f}", f"{produced / theirs:,.1f}",
                     f"{theirs / ours:.2f}x", f"{same}/{len(prompts)}"])
        print(rows[-1], flush=True)
    return rows


def overhead_row(folder: Path) -> list[object]:
    """Decode steps at 64 running requests: time inside model forward + logits against the whole step."""
    llm = LLM(str(folder), dtype="float32", max_prefill_tokens=16384, chunked_prefill_size=16384)
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
    prompts, _ = workload(64, seed=1)
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


def memory_row(folder: Path) -> list[object]:
    """A budget whose state pool holds a few dozen slots; more requests than that, each short."""
    llm = LLM(str(folder), dtype="float32", max_mamba_cache_size=24, max_total_tokens=24 * 512, page_size=16)
    engine, plan = llm.engine, llm.engine.plan
    prompts, _ = workload(60, seed=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    admitted = 0
    while engine.has_unfinished_requests():
        engine.step()
        admitted = max(admitted, len(engine.scheduler.running))
    return [plan.num_slots, plan.kv_tokens, plan.max_running_requests, admitted,
            engine.scheduler.num_preemptions]


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder)
        throughput = throughput_rows(folder)
        overhead = overhead_row(folder)
        print(overhead, flush=True)
        memory = memory_row(folder)
        print(memory, flush=True)
    body = "\n\n".join([
        "## Engine (CPU)",
        "A Kimi-Linear-format checkpoint written by transformers' `KimiLinearForCausalLM.save_pretrained` "
        "(hidden 512, 8 layers: 6 KDA + 2 MLA, 16 experts top-2, vocab 4096; random weights, float32). "
        "Greedy decoding; transformers runs each workload as one left-padded `generate` batch (its torch paths: "
        "fla hidden) and produces the longest requested length for every row; both are credited with the "
        "requested output tokens only. \"same tokens\" counts requests whose greedy outputs agree exactly.",
        machine(),
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
    main()
