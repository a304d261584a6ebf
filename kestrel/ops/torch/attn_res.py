"""AttnRes depth mix followed by the RMSNorm of the sublayer that reads it (model-spec section 3).

What the decoder runs before every sublayer of a K3-family model: the mix, then the sublayer's input RMSNorm (the
Triton kernel fuses both); at the output, where the mix itself is the hidden state, the mix alone. Float32 on the
CPU, eagerly, runs on the C++ kernel kestrel_cpu::attn_res_mix_norm (kestrel.ops.cpu), one call where the torch
reference (`mix_norm_reference`) dispatches ~14 ops.
"""

from __future__ import annotations

import torch

from .. import batch_invariant, cpu


def attn_res_mix_norm(sources: torch.Tensor, mix_norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                      mix_eps: float, norm_weight: torch.Tensor | None, norm_eps: float) -> torch.Tensor:
    """mix_norm_reference (same arguments and result), on the CPU kernel for float32 CPU tensors (contiguous
    weights) outside traced graphs (inductor fuses the reference's ops) and deterministic inference (whose products
    are its own)."""
    weights = (mix_norm_weight, proj_weight, norm_weight)
    if (sources.device.type == "cpu" and sources.dtype == torch.float32 and not torch.compiler.is_dynamo_compiling()
            and not batch_invariant.active() and cpu.available()
            and all(w is None or (w.dtype == torch.float32 and w.is_contiguous()) for w in weights)):
        return torch.ops.kestrel_cpu.attn_res_mix_norm(sources.contiguous(), *weights[:2], mix_eps, weights[2],
                                                       norm_eps)
    return mix_norm_reference(sources, mix_norm_weight, proj_weight, mix_eps, norm_weight, norm_eps)


def mix_norm_reference(sources: torch.Tensor, mix_norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                       mix_eps: float, norm_weight: torch.Tensor | None, norm_eps: float) -> torch.Tensor:
    """Mix the residual snapshots by a softmax over depth, then RMSNorm the mix (when norm_weight is given).

    sources: [S, T, D] (the stored blocks, then the running partial sum); mix_norm_weight, proj_weight: [D], the
    mix's RMSNorm weight and its Linear(D, 1) weight; norm_weight: [D], the following RMSNorm's weight, or None.
    Logit of source i: <RMSNorm(v_i) * mix_norm_weight, proj_weight>; mixed = sum_i softmax_i v_i, in fp32.
    Returns RMSNorm(mixed) * norm_weight, or mixed when norm_weight is None: [T, D] in the sources' dtype (the
    mix is rounded to that dtype before the norm).
    """
    v = sources.float()
    inv_rms = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + mix_eps)
    probs = torch.softmax((v * inv_rms) @ (mix_norm_weight.float() * proj_weight.float()), dim=0)   # [S, T]
    mixed = (probs.unsqueeze(-1) * v).sum(0).to(sources.dtype)
    if norm_weight is None:
        return mixed
    m = mixed.float()
    return (m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()).to(sources.dtype)
