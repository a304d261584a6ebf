"""kestrel's torch KDA ops against fla's naive references, and against themselves (chunked == recurrent,
split == whole, stepwise == batched).

Oracle: fla.ops.kda.naive.naive_recurrent_kda (and naive_chunk_kda where T is a multiple of 64), run on one
sequence at a time. fla computes in float32. Tolerance for float32 outputs and states: max abs error at most
1e-4 times the largest magnitude of the reference (observed: about 1e-6 times).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from kestrel.ops import causal_conv1d
from kestrel.ops.torch import kda as kda_ops
from kestrel.ops.torch.kda import chunk_kda, recurrent_kda, recurrent_kda_step, recurrent_kda_uniform
from kestrel.ops.torch.kda_prefill import kda_prefill

RELATIVE_TOLERANCE = 1e-4
LENGTHS_SINGLE = [1, 17, 64, 100, 130]
LENGTHS_VARLEN = [17, 0, 130, 64, 1, 100]
GATES = ["unbounded", "lower_bound"]


def make_inputs(lengths: list[int], gate: str = "unbounded", heads: int = 2, key_dim: int = 32,
                value_dim: int = 16, initial_state: bool = True, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Realistic float32 KDA inputs for packed sequences: L2-normalised q, k; sigmoid beta; a real KDA gate.

    The unbounded (Kimi-Linear) gate uses A_log in [0, 2.7], so per-step decays reach exp(-20) and below;
    the lower-bounded (K3) gate uses lower_bound = -5.
    """
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    raw_gate = randn(total, heads, key_dim)
    a_log = 2.7 * torch.rand(heads, generator=generator)
    dt_bias = randn(heads * key_dim)
    if gate == "unbounded":
        g = naive_kda_gate(raw_gate, a_log, dt_bias)
    else:
        g = naive_kda_lowerbound_gate(raw_gate, a_log, dt_bias, lower_bound=-5.0)
    return {
        "q": F.normalize(randn(total, heads, key_dim), dim=-1),
        "k": F.normalize(randn(total, heads, key_dim), dim=-1),
        "v": randn(total, heads, value_dim),
        "g": g,
        "beta": randn(total, heads).sigmoid(),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]),
        "initial_state": randn(len(lengths), heads, key_dim, value_dim) if initial_state else None,
    }


def naive_per_sequence(inputs: dict[str, torch.Tensor | None], naive=naive_recurrent_kda
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each packed sequence alone through fla's naive op; returns (o [T, H, V], final states [N, H, K, V])."""
    bounds = inputs["cu_seqlens"].tolist()
    outputs, states = [], []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        pieces = [inputs[name][start:end].unsqueeze(0) for name in ("q", "k", "v", "g", "beta")]
        state = None if inputs["initial_state"] is None else inputs["initial_state"][n:n + 1]
        o, final = naive(*pieces, initial_state=state, output_final_state=True)
        outputs.append(o[0])
        states.append(final[0])
    return torch.cat(outputs), torch.stack(states)


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Max abs error at most RELATIVE_TOLERANCE times the reference's largest magnitude."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=RELATIVE_TOLERANCE * scale,
                               msg=lambda message: f"{what}: {message}" if what else message)


def sequence_inputs(inputs: dict, names: tuple[str, ...] = ("q", "k", "v", "g", "beta", "cu_seqlens")) -> list:
    """The positional arguments of chunk_kda / recurrent_kda."""
    return [inputs[name] for name in names]


@pytest.mark.parametrize("op", ["chunk", "chunk, torch paths", "recurrent"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("lengths", [[length] for length in LENGTHS_SINGLE] + [LENGTHS_VARLEN],
                         ids=lambda lengths: "-".join(map(str, lengths)))
def test_matches_naive_recurrent(op: str, gate: str, with_state: bool, lengths: list[int], request) -> None:
    """chunk_kda (its chunk terms from the CPU kernel, and with the kernels off from torch) and recurrent_kda."""
    if op == "chunk, torch paths":
        request.getfixturevalue("torch_paths")
    inputs = make_inputs(lengths, gate, initial_state=with_state)
    kda = recurrent_kda if op == "recurrent" else chunk_kda
    o, final, _ = kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])
    expected_o, expected_final = naive_per_sequence(inputs)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert_close_to(o, expected_o)
    assert_close_to(final, expected_final)


