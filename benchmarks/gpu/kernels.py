"""Each Triton kernel against its torch reference on model-sized inputs: time, achieved bandwidth and FLOP/s,
and the largest difference of the outputs (relative to the reference's largest magnitude).

Shapes are Kimi-Linear-48B's (32 KDA and MLA heads, head_dim 128, 256 dense experts of 2304 -> 1024) and K3's
(96 heads, lower-bounded gate, 896 MXFP4 experts of 3584 -> 3072 with SiTU, AttnRes over 7168) or K3.1's
(indexer of 32 heads x 128, top-2048 sparse MLA); activations bf16. KDA prefill is also timed against fla's
chunk_kda when fla imports.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.timing import cuda_time_ms
from kestrel.ops import backend
from kestrel.ops.torch.kda_decode import KDALayerParams
from kestrel.ops.torch.moe import ExpertWeights, GLUActivation

DEVICE = "cuda"
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
MUTATED = {"kda_decode": ("conv_pool", "state_pool"), "kda_prefill": ("state_pool",)}
"""Inputs an op updates in place: the correctness check gives each side its own copy."""


@dataclass
class Case:
    """One timed call: the op's registry name, a label, its inputs, and the least HBM traffic and work it implies."""

    op: str
    label: str
    inputs: dict[str, Any]
    bytes: float
    flops: float = 0.0
    tokens: int = 0


