"""Chunked KDA prefill over the state pool: `chunk_kda` with initial states read from, and final states written
to, the sequences' slots. The reference for the Triton prefill kernels."""

from __future__ import annotations

import torch

from .kda import chunk_kda, recurrent_kda

SHORT_SEQUENCES = 8
"""Batches whose sequences all bring at most this many tokens run the recurrence token by token (as decode does):
on the CPU the chunked form's fixed work per chunk costs more for so few (4 heads of 48, 2 threads: one token 2.0 ms
chunked against 0.05 ms, eight 0.36 ms; a prefix-cache capture's tail is usually one token)."""


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, use_state: torch.Tensor,
                scale: float | None = None, chunk_size: int = 64, output_chunk_states: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over packed sequences, each starting from its slot's recurrent state.

    q, k: [T, H, K] (L2-normalised); v: [T, H, V]; g: [T, H, K] log decay (<= 0); beta: [T, H];
    cu_seqlens: [N+1] int64; state_pool: [slots, H, K, V]; slots: [N] int64, distinct; use_state: [N] bool,
    False where a sequence starts from zeros (whatever its slot holds). Writes each sequence's final state to
    state_pool[slots]. Returns o [T, H, V] in v's dtype and, with output_chunk_states, the state after every full
    chunk_size tokens of each sequence [sum_n floor(L_n / chunk_size), H, K, V] fp32 (sequences in order), else None.
    """
    initial = torch.where(use_state.view(-1, 1, 1, 1), state_pool[slots].float(), 0)   # fresh slots may hold NaN
    if not output_chunk_states and int(cu_seqlens.diff().max()) <= SHORT_SEQUENCES:
        o, final, chunk_states = recurrent_kda(q, k, v, g, beta, cu_seqlens, initial_state=initial, scale=scale)
    else:
        o, final, chunk_states = chunk_kda(q, k, v, g, beta, cu_seqlens, initial_state=initial, scale=scale,
                                           chunk_size=chunk_size, output_chunk_states=output_chunk_states)
    state_pool[slots] = final.detach().to(state_pool.dtype)
    return o, chunk_states
