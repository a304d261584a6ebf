"""The fused KDA decode step: the torch reference against the KDA layer's chunked prefill path, the Triton kernel
against the reference.

Oracles: the layer's prefill path (short conv, then chunked KDA from the slots' states) on the same tokens must give
the fused step's output and pool contents; then `kestrel.ops.torch.kda_decode.kda_decode` for the kernel, run under
the Triton interpreter. Tolerances, relative to the largest reference magnitude: 1e-5 for fp32 (observed at most
4e-7), 1e-3 for fp16 inputs (observed at most 2e-5 on o, where one fp16 rounding of the conv, silu or output can
land on the other side; the fp32 states stay within 3e-7).
"""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.ops.torch import kda_decode as reference
from kestrel.ops.torch.kda_decode import KDALayerParams, TokenStates
from kestrel.ops.triton import kda_decode as kernel

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3}
POOL_SLOTS = 8
SLOTS = [5, 2, 7, 0]              # out of order, one sequence per slot
USE_STATE = [True, False, True, True]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().clamp(min=1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def layer_inputs(layer, x: torch.Tensor) -> tuple:
    """The KDA layer's projections of x: qkv, the decay-gate input, beta logits and the output gate."""
    num_tokens, heads, dim = x.shape[0], layer.num_heads, layer.head_dim
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
    gate = layer.g_proj(x) if hasattr(layer, "g_proj") else layer.g_b_proj(layer.g_a_proj(x))
    return (qkv, layer.f_b_proj(layer.f_a_proj(x)).view(num_tokens, heads, dim), layer.b_proj(x),
            gate.view(num_tokens, heads, dim))


def fused_step(layer, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
    """The layer's decode path: the fused reference op over the pool."""
    state = cache.kda[layer.kda_index]
    o, _ = reference.kda_decode(*layer_inputs(layer, x), layer.step_params(), state.conv, state.recurrent,
                                batch.state_slots, batch.cu_seqlens, batch.prefix_lens > 0)
    return o


def prefill_path(layer, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
    """The layer's prefill path on the same tokens: short conv and chunked KDA from the slots, then the norm."""
    qkv, gate_raw, beta_raw, out_gate = layer_inputs(layer, x)
    o = layer._prefill(qkv, gate_raw, beta_raw, batch, cache.kda[layer.kda_index])
    return reference.gated_rms_norm(o, out_gate, layer.o_norm.weight, layer.o_norm.eps)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
@pytest.mark.parametrize("new_lens", [[1, 1, 1, 1], [3, 1, 0, 2], [2, 1, 0, 1]])   # the last: as many tokens as slots
@torch.inference_mode()
def test_reference_matches_the_prefill_path(preset: str, new_lens: list[int]) -> None:
    model, _ = tiny_model(preset)
    layer = next(m.self_attn for m in model.model.layers if hasattr(m.self_attn, "kda_index"))
    generator = torch.Generator().manual_seed(1)
    caches = []
    for _ in range(2):
        cache = HybridCache.allocate(model.config, num_slots=POOL_SLOTS, num_pages=1, page_size=16,
                                     dtype=torch.float32)
        caches.append(cache)
    for name in ("conv", "recurrent"):
        pool = getattr(caches[0].kda[layer.kda_index], name)
        pool.copy_(torch.randn(pool.shape, generator=generator) * 0.3)
        getattr(caches[1].kda[layer.kda_index], name).copy_(pool)
    prefix = [4 if use else 0 for use in USE_STATE]
    batch = ForwardBatch.build(new_lens, prefix, SLOTS)
    x = torch.randn(sum(new_lens), model.config.hidden_size, generator=generator)

    expected = prefill_path(layer, x, batch, caches[0])
    actual = fused_step(layer, x, batch, caches[1])
    assert relative_error(actual, expected) < 1e-5
    for name in ("conv", "recurrent"):
        pools = [getattr(c.kda[layer.kda_index], name) for c in caches]
        assert relative_error(pools[1], pools[0]) < 1e-5


def make_case(new_lens: list[int], dtype: torch.dtype, lower_bound: float | None, heads: int = 2, dim: int = 16,
              width: int = 4, seed: int = 0) -> dict:
    """Random inputs of a decode step: activations in dtype, fp32 parameters and recurrent pool."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tokens, channels = sum(new_lens), 3 * heads * dim
    slots, use_state = torch.tensor(SLOTS[:len(new_lens)]), torch.tensor(USE_STATE[:len(new_lens)])
    params = KDALayerParams(
        conv_weight=(torch.rand(channels, width, generator=generator) - 0.5),
        A_log=2.7 * torch.rand(heads, generator=generator) if lower_bound is None else randn(heads),
        dt_bias=randn(heads * dim), norm_weight=1 + randn(dim, scale=0.1), lower_bound=lower_bound, norm_eps=1e-5)
    conv_pool = randn(POOL_SLOTS, width - 1, channels).to(dtype)
    state_pool = randn(POOL_SLOTS, heads, dim, dim, scale=0.3)
    conv_pool[slots[~use_state]] = float("nan")        # a fresh sequence's slot holds anything: it must be ignored
    state_pool[slots[~use_state]] = float("nan")
    return dict(
        qkv=randn(tokens, channels).to(dtype), gate_raw=randn(tokens, heads, dim).to(dtype),
        beta_raw=randn(tokens, heads).to(dtype), out_gate=randn(tokens, heads, dim).to(dtype), params=params,
        conv_pool=conv_pool, state_pool=state_pool, slots=slots,
        cu_seqlens=torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()]), use_state=use_state,
    )


def run(op, case: dict, keep_token_states: bool) -> tuple:
    """Call op on a private copy of the pools; returns (o, token states, conv pool, state pool)."""
    case = {**case, "conv_pool": case["conv_pool"].clone(), "state_pool": case["state_pool"].clone()}
    o, states = op(**case, keep_token_states=keep_token_states)
    return o, states, case["conv_pool"], case["state_pool"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("new_lens", [[1, 1, 1, 1], [3, 1, 0, 2]])
def test_kernel_updates_pool_like_reference(dtype: torch.dtype, lower_bound: float | None,
                                            new_lens: list[int]) -> None:
    case = make_case(new_lens, dtype, lower_bound)
    o_ref, _, conv_ref, state_ref = run(reference.kda_decode, case, keep_token_states=False)
    o, states, conv, state = run(kernel.kda_decode, case, keep_token_states=False)
    assert states is None
    assert relative_error(o, o_ref) < TOLERANCE[dtype]
    assert relative_error(state, state_ref) < TOLERANCE[dtype]
    assert torch.equal(conv, conv_ref)                       # conv state rows are copies, exact in any dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_keeps_token_states(dtype: torch.dtype) -> None:
    case = make_case([3, 1, 0, 2], dtype, lower_bound=-5.0, dim=24)      # head_dim 24: padded to 32 in the kernel
    o_ref, states_ref, _, _ = run(reference.kda_decode, case, keep_token_states=True)
    o, states, conv, state = run(kernel.kda_decode, case, keep_token_states=True)
    assert relative_error(o, o_ref) < TOLERANCE[dtype]
    assert relative_error(states.recurrent, states_ref.recurrent) < TOLERANCE[dtype]
    assert torch.equal(states.conv, states_ref.conv)
    torch.testing.assert_close(conv, case["conv_pool"], rtol=0, atol=0, equal_nan=True)         # pools untouched
    torch.testing.assert_close(state, case["state_pool"], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("keep_token_states", [False, True])
@pytest.mark.parametrize("each", [1, 3])
def test_equal_counts_need_no_lengths(keep_token_states: bool, each: int) -> None:
    """cu_seqlens=None (every sequence brings T / N tokens: a decode step, a verification of equal drafts; no
    lengths read back) gives what the lengths give, on the reference's uniform path and the kernel."""
    case = make_case([each] * 4, torch.float32, lower_bound=-5.0)
    for op in (reference.kda_decode, kernel.kda_decode):
        expected = run(op, case, keep_token_states)
        got = run(op, {**case, "cu_seqlens": None}, keep_token_states)
        for a, b in zip(got, expected):
            if isinstance(a, TokenStates):
                a, b = torch.cat([a.conv.flatten(), a.recurrent.flatten()]), torch.cat([b.conv.flatten(),
                                                                                        b.recurrent.flatten()])
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_token_states_end_where_the_plain_step_ends() -> None:
    """The last token's kept states are the states the plain step writes to the pool (reference invariant)."""
    case = make_case([3, 1, 2], torch.float32, lower_bound=None)
    _, states, _, _ = run(reference.kda_decode, case, keep_token_states=True)
    _, _, conv, state = run(reference.kda_decode, case, keep_token_states=False)
    last = case["cu_seqlens"][1:] - 1
    assert torch.equal(states.conv[last], conv[case["slots"]])
    assert torch.allclose(states.recurrent[last], state[case["slots"]])
