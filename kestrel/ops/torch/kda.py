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
for the unbounded Kimi-Linear gate as much as for the lower-bounded K3 gate. The decayed
key-key and query-key scores of a chunk are built by halving it recursively: between the two
halves, exp(G_i - G_j) = exp(G_i - G_m) exp(G_m - G_j) with m the midpoint, both factors <= 1, so
each lower-left quarter is one matrix product; (I + A)^-1 is inverted by the same halving.
Decay factors and couplings too small to matter in float32 are set to exactly zero, which keeps
subnormal numbers (that CPUs multiply up to 20x slower) out of the matrix products. On the CPU, in float32 and
without gradients, the intra-chunk terms come from one C++ kernel, kestrel_cpu::kda_chunk_terms (kestrel.ops.cpu):
the same quantities, rows scored in blocks against one product of decayed keys, (I + A) solved by substitution.

Computation is in float32 (float64 when an input is float64, e.g. for gradient checks); `o` comes
back in v's dtype. Everything is differentiable with respect to q, k, v, g, beta and initial_state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache, lru_cache, reduce
from itertools import accumulate

import torch

from .. import cpu

log = logging.getLogger("kestrel")

LEAF_BLOCK = 2
"""Score blocks of at most this many tokens (or of odd length) use the elementwise [s, s, K] decay form."""
NEGLIGIBLE_LOG_DECAY = -30.0
"""Decay factors below exp(-30) (about 1e-13) inside a chunk count as exactly zero."""
UNIT_LOG_DECAY = -2.0 ** -25
"""Compiled, log decays above this (closer to zero) count as zero: float32's exp rounds them to one anyway, and
inductor's vectorized exp takes such tiny inputs through subnormal numbers (its polynomial's powers), which CPUs
compute up to 100x slower: the compiled chunk terms of a real 128-token prompt took 1.07 instead of 0.64 ms per
layer (bundled model, one thread)."""
NEGLIGIBLE = 1e-15
"""Entries of the chunk's coupling matrix A and of (I + A)^-1 below this magnitude count as zero."""

_terms_backend: ContextVar[str | None] = ContextVar("kestrel_chunk_terms_backend", default=None)
_failed_backends: set[str] = set()


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token goes when sequences are cut into chunks, and in which order chunks are processed.

    Sequences are ranked by chunk count (most first), so at chunk step c the sequences that still
    have a chunk are ranks 0..active[c]-1. The packed chunk list holds step 0's chunks (by rank), then
    step 1's, and so on; each sequence is padded only to a multiple of chunk_size.
    """

    chunk_size: int
    num_chunks: int
    token_slot: torch.Tensor      # [T] int64: position of each token in the padded [num_chunks * chunk_size] buffer
    order: torch.Tensor           # [N] int64: sequence index at each rank
    rank: torch.Tensor            # [N] int64: rank of each sequence
    active: tuple[int, ...]       # per chunk step: how many sequences have a chunk there
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
    Any chunk_size >= 1 works; powers of two take the all-matmul path.
    """
    lengths = _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    scale = key_dim ** -0.5 if scale is None else scale
    layout = _chunk_layout(tuple(lengths), chunk_size, q.device)
    state = _initial_state(initial_state, (len(lengths), num_heads, key_dim, value_dim), dtype, q.device)

    q_c, k_c, v_c, g_c = (_to_chunks(x.to(dtype), layout) for x in (q, k, v, g))
    beta_c = _to_chunks(beta.to(dtype).unsqueeze(-1), layout).squeeze(-1)
    terms = _chunk_terms(q_c * scale, k_c, v_c, g_c, beta_c)
    chunk_start, new_values, chunk_end, final_sorted = _carry_state(terms, state[layout.order], layout,
                                                                    output_chunk_states)

    o_c = terms.q_decayed @ chunk_start + terms.attn_qk @ new_values          # [B, H, C, V]
    o = o_c.transpose(1, 2).reshape(-1, num_heads, value_dim).index_select(0, layout.token_slot).to(v.dtype)
    chunk_states = chunk_end[layout.full_chunks] if chunk_end is not None else None
    return o, final_sorted[layout.rank], chunk_states


