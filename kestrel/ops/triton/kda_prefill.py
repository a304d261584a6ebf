"""Chunked KDA prefill over variable-length sequences, reading and writing the state pool (WY form).

Matches `kestrel.ops.torch.kda_prefill.kda_prefill` (same signature). Two kernels:

1. `_intra_chunk_kernel`, one program per (chunk, head), everything that does not depend on the state entering
   the chunk: the cumulative log decay G, the decayed scores A_qk (j <= i) and A_kk (j < i), the inverse
   T = (I + diag(beta) A_kk)^-1 by forward substitution, and W = T diag(beta) (exp(G) k), U = T diag(beta) v.
   Every exponent is a difference G_i - G_j with i after j (<= 0, so exp never overflows, for the unbounded
   Kimi-Linear gate too): blocks of 16 tokens below the diagonal are one matrix product each, decayed to and
   from the last token of the earlier block; the 16-token diagonal blocks are built column by column.
2. `_state_scan_kernel`, one program per (sequence, head, block of value columns), carries the state S [K, BV]
   through the sequence's chunks: u = U - W S, o = (q exp(G)) S + A_qk u, S = exp(G_last) S + (k exp(G_last - G))^T u.

Intermediates (G, W, U, A_qk) are fp32 in token order, [T, H, ...]; chunks never cross sequence boundaries. The
loops carry [C, K] fp32 tiles, so they are not software-pipelined (num_stages=1), which keeps shared memory small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision, require_power_of_two

SUB_CHUNK = 16
"""Tokens per diagonal block of the intra-chunk scores (the smallest tl.dot tile)."""


@triton.jit
def _decayed_scores(qs, ks, G, k, cum_g, start, length, h, rows, kk, k_ok,
                    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(A_qk, A_kk) [C, C]: rows_i . (exp(G_i - G_j) k_j) for j <= i (A_qk) and j < i (A_kk), else 0."""
    a_qk = tl.zeros([C, C], dtype=tl.float32)
    a_kk = tl.zeros([C, C], dtype=tl.float32)
    for block in tl.static_range(C // SUB - 1):         # blocks below the diagonal, one column block at a time
        last = block * SUB + SUB - 1
        g_ref = tl.sum(tl.where(rows[:, None] == last, G, 0.0), axis=0)                 # G at the block's end
        later = rows > last
        inside = (rows >= block * SUB) & (rows <= last)
        to_ref = tl.exp(tl.where(later[:, None], G - g_ref[None, :], float("-inf")))
        from_ref = tl.trans(ks * tl.exp(tl.where(inside[:, None], g_ref[None, :] - G, float("-inf"))))
        a_qk += tl.dot(qs * to_ref, from_ref, input_precision=PRECISION)
        a_kk += tl.dot(ks * to_ref, from_ref, input_precision=PRECISION)
    for d in range(SUB):            # diagonal blocks: column d of every block at once, elementwise decay
        j = (rows // SUB) * SUB + d
        on = (rows % SUB >= d) & (j < length)
        offsets = ((start + j) * H + h)[:, None] * K + kk[None, :]
        both = on[:, None] & k_ok[None, :]
        k_j = tl.load(k + offsets, mask=both, other=0.0).to(tl.float32)
        g_j = tl.load(cum_g + offsets, mask=both, other=0.0)
        k_j = k_j * tl.exp(tl.where(on[:, None], G - g_j, float("-inf")))
        hit = (rows[None, :] == j[:, None]) & on[:, None]
        a_qk = tl.where(hit, tl.sum(qs * k_j, axis=1)[:, None], a_qk)
        a_kk = tl.where(hit & (j != rows)[:, None], tl.sum(ks * k_j, axis=1)[:, None], a_kk)
    return a_qk, a_kk


@triton.jit
def _unit_lower_inverse(lower, rows, length, C: tl.constexpr):
    """(I + lower)^-1 [C, C] for strictly lower-triangular `lower`, by forward substitution over its first
    `length` rows (later rows come back zero)."""
    inverse = tl.zeros([C, C], dtype=tl.float32)
    for i in range(0, length):
        row_i = tl.sum(tl.where(rows[:, None] == i, lower, 0.0), axis=0)                # lower[i, :]
        new_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(row_i[:, None] * inverse, axis=0)
        inverse = tl.where(rows[:, None] == i, new_row[None, :], inverse)
    return inverse


@triton.jit
def _intra_chunk_kernel(q, k, v, g, beta, chunk_start, chunk_len, cum_g, w_out, u_out, a_out, scale,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_V: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(chunk_start + c)
    length = tl.load(chunk_len + c)
    rows = tl.arange(0, C)
    row_ok = rows < length
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    vv = tl.arange(0, BLOCK_V)
    token = start + rows
    k_offsets = (token * H + h)[:, None] * K + kk[None, :]
    k_mask = row_ok[:, None] & k_ok[None, :]
    v_offsets = (token * H + h)[:, None] * V + vv[None, :]
    v_mask = row_ok[:, None] & (vv < V)[None, :]

    qs = tl.load(q + k_offsets, mask=k_mask, other=0.0).to(tl.float32) * scale
    ks = tl.load(k + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
    G = tl.cumsum(tl.load(g + k_offsets, mask=k_mask, other=0.0).to(tl.float32), axis=0)
    tl.store(cum_g + k_offsets, G, mask=k_mask)
    tl.debug_barrier()          # the diagonal blocks read G back by row
    a_qk, a_kk = _decayed_scores(qs, ks, G, k, cum_g, start, length, h, rows, kk, k_ok, H, K, C, SUB, PRECISION)

    b = tl.load(beta + token * H + h, mask=row_ok, other=0.0).to(tl.float32)
    inverse = _unit_lower_inverse(a_kk * b[:, None], rows, length, C)
    vs = tl.load(v + v_offsets, mask=v_mask, other=0.0).to(tl.float32)
    w = tl.dot(inverse, ks * tl.exp(G) * b[:, None], input_precision=PRECISION)
    u = tl.dot(inverse, vs * b[:, None], input_precision=PRECISION)
    tl.store(w_out + k_offsets, w, mask=k_mask)
    tl.store(u_out + v_offsets, u, mask=v_mask)
    tl.store(a_out + (token * H + h)[:, None] * C + rows[None, :], a_qk, mask=row_ok[:, None])


@triton.jit
def _state_scan_kernel(q, k, cum_g, w_in, u_in, a_in, cu_seqlens, state_pool, slots, use_state, first_chunk_state,
                       o, chunk_states, scale,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, C: tl.constexpr, OUTPUT_CHUNK_STATES: tl.constexpr,
                       PRECISION: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cu_seqlens + n)
    end = tl.load(cu_seqlens + n + 1)
    slot = tl.load(slots + n)
    keep = tl.load(use_state + n) != 0
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < V
    square = kk[:, None] * V + vv[None, :]
    square_ok = k_ok[:, None] & v_ok[None, :]
    state_at = state_pool + (slot * H + h) * K * V + square
    state = tl.where(keep, tl.load(state_at, mask=square_ok, other=0.0).to(tl.float32), 0.0)   # [K, BLOCK_V]
    first_state = tl.load(first_chunk_state + n)
    rows = tl.arange(0, C)

    for c in range(0, tl.cdiv(end - start, C)):
        chunk = start + c * C
        length = tl.minimum(C, end - chunk)
        row_ok = rows < length
        token = chunk + rows
        k_offsets = (token * H + h)[:, None] * K + kk[None, :]
        k_mask = row_ok[:, None] & k_ok[None, :]
        v_offsets = (token * H + h)[:, None] * V + vv[None, :]
        v_mask = row_ok[:, None] & v_ok[None, :]
        G = tl.load(cum_g + k_offsets, mask=k_mask, other=0.0)
        g_last = tl.load(cum_g + ((chunk + length - 1) * H + h) * K + kk, mask=k_ok, other=0.0)
        w = tl.load(w_in + k_offsets, mask=k_mask, other=0.0)
        u = tl.load(u_in + v_offsets, mask=v_mask, other=0.0) - tl.dot(w, state, input_precision=PRECISION)
        q_decayed = tl.load(q + k_offsets, mask=k_mask, other=0.0).to(tl.float32) * scale * tl.exp(G)
        a_qk = tl.load(a_in + (token * H + h)[:, None] * C + rows[None, :], mask=row_ok[:, None], other=0.0)
        out = tl.dot(q_decayed, state, input_precision=PRECISION) + tl.dot(a_qk, u, input_precision=PRECISION)
        tl.store(o + v_offsets, out.to(o.dtype.element_ty), mask=v_mask)
        keys_to_end = tl.load(k + k_offsets, mask=k_mask, other=0.0).to(tl.float32) * tl.exp(g_last[None, :] - G)
        state = tl.exp(g_last)[:, None] * state + tl.dot(tl.trans(keys_to_end), u, input_precision=PRECISION)
        if OUTPUT_CHUNK_STATES:
            if length == C:
                tl.store(chunk_states + ((first_state + c) * H + h) * K * V + square, state, mask=square_ok)
    tl.store(state_at, state.to(state_pool.dtype.element_ty), mask=square_ok)


def _chunk_table(lengths: list[int], chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """First token and length of every chunk, sequences in order: two [num_chunks] int64 tensors."""
    starts, sizes, offset = [], [], 0
    for length in lengths:
        for begin in range(0, length, chunk_size):
            starts.append(offset + begin)
            sizes.append(min(chunk_size, length - begin))
        offset += length
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(sizes, dtype=torch.int64, device=device))


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, use_state: torch.Tensor,
                scale: float | None = None, chunk_size: int = 64, output_chunk_states: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of `kestrel.ops.torch.kda_prefill.kda_prefill` (see there for shapes and semantics).

    chunk_size must be a power of two >= 16; the state pool must be contiguous. Reads cu_seqlens on the host once.
    """
    require_power_of_two("chunk_size", chunk_size)
    num_tokens, num_heads, key_dim = q.shape
    value_dim = v.shape[2]
    lengths = cu_seqlens.diff().tolist()
    device = q.device
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = max(16, triton.next_power_of_2(value_dim))
    precision = dot_precision(torch.float32)
    scale = key_dim ** -0.5 if scale is None else scale

    cum_g = torch.empty(num_tokens, num_heads, key_dim, dtype=torch.float32, device=device)
    w = torch.empty_like(cum_g)
    u = torch.empty(num_tokens, num_heads, value_dim, dtype=torch.float32, device=device)
    a_qk = torch.empty(num_tokens, num_heads, chunk_size, dtype=torch.float32, device=device)
    chunk_start, chunk_len = _chunk_table(lengths, chunk_size, device)
    if chunk_start.numel():
        _intra_chunk_kernel[(chunk_start.numel(), num_heads)](
            q, k, v, g, beta, chunk_start, chunk_len, cum_g, w, u, a_qk, scale,
            H=num_heads, K=key_dim, V=value_dim, BLOCK_K=block_k, BLOCK_V=block_v, C=chunk_size, SUB=SUB_CHUNK,
            PRECISION=precision, num_warps=8 if block_k * chunk_size >= 4096 else 4, num_stages=1)

    full_chunks = [length // chunk_size for length in lengths]
    first_state = torch.tensor([0, *full_chunks], device=device).cumsum(0)
    o = torch.empty(num_tokens, num_heads, value_dim, dtype=v.dtype, device=device)
    chunk_states = None
    if output_chunk_states:
        chunk_states = torch.empty(sum(full_chunks), num_heads, key_dim, value_dim, dtype=torch.float32, device=device)
    scan_block_v = min(block_v, 64)
    _state_scan_kernel[(len(lengths), num_heads, triton.cdiv(value_dim, scan_block_v))](
        q, k, cum_g, w, u, a_qk, cu_seqlens, state_pool, slots, use_state.to(torch.int8), first_state,
        o, o if chunk_states is None else chunk_states, scale,
        H=num_heads, K=key_dim, V=value_dim, BLOCK_K=block_k, BLOCK_V=scan_block_v, C=chunk_size,
        OUTPUT_CHUNK_STATES=output_chunk_states, PRECISION=precision,
        num_warps=8 if block_k * scan_block_v >= 8192 else 4, num_stages=1)
    return o, chunk_states
