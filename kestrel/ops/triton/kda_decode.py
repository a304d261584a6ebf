"""Fused KDA decode: one program per (sequence, head) runs the short conv, the decay gate, the L2 norms, the delta
rule and the gated RMSNorm for each of the sequence's new tokens, reading and writing the state pool in place.

Matches `kestrel.ops.torch.kda_decode.kda_decode` (same signature). The head's recurrent state [D, D] stays in
registers across the sequence's tokens; conv windows are read from the pooled conv state and the token inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch.kda_decode import KDALayerParams, TokenStates


@triton.jit
def _conv_inputs(qkv, conv_pool, start, position, slot, keep, channel, channel_ok, num_channels,
                 WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr):
    """The conv inputs at stream positions position + r (r < ROWS) for `channel` [BLOCK_D]: [BLOCK_W, BLOCK_D]
    fp32, in qkv's dtype precision. The stream is the slot's WIDTH-1 state rows (zeros unless keep), then the
    tokens."""
    r = tl.arange(0, BLOCK_W)
    p = position + r
    row_ok = r < ROWS
    state_rows = tl.where(keep, WIDTH - 1, 0)        # a fresh sequence reads its state rows as zeros
    from_state = (row_ok & (p < state_rows))[:, None] & channel_ok[None, :]
    from_tokens = (row_ok & (p >= WIDTH - 1))[:, None] & channel_ok[None, :]
    state = tl.load(conv_pool + (slot * (WIDTH - 1) + p)[:, None] * num_channels + channel[None, :],
                    mask=from_state, other=0.0)
    tokens = tl.load(qkv + (start + p - (WIDTH - 1))[:, None] * num_channels + channel[None, :],
                     mask=from_tokens, other=0.0)
    return state.to(qkv.dtype.element_ty).to(tl.float32) + tokens.to(tl.float32)


@triton.jit
def _conv_silu(qkv, conv_pool, conv_weight, start, offset, slot, keep, channel, channel_ok, num_channels,
               WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """silu(causal conv) of `channel` [BLOCK_D] at token `offset` of its sequence, rounded as the reference."""
    window = _conv_inputs(qkv, conv_pool, start, offset, slot, keep, channel, channel_ok, num_channels,
                          WIDTH, BLOCK_W, WIDTH)
    r = tl.arange(0, BLOCK_W)
    taps = tl.load(conv_weight + channel[None, :] * WIDTH + r[:, None],
                   mask=(r < WIDTH)[:, None] & channel_ok[None, :], other=0.0)
    y = tl.sum(taps.to(tl.float32) * window, axis=0).to(qkv.dtype.element_ty).to(tl.float32)
    return (y * tl.sigmoid(y)).to(qkv.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_conv_rows(qkv, conv_pool, out, out_row, start, position, slot, keep, channel, channel_ok,
                     num_channels, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Write the WIDTH-1 conv inputs at stream positions position .. position + WIDTH - 2 to out[out_row]."""
    rows = _conv_inputs(qkv, conv_pool, start, position, slot, keep, channel, channel_ok, num_channels,
                        WIDTH, BLOCK_W, WIDTH - 1)
    r = tl.arange(0, BLOCK_W)
    tl.debug_barrier()      # every read of the pooled rows happens before any of them is overwritten
    tl.store(out + (out_row * (WIDTH - 1) + r)[:, None] * num_channels + channel[None, :],
             rows.to(out.dtype.element_ty), mask=(r < WIDTH - 1)[:, None] & channel_ok[None, :])


@triton.jit
def _decay_gate(gate_raw, dt_bias, a_log, t, h, d, d_ok, lower_bound, H: tl.constexpr, D: tl.constexpr,
                LOWER_BOUND: tl.constexpr):
    """Log decay g [BLOCK_D] fp32 of head h at token t (both KDA gate forms); 0 past D."""
    x = (tl.load(gate_raw + (t * H + h) * D + d, mask=d_ok, other=0.0).to(tl.float32)
         + tl.load(dt_bias + h * D + d, mask=d_ok, other=0.0).to(tl.float32))
    rate = tl.exp(tl.load(a_log + h).to(tl.float32))
    if LOWER_BOUND:
        return tl.where(d_ok, lower_bound * tl.sigmoid(rate * x), 0.0)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return tl.where(d_ok, -rate * softplus, 0.0)