@contextmanager
def compiled_chunk_terms(backend: str | None = "inductor") -> Iterator[None]:
    """Within it, chunk_kda computes its intra-chunk terms (everything but the state carried from chunk to chunk)
    as one torch.compile'd graph of the given backend, where no gradient is wanted, there are two chunks or more and
    kestrel's CPU kernel does not compute them (--disable-cpu-kernels);
    None keeps them eager. Inductor fuses the recursive halving's ~150 small ops into a few C++ loops, dynamic in the
    number of chunks (one compile per shape of heads, ~20-40 s on two cores, then cached on disk). Measured on two
    cores, per layer: 4 heads of 48 (the bundled model), 1.8 -> 0.5 ms at 127 tokens, 6.3 -> 1.8 at 512; 8 heads of
    128, 4.7 -> 1.3 and 17.8 -> 5.7. A backend that fails to compile logs why, and the terms run eagerly after."""
    token = _terms_backend.set(backend)
    try:
        yield
    finally:
        _terms_backend.reset(token)


def _chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> IntraChunkTerms:
    """_intra_chunk_terms: from kestrel's CPU kernel (kestrel_cpu::kda_chunk_terms) for float32 CPU tensors where
    no gradient is wanted, else compiled where compiled_chunk_terms asks for it."""
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta))
    if not wants_grad and q.device.type == "cpu" and q.dtype == torch.float32 and cpu.available():
        return IntraChunkTerms(*torch.ops.kestrel_cpu.kda_chunk_terms(q, k, v, g, beta))
    backend = _terms_backend.get()
    if backend is None or backend in _failed_backends or wants_grad or q.shape[0] < 2:
        return _intra_chunk_terms(q, k, v, g, beta)
    for x in (q, k, v, g, beta):
        torch._dynamo.mark_dynamic(x, 0)                 # the number of chunks; heads and widths stay static
    try:
        return _compiled_intra_chunk_terms(backend)(q, k, v, g, beta)
    except Exception as e:           # inductor failed (no C++ compiler, say): the eager terms are the same
        log.warning("prefill: torch.compile (%s) of the KDA chunk terms failed, computing them eagerly from now on: "
                    "%s", backend, e)
        _failed_backends.add(backend)
        return _intra_chunk_terms(q, k, v, g, beta)


def compile_chunk_terms(backend: str, num_heads: int, key_dim: int, value_dim: int, chunk_size: int = 64) -> None:
    """Compile the intra-chunk terms that compiled_chunk_terms(backend) runs, now: chunk_kda over one sequence of two
    chunks of zeros, so that the graph is traced from the tensors (shapes, strides) a prefill gives it; later
    prefills reuse it whatever their number of chunks. A backend that fails is logged and left out, as there."""
    tokens = 2 * chunk_size
    q, k, g = (torch.zeros(tokens, num_heads, key_dim) for _ in range(3))
    v, beta = torch.zeros(tokens, num_heads, value_dim), torch.zeros(tokens, num_heads)
    with compiled_chunk_terms(backend):
        chunk_kda(q, k, v, g, beta, torch.tensor([0, tokens]), chunk_size=chunk_size)


