"""End-to-end decode and prefill of a Kimi-Linear-48B-shaped model (random weights, bf16 activations and caches) on
one GPU, in the configuration benchmarks/gpu/sizing.py picks for the device (bf16 or MXFP4 routed experts, all
layers or a stated cut).

Decode is timed at several batch sizes over a context already in the cache (its pages and state slots are filled
with random values rather than prefilled, which would take longer than the whole benchmark), eagerly and replayed
from CUDA graphs as the engine runs it (kestrel.engine.decode_graphs), and so is a speculative verification of 4
drafts per sequence (eagerly, as the engine runs verifications: the cost side of speculation; with random weights
there is no acceptance to measure), and compared with the bandwidth bound: the
HBM bandwidth over the bytes one step must move (every weight but the routed experts, the experts the step's
tokens are routed to, the latent KV read, the KDA states read and written). The step runs whatever backend the
layers use; which one ran is read from the kernel names of a profiled eager step.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.sizing import Sizing
from kestrel.config import ModelConfig
from kestrel.engine.cache.page_table import PageTable
from kestrel.engine.decode_graphs import DecodeGraphs
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.layers.moe import RoutedExperts, Router
from kestrel.layers.norm import RMSNorm
from kestrel.models.checkpoint import build_model
from kestrel.models.kimi import KimiForCausalLM

MODEL = "kimi-linear-48b"
CONTEXT = 2048
BATCHES = (1, 32, 128)
PAGE_SIZE = 64
WARMUP_STEPS, DECODE_STEPS = 2, 8
PREFILL_SEQS, PREFILL_LEN = 4, 2048
VERIFY_BATCHES, VERIFY_TOKENS = (1, 32), 5
PAGES_PER_SEQ = math.ceil((CONTEXT + WARMUP_STEPS + DECODE_STEPS + 1) / PAGE_SIZE)
CACHE_SLOTS, CACHE_PAGES = max(BATCHES) + 1, max(BATCHES) * PAGES_PER_SEQ + 1
"""The cache run_model allocates: a state slot and pages for each sequence of the largest batch, plus the scratch slot
and page that graph padding writes to."""
TRITON_KERNELS = {"_kda_decode_kernel": "kda", "_intra_chunk_kernel": "kda", "_state_scan_kernel": "kda",
                  "_partial_kernel": "attention", "_combine_kernel": "attention", "_scores_kernel": "attention",
                  "_gate_up_kernel": "moe", "_down_kernel": "moe", "_mix_norm_kernel": "norm"}
"""kestrel's Triton kernels by name, and the op family each belongs to."""


@torch.no_grad()
def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Random weights drawn on the device (init_weights draws on the CPU: minutes for 48B values).

    N(0, 0.02) for matrices and embeddings, ones for norm weights, A_log = log U(1, 16), dt_bias ~ U(-6.9, -2.3)
    (about softplus^-1 of U(1e-3, 0.1)), a zero router bias; MXFP4 codes uniform with scale 2^-7.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if isinstance(module, (RMSNorm, nn.LayerNorm)):
                tensor.fill_(1.0 if name == "weight" else 0.0)
            elif name == "A_log":
                tensor.uniform_(1, 16, generator=gen).log_()
            elif name == "dt_bias":
                tensor.uniform_(-6.9, -2.3, generator=gen)
            elif name == "e_score_correction_bias":
                tensor.zero_()
            elif tensor.dtype == torch.uint8 and name.endswith("_scale"):
                tensor.fill_(120)
            elif tensor.dtype == torch.uint8:
                tensor.random_(0, 256, generator=gen)
            else:
                tensor.normal_(0, 0.02, generator=gen)


@torch.no_grad()
def fill_cache(cache: HybridCache) -> None:
    """Random finite contents for every state slot and cache row (stands in for the prefilled context)."""
    for state in cache.kda:
        state.conv.normal_()
        state.recurrent.normal_(0, 0.1)
    for pages in cache.mla:
        pages.latent.values.normal_()


def tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def step_bytes(model: KimiForCausalLM, config: ModelConfig, batch: int, context: int, experts_used: int,
               kv_itemsize: int) -> dict[str, int]:
    """HBM bytes one decode step of `batch` sequences at `context` tokens must move, by kind."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    expert_total = sum(tensor_bytes(m) for m in experts)
    per_expert = expert_total // (len(experts) * config.num_experts)
    embedding = model.model.embed_tokens.weight
    weights = tensor_bytes(model) - expert_total - embedding.numel() * embedding.element_size()
    weights += batch * config.hidden_size * embedding.element_size() + experts_used * per_expert
    heads, dim = config.kda_num_heads, config.kda_head_dim
    state = len(config.kda_layers) * batch * 2 * (heads * dim * dim * 4 + (config.conv_kernel_size - 1) * 3 * heads
                                                  * dim * embedding.element_size())
    kv = len(config.mla_layers) * batch * (context + 1) * config.kv_cache_dim * kv_itemsize
    return {"weights": weights, "kv": kv, "state": state, "total": weights + kv + state}


def experts_used(model: nn.Module, step) -> int:
    """The distinct experts the routers pick during one call of step(), summed over layers (forward hooks, which
    synchronise: keep this call out of timings)."""
    used = 0

    def count(module: nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        nonlocal used
        used += int(output[0].unique().numel())

    handles = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, Router)]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return used


def backends_used(step) -> dict[str, str]:
    """Which backend each op family ran on in one call of step(): "triton" where a kestrel kernel ran."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    families = dict.fromkeys(TRITON_KERNELS.values(), "torch")
    for kernel, family in TRITON_KERNELS.items():
        if any(kernel in name for name in names):
            families[family] = "triton"
    return families