@pytest.mark.parametrize("gate", GATES)
def test_chunk_matches_naive_chunk(gate: str) -> None:
    inputs = make_inputs([128, 64], gate)
    o, final, _ = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])
    expected_o, expected_final = naive_per_sequence(inputs, naive_chunk_kda)
    assert_close_to(o, expected_o)
    assert_close_to(final, expected_final)


@pytest.mark.parametrize("paths", ["kernel", "torch"])
@pytest.mark.parametrize("chunk_size", [1, 16, 24, 100, 128])
def test_any_chunk_size_matches_naive(chunk_size: int, paths: str, request) -> None:
    if paths == "torch":
        request.getfixturevalue("torch_paths")
    inputs = make_inputs(LENGTHS_VARLEN, "unbounded")
    o, final, _ = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"], chunk_size=chunk_size)
    expected_o, expected_final = naive_per_sequence(inputs)
    assert_close_to(o, expected_o)
    assert_close_to(final, expected_final)


def test_extreme_decay_stays_finite_and_matches() -> None:
    """Per-step log-decays down to about -300 (A_log = 4 in the unbounded gate): no overflow, no NaN in o or grads."""
    inputs = make_inputs([150, 40], "unbounded")
    raw = torch.randn(inputs["g"].shape, generator=torch.Generator().manual_seed(3))
    inputs["g"] = naive_kda_gate(raw, torch.full((raw.shape[1],), 4.0), None)
    assert inputs["g"].min() < -100
    g = inputs["g"].clone().requires_grad_()
    o, final, _ = chunk_kda(inputs["q"], inputs["k"], inputs["v"], g, inputs["beta"], inputs["cu_seqlens"],
                            initial_state=inputs["initial_state"])
    (o.sum() + final.sum()).backward()
    assert torch.isfinite(g.grad).all()
    expected_o, expected_final = naive_per_sequence(inputs)
    assert_close_to(o, expected_o)
    assert_close_to(final, expected_final)
    o, final, _ = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])   # the CPU kernel's
    assert_close_to(o, expected_o)
    assert_close_to(final, expected_final)