@cache
def _compiled_intra_chunk_terms(backend: str) -> Callable[..., IntraChunkTerms]:
    """_intra_chunk_terms compiled by backend (once per process; its inputs mark the chunk count dynamic)."""
    options = {"cpp_wrapper": True} if backend == "inductor" else None
    return torch.compile(_intra_chunk_terms, backend=backend, options=options)


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
    state = _initial_state(initial_state, (num_seqs, num_heads, key_dim, value_dim), dtype, q.device)
    if lengths and min(lengths) == max(lengths) == 1:       # plain decode: one token per sequence, no padding
        o, state = recurrent_kda_step(q, k, v, g, beta, state, scale)
        return o, state, state if output_token_states else None
    max_len = max(lengths, default=0)
    seq, pos = _token_positions(lengths, q.device)
    slot = seq * max_len + pos                                                  # [T] into [N * max_len]
    # Padding steps have g = k = beta = 0, which leaves the state unchanged.
    q_p, k_p, v_p, g_p, beta_p = (_scatter_rows(x.to(dtype), slot, num_seqs * max_len)
                                  .unflatten(0, (num_seqs, max_len)) for x in (q, k, v, g, beta))
    outputs, states = [], []
    for q_t, *terms in zip(*(x.unbind(1) for x in (q_p * scale, *_delta_terms(k_p, v_p, g_p, beta_p)))):
        state = _delta_step(state, *terms)
        outputs.append(_read_state(q_t, state))
        states.append(state)
    o = _stack_steps(outputs, v_p)[slot].to(v.dtype)
    token_states = _stack_steps(states, state.unsqueeze(1))[slot] if output_token_states else None
    return o, state, token_states


def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of N sequences, with no host synchronisation: q, k, g [N, H, K]; v [N, H, V];
    beta [N, H]; state [N, H, K, V]. Returns o [N, H, V] in v's dtype and the new state, computed in float32
    (float64 when an input is)."""
    dtype = _compute_dtype(q, k, v, g, beta, state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _delta_step(state.to(dtype), *_delta_terms(k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype)))
    return _read_state(q.to(dtype) * scale, state).to(v.dtype), state


def recurrent_kda_uniform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens for each of N sequences, with no host synchronisation: q, k, g [N, L, H, K]; v [N, L, H, V];
    beta [N, L, H]; state [N, H, K, V]. Returns o [N, L, H, V] in v's dtype and the state after every token
    [N, L, H, K, V], in float32 (float64 when an input is).

    recurrent_kda_step's arithmetic token after token (a speculative verification's few tokens), so every token's
    output and state are bit for bit those plain decoding computes; the elementwise terms of all L tokens are taken
    at once, and so are the outputs from the states (one batched product). Against the closed form batched over
    the tokens that kestrel used before (1 thread, 4 heads of 48, 5 tokens per sequence, one run): eagerly 1.6x
    faster at 1 sequence, 1.8x at 8 and 4.9x at 32; compiled by inductor 1.8x, 2.2x and 2.5x.
    """
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta, state), v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.to(dtype) for x in (q, k, v))
    state = state.to(dtype)
    states = []
    for terms in zip(*(x.unbind(1) for x in _delta_terms(k, v, g.to(dtype), beta.to(dtype)))):
        state = _delta_step(state, *terms)
        states.append(state)
    states = torch.stack(states, 1)                                                 # [N, L, H, K, V]
    return _read_state(q * scale, states).to(out_dtype), states


