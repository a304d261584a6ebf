"""Kimi Delta Attention (KDA) in plain PyTorch: chunked prefill and token-by-token decode.

Per sequence and head the state S [K, V] evolves, for each token t, as

    S = diag(exp(g_t)) S
    S = S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale q_t)

(fla's `naive_recurrent_kda`). Sequences are packed along T and delimited by `cu_seqlens`.
`recurrent_kda` runs this loop, batched over sequences. `chunk_kda` computes the same thing
chunk by chunk (WY form of the delta rule): inside a chunk everything is a matrix product, and
the only Python loop carries the state from one chunk to the next.

Numerics: with G the cumulative log-decay inside a chunk (non-increasing), every exponent
evaluated here is a difference G_i - G_j with i after j, so it is <= 0 and exp never overflows,
for the unbounded Kimi-Linear gate as much as for the lower-bounded K3 gate. Chunks are split
into sub-chunks; the decay between two different sub-chunks factors through the boundary of
the later one, exp(G_i - G_j) = exp(G_i - G_b) exp(G_b - G_j), which turns those blocks into
matrix products. Only the small diagonal sub-chunk blocks use the elementwise [c, c, K] form.

Computation is in float32 (float64 when an input is float64); `o` comes back in v's dtype.
Everything is differentiable with respect to q, k, v, g, beta and initial_state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import torch

LEAF_BLOCK = 8
"""Blocks of at most this many tokens use the elementwise decay form; larger ones are halved."""


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token goes when sequences are cut into chunks, and in which order chunks are processed.

    Sequences are ranked by chunk count (most first), so at chunk step c the sequences that still
    have a chunk are ranks 0..active[c]-1, and their chunks sit contiguously at
    step_offset[c] .. step_offset[c] + active[c] - 1 of the packed chunk list.
    """

    chunk_size: int
    num_chunks: int
    token_slot: torch.Tensor      # [T] int64: position of each token in the padded [num_chunks * chunk_size] buffer
    order: torch.Tensor           # [N] int64: sequence index at each rank
    rank: torch.Tensor            # [N] int64: rank of each sequence
    active: list[int]             # per chunk step: how many sequences have a chunk there
    step_offset: list[int]        # per chunk step: index of its first chunk in the packed list
    full_chunks: torch.Tensor     # [F] int64: packed index of every full chunk, by sequence then position


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None, scale: float | None = None,
              chunk_size: int = 64, output_chunk_states: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """KDA over packed sequences, computed chunk by chunk.

    q, k: [T, H, K] (L2-normalised); v: [T, H, V]; g: [T, H, K] log-decay (<= 0); beta: [T, H];
    cu_seqlens: [N+1] int64; initial_state: [N, H, K, V] or None (zeros); scale defaults to K**-0.5.
    Returns o [T, H, V] in v's dtype, the final state [N, H, K, V] float32, and, when
    output_chunk_states, the state after every full chunk_size tokens of each sequence
    [sum_n floor(L_n / chunk_size), H, K, V] float32 (sequences in order), else None.
    """
    lengths = _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    scale = key_dim ** -0.5 if scale is None else scale
    layout = _chunk_layout(lengths, chunk_size, q.device)
    state = _initial_state(initial_state, len(lengths), num_heads, key_dim, value_dim, q, dtype)

    q_c, k_c, v_c, g_c = (_to_chunks(x.to(dtype), layout) for x in (q, k, v, g))
    beta_c = _to_chunks(beta.to(dtype).unsqueeze(-1), layout).squeeze(-1)
    terms = _intra_chunk_terms(q_c * scale, k_c, v_c, g_c, beta_c)
    chunk_start, new_values, chunk_end, final_sorted = _carry_state(terms, state[layout.order], layout)

    o_c = terms.q_decayed @ chunk_start + terms.attn_qk @ new_values          # [B, H, C, V]
    o = o_c.transpose(1, 2).reshape(-1, num_heads, value_dim)[layout.token_slot].to(v.dtype)
    chunk_states = chunk_end[layout.full_chunks] if output_chunk_states else None
    return o, final_sorted[layout.rank], chunk_states


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None, scale: float | None = None,
                  output_token_states: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """KDA over packed sequences, one time step at a time (batched over sequences); meant for decode.

    Shapes as in `chunk_kda`. Returns o [T, H, V] in v's dtype, the final state [N, H, K, V] float32,
    and, when output_token_states, the state after every token [T, H, K, V] float32, else None.
    """
    lengths = _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    num_seqs, (num_heads, key_dim), value_dim = len(lengths), q.shape[1:], v.shape[2]
    scale = key_dim ** -0.5 if scale is None else scale
    max_len = max(lengths, default=0)
    slot = _token_positions(lengths, q.device)
    slot = slot[0] * max_len + slot[1]                                          # [T] into [N * max_len]
    # Padding steps have g = k = beta = 0, which leaves the state unchanged.
    q_p, k_p, v_p, g_p, beta_p = (_scatter_rows(x.to(dtype), slot, num_seqs * max_len)
                                  .unflatten(0, (num_seqs, max_len)) for x in (q, k, v, g, beta))
    q_p = q_p * scale
    state = _initial_state(initial_state, num_seqs, num_heads, key_dim, value_dim, q, dtype)
    outputs, states = [], []
    for t in range(max_len):
        state = _recurrent_step(state, q_p[:, t], k_p[:, t], v_p[:, t], g_p[:, t], beta_p[:, t])
        outputs.append(torch.einsum("nhk,nhkv->nhv", q_p[:, t], state))
        states.append(state)
    if max_len == 0:
        return v.new_zeros(v.shape), state, (state.new_zeros(0, num_heads, key_dim, value_dim)
                                             if output_token_states else None)
    o = torch.stack(outputs, 1).flatten(0, 1)[slot].to(v.dtype)
    token_states = torch.stack(states, 1).flatten(0, 1)[slot] if output_token_states else None
    return o, state, token_states


