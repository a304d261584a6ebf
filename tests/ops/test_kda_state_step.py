"""kestrel_cpu::kda_state_step_, the C++ recurrence of a compiled CPU decode step: against the torch reference step
(recurrent_kda_step) in float64 over the same gathered states, its pool updated in place at the sequences' slots
only, a fresh sequence's slot read as zeros whatever it holds (NaN here); and kda_decode traced by torch.compile takes
it for a plain decode step over a float32 pool, giving the eager step's output and pools, and keeps the torch
recurrence where it does not apply."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.cpu as cpu
from kestrel.ops.torch import kda_decode as reference
from kestrel.ops.torch.kda import recurrent_kda_step
from kestrel.ops.torch.kda_decode import KDALayerParams

SLOTS, USE_STATE = [5, 2, 7, 0, 3], [True, False, True, True, False]


def inputs(heads: int, key_dim: int, value_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, k (unit rows), v, g (log decay < 0) [N, H, .] and beta [N, H] for len(SLOTS) sequences, float32."""
    n = len(SLOTS)
    q, k = (torch.nn.functional.normalize(torch.randn(n, heads, key_dim, generator=generator), dim=-1)
            for _ in range(2))
    return (q, k, torch.randn(n, heads, value_dim, generator=generator),
            -torch.rand(n, heads, key_dim, generator=generator) * 2, torch.rand(n, heads, generator=generator))


@pytest.mark.parametrize("heads, key_dim, value_dim", [(3, 32, 32), (2, 24, 48), (1, 128, 128)])
def test_the_kernel_is_the_reference_step_in_place(heads: int, key_dim: int, value_dim: int) -> None:
    assert cpu.load()
    generator = torch.Generator().manual_seed(key_dim)
    pool = torch.randn(8, heads, key_dim, value_dim, generator=generator) * 0.3
    slots, use_state = torch.tensor(SLOTS), torch.tensor(USE_STATE)
    pool[slots[~use_state]] = float("nan")                     # a fresh sequence's slot may hold anything
    q, k, v, g, beta = inputs(heads, key_dim, value_dim, generator)
    state = torch.where(use_state.view(-1, 1, 1, 1), pool[slots], 0).double()
    expected_o, expected_state = recurrent_kda_step(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                    state, scale=0.3)
    updated = pool.clone()
    o = torch.ops.kestrel_cpu.kda_state_step_(q, k, v, g, beta, updated, slots, use_state, 0.3)
    assert o.dtype == torch.float32 and o.shape == v.shape
    torch.testing.assert_close(o.double(), expected_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(updated[slots].double(), expected_state, rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(8) if s not in SLOTS]
    assert torch.equal(updated[untouched], pool[untouched])
    torch.library.opcheck(torch.ops.kestrel_cpu.kda_state_step_.default,
                          (q, k, v, g, beta, pool.nan_to_num(), slots, use_state, 0.3))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kestrel_cpu.kda_state_step_(q, k, v, g, beta, updated, slots + 8, use_state, 0.3)


def decode_args(pool_dtype: torch.dtype, generator: torch.Generator) -> tuple:
    """kda_decode's arguments for one token of each of len(SLOTS) sequences: 2 heads of 32, conv width 4."""
    heads, dim, width, n = 2, 32, 4, len(SLOTS)
    params = KDALayerParams(torch.randn(3 * heads * dim, width, generator=generator) * 0.3,
                            torch.randn(heads, generator=generator), torch.randn(heads * dim, generator=generator),
                            torch.ones(dim), -5.0, 1e-5)
    conv_pool = torch.randn(8, width - 1, 3 * heads * dim, generator=generator)
    state_pool = (torch.randn(8, heads, dim, dim, generator=generator) * 0.3).to(pool_dtype)
    return (torch.randn(n, 3 * heads * dim, generator=generator), torch.randn(n, heads, dim, generator=generator),
            torch.randn(n, heads, generator=generator), torch.randn(n, heads, dim, generator=generator), params,
            conv_pool, state_pool, torch.tensor(SLOTS), None, torch.tensor(USE_STATE))


def trace_decode(*args, **kwargs) -> tuple[tuple, list[str]]:
    """kda_decode(*args, **kwargs) traced by torch.compile (the graph run as traced), and the ops its graph calls."""
    targets = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(reference.kda_decode, backend=capture, fullgraph=True)(*args, **kwargs), targets


@pytest.mark.parametrize("pool_dtype, kernel", [(torch.float32, True), (torch.bfloat16, False)])
def test_a_traced_decode_step_runs_the_kernel_on_a_float32_pool(pool_dtype: torch.dtype, kernel: bool) -> None:
    args = decode_args(pool_dtype, torch.Generator().manual_seed(3))
    eager_pools = [p.clone() for p in args[5:7]]
    traced_pools = [p.clone() for p in args[5:7]]
    with torch.inference_mode():
        expected, _ = reference.kda_decode(*args[:5], *eager_pools, *args[7:])
        (actual, _), targets = trace_decode(*args[:5], *traced_pools, *args[7:])
    assert any("kestrel_cpu.kda_state_step_" in target for target in targets) == kernel
    tolerance = 1e-5 if kernel else 0
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    for traced, eager in zip(traced_pools, eager_pools):
        torch.testing.assert_close(traced, eager, rtol=tolerance, atol=tolerance)


def test_a_traced_verification_keeps_the_torch_recurrence() -> None:
    """keep_token_states (a speculative verification) wants every token's state and leaves the pools as they were:
    the kernel does not apply."""
    args = decode_args(torch.float32, torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = reference.kda_decode(*args, keep_token_states=True)
        actual, targets = trace_decode(*args, keep_token_states=True)
    assert targets and not any("kda_state_step_" in target for target in targets)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
