"""One fused KDA step over the state pool: short conv, decay gate, L2 norm, delta rule and gated RMSNorm.

This is the reference for the fused decode kernel, composed of the plain pieces (the short conv's window sums, each
an einsum over the taps whatever the tokens per sequence, and `recurrent_kda`'s steps) and the same gate,
normalisation and output norm as `kestrel.layers.kda`; under kestrel.ops.batch_invariant's operators a token's
numbers do not depend on how many tokens its sequence brings (deterministic inference runs every token through
it). It reads each sequence's conv and recurrent state from its slot of the pool and, for plain decode, writes the
new states back in place. With `keep_token_states` (speculative verification) it leaves the pool as it was and returns
the states after every token instead, so the engine can commit the state of the last accepted token. On the CPU,
eagerly and traced for the compiled decode step, a plain decode of a float32 layer is one call of the C++ kernel
kestrel_cpu::kda_decode_step_ (kestrel.ops.cpu): the same math from the conv to the output norm, the states updated
where they lie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import batch_invariant, cpu
from .conv import causal_conv1d_step, causal_conv1d_uniform, causal_conv1d_windows
from .kda import recurrent_kda, recurrent_kda_step, recurrent_kda_uniform


@dataclass(frozen=True)
class KDALayerParams:
    """The per-layer constants a KDA step needs (D = head_dim, H heads, W = conv width)."""

    conv_weight: torch.Tensor   # [3*H*D, W] fp32: q, k, v depthwise conv taps
    A_log: torch.Tensor         # [H] fp32
    dt_bias: torch.Tensor       # [H*D] fp32
    norm_weight: torch.Tensor   # [D] fp32: the gated output RMSNorm's weight
    lower_bound: float | None   # K3 gate lower bound; None: Kimi-Linear's softplus gate
    norm_eps: float


@dataclass(frozen=True)
class TokenStates:
    """The states after every token of a speculative-verification step."""

    conv: torch.Tensor        # [T, W-1, 3*H*D] in the conv pool's dtype: the last W-1 conv inputs
    recurrent: torch.Tensor   # [T, H, D, D] fp32


def decay_gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
               ) -> torch.Tensor:
    """Per-channel log decay g <= 0, fp32. raw: [T, H, D]; A_log: [H]; dt_bias: [H*D].

    lower_bound None: g = -exp(A_log) softplus(raw + dt); else g = lower_bound * sigmoid(exp(A_log) (raw + dt)).
    """
    num_heads, head_dim = raw.shape[-2:]
    x = raw.float() + dt_bias.float().view(num_heads, head_dim)
    rate = A_log.float().exp().unsqueeze(-1)
    if lower_bound is None:
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(rate * x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * sigmoid(gate) over the last dim, in fp32; returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


def kda_decode(qkv: torch.Tensor, gate_raw: torch.Tensor, beta_raw: torch.Tensor, out_gate: torch.Tensor,
               params: KDALayerParams, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor | None, use_state: torch.Tensor, scale: float | None = None,
               keep_token_states: bool = False) -> tuple[torch.Tensor, TokenStates | None]:
    """KDA over a few new tokens per sequence, starting from the sequences' pooled states.

    qkv: [T, 3*H*D], the q, k, v projections before the conv (activation dtype); gate_raw: [T, H, D], the decay
    gate projection; beta_raw: [T, H], the beta logits; out_gate: [T, H, D], the output-norm gate;
    conv_pool: [slots, W-1, 3*H*D]; state_pool: [slots, H, D, D]; slots: [N] int64, distinct;
    cu_seqlens: [N+1] int64, or None when every sequence brings T / N tokens (a decode step, or a verification of
    equal drafts: then nothing is read back to the host, so the step traces into one graph); use_state: [N] bool,
    False where a sequence starts fresh (its slot, whatever it holds, is read as zeros).
    Returns o [T, H, D] in qkv's dtype (after the gated RMSNorm) and, with keep_token_states, the states after
    every token (the pools untouched); else None, with the final states written to the pools at `slots`.
    """
    num_tokens = qkv.shape[0]
    num_heads, head_dim = gate_raw.shape[1:]
    num_seqs = slots.numel()
    each = num_tokens // max(num_seqs, 1) if cu_seqlens is None else 0        # tokens per sequence, when uniform
    if each == 1 and not keep_token_states and _on_the_kernel(qkv, conv_pool, state_pool):
        o = torch.ops.kestrel_cpu.kda_decode_step_(qkv, gate_raw, beta_raw, out_gate, params.conv_weight, params.A_log,
                                                   params.dt_bias, params.norm_weight, params.lower_bound,
                                                   params.norm_eps, conv_pool, state_pool, slots, use_state,
                                                   head_dim ** -0.5 if scale is None else scale)
        return o, None
    keep = use_state.view(-1, 1, 1)
    conv_state = torch.where(keep, conv_pool[slots], 0)                 # a fresh slot may hold anything, NaN too
    state = torch.where(keep.unsqueeze(-1), state_pool[slots].float(), 0)
    token_conv = None
    if each == 1:
        y, conv_final = causal_conv1d_step(qkv, params.conv_weight, conv_state)
        token_conv = conv_final
    elif each:
        y, token_conv = causal_conv1d_uniform(qkv.view(num_seqs, each, -1), params.conv_weight, conv_state)
        y, conv_final, token_conv = y.flatten(0, 1), token_conv[:, -1], token_conv.flatten(0, 1)
    else:
        y, conv_final = causal_conv1d_windows(qkv, params.conv_weight, cu_seqlens, conv_state)
    q, k, v = F.silu(y).view(num_tokens, 3, num_heads, head_dim).unbind(1)
    q, k = l2_normalize(q), l2_normalize(k)
    g = decay_gate(gate_raw, params.A_log, params.dt_bias, params.lower_bound)
    beta = torch.sigmoid(beta_raw.float())
    if each == 1:
        o, final = recurrent_kda_step(q, k, v, g, beta, state, scale)
        token_recurrent = final
    elif each:
        o, token_recurrent = recurrent_kda_uniform(*(x.unflatten(0, (num_seqs, each)) for x in (q, k, v, g, beta)),
                                                   state, scale)
        o, final, token_recurrent = o.flatten(0, 1), token_recurrent[:, -1], token_recurrent.flatten(0, 1)
    else:
        o, final, token_recurrent = recurrent_kda(q, k, v, g, beta, cu_seqlens, initial_state=state, scale=scale,
                                                  output_token_states=keep_token_states)
    o = gated_rms_norm(o, out_gate, params.norm_weight, params.norm_eps)
    if keep_token_states:
        if token_conv is None:
            token_conv = token_conv_states(qkv, conv_state, cu_seqlens)
        return o, TokenStates(conv=token_conv.to(conv_pool.dtype), recurrent=token_recurrent)
    conv_pool[slots] = conv_final.detach().to(conv_pool.dtype)
    state_pool[slots] = final.detach().to(state_pool.dtype)
    return o, None


def _on_the_kernel(qkv: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor) -> bool:
    """Whether a decode step is one call of the CPU kernel kestrel_cpu::kda_decode_step_ (kestrel.ops.cpu), eagerly
    as compiled: float32 activations and contiguous float32 pools on the CPU, a head dim of whole 16-float vectors,
    the kernels built here; not in deterministic inference, whose prefill computes each token as this module's torch
    ops do."""
    return (not batch_invariant.active() and qkv.device.type == "cpu"
            and qkv.dtype == conv_pool.dtype == state_pool.dtype == torch.float32 and conv_pool.is_contiguous()
            and state_pool.is_contiguous() and state_pool.shape[-1] % 16 == 0 and cpu.available())


def token_conv_states(x: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The conv state after every token: its sequence's last W-1 inputs, state rows first, [T, W-1, C] in x's dtype.

    x: [T, C]; initial_state: [N, W-1, C]; cu_seqlens: [N+1] int64.
    """
    num_tokens, keep = x.shape[0], initial_state.shape[1]
    seq = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1, device=x.device), cu_seqlens.diff())
    offset = torch.arange(num_tokens, device=x.device) - cu_seqlens[seq]
    # Position in [state rows, tokens] of each kept row: token t keeps positions offset+1 .. offset+W-1.
    position = offset.unsqueeze(1) + 1 + torch.arange(keep, device=x.device)                # [T, W-1]
    from_state = initial_state[seq.unsqueeze(1), position.clamp(max=keep - 1)].to(x.dtype)
    from_tokens = x[(cu_seqlens[seq].unsqueeze(1) + position - keep).clamp(min=0)]
    return torch.where((position < keep).unsqueeze(-1), from_state, from_tokens)