def _recurrent_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token for every sequence: state [N, H, K, V]; k, g: [N, H, K]; v: [N, H, V]; beta: [N, H]."""
    state = state * g.exp().unsqueeze(-1)
    residual = v - torch.einsum("nhk,nhkv->nhv", k, state)
    return state + (beta.unsqueeze(-1) * k).unsqueeze(-1) * residual.unsqueeze(-2)


@dataclass(frozen=True)
class IntraChunkTerms:
    """Per-chunk quantities of the WY form, all [B, H, ...] with B chunks and C = chunk_size.

    With S the state entering a chunk, its new values are u = values - keys_to_values @ S, its output is
    q_decayed @ S + attn_qk @ u, and the state leaving it is decay_total * S + keys_to_end^T @ u.
    """

    q_decayed: torch.Tensor       # [B, H, C, K]: scale * q_i * exp(G_i)
    attn_qk: torch.Tensor         # [B, H, C, C]: q_i . (exp(G_i - G_j) k_j) for j <= i, else 0
    keys_to_values: torch.Tensor  # [B, H, C, K]: W = (I + A)^-1 diag(beta) (exp(G) k)
    values: torch.Tensor          # [B, H, C, V]: U = (I + A)^-1 diag(beta) v
    keys_to_end: torch.Tensor     # [B, H, C, K]: k_j * exp(G_last - G_j)
    decay_total: torch.Tensor     # [B, H, K]: exp(G_last)


def _intra_chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                       ) -> IntraChunkTerms:
    """Everything that does not depend on the state entering a chunk, for all chunks at once.

    q (already scaled), k, g: [B, H, C, K]; v: [B, H, C, V]; beta: [B, H, C].
    """
    key_dim = q.shape[-1]
    cum_g = g.cumsum(-2)                                                     # G, relative to the chunk start
    last = cum_g[..., -1:, :]
    scores = _causal_decayed_scores(torch.stack([q, k], -2), k, cum_g)       # [B, H, C, 2, C]
    attn_qk, attn_kk = scores.unbind(-2)
    right = beta.unsqueeze(-1) * torch.cat([k * cum_g.exp(), v], -1)
    # A = strictly lower part of beta_i * attn_kk; unitriangular=True reads only that part and takes I + A.
    solved = torch.linalg.solve_triangular(beta.unsqueeze(-1) * attn_kk, right, upper=False, unitriangular=True)
    return IntraChunkTerms(
        q_decayed=q * cum_g.exp(),
        attn_qk=attn_qk,
        keys_to_values=solved[..., :key_dim],
        values=solved[..., key_dim:],
        keys_to_end=k * (last - cum_g).exp(),
        decay_total=last.squeeze(-2).exp(),
    )


def _causal_decayed_scores(rows: torch.Tensor, keys: torch.Tensor, cum_g: torch.Tensor) -> torch.Tensor:
    """rows_i . (exp(G_i - G_j) keys_j) for j <= i, else 0, within each block.

    rows: [..., s, R, K] (R row sets scored against the same keys); keys: [..., s, K];
    cum_g: [..., s, K], the cumulative log-decay G from the block start. Returns [..., s, R, s].
    A block is halved recursively: the lower-left quarter is one matrix product of rows decayed from the
    halfway point and keys decayed to it, so only blocks of LEAF_BLOCK tokens use the elementwise form.
    """
    size = keys.shape[-2]
    if size <= LEAF_BLOCK or size % 2:
        return _causal_decayed_scores_elementwise(rows, keys, cum_g)
    half = size // 2
    midpoint = cum_g[..., half - 1:half, :]                                  # G at the end of the first half
    halves_g = cum_g.unflatten(-2, (2, half)) - torch.cat([torch.zeros_like(midpoint), midpoint], -2).unsqueeze(-2)
    diagonal = _causal_decayed_scores(rows.unflatten(-3, (2, half)), keys.unflatten(-2, (2, half)), halves_g)
    late_rows = rows[..., half:, :, :] * halves_g[..., 1, :, :].exp().unsqueeze(-2)
    early_keys = keys[..., :half, :] * (midpoint - cum_g[..., :half, :]).exp()
    lower_left = (late_rows.flatten(-3, -2) @ early_keys.transpose(-1, -2)).unflatten(-2, late_rows.shape[-3:-1])
    upper = torch.cat([diagonal[..., 0, :, :, :], torch.zeros_like(lower_left)], -1)
    lower = torch.cat([lower_left, diagonal[..., 1, :, :, :]], -1)
    return torch.cat([upper, lower], -3)


def _causal_decayed_scores_elementwise(rows: torch.Tensor, keys: torch.Tensor, cum_g: torch.Tensor) -> torch.Tensor:
    """`_causal_decayed_scores` through the [s, s, K] decay tensor (for small blocks)."""
    size = keys.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=keys.device).tril()
    exponent = (cum_g.unsqueeze(-2) - cum_g.unsqueeze(-3)).masked_fill(~causal.unsqueeze(-1), -math.inf)
    decayed_keys = exponent.exp() * keys.unsqueeze(-3)                       # [..., s (i), s (j), K]
    return rows @ decayed_keys.transpose(-1, -2)


def _carry_state(terms: IntraChunkTerms, state: torch.Tensor, layout: ChunkLayout
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the state through the chunks in order, all sequences of a chunk step at once.

    state: [N, H, K, V] by rank. Returns the state entering each chunk [B, H, K, V], the chunk's new
    values u [B, H, C, V], the state leaving each chunk [B, H, K, V] (all in packed chunk order) and
    the final state by rank [N, H, K, V].
    """
    entering, new_values, leaving = [], [], []
    for active, offset in zip(layout.active, layout.step_offset):
        chunks = slice(offset, offset + active)
        current = state[:active]
        u = terms.values[chunks] - terms.keys_to_values[chunks] @ current
        after = terms.decay_total[chunks].unsqueeze(-1) * current + terms.keys_to_end[chunks].transpose(-1, -2) @ u
        entering.append(current)
        new_values.append(u)
        leaving.append(after)
        state = torch.cat([after, state[active:]])
    if not entering:
        empty = state.new_zeros(0, *state.shape[1:])
        return empty, terms.values, empty, state
    return torch.cat(entering), torch.cat(new_values), torch.cat(leaving), state