def test_zero_length_sequence_keeps_its_state() -> None:
    inputs = make_inputs([5, 0, 7])
    for kda in (chunk_kda, recurrent_kda):
        _, final, _ = kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])
        assert torch.equal(final[1], inputs["initial_state"][1])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_states_equal_token_states_at_chunk_ends(chunk_size: int) -> None:
    inputs = make_inputs(LENGTHS_VARLEN, "lower_bound")
    _, _, chunk_states = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"],
                                   chunk_size=chunk_size, output_chunk_states=True)
    _, _, token_states = recurrent_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"],
                                       output_token_states=True)
    bounds = inputs["cu_seqlens"].tolist()
    chunk_ends = [start + offset for start, stop in zip(bounds, bounds[1:])
                  for offset in range(chunk_size - 1, stop - start, chunk_size)]
    assert chunk_states.shape == (sum(length // chunk_size for length in LENGTHS_VARLEN), *token_states.shape[1:])
    assert_close_to(chunk_states, token_states[chunk_ends])


def test_token_states_equal_stepping_one_token_at_a_time() -> None:
    inputs = make_inputs([6, 0, 4], "unbounded")
    o, final, token_states = recurrent_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"],
                                           output_token_states=True)
    bounds = inputs["cu_seqlens"].tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        state = inputs["initial_state"][n:n + 1]
        for t in range(start, end):
            step = [inputs[name][t:t + 1] for name in ("q", "k", "v", "g", "beta")]
            o_t, state, _ = recurrent_kda(*step, torch.tensor([0, 1]), initial_state=state)
            assert_close_to(o[t:t + 1], o_t)
            assert_close_to(token_states[t], state[0])
        assert_close_to(final[n], state[0])


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_two_calls_equal_one(kda) -> None:
    lengths_first, lengths_second = [70, 3, 0], [45, 0, 9]
    whole = make_inputs([a + b for a, b in zip(lengths_first, lengths_second)], "unbounded")
    o, final, _ = kda(*sequence_inputs(whole), initial_state=whole["initial_state"])
    bounds = whole["cu_seqlens"].tolist()
    first_rows = torch.cat([torch.arange(start, start + n) for start, n in zip(bounds, lengths_first)])
    second_rows = torch.cat([torch.arange(start + a, start + a + b)
                             for start, a, b in zip(bounds, lengths_first, lengths_second)])

    def part(rows: torch.Tensor, lengths: list[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = [whole[name][rows] for name in ("q", "k", "v", "g", "beta")]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        o_part, state_part, _ = kda(*pieces, cu_seqlens, initial_state=state)
        return o_part, state_part

    o_first, state_first = part(first_rows, lengths_first, whole["initial_state"])
    o_second, state_second = part(second_rows, lengths_second, state_first)
    assert_close_to(o_first, o[first_rows])
    assert_close_to(o_second, o[second_rows])
    assert_close_to(state_second, final)


GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_gradients_match_naive_recurrent(gate: str, kda) -> None:
    inputs = make_inputs([23, 0, 41], gate, heads=2, key_dim=16, value_dim=8)
    leaves = {name: inputs[name].clone().requires_grad_() for name in GRAD_NAMES}
    probe_o = torch.randn(inputs["v"].shape, generator=torch.Generator().manual_seed(1))
    probe_state = torch.randn(inputs["initial_state"].shape, generator=torch.Generator().manual_seed(2))
    extra = {"chunk_size": 16} if kda is chunk_kda else {}

    o, final, _ = kda(*(leaves[name] for name in GRAD_NAMES[:5]), inputs["cu_seqlens"],
                      initial_state=leaves["initial_state"], **extra)
    grads = torch.autograd.grad((o * probe_o).sum() + (final * probe_state).sum(), list(leaves.values()))

    reference_leaves = {name: inputs[name].clone().requires_grad_() for name in GRAD_NAMES}
    expected_o, expected_final = naive_per_sequence({**reference_leaves, "cu_seqlens": inputs["cu_seqlens"]})
    expected = torch.autograd.grad((expected_o * probe_o).sum() + (expected_final * probe_state).sum(),
                                   list(reference_leaves.values()))
    for name, grad, expected_grad in zip(GRAD_NAMES, grads, expected):
        assert_close_to(grad, expected_grad, f"d/d{name}")


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_gradcheck_float64(kda) -> None:
    inputs = make_inputs([5, 0, 11], "unbounded", heads=1, key_dim=4, value_dim=3)
    cu_seqlens = inputs["cu_seqlens"]
    leaves = [inputs[name].double().requires_grad_() for name in GRAD_NAMES]
    extra = {"chunk_size": 8} if kda is chunk_kda else {}

    def outputs(q, k, v, g, beta, initial_state):
        o, final, _ = kda(q, k, v, g, beta, cu_seqlens, initial_state=initial_state, **extra)
        return o, final

    assert torch.autograd.gradcheck(outputs, leaves)


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_bfloat16_inputs(kda) -> None:
    inputs = make_inputs(LENGTHS_VARLEN, "lower_bound")
    low = {name: inputs[name].bfloat16() for name in ("q", "k", "v", "g", "beta")}
    o, final, _ = kda(*(low[name] for name in ("q", "k", "v", "g", "beta")), inputs["cu_seqlens"],
                      initial_state=inputs["initial_state"])
    rounded = {**inputs, **{name: tensor.float() for name, tensor in low.items()}}
    expected_o, expected_final = kda(*sequence_inputs(rounded), initial_state=inputs["initial_state"])[:2]
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    # The inputs are the same bf16 values; only rounding o to bf16 (8 bits of mantissa) may differ.
    torch.testing.assert_close(o.float(), expected_o, rtol=2 ** -8, atol=1e-3 * expected_o.abs().max().item())
    assert_close_to(final, expected_final)
    reference_o, _ = naive_per_sequence(rounded)
    torch.testing.assert_close(o.float(), reference_o, rtol=2 ** -8, atol=1e-3 * reference_o.abs().max().item())
    # Against float32 inputs, the bf16 rounding of the inputs shows too (observed: 4e-3 of the output scale).
    full_o = kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])[0]
    torch.testing.assert_close(o.float(), full_o, rtol=0, atol=2e-2 * full_o.abs().max().item())


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("change, message", [
    (lambda x: {**x, "k": x["k"][:, :1]}, "k and g must have q's shape"),
    (lambda x: {**x, "v": x["v"][:-1]}, "v must be"),
    (lambda x: {**x, "beta": x["beta"][:, :, None]}, "beta must be"),
    (lambda x: {**x, "cu_seqlens": torch.tensor([0, 3, 100])}, "cu_seqlens must rise from 0 to T"),
    (lambda x: {**x, "cu_seqlens": torch.tensor([0, 9, 3, 12])}, "cu_seqlens must rise from 0 to T"),
    (lambda x: {**x, "initial_state": x["initial_state"][:1]}, "initial_state must be"),
])
def test_bad_inputs_raise_value_error(kda, change, message: str) -> None:
    inputs = change(make_inputs([3, 0, 9]))
    with pytest.raises(ValueError, match=message):
        kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("length", [1, 2, 5, 8])
def test_uniform_steps_equal_the_naive_recurrence_token_by_token(gate: str, length: int) -> None:
    """recurrent_kda_uniform (the closed form of a verification's few tokens) against fla's naive recurrence:
    each token's output and the state after each token (the naive op's final state over the prefix)."""
    inputs = make_inputs([length] * 3, gate)
    per_sequence = {name: inputs[name].unflatten(0, (3, length)) for name in ("q", "k", "v", "g", "beta")}
    o, token_states = recurrent_kda_uniform(*per_sequence.values(), inputs["initial_state"])
    expected_o, _ = naive_per_sequence(inputs)
    assert_close_to(o.flatten(0, 1), expected_o, "outputs")
    for t in range(length):                   # each sequence's first t + 1 tokens
        rows = torch.cat([torch.arange(n * length, n * length + t + 1) for n in range(3)])
        prefix = {**{name: inputs[name][rows] for name in ("q", "k", "v", "g", "beta")},
                  "cu_seqlens": torch.arange(4) * (t + 1), "initial_state": inputs["initial_state"]}
        _, states = naive_per_sequence(prefix)
        assert_close_to(token_states[:, t], states, f"states after token {t}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_steps_are_decode_steps_bit_for_bit(dtype: torch.dtype) -> None:
    """A verification's tokens get exactly what plain decoding computes: recurrent_kda_uniform's outputs and states
    equal recurrent_kda_step's (a decode step's op) applied token after token, bit for bit, so a verification
    commits the state decoding would have reached."""
    inputs = make_inputs([5] * 3, GATES[1])
    per_sequence = [inputs[name].unflatten(0, (3, 5)).to(dtype) for name in ("q", "k", "v", "g", "beta")]
    o, token_states = recurrent_kda_uniform(*per_sequence, inputs["initial_state"])
    state = inputs["initial_state"]
    for t in range(5):
        o_t, state = recurrent_kda_step(*(x[:, t] for x in per_sequence), state)
        torch.testing.assert_close(o[:, t], o_t, rtol=0, atol=0)
        torch.testing.assert_close(token_states[:, t], state, rtol=0, atol=0)


def test_uniform_steps_return_outputs_in_vs_dtype() -> None:
    """bfloat16 inputs (a bf16 model's verification): o comes back in bfloat16, the states in float32, both the
    float32 computation's (the bf16 run once crashed the next projection with float32 outputs)."""
    inputs = make_inputs([4] * 2, GATES[0])
    per_sequence = [inputs[name].unflatten(0, (2, 4)) for name in ("q", "k", "v", "g", "beta")]
    o, states = recurrent_kda_uniform(*(x.bfloat16() for x in per_sequence), inputs["initial_state"])
    o32, states32 = recurrent_kda_uniform(*(x.bfloat16().float() for x in per_sequence), inputs["initial_state"])
    assert o.dtype == torch.bfloat16 and states.dtype == torch.float32
    torch.testing.assert_close(o, o32.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(states, states32, rtol=0, atol=0)


@pytest.mark.parametrize("gate", GATES)
def test_compiled_chunk_terms_match_naive_recurrent(gate: str, monkeypatch, torch_paths) -> None:
    """Within compiled_chunk_terms, with the CPU kernels off, the intra-chunk terms come from a torch.compile'd graph
    (aot_eager here: the graph inductor compiles, dynamic in the number of chunks); the outputs, final states and
    chunk states still match fla's naive recurrence, for 8 and then 2 chunks, and a batch of one chunk or one that
    wants gradients stays eager."""
    compiled_calls = []
    compiled = kda_ops._compiled_intra_chunk_terms

    def counting(backend: str):
        compiled_calls.append(backend)
        return compiled(backend)

    monkeypatch.setattr(kda_ops, "_compiled_intra_chunk_terms", counting)
    for lengths in (LENGTHS_VARLEN, [100], [64]):
        inputs = make_inputs(lengths, gate)
        with torch.inference_mode(), kda_ops.compiled_chunk_terms("aot_eager"):
            o, final, chunk_states = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"],
                                               output_chunk_states=True)
        expected_o, expected_final = naive_per_sequence(inputs)
        assert_close_to(o, expected_o, "o")
        assert_close_to(final, expected_final, "final state")
        _, _, eager_states = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"],
                                       output_chunk_states=True)
        assert_close_to(chunk_states, eager_states, "chunk states")
    assert compiled_calls == ["aot_eager", "aot_eager"]          # 8 chunks, 2 chunks; one chunk runs eagerly
    inputs = make_inputs([100], gate)
    inputs["v"].requires_grad_()
    with kda_ops.compiled_chunk_terms("aot_eager"):
        o, _, _ = chunk_kda(*sequence_inputs(inputs), initial_state=inputs["initial_state"])
    assert o.requires_grad and compiled_calls == ["aot_eager", "aot_eager"]


def test_a_layout_cached_under_inference_mode_serves_a_later_backward() -> None:
    """chunk_kda's and causal_conv1d's row layouts are cached per batch shape; one first built while serving (in
    inference mode) must still serve a training step's backward, which saves the index tensors."""
    inputs = make_inputs([37, 90], initial_state=False, seed=3)
    x = torch.randn(127, 6)
    with torch.inference_mode():
        chunk_kda(*sequence_inputs(inputs))
        causal_conv1d(x, torch.randn(6, 4), inputs["cu_seqlens"])
    q = inputs["q"].clone().requires_grad_()
    chunk_kda(q, *sequence_inputs(inputs)[1:])[0].sum().backward()
    x.requires_grad_()
    causal_conv1d(x, torch.randn(6, 4), inputs["cu_seqlens"])[0].sum().backward()
    assert q.grad.isfinite().all() and x.grad.isfinite().all()


@pytest.mark.parametrize("lengths", [[1, 8, 0, 3], [9, 2]], ids=["short: recurrence", "chunked"])
def test_pool_prefill_equals_the_naive_recurrence(lengths: list[int]) -> None:
    """kda_prefill over the state pool (sequences of at most SHORT_SEQUENCES tokens run the recurrence token by
    token, longer batches the chunked form): fla's naive recurrence from each slot's state (zeros where a sequence
    starts fresh, whatever its slot holds), the final states written to the slots."""
    inputs = make_inputs(lengths)
    slots, use_state = torch.tensor([3, 0, 2, 1][:len(lengths)]), torch.tensor([True, False, True, True][:len(lengths)])
    pool = torch.full((4, *inputs["initial_state"].shape[1:]), float("nan"))
    pool[slots[use_state]] = inputs["initial_state"][use_state]
    inputs["initial_state"] = torch.where(use_state.view(-1, 1, 1, 1), inputs["initial_state"], 0)
    o, _ = kda_prefill(*sequence_inputs(inputs), pool, slots, use_state)
    expected_o, expected_states = naive_per_sequence(inputs)
    assert_close_to(o, expected_o, "o")
    assert_close_to(pool[slots], expected_states, "final states")