def median_step_seconds(step) -> float:
    """Median wall time of step(i) over DECODE_STEPS calls, after WARMUP_STEPS (i counts every call)."""
    times = []
    for i in range(WARMUP_STEPS + DECODE_STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_batch(model: KimiForCausalLM, cache: HybridCache, graphs: DecodeGraphs, batch_size: int,
                 bandwidth_gbps: float, page_table: torch.Tensor) -> dict[str, Any]:
    """Median step time of batch_size sequences decoding at CONTEXT, eagerly and from a CUDA graph (the first
    warm-up step captures it), and the fraction of the bandwidth bound each reaches. step_ms, tokens_per_s and
    fraction_of_bound are the graph's, or the eager step's with graph_error when capture or replay failed."""
    config = model.config
    slots, rows = list(range(batch_size)), page_table[:batch_size]

    def eager(i: int) -> None:
        batch = ForwardBatch.build([1] * batch_size, [CONTEXT + i] * batch_size, slots, rows, PAGE_SIZE, "cuda")
        model.compute_logits(model(torch.randint(config.vocab_size, (batch_size,), device="cuda"), batch, cache))

    used = experts_used(model, lambda: eager(0))
    eager_s = median_step_seconds(eager)
    moved = step_bytes(model, config, batch_size, CONTEXT, used, cache.mla[0].latent.values.element_size())
    bound = moved["total"] / (bandwidth_gbps * 1e9)
    row = dict(batch=batch_size, context=CONTEXT, eager_step_ms=round(eager_s * 1e3, 2),
               bytes_per_step_gb=round(moved["total"] / 1e9, 3), weights_gb=round(moved["weights"] / 1e9, 3),
               kv_gb=round(moved["kv"] / 1e9, 3), state_gb=round(moved["state"] / 1e9, 3),
               bound_ms=round(bound * 1e3, 3), eager_fraction_of_bound=round(bound / eager_s, 3))
    ids, longest = torch.randint(config.vocab_size, (batch_size,)).tolist(), rows.shape[1]
    try:
        graph_s = median_step_seconds(lambda i: graphs.run(ids, [CONTEXT + i] * batch_size, slots, longest))
    except Exception as error:                       # noqa: BLE001 - recorded; the eager numbers stand
        return {**row, "graph_error": f"{type(error).__name__}: {error}", "step_ms": row["eager_step_ms"],
                "tokens_per_s": round(batch_size / eager_s), "fraction_of_bound": row["eager_fraction_of_bound"]}
    return {**row, "step_ms": round(graph_s * 1e3, 2), "tokens_per_s": round(batch_size / graph_s),
            "fraction_of_bound": round(bound / graph_s, 3)}


def verify_batch(model: KimiForCausalLM, cache: HybridCache, batch_size: int, page_table: torch.Tensor,
                 decode_ms: float) -> dict[str, Any]:
    """Median step time of batch_size sequences each verifying VERIFY_TOKENS tokens (a speculative verification of
    VERIFY_TOKENS - 1 drafts) at CONTEXT, eagerly and keeping every token's KDA state, as the engine runs
    verifications; against decode_ms, the decode step's, the tokens a verification must emit to beat plain
    decoding (the draft's own cost aside). Acceptance is not measured: the weights are random."""
    slots, rows = list(range(batch_size)), page_table[:batch_size]
    batch = ForwardBatch.build([VERIFY_TOKENS] * batch_size, [CONTEXT] * batch_size, slots, rows, PAGE_SIZE, "cuda",
                               keep_token_states=True)

    def verify(i: int) -> None:
        ids = torch.randint(model.config.vocab_size, (batch_size * VERIFY_TOKENS,), device="cuda")
        model.compute_logits(model(ids, batch, cache))

    seconds = median_step_seconds(verify)
    return dict(batch=batch_size, tokens_per_seq=VERIFY_TOKENS, verify_ms=round(seconds * 1e3, 2),
                decode_ms=decode_ms, break_even_tokens=round(seconds * 1e3 / decode_ms, 2))


def prefill(model: KimiForCausalLM, cache: HybridCache, page_table: torch.Tensor) -> dict[str, Any]:
    """Prefill throughput: PREFILL_SEQS fresh sequences of PREFILL_LEN tokens in one forward call."""
    batch = ForwardBatch.build([PREFILL_LEN] * PREFILL_SEQS, None, list(range(PREFILL_SEQS)),
                               page_table[:PREFILL_SEQS], PAGE_SIZE, "cuda")
    ids = torch.randint(model.config.vocab_size, (PREFILL_SEQS * PREFILL_LEN,), device="cuda")
    last = batch.cu_seqlens[1:] - 1
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.compute_logits(model(ids, batch, cache)[last])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    tokens = PREFILL_SEQS * PREFILL_LEN
    return dict(sequences=PREFILL_SEQS, length=PREFILL_LEN, ms=round(seconds * 1e3, 1),
                tokens_per_s=round(tokens / seconds))


@torch.inference_mode()
def run_model(bandwidth_gbps: float, sized: Sizing, deadline: float) -> dict[str, Any]:
    """Build the sized model, then time decode at each of BATCHES, the verifications and one prefill; returns the
    section's results. A part that would start after `deadline` (time.monotonic()) is left out and named in "left_out";
    decode at the first batch size always runs."""
    config = sized.config
    model = build_model(config, torch.bfloat16, "cuda").eval()
    fill_random(model)
    slots, pages = CACHE_SLOTS - 1, CACHE_PAGES - 1
    cache = HybridCache.allocate(config, num_slots=slots + 1, num_pages=pages + 1, page_size=PAGE_SIZE,
                                 dtype=torch.bfloat16, device="cuda")              # the last: graph padding's
    fill_cache(cache)
    page_table = torch.arange(pages, device="cuda").view(slots, PAGES_PER_SEQ)
    table = PageTable(slots + 1, PAGES_PER_SEQ, fill=pages, device="cuda")   # scratch slot's row: scratch page
    for slot in range(slots):
        table.set(slot, 0, page_table[slot].tolist())
    table.flush()
    graphs = DecodeGraphs(model, cache, table, max(BATCHES), scratch_slot=slots)
    one_step = ForwardBatch.build([1], [CONTEXT], [0], page_table[:1], PAGE_SIZE, "cuda")
    backends = backends_used(lambda: model(torch.zeros(1, dtype=torch.long, device="cuda"), one_step, cache))
    left_out: list[str] = []

    def in_time(part: str) -> bool:
        if time.monotonic() < deadline:
            return True
        left_out.append(part)
        return False

    decode = [decode_batch(model, cache, graphs, b, bandwidth_gbps, page_table) for b in BATCHES
              if b == BATCHES[0] or in_time(f"decode at batch {b}")]
    step_ms = {d["batch"]: d["step_ms"] for d in decode}
    verify = [verify_batch(model, cache, b, page_table, step_ms[b]) for b in VERIFY_BATCHES
              if b in step_ms and in_time(f"verification at batch {b}")]
    prefilled = prefill(model, cache, page_table) if in_time("prefill") else None
    return dict(model=MODEL, parameters_b=round(sized.parameters / 1e9, 2), backends=backends, decode=decode,
                verify=verify, prefill=prefilled, left_out=left_out,
                peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 1))
