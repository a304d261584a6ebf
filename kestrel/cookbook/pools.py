"""Pool sizes on one rank the way SGLang derives them from --mem-fraction-static and --mamba-full-memory-ratio.

rest = memory x mem_fraction - weights. The state pool gets rest x r / (1 + r): slots = that / state_bytes, or,
under speculation, that / (state_bytes x (1 + D / S)) with the D verify states of every admitted request carved
out of the same budget. The KV pool gets what the state pool leaves. The admitted-concurrency cap is
min(2048-4096 by token capacity, tokens // 2, slots // S, --max-running-requests).
Runtime overheads SGLang subtracts as well (CUDA graphs, activations, communication buffers) are not modelled, so
the pools here are upper bounds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pools:
    """One rank's pools (tokens are logical tokens of its attention-DP group)."""

    rest_bytes: int              # memory x fraction - weights (negative: the weights do not fit)
    state_slots: int
    kv_tokens: int
    max_running_requests: int    # per attention-DP group

    def holds(self, request_len: int) -> bool:
        """Whether at least one request of request_len tokens is admitted."""
        return self.max_running_requests >= 1 and self.kv_tokens >= request_len


def size_pools(rest_bytes: int, ratio: float, state_bytes: int, kv_bytes_per_token: float, slots_per_request: int,
               verify_states: int, context_len: int, max_running_requests: int | None = None) -> Pools:
    """Pools of one rank with `rest_bytes` after the weights (see the module docstring)."""
    if rest_bytes <= 0:
        return Pools(rest_bytes, 0, 0, 0)
    state_budget = rest_bytes * ratio / (1 + ratio)
    if verify_states:
        slots = int(state_budget // (state_bytes * (1 + verify_states / slots_per_request)))
        admitted = slots // slots_per_request
        if max_running_requests is not None:
            admitted = min(admitted, max_running_requests)
        intermediate = state_bytes * admitted * verify_states
    else:
        slots = int(state_budget // state_bytes)
        intermediate = 0
    kv_tokens = max(int((rest_bytes - slots * state_bytes - intermediate) // kv_bytes_per_token), 0)
    estimated = min(max(int(kv_tokens / context_len * 512), 2048), 4096)
    cap = min(max_running_requests if max_running_requests is not None else estimated, kv_tokens // 2,
              slots // slots_per_request)
    return Pools(rest_bytes, slots, kv_tokens, max(cap, 0))
