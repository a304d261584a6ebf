"""Pool sizes on one rank the way SGLang's runtime derives them (sgl-project/sglang
python/sglang/srt/mem_cache/kv_cache_configurator.py: `_handle_max_mamba_cache` and `resolve_max_num_reqs`).

rest = memory x mem_fraction - weights. The state pool holds K slots per attention-DP worker:
- `--max-mamba-cache-size` pins K = that // dp;
- with the radix cache disabled and `--max-running-requests` set, K = that // dp;
- otherwise K comes from the ratio budget rest x r / (1 + r): K = (budget - slot) // slot without speculation,
  where a slot is the state plus, under ReplaySSM spec-verify, its ring; under speculation the verify scratch of every
  admitted request shares the budget: K = (budget - slot - scratch) // (slot + scratch / S).
The verify scratch of one request is its D verify states (state x D) without ReplaySSM; under ReplaySSM spec-verify D
is 0 but the conv verify windows stay (SGLang keeps them for the conv rollback: the conv state, W verified tokens
deep). The scratch takes scratch x (admitted + 1); the K slots take (K + 1) slots (the pool's padding slot); the KV
pool gets the rest. A worker admits min(--max-running-requests // dp (else 2,048-4,096 by token capacity),
tokens // 2, K // S) requests. Plans of kestrel's own engine call its planner instead
(kestrel/engine/cache/planner.py, through planner.py).
Runtime overheads SGLang subtracts as well (CUDA graphs, activations, communication buffers) are not modelled, so
the pools here are upper bounds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolInputs:
    """What one rank's pool sizing reads; counts given for the whole server are divided per DP worker here."""

    rest_bytes: int                   # memory x fraction - weights
    ratio: float                      # --mamba-full-memory-ratio
    state_bytes: int                  # one state slot on this rank
    kv_bytes_per_token: float         # one logical token on this rank (KV / DCP + draft KV)
    slots_per_request: int            # S
    verify_states: int = 0            # D (0 under ReplaySSM spec-verify)
    ring_bytes: int = 0               # the ReplaySSM ring of one slot (0 without ReplaySSM spec-verify)
    window_bytes: int = 0             # the conv verify windows of one request under ReplaySSM spec-verify
    context_len: int = 1_048_576
    dp: int = 1                       # attention-DP workers
    max_running_requests: int | None = None
    max_mamba_cache_size: int | None = None
    radix_disabled: bool = False


@dataclass(frozen=True)
class Pools:
    """One rank's pools (tokens are logical tokens of its attention-DP worker)."""

    rest_bytes: int              # memory x fraction - weights (negative: the weights do not fit)
    state_slots: int             # K
    kv_tokens: int
    max_running_requests: int    # per attention-DP worker

    def holds(self, request_len: int) -> bool:
        """Whether at least one request of request_len tokens is admitted."""
        return self.max_running_requests >= 1 and self.kv_tokens >= request_len


def _per_worker(count: int | None, dp: int) -> int | None:
    return None if count is None else count // dp


def _scratch(inputs: PoolInputs) -> int:
    """The verify scratch of one running request: its D verify states, and the conv verify windows that ReplaySSM
    spec-verify keeps."""
    return inputs.state_bytes * inputs.verify_states + inputs.window_bytes


def _verify_bytes(inputs: PoolInputs, requests: int) -> int:
    """The verify scratch of `requests` admitted requests plus the padding row."""
    return _scratch(inputs) * (requests + 1)


def _capped_requests(inputs: PoolInputs, slots: int) -> int:
    running = _per_worker(inputs.max_running_requests, inputs.dp)
    by_slots = slots // inputs.slots_per_request
    return by_slots if running is None else min(running, by_slots)


def state_slots(inputs: PoolInputs) -> tuple[int, int]:
    """(K state slots, bytes of verify states) of one worker (see the module docstring)."""
    running = _per_worker(inputs.max_running_requests, inputs.dp)
    if inputs.max_mamba_cache_size is not None:
        slots = inputs.max_mamba_cache_size // inputs.dp
        return slots, _verify_bytes(inputs, _capped_requests(inputs, slots))
    if inputs.radix_disabled and running is not None:
        return running, _verify_bytes(inputs, running)
    budget = inputs.rest_bytes * inputs.ratio / (1 + inputs.ratio)
    slot, scratch = inputs.state_bytes + inputs.ring_bytes, _scratch(inputs)
    if scratch:
        slots = int((budget - slot - scratch) // (slot + scratch / inputs.slots_per_request))
        return slots, _verify_bytes(inputs, _capped_requests(inputs, slots))
    return int((budget - slot) // slot), 0


def admitted_requests(inputs: PoolInputs, slots: int, kv_tokens: int) -> int:
    """SGLang's resolve_max_num_reqs for one worker."""
    running = _per_worker(inputs.max_running_requests, inputs.dp)
    if running is None:
        running = max(min(int(kv_tokens / inputs.context_len * 512), 4096), 2048)
    return max(min(running, kv_tokens // 2, slots // inputs.slots_per_request), 0)


def size_pools(inputs: PoolInputs) -> Pools:
    """One rank's pools (see the module docstring)."""
    if inputs.rest_bytes <= 0:
        return Pools(inputs.rest_bytes, 0, 0, 0)
    slots, verify = state_slots(inputs)
    slots = max(slots, 0)
    state = (slots + 1) * (inputs.state_bytes + inputs.ring_bytes)
    kv_tokens = max(int((inputs.rest_bytes - verify - state) // inputs.kv_bytes_per_token), 0)
    return Pools(inputs.rest_bytes, slots, kv_tokens, admitted_requests(inputs, slots, kv_tokens))