@triton.jit
def _kda_decode_kernel(qkv, gate_raw, beta_raw, out_gate, conv_weight, a_log, dt_bias, norm_weight,
                       conv_pool, state_pool, slots, cu_seqlens, use_state, o, token_conv, token_state,
                       scale, lower_bound, norm_eps,
                       H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, WIDTH: tl.constexpr,
                       BLOCK_W: tl.constexpr, LOWER_BOUND: tl.constexpr, KEEP_TOKEN_STATES: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    num_channels = 3 * H * D
    start = tl.load(cu_seqlens + n)
    length = tl.load(cu_seqlens + n + 1) - start
    slot = tl.load(slots + n)
    keep = tl.load(use_state + n) != 0
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    square_ok = d_ok[:, None] & d_ok[None, :]
    q_channel = h * D + d
    k_channel = H * D + q_channel
    v_channel = 2 * H * D + q_channel
    state_offsets = ((slot * H + h) * D + d[:, None]) * D + d[None, :]
    state = tl.load(state_pool + state_offsets, mask=square_ok, other=0.0).to(tl.float32)          # [K, V]
    state = tl.where(keep, state, 0.0)
    norm_w = tl.load(norm_weight + d, mask=d_ok, other=0.0).to(tl.float32)

    for i in range(0, length):
        t = start + i
        q = _conv_silu(qkv, conv_pool, conv_weight, start, i, slot, keep, q_channel, d_ok, num_channels,
                       WIDTH, BLOCK_W)
        k = _conv_silu(qkv, conv_pool, conv_weight, start, i, slot, keep, k_channel, d_ok, num_channels,
                       WIDTH, BLOCK_W)
        v = _conv_silu(qkv, conv_pool, conv_weight, start, i, slot, keep, v_channel, d_ok, num_channels,
                       WIDTH, BLOCK_W)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = _decay_gate(gate_raw, dt_bias, a_log, t, h, d, d_ok, lower_bound, H, D, LOWER_BOUND)
        beta = tl.sigmoid(tl.load(beta_raw + t * H + h).to(tl.float32))

        state = state * tl.exp(g)[:, None]
        residual = v - tl.sum(k[:, None] * state, axis=0)
        state = state + (beta * k)[:, None] * residual[None, :]
        out = tl.sum(q[:, None] * state, axis=0).to(o.dtype.element_ty).to(tl.float32)

        gate = tl.load(out_gate + (t * H + h) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        normed = out * tl.rsqrt(tl.sum(out * out, axis=0) / D + norm_eps) * norm_w * tl.sigmoid(gate)
        tl.store(o + (t * H + h) * D + d, normed.to(o.dtype.element_ty), mask=d_ok)
        if KEEP_TOKEN_STATES:
            tl.store(token_state + ((t * H + h) * D + d[:, None]) * D + d[None, :], state, mask=square_ok)
            for channel in tl.static_range(3):
                _store_conv_rows(qkv, conv_pool, token_conv, t, start, i + 1, slot, keep,
                                 channel * H * D + q_channel, d_ok, num_channels, WIDTH, BLOCK_W)

    if not KEEP_TOKEN_STATES:
        for channel in tl.static_range(3):
            _store_conv_rows(qkv, conv_pool, conv_pool, slot, start, length, slot, keep,
                             channel * H * D + q_channel, d_ok, num_channels, WIDTH, BLOCK_W)
        tl.store(state_pool + state_offsets, state.to(state_pool.dtype.element_ty), mask=square_ok)


def kda_decode(qkv: torch.Tensor, gate_raw: torch.Tensor, beta_raw: torch.Tensor, out_gate: torch.Tensor,
               params: KDALayerParams, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor | None, use_state: torch.Tensor, scale: float | None = None,
               keep_token_states: bool = False) -> tuple[torch.Tensor, TokenStates | None]:
    """Triton version of `kestrel.ops.torch.kda_decode.kda_decode` (see there for shapes and semantics).

    The pools must be contiguous. No host synchronisation, so the call can be captured in a CUDA graph.
    """
    if cu_seqlens is None:                   # T / N tokens per sequence
        cu_seqlens = torch.arange(slots.numel() + 1, device=qkv.device) * (qkv.shape[0] // max(slots.numel(), 1))
    num_tokens = qkv.shape[0]
    num_heads, head_dim = gate_raw.shape[1:]
    width = params.conv_weight.shape[1]
    o = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    token_states = None
    token_conv, token_state = o, o           # unused placeholders unless keep_token_states
    if keep_token_states:
        token_conv = torch.empty(num_tokens, width - 1, qkv.shape[1], dtype=conv_pool.dtype, device=qkv.device)
        token_state = torch.empty(num_tokens, num_heads, head_dim, head_dim, dtype=torch.float32, device=qkv.device)
        token_states = TokenStates(conv=token_conv, recurrent=token_state)
    grid = (slots.numel(), num_heads)
    _kda_decode_kernel[grid](
        qkv.contiguous(), gate_raw.contiguous(), beta_raw.contiguous(), out_gate.contiguous(),
        params.conv_weight.contiguous(), params.A_log, params.dt_bias, params.norm_weight,
        conv_pool, state_pool, slots, cu_seqlens, use_state.to(torch.int8), o, token_conv, token_state,
        head_dim ** -0.5 if scale is None else scale, params.lower_bound or 0.0, params.norm_eps,
        H=num_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), WIDTH=width,
        BLOCK_W=triton.next_power_of_2(width),
        LOWER_BOUND=params.lower_bound is not None, KEEP_TOKEN_STATES=keep_token_states,
        num_warps=8 if head_dim >= 128 else 4,
    )
    return o, token_states