def _stack_steps(steps: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Per-step [N, ...] tensors -> [N * steps, ...], sequence-major; `like` [N, L, ...] gives the shape when empty."""
    if not steps:
        return like.new_zeros(0, *like.shape[2:])
    return torch.stack(steps, 1).flatten(0, 1)


def _delta_terms(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta rule's operands for tokens k, g [..., K], v [..., V], beta [...], shaped to broadcast against
    their states [..., K, V]: the decay exp(g) [..., K, 1], k [..., 1, K], v [..., 1, V] and beta * k [..., K, 1]."""
    return g.exp().unsqueeze(-1), k.unsqueeze(-2), v.unsqueeze(-2), (beta.unsqueeze(-1) * k).unsqueeze(-1)


def _delta_step(state: torch.Tensor, decay: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta_k: torch.Tensor
                ) -> torch.Tensor:
    """The state [..., K, V] after one token (operands from _delta_terms): decayed, then the delta rule's update
    beta_k times the residual v - k^T state."""
    state = state * decay
    return state + beta_k * (v - k @ state)


def _read_state(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x^T S per sequence and head: x [N, H, K], state [N, H, K, V] -> [N, H, V] (a batched matrix product; einsum
    computes the same product at twice the dispatch cost)."""
    return (x.unsqueeze(-2) @ state).squeeze(-2)


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
    right = beta.unsqueeze(-1) * torch.cat([k * _decay(cum_g), v], -1)
    strictly_lower = torch.ones(attn_kk.shape[-2:], dtype=torch.bool, device=attn_kk.device).tril(-1)
    coupling = _flush_negligible((beta.unsqueeze(-1) * attn_kk).masked_fill(~strictly_lower, 0.0))
    solved = _unit_lower_inverse(coupling) @ right
    return IntraChunkTerms(
        q_decayed=q * _decay(cum_g),
        attn_qk=attn_qk,
        keys_to_values=solved[..., :key_dim],
        values=solved[..., key_dim:],
        keys_to_end=k * _decay(last - cum_g),
        decay_total=_decay(last.squeeze(-2)),
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
    rows_halves = rows.unflatten(-3, (2, half))                              # [..., 2, half, R, K]
    keys_halves = keys.unflatten(-2, (2, half))
    g_halves = cum_g.unflatten(-2, (2, half))
    midpoint = g_halves[..., 0, -1:, :]                                      # G at the end of the first half
    g_halves = g_halves - torch.cat([torch.zeros_like(midpoint), midpoint], -2).unsqueeze(-2)  # from each half's start
    diagonal = _causal_decayed_scores(rows_halves, keys_halves, g_halves)    # [..., 2, half, R, half]
    early_keys, _ = keys_halves.unbind(-3)
    early_g, late_g = g_halves.unbind(-3)
    _, late_rows = rows_halves.unbind(-4)
    late_rows = late_rows * _decay(late_g).unsqueeze(-2)
    early_keys = early_keys * _decay(early_g[..., -1:, :] - early_g)
    lower_left = (late_rows.flatten(-3, -2) @ early_keys.transpose(-1, -2)).unflatten(-2, late_rows.shape[-3:-1])
    upper_diagonal, lower_diagonal = diagonal.unbind(-4)
    upper = torch.cat([upper_diagonal, torch.zeros_like(lower_left)], -1)
    lower = torch.cat([lower_left, lower_diagonal], -1)
    return torch.cat([upper, lower], -3)


def _causal_decayed_scores_elementwise(rows: torch.Tensor, keys: torch.Tensor, cum_g: torch.Tensor) -> torch.Tensor:
    """`_causal_decayed_scores` through the [s, s, K] decay tensor (for small blocks)."""
    return rows @ _causal_decayed_keys(keys, cum_g).transpose(-1, -2)


def _causal_decayed_keys(keys: torch.Tensor, cum_g: torch.Tensor) -> torch.Tensor:
    """exp(G_i - G_j) keys_j for j <= i, else 0: keys, cum_g [..., s, K] -> [..., s (i), s (j), K]."""
    size = keys.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=keys.device).tril()
    exponent = (cum_g.unsqueeze(-2) - cum_g.unsqueeze(-3)).masked_fill(~causal.unsqueeze(-1), -math.inf)
    return _decay(exponent) * keys.unsqueeze(-3)


def _unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., s, s], by recursive halving:
    [[I + L11, 0], [L21, I + L22]]^-1 = [[T11, 0], [-T22 L21 T11, T22]], with negligible entries flushed."""
    size = lower.shape[-1]
    if size == 1:
        return torch.ones_like(lower)
    if size % 2:
        eye = torch.eye(size, dtype=lower.dtype, device=lower.device)
        return torch.linalg.solve_triangular(lower + eye, eye, upper=False, unitriangular=True)
    half = size // 2
    blocks = lower.unflatten(-1, (2, half)).unflatten(-3, (2, half))          # [..., 2, half, 2, half]
    diagonal = _unit_lower_inverse(torch.diagonal(blocks, 0, -4, -2).movedim(-1, -3))
    upper_inverse, lower_inverse = diagonal.unbind(-3)
    lower_left = -_flush_negligible(_flush_negligible(lower_inverse @ blocks[..., 1, :, 0, :]) @ upper_inverse)
    top = torch.cat([upper_inverse, torch.zeros_like(upper_inverse)], -1)
    bottom = torch.cat([lower_left, lower_inverse], -1)
    return torch.cat([top, bottom], -2)


def _flush_negligible(x: torch.Tensor) -> torch.Tensor:
    """x with entries below NEGLIGIBLE in magnitude set to zero."""
    return torch.where(x.abs() > NEGLIGIBLE, x, 0.0)


def _decay(exponent: torch.Tensor) -> torch.Tensor:
    """exp(exponent) for exponents <= 0, exactly zero below NEGLIGIBLE_LOG_DECAY (and, compiled, exactly one above
    UNIT_LOG_DECAY)."""
    exponent = torch.where(exponent > NEGLIGIBLE_LOG_DECAY, exponent, -math.inf)
    if torch.compiler.is_dynamo_compiling():   # free there (fused); eagerly one more op, aten's exp has no such cost
        exponent = torch.where(exponent < UNIT_LOG_DECAY, exponent, 0.0)
    return exponent.exp()


def _carry_state(terms: IntraChunkTerms, state: torch.Tensor, layout: ChunkLayout, keep_leaving: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Run the state through the chunks in order, all sequences of a chunk step at once.

    state: [N, H, K, V] by rank. Returns the state entering each chunk [B, H, K, V], the chunks' new
    values u [B, H, C, V], the state leaving each chunk [B, H, K, V] when keep_leaving (else None), all
    in packed chunk order, and the final state by rank [N, H, K, V].
    """
    entering, new_values, leaving = [], [], []
    per_step = (x.split(layout.active) for x in (terms.values, terms.keys_to_values, terms.keys_to_end,
                                                  terms.decay_total))
    for values, keys_to_values, keys_to_end, decay_total in zip(*per_step):
        active = values.shape[0]
        current = state[:active]
        u = values - keys_to_values @ current
        after = decay_total.unsqueeze(-1) * current + keys_to_end.transpose(-1, -2) @ u
        entering.append(current)
        new_values.append(u)
        if keep_leaving:
            leaving.append(after)
        state = torch.cat([after, state[active:]])
    no_states = state[:0]
    return (torch.cat(entering or [no_states]), torch.cat(new_values or [terms.values]),
            torch.cat(leaving or [no_states]) if keep_leaving else None, state)


@lru_cache(maxsize=16)
def _chunk_layout(lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """Packed chunk order for sequences of the given lengths (see ChunkLayout); computed once per batch (the KDA
    layers of a forward share it), as normal tensors even under inference mode (a later training step may reuse it)."""
    with torch.inference_mode(False):
        return _build_chunk_layout(lengths, chunk_size, device)


def _build_chunk_layout(lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    chunks_per_seq = [-(-length // chunk_size) for length in lengths]
    order = sorted(range(len(lengths)), key=lambda n: -chunks_per_seq[n])
    rank = [0] * len(lengths)
    for position, seq in enumerate(order):
        rank[seq] = position
    active = tuple(sum(1 for count in chunks_per_seq if count > step) for step in range(max(chunks_per_seq, default=0)))
    step_offset = [0, *accumulate(active)][:-1]                               # first packed chunk of each step

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


def _initial_state(initial_state: torch.Tensor | None, shape: tuple[int, int, int, int], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """initial_state in the compute dtype, or zeros of shape [N, H, K, V]."""
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
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