def _chunk_layout(lengths: list[int], chunk_size: int, device: torch.device) -> ChunkLayout:
    """Packed chunk order for sequences of the given lengths (see ChunkLayout)."""
    chunks_per_seq = [-(-length // chunk_size) for length in lengths]
    order = sorted(range(len(lengths)), key=lambda n: -chunks_per_seq[n])
    rank = [0] * len(lengths)
    for position, seq in enumerate(order):
        rank[seq] = position
    active = [sum(1 for count in chunks_per_seq if count > step) for step in range(max(chunks_per_seq, default=0))]
    step_offset = [sum(active[:step]) for step in range(len(active))]

    seq_of_token, pos_in_seq = _token_positions(lengths, device)
    rank_t = torch.tensor(rank, dtype=torch.int64, device=device)
    offsets_t = torch.tensor(step_offset or [0], dtype=torch.int64, device=device)
    chunk_of_token = offsets_t[pos_in_seq // chunk_size] + rank_t[seq_of_token]
    full_chunks = [step_offset[step] + rank[seq] for seq, length in enumerate(lengths)
                   for step in range(length // chunk_size)]
    return ChunkLayout(
        chunk_size=chunk_size,
        num_chunks=sum(active),
        token_slot=chunk_of_token * chunk_size + pos_in_seq % chunk_size,
        order=torch.tensor(order, dtype=torch.int64, device=device),
        rank=rank_t,
        active=active,
        step_offset=step_offset,
        full_chunks=torch.tensor(full_chunks, dtype=torch.int64, device=device),
    )


def _to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, D] tokens -> [B, H, C, D] chunks, zero in the padding."""
    padded = _scatter_rows(x, layout.token_slot, layout.num_chunks * layout.chunk_size)
    return padded.unflatten(0, (layout.num_chunks, layout.chunk_size)).transpose(1, 2).contiguous()


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A [num_rows, ...] tensor of zeros with x's rows placed at `rows` (differentiable, out of place)."""
    return x.new_zeros(num_rows, *x.shape[1:]).index_copy(0, rows, x)


def _token_positions(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed token: its sequence index and its position in that sequence, both [T] int64."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    return seq, torch.arange(seq.numel(), device=device) - starts[seq]


def _initial_state(initial_state: torch.Tensor | None, num_seqs: int, num_heads: int, key_dim: int,
                   value_dim: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """initial_state in the compute dtype, or zeros [N, H, K, V]."""
    if initial_state is None:
        return torch.zeros(num_seqs, num_heads, key_dim, value_dim, dtype=dtype, device=like.device)
    return initial_state.to(dtype)


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any input is float64."""
    return reduce(torch.promote_types, (t.dtype for t in tensors if t is not None), torch.float32)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None) -> list[int]:
    """Raise ValueError on inconsistent shapes; return the sequence lengths."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, K], got shape {tuple(q.shape)}.")
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k and g must have q's shape {tuple(q.shape)}, got {tuple(k.shape)} and {tuple(g.shape)}.")
    if v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [T, H, V] with T, H = {tuple(q.shape[:2])}, got shape {tuple(v.shape)}.")
    if beta.shape != q.shape[:2]:
        raise ValueError(f"beta must be [T, H] = {tuple(q.shape[:2])}, got shape {tuple(beta.shape)}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] with at least one sequence.")
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or min(lengths) < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[0]} without decreasing, got {bounds}.")
    expected_state = (len(lengths), q.shape[1], q.shape[2], v.shape[2])
    if initial_state is not None and tuple(initial_state.shape) != expected_state:
        raise ValueError(f"initial_state must be [N, H, K, V] = {expected_state}, got {tuple(initial_state.shape)}.")
    return lengths
