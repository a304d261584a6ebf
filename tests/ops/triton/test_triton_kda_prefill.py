"""The chunked KDA prefill kernels against `kestrel.ops.torch.kda_prefill.kda_prefill` (chunk_kda over the pool),
under the Triton interpreter.

Cases: odd lengths, an empty sequence, lengths that are exact multiples of the chunk, a sequence shorter than one
diagonal block; slots out of order, some sequences starting fresh (their slots hold NaN); both decay gates, the
unbounded one with per-step decays below exp(-70) (the kernel must not overflow where the gate is steep);
chunk-boundary states.
Tolerances, relative to the largest reference magnitude: 1e-4 for fp32 (observed at most 4e-6; the two sides
invert (I + A) differently), 1e-3 for fp16 q, k, v (observed at most 6e-5: fp16 rounding of o).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.ops.torch import kda_prefill as reference
from kestrel.ops.triton import kda_prefill as kernel

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3}
POOL_SLOTS = 8
SLOTS = [6, 1, 4, 0, 3]
USE_STATE = [True, False, True, True, False]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().clamp(min=1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def make_case(lengths: list[int], gate: str, dtype: torch.dtype, key_dim: int = 16, value_dim: int = 32,
              heads: int = 2, seed: int = 0) -> dict:
    """Realistic inputs: L2-normalised q, k; sigmoid beta; a KDA gate (unbounded: -exp(A) softplus, A up to e^3)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    raw = randn(total, heads, key_dim) + 1.0
    rate = torch.exp(3.0 * torch.rand(heads, 1, generator=generator))
    g = -rate * F.softplus(raw) if gate == "unbounded" else -5.0 * torch.sigmoid(rate * raw)
    slots, use_state = torch.tensor(SLOTS[:len(lengths)]), torch.tensor(USE_STATE[:len(lengths)])
    state_pool = randn(POOL_SLOTS, heads, key_dim, value_dim) * 0.5
    state_pool[slots[~use_state]] = float("nan")        # a fresh sequence's slot holds anything: it must be ignored
    return dict(
        q=F.normalize(randn(total, heads, key_dim), dim=-1).to(dtype),
        k=F.normalize(randn(total, heads, key_dim), dim=-1).to(dtype),
        v=randn(total, heads, value_dim).to(dtype), g=g, beta=randn(total, heads).sigmoid(),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        state_pool=state_pool, slots=slots, use_state=use_state,
    )


def run(op, case: dict, chunk_size: int, output_chunk_states: bool) -> tuple:
    """op on a private copy of the pool; returns (o, chunk states, pool)."""
    case = {**case, "state_pool": case["state_pool"].clone()}
    o, states = op(**case, chunk_size=chunk_size, output_chunk_states=output_chunk_states)
    return o, states, case["state_pool"]


@pytest.mark.parametrize("gate", ["unbounded", "lower_bound"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(gate: str, dtype: torch.dtype) -> None:
    case = make_case([37, 0, 64, 5, 32], gate, dtype)
    o_ref, states_ref, pool_ref = run(reference.kda_prefill, case, 32, output_chunk_states=True)
    o, states, pool = run(kernel.kda_prefill, case, 32, output_chunk_states=True)
    assert o.dtype == o_ref.dtype and states.shape == states_ref.shape == (4, 2, 16, 32)
    assert relative_error(o, o_ref) < TOLERANCE[dtype]
    assert relative_error(pool, pool_ref) < TOLERANCE[dtype]
    assert relative_error(states, states_ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_sizes_and_padded_dims(chunk_size: int) -> None:
    """Head dims that are not powers of two (padded inside the kernel), chunks of one and four diagonal blocks."""
    case = make_case([70, 3], "unbounded", torch.float32, key_dim=24, value_dim=20, heads=1, seed=1)
    o_ref, states_ref, pool_ref = run(reference.kda_prefill, case, chunk_size, output_chunk_states=True)
    o, states, pool = run(kernel.kda_prefill, case, chunk_size, output_chunk_states=True)
    assert relative_error(o, o_ref) < TOLERANCE[torch.float32]
    assert relative_error(pool, pool_ref) < TOLERANCE[torch.float32]
    assert relative_error(states, states_ref) < TOLERANCE[torch.float32]


def test_without_chunk_states_and_all_empty() -> None:
    case = make_case([0, 0], "lower_bound", torch.float32)
    o, states, pool = run(kernel.kda_prefill, case, 16, output_chunk_states=False)
    _, _, pool_ref = run(reference.kda_prefill, case, 16, output_chunk_states=False)
    assert o.shape == (0, 2, 32) and states is None
    assert torch.equal(pool, pool_ref)            # sequence 0 keeps its state, sequence 1's slot is zeroed
