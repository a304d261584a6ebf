"""AttnRes depth mix fused with the following RMSNorm: one program per token, one pass over the sources, one output.

Matches `kestrel.ops.torch.attn_res.attn_res_mix_norm` (same signature). Each source row is read once; its logit
and an online softmax over depth update the running mix, which is then rounded to the sources' dtype (as the
reference returns it) and normalised in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix_norm_kernel(sources, mix_norm_weight, proj_weight, norm_weight, out, num_sources, num_tokens,
                     mix_eps, norm_eps, D: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    direction = (tl.load(mix_norm_weight + d, mask=d_ok, other=0.0).to(tl.float32)
                 * tl.load(proj_weight + d, mask=d_ok, other=0.0).to(tl.float32))
    running_max = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, num_sources):
        v = tl.load(sources + (i * num_tokens + t) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        logit = tl.sum(v * direction, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + mix_eps)
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        weight = tl.exp(logit - new_max)
        total = total * rescale + weight
        acc = acc * rescale + weight * v
        running_max = new_max
    mix = (acc / total).to(out.dtype.element_ty)
    if NORM:
        m = mix.to(tl.float32)
        weight = tl.load(norm_weight + d, mask=d_ok, other=0.0).to(tl.float32)
        mix = (m * tl.rsqrt(tl.sum(m * m, axis=0) / D + norm_eps) * weight).to(out.dtype.element_ty)
    tl.store(out + t * D + d, mix, mask=d_ok)


def attn_res_mix_norm(sources: torch.Tensor, mix_norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                      mix_eps: float, norm_weight: torch.Tensor | None, norm_eps: float) -> torch.Tensor:
    """Triton version of `kestrel.ops.torch.attn_res.attn_res_mix_norm` (see there for shapes and semantics)."""
    num_sources, num_tokens, dim = sources.shape
    out = torch.empty(num_tokens, dim, dtype=sources.dtype, device=sources.device)
    if num_tokens == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    _mix_norm_kernel[(num_tokens,)](
        sources.contiguous(), mix_norm_weight, proj_weight.reshape(-1),
        mix_norm_weight if norm_weight is None else norm_weight, out, num_sources, num_tokens, mix_eps, norm_eps,
        D=dim, BLOCK_D=block_d, NORM=norm_weight is not None, num_warps=8 if block_d >= 4096 else 4)
    return out