def randn(*shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def kda_decode_case(seqs: int, heads: int, dim: int, lower_bound: float | None, tokens_per_seq: int = 1) -> Case:
    """A decode step (or a speculative verification of tokens_per_seq tokens, keeping per-token states)."""
    tokens, channels, keep = seqs * tokens_per_seq, 3 * heads * dim, tokens_per_seq > 1
    params = KDALayerParams(conv_weight=randn(channels, 4, dtype=torch.float32, scale=0.3),
                            A_log=torch.rand(heads, device=DEVICE) * 2.7,
                            dt_bias=randn(heads * dim, dtype=torch.float32),
                            norm_weight=torch.ones(dim, device=DEVICE), lower_bound=lower_bound, norm_eps=1e-5)
    inputs = dict(qkv=randn(tokens, channels), gate_raw=randn(tokens, heads, dim), beta_raw=randn(tokens, heads),
                  out_gate=randn(tokens, heads, dim), params=params, conv_pool=randn(seqs, 3, channels),
                  state_pool=randn(seqs, heads, dim, dim, dtype=torch.float32, scale=0.1),
                  slots=torch.randperm(seqs, device=DEVICE),
                  cu_seqlens=torch.arange(seqs + 1, device=DEVICE) * tokens_per_seq,
                  use_state=torch.ones(seqs, dtype=torch.bool, device=DEVICE), keep_token_states=keep)
    state_bytes = seqs * heads * dim * dim * 4 * (1 if keep else 2) + tokens * heads * dim * dim * 4 * keep
    bytes_ = state_bytes + 2 * seqs * 3 * channels * 2 + tokens * (channels + 3 * heads * dim + heads) * 2
    label = f"N={seqs}x{tokens_per_seq} H={heads} D={dim} {'K3 gate' if lower_bound else 'softplus gate'}"
    return Case("kda_decode", label, inputs, bytes_, flops=tokens * heads * dim * dim * 6, tokens=tokens)


def kda_prefill_inputs(seqs: int, length: int, heads: int, dim: int) -> dict[str, Any]:
    """q, k (L2-normalised fp32, as the layer makes them), v bf16, Kimi-Linear's gate, sigmoid beta, a pool."""
    tokens = seqs * length
    raw = torch.randn(tokens, heads, dim, device=DEVICE)
    g = -torch.exp(torch.rand(heads, 1, device=DEVICE) * 2.7) * F.softplus(raw)
    return dict(q=F.normalize(torch.randn(tokens, heads, dim, device=DEVICE), dim=-1),
                k=F.normalize(torch.randn(tokens, heads, dim, device=DEVICE), dim=-1), v=randn(tokens, heads, dim),
                g=g, beta=torch.rand(tokens, heads, device=DEVICE),
                cu_seqlens=torch.arange(seqs + 1, device=DEVICE) * length,
                state_pool=randn(seqs, heads, dim, dim, dtype=torch.float32, scale=0.1),
                slots=torch.arange(seqs, device=DEVICE), use_state=torch.ones(seqs, dtype=torch.bool, device=DEVICE))


def kda_prefill_case(seqs: int, length: int, heads: int, dim: int, chunk_size: int) -> Case:
    inputs = {**kda_prefill_inputs(seqs, length, heads, dim), "chunk_size": chunk_size}
    tokens = seqs * length
    bytes_ = tokens * heads * dim * (4 + 4 + 2 + 4 + 2) + 2 * seqs * heads * dim * dim * 4   # q k v g o, states
    return Case("kda_prefill", f"{seqs}x{length} tokens H={heads} D={dim} chunk={chunk_size}", inputs, bytes_,
                tokens=tokens)


def paged_cache(rows: int, dim: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not fp8:
        return randn(rows, dim), None
    return randn(rows, dim, dtype=torch.float32, scale=100).to(FP8), torch.full((rows,), 0.01, device=DEVICE)


def mla_case(seqs: int, heads: int, context: int, fp8: bool = False, topk: int | None = None) -> Case:
    """Absorbed MLA decode of one token per sequence over `context` cached tokens (576 values each)."""
    page_size, row = 64, 576
    pages = math.ceil(context / page_size)
    values, scales = paged_cache(seqs * pages * page_size, row, fp8)
    selected = torch.rand(seqs, context, device=DEVICE).topk(topk).indices if topk else None
    inputs = dict(q=randn(seqs, heads, row, scale=0.1), cache_values=values, cache_scales=scales,
                  page_table=torch.randperm(seqs * pages, device=DEVICE).view(seqs, pages), page_size=page_size,
                  seq_index=torch.arange(seqs, device=DEVICE),
                  positions=torch.full((seqs,), context - 1, device=DEVICE), scale=192 ** -0.5, value_dim=512,
                  selected=selected)
    read = topk or context
    bytes_ = seqs * read * (row * values.element_size() + (4 if fp8 else 0)) + seqs * heads * (row + 512) * 2
    label = f"N={seqs} H={heads} ctx={context}{' fp8' if fp8 else ''}{f' top-{topk}' if topk else ''}"
    return Case("paged_mla_decode", label, inputs, bytes_, flops=2 * seqs * heads * read * (row + 512),
                tokens=seqs)


def indexer_case(seqs: int, context: int, fp8: bool = False, heads: int = 32, dim: int = 128) -> Case:
    page_size = 64
    pages = math.ceil(context / page_size)
    values, scales = paged_cache(seqs * pages * page_size, dim, fp8)
    inputs = dict(q=randn(seqs, heads, dim), weights=torch.randn(seqs, heads, device=DEVICE) * heads ** -0.5,
                  key_values=values, key_scales=scales,
                  page_table=torch.randperm(seqs * pages, device=DEVICE).view(seqs, pages), page_size=page_size,
                  seq_index=torch.arange(seqs, device=DEVICE),
                  positions=torch.full((seqs,), context - 1, device=DEVICE), context_len=context)
    bytes_ = seqs * context * (dim * values.element_size() + (4 if fp8 else 0) + 4)
    return Case("paged_indexer_scores", f"N={seqs} Hi={heads} ctx={context}{' fp8' if fp8 else ''}", inputs,
                bytes_, flops=2 * seqs * heads * dim * context, tokens=seqs)


def moe_case(tokens: int, experts: int, top_k: int, dim: int, inter: int, mxfp4: bool, activation: GLUActivation,
             mxfp8: bool = False) -> Case:
    """The routed experts of one MoE layer for `tokens` tokens, each routed to top_k distinct experts (W4A8 with
    mxfp8: activations rounded to MXFP8)."""
    if mxfp4:
        packed = [torch.randint(0, 256, shape, dtype=torch.uint8, device=DEVICE)
                  for shape in ((experts, inter, dim // 2), (experts, inter, dim // 2), (experts, dim, inter // 2))]
        scales = [torch.full((*p.shape[:2], p.shape[2] // 16), 120, dtype=torch.uint8, device=DEVICE) for p in packed]
        weights, per_weight = ExpertWeights(*packed, *scales), 0.5 + 1 / 32
    else:
        weights = ExpertWeights(randn(experts, inter, dim, scale=0.02), randn(experts, inter, dim, scale=0.02),
                                randn(experts, dim, inter, scale=0.02))
        per_weight = 2
    ids = torch.rand(tokens, experts, device=DEVICE).topk(top_k).indices
    used = int(ids.unique().numel())
    inputs = dict(z=randn(tokens, dim), ids=ids, weights=torch.rand(tokens, top_k, device=DEVICE), experts=weights,
                  activation=activation, mxfp8_activations=mxfp8)
    bytes_ = used * 3 * inter * dim * per_weight + tokens * dim * 4
    label = (f"T={tokens} E={experts} k={top_k} {dim}->{inter} {'MXFP4' if mxfp4 else 'bf16'} {activation.kind}"
             f"{' A8' if mxfp8 else ''}")
    return Case("moe_experts", label, inputs, bytes_, flops=2 * 3 * tokens * top_k * inter * dim, tokens=tokens)


def attn_res_case(tokens: int, sources: int, dim: int) -> Case:
    inputs = dict(sources=randn(sources, tokens, dim), mix_norm_weight=torch.ones(dim, device=DEVICE),
                  proj_weight=torch.randn(dim, device=DEVICE), mix_eps=1e-5,
                  norm_weight=torch.ones(dim, device=DEVICE), norm_eps=1e-5)
    return Case("attn_res_mix_norm", f"T={tokens} S={sources} D={dim}", inputs, (sources + 1) * tokens * dim * 2,
                tokens=tokens)


def all_cases() -> list[Callable[[], Case]]:
    """The cases in run order (built lazily, one at a time, so their inputs never pile up on the device)."""
    k3_situ = GLUActivation("situ", 4.0, 25.0)
    return [
        *(lambda n=n: kda_decode_case(n, 32, 128, None) for n in (1, 32, 128)),
        lambda: kda_decode_case(32, 96, 128, -5.0),
        lambda: kda_decode_case(32, 32, 128, None, tokens_per_seq=4),
        lambda: kda_prefill_case(4, 2048, 32, 128, 64),
        lambda: kda_prefill_case(4, 2048, 32, 128, 32),
        *(lambda n=n: mla_case(n, 32, 4096) for n in (1, 32, 128)),
        lambda: mla_case(32, 32, 4096, fp8=True),
        lambda: mla_case(32, 96, 8192, topk=2048),
        lambda: indexer_case(32, 8192),
        lambda: indexer_case(32, 8192, fp8=True),
        *(lambda t=t: moe_case(t, 256, 8, 2304, 1024, False, GLUActivation("silu")) for t in (1, 32, 128)),
        *(lambda t=t: moe_case(t, 896, 16, 3584, 3072, True, k3_situ) for t in (1, 16)),
        *(lambda t=t: moe_case(t, 896, 16, 3584, 3072, True, k3_situ, mxfp8=True) for t in (16, 256)),
        *(lambda t=t: attn_res_case(t, 9, 7168) for t in (1, 128)),
    ]


def implementations(op: str) -> tuple[Callable, Callable]:
    """(torch reference, Triton kernel) of op, through the backend registry."""
    backend.set_backend(backend.TORCH)
    reference = backend.get_op(op, DEVICE)
    backend.set_backend(backend.TRITON)
    kernel = backend.get_op(op, DEVICE)
    backend.set_backend(None)
    return reference, kernel


def primary(out: Any) -> torch.Tensor:
    """The output compared between backends: o for the KDA ops, else the result."""
    return out[0] if isinstance(out, tuple) else out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over the reference's finite entries, over its largest finite magnitude."""
    finite = expected.isfinite()
    if not finite.any():
        return 0.0
    scale = expected[finite].float().abs().max().clamp(min=1e-12)
    return float((actual[finite].float() - expected[finite].float()).abs().max() / scale)


def run_case(case: Case) -> dict[str, Any]:
    reference, kernel = implementations(case.op)
    mutated = MUTATED.get(case.op, ())

    def own_copy() -> dict[str, Any]:
        return {k: v.clone() if k in mutated else v for k, v in case.inputs.items()}

    error = relative_error(primary(kernel(**own_copy())), primary(reference(**own_copy())))
    triton_ms = cuda_time_ms(lambda: kernel(**case.inputs))
    torch_ms = cuda_time_ms(lambda: reference(**case.inputs), warmup=1, iters=5)
    return result_row(case, triton_ms, torch_ms, error)


def result_row(case: Case, triton_ms: float, torch_ms: float, error: float) -> dict[str, Any]:
    seconds = triton_ms * 1e-3
    return dict(op=case.op, shape=case.label, triton_ms=round(triton_ms, 4), torch_ms=round(torch_ms, 4),
                speedup=round(torch_ms / triton_ms, 2), triton_gbps=round(case.bytes / seconds / 1e9, 1),
                triton_tflops=round(case.flops / seconds / 1e12, 2),
                tokens_per_s=round(case.tokens / seconds) if case.tokens else None,
                max_rel_error=float(f"{error:.2e}"))


def fla_prefill_row(seqs: int = 4, length: int = 2048, heads: int = 32, dim: int = 128) -> dict[str, Any]:
    """kestrel's Triton prefill (chunk 64) against fla's chunk_kda on the same inputs (no pool for fla)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    inputs = kda_prefill_inputs(seqs, length, heads, dim)
    _, kernel = implementations("kda_prefill")
    initial = inputs["state_pool"].clone()
    fla_inputs = [inputs[n].unsqueeze(0).to(BF16) for n in ("q", "k", "v")]
    fla_inputs += [inputs["g"].unsqueeze(0), inputs["beta"].unsqueeze(0).to(BF16)]

    def fla_call() -> torch.Tensor:
        o, _ = fla_chunk_kda(*fla_inputs, initial_state=initial, output_final_state=True,
                             cu_seqlens=inputs["cu_seqlens"])
        return o[0]

    error = relative_error(fla_call(), kernel(**{**inputs, "state_pool": initial.clone()})[0])
    fla_ms, kestrel_ms = cuda_time_ms(fla_call), cuda_time_ms(lambda: kernel(**inputs))
    tokens = seqs * length
    return dict(shape=f"{seqs}x{length} tokens H={heads} D={dim}", kestrel_ms=round(kestrel_ms, 3),
                fla_ms=round(fla_ms, 3), kestrel_vs_fla=round(fla_ms / kestrel_ms, 2),
                kestrel_tokens_per_s=round(tokens / kestrel_ms * 1e3), max_rel_diff=float(f"{error:.2e}"))
