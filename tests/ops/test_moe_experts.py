"""The routed experts' torch op (the CPU path and the reference) against the plain formula, token by token in float64:
dense and MXFP4 experts, SiLU and SiTU, 1 to 64 tokens, a token routed twice to one expert, many tokens on one expert,
experts with no tokens; gradients; MXFP4's table expansion against kestrel.quant.dequantize_mxfp4; and the op works
in place: no tensor it creates is as large as the weights of two experts' matrices. The forms a compiled decode step
runs (the CPU kernel kestrel_cpu::expert_matvec for dense experts; one pair at a time; grouped as a custom op) against
the same formula, and the kernel itself against float64 products."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kestrel.ops.torch.moe as moe_module
import kestrel.ops.cpu as cpu
from kestrel.ops.torch.moe import (ExpertWeights, GLUActivation, _padded_bmm, expand_mxfp4, moe_experts,
                                   moe_experts_by_pairs, moe_experts_grouped, moe_experts_native)
from kestrel.quant import dequantize_mxfp4, quantize_mxfp4

ACTIVATIONS = {"silu": GLUActivation("silu"), "situ": GLUActivation("situ", beta=4.0, linear_beta=25.0)}
NUM_EXPERTS, DIM, INTER, TOP_K = 8, 64, 32, 3


def float64_weight(experts: ExpertWeights, name: str) -> torch.Tensor:
    """Weight `name` of all experts [E, out, in] in float64, dequantized by kestrel.quant when packed."""
    weight = getattr(experts, name)
    if experts.mxfp4:
        return dequantize_mxfp4(weight, getattr(experts, f"{name}_scale"), torch.float64)
    return weight.double()


def per_token(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
              activation: GLUActivation) -> torch.Tensor:
    """sum_k weights[t, k] * W2_e act(W1_e z_t, W3_e z_t), one token and one choice at a time: [T, D] float64."""
    w1, w3, w2 = (float64_weight(experts, name) for name in ("w1", "w3", "w2"))
    rows = []
    for t in range(z.shape[0]):
        x = z[t].double()
        rows.append(sum(w * w2[e] @ activation(w1[e] @ x, w3[e] @ x) for e, w in zip(ids[t], weights[t].double())))
    return torch.stack(rows)


def make_experts(mxfp4: bool, generator: torch.Generator, dim: int = DIM, inter: int = INTER,
                 fused: bool = False) -> ExpertWeights:
    """Random experts: dense (with fused, w1 and w3 the halves of one w13, as a held dense copy stores them) or
    MXFP4."""
    dense = [torch.randn(NUM_EXPERTS, inter, dim, generator=generator) * 0.1,
             torch.randn(NUM_EXPERTS, inter, dim, generator=generator) * 0.1,
             torch.randn(NUM_EXPERTS, dim, inter, generator=generator) * 0.1]
    if fused:
        w13 = torch.cat(dense[:2], 1)
        return ExpertWeights(*w13.chunk(2, dim=1), dense[2], w13=w13)
    if not mxfp4:
        return ExpertWeights(*dense)
    packed, scales = zip(*(quantize_mxfp4(w) for w in dense))
    return ExpertWeights(*packed, *scales)


def routing(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] among experts 0..E-3 (the last two get no tokens), half the tokens on expert 0, token 0 routed to
    expert 1 twice; routing weights [T, k] in [0, 1)."""
    ids = torch.stack([torch.randperm(NUM_EXPERTS - 2, generator=generator)[:TOP_K] for _ in range(tokens)])
    ids[: (tokens + 1) // 2, 0] = 0
    ids[0] = torch.tensor([1, 1, 0])
    return ids, torch.rand(tokens, TOP_K, generator=generator)


def grouped_custom_op(z, ids, weights, experts: ExpertWeights, activation: GLUActivation) -> torch.Tensor:
    """moe_experts as the custom op a compiled graph calls."""
    return torch.ops.kestrel.moe_experts_grouped(z, ids, weights, *moe_module._tensors(experts), activation.kind,
                                                 activation.beta, activation.linear_beta, False)


PATHS = {"dispatched": moe_experts, "grouped": moe_experts_grouped, "by_pairs": moe_experts_by_pairs,
         "custom_op": grouped_custom_op}
FORMS = {"dense": {"mxfp4": False}, "fused": {"mxfp4": False, "fused": True}, "mxfp4": {"mxfp4": True}}
DENSE_FORMS = [form for form, options in FORMS.items() if not options["mxfp4"]]


@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("path", list(PATHS))
def test_matches_the_per_token_formula(tokens: int, form: str, activation: str, path: str) -> None:
    generator = torch.Generator().manual_seed(tokens)
    experts = make_experts(generator=generator, **FORMS[form])
    z = torch.randn(tokens, DIM, generator=generator)
    ids, weights = routing(tokens, generator)
    expected = per_token(z, ids, weights, experts, ACTIVATIONS[activation])
    actual = PATHS[path](z, ids, weights, experts, ACTIVATIONS[activation])
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


KERNEL_FORMS = [*((form, dtype) for form in DENSE_FORMS for dtype in (torch.float32, torch.bfloat16)),
                ("mxfp4", torch.uint8)]


def kernel_experts(form: str, weight_dtype: torch.dtype, generator: torch.Generator) -> ExpertWeights:
    """make_experts of `form`, dense ones in weight_dtype (a fused copy's w1 and w3 the halves of its w13 again)."""
    experts = make_experts(generator=generator, **FORMS[form])
    if experts.mxfp4:
        return experts
    w1, w3, w2, w13 = (None if w is None else w.to(weight_dtype) for w in
                       (experts.w1, experts.w3, experts.w2, experts.w13))
    return ExpertWeights(*w13.chunk(2, dim=1), w2, w13=w13) if w13 is not None else ExpertWeights(w1, w3, w2)


@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("form, weight_dtype", KERNEL_FORMS)
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_the_cpu_kernel_matches_the_per_token_formula(tokens: int, form: str, weight_dtype: torch.dtype,
                                                      activation: str) -> None:
    """moe_experts_native (experts on kestrel_cpu::expert_mlp, float32 activations): float32 experts, bfloat16
    ones multiplied in float32 and MXFP4 ones decoded as they are read, against the formula over the same
    weights."""
    generator = torch.Generator().manual_seed(tokens)
    experts = kernel_experts(form, weight_dtype, generator)
    z = torch.randn(tokens, DIM, generator=generator)
    ids, weights = routing(tokens, generator)
    expected = per_token(z, ids, weights, experts, ACTIVATIONS[activation])
    actual = moe_experts_native(z, ids, weights, experts, ACTIVATIONS[activation])
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def composed(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
             activation: GLUActivation) -> torch.Tensor:
    """The routed experts as separate kernel and torch ops: each pair's token repeated, expert_matvec's products,
    glu between them, the weighted sum over each token's experts [T, k, D] -> [T, D]."""
    tokens, top_k = ids.shape
    expert, x = ids.flatten(), z.repeat_interleave(top_k, 0)

    def matvec(rows: torch.Tensor, name: str) -> torch.Tensor:
        return torch.ops.kestrel_cpu.expert_matvec(rows, expert, getattr(experts, name),
                                                   getattr(experts, f"{name}_scale", None))

    gate, up = matvec(x, "w13").chunk(2, -1) if experts.w13 is not None else (matvec(x, "w1"), matvec(x, "w3"))
    hidden = torch.ops.kestrel_cpu.glu(gate, up, activation.kind == "situ", activation.beta, activation.linear_beta)
    return (matvec(hidden, "w2").view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize("form, weight_dtype", KERNEL_FORMS)
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_expert_mlp_equals_the_ops_it_fuses(tokens: int, form: str, weight_dtype: torch.dtype,
                                            activation: str) -> None:
    """kestrel_cpu::expert_mlp (moe_experts_native's one call) computes exactly what its products, activation and
    weighted sum computed as separate ops, bit for bit, on one thread and two, with z's rows strided (the columns of
    a fused projection); registered soundly (torch.library.opcheck)."""
    assert cpu.load()
    generator = torch.Generator().manual_seed(tokens + 1)
    experts = kernel_experts(form, weight_dtype, generator)
    z = torch.randn(tokens, DIM + 5, generator=generator)[:, 2:DIM + 2]
    ids, weights = routing(tokens, generator)
    expected = composed(z.contiguous(), ids, weights, experts, ACTIVATIONS[activation])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(moe_experts_native(z, ids, weights, experts, ACTIVATIONS[activation]), expected)
    finally:
        torch.set_num_threads(threads)
    fused = experts.w13 is not None
    args = (z.contiguous(), ids, weights, experts.w13 if fused else experts.w1, experts.w1_scale,
            None if fused else experts.w3, experts.w3_scale, experts.w2, experts.w2_scale, activation == "situ",
            ACTIVATIONS[activation].beta, ACTIVATIONS[activation].linear_beta)
    if not experts.mxfp4:               # opcheck's schema test perturbs the inputs, which uint8 codes do not allow
        torch.library.opcheck(torch.ops.kestrel_cpu.expert_mlp.default, args)


def test_expert_mlp_refuses_what_it_cannot_compute() -> None:
    assert cpu.load()
    generator = torch.Generator().manual_seed(5)
    experts = make_experts(False, generator)
    z = torch.randn(2, DIM, generator=generator)
    ids, weights = routing(2, generator)
    call = torch.ops.kestrel_cpu.expert_mlp
    with pytest.raises(RuntimeError, match="out of range"):
        call(z, ids + NUM_EXPERTS, weights, experts.w1, None, experts.w3, None, experts.w2, None, False, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="one shape"):
        call(z, ids, weights, experts.w1, None, experts.w3[:-1], None, experts.w2, None, False, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="w2 must be"):
        call(z, ids, weights, experts.w1, None, experts.w3, None, experts.w2[:-1], None, False, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="ids int64 and weights float32"):
        call(z, ids, weights.double(), experts.w1, None, experts.w3, None, experts.w2, None, False, 1.0, 1.0)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, out_dim, in_dim, pairs", [
    (8, 12, 64, 9),        # whole chunks of the input; rows in blocks of 4
    (4, 7, 33, 5),         # a short last chunk; 3 rows after the blocks of 4
    (3, 5, 16, 0),         # no pairs
    (2, 130, 8, 23),       # many pairs on each expert (blocks of 4 pairs and a rest); more rows than a task's 64
])
def test_expert_matvec_computes_each_pairs_product(weight_dtype, experts, out_dim, in_dim, pairs) -> None:
    """kestrel_cpu::expert_matvec: out[p] = w[expert[p]] @ x[p], against float64 products of the same values;
    registered soundly (schema, fake, dispatch: torch.library.opcheck); an expert id out of range is refused."""
    assert cpu.load()
    matvec = torch.ops.kestrel_cpu.expert_matvec
    generator = torch.Generator().manual_seed(pairs)
    w = torch.randn(experts, out_dim, in_dim, generator=generator).to(weight_dtype)
    x = torch.randn(pairs, in_dim, generator=generator)
    expert = torch.randint(0, experts, (pairs,), generator=generator)
    expected = torch.einsum("poi,pi->po", w.double()[expert], x.double())
    actual = matvec(x, expert, w)
    assert actual.dtype == torch.float32 and actual.shape == (pairs, out_dim)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.kestrel_cpu.expert_matvec.default, (x, expert, w))
    with pytest.raises(RuntimeError, match="out of range"):
        matvec(torch.zeros(1, in_dim), torch.tensor([experts]), w)


@pytest.mark.parametrize("experts, out_dim, in_dim, pairs", [
    (8, 12, 64, 9),        # two blocks of 32 inputs per row; rows in blocks of 4
    (4, 7, 96, 5),         # three blocks; 3 rows after the blocks of 4
    (3, 5, 32, 0),         # no pairs
    (2, 130, 32, 23),      # many pairs on each expert; more rows than a task's 64
])
def test_expert_matvec_decodes_mxfp4_weights(experts, out_dim, in_dim, pairs) -> None:
    """kestrel_cpu::expert_matvec on MXFP4 weights (codes and E8M0 scales, kestrel.quant's layout) against float64
    products of kestrel.quant.dequantize_mxfp4's values: every E2M1 code (-0 too), the smallest scale (2^-127) and a
    NaN block (scale 0xFF), which makes exactly its pairs' outputs NaN; registered soundly (opcheck); misshapen
    codes or scales are refused."""
    assert cpu.load()
    matvec = torch.ops.kestrel_cpu.expert_matvec
    generator = torch.Generator().manual_seed(pairs)
    codes = torch.randint(0, 256, (experts, out_dim, in_dim // 2), dtype=torch.uint8, generator=generator)
    scale = torch.randint(122, 130, (experts, out_dim, in_dim // 32), dtype=torch.uint8, generator=generator)
    scale[0, 0, 0], scale[-1, -1, -1] = 0, 0xFF
    x = torch.randn(pairs, in_dim, generator=generator)
    expert = torch.randint(0, experts, (pairs,), generator=generator)
    expected = torch.einsum("poi,pi->po", dequantize_mxfp4(codes, scale, torch.float64)[expert], x.double())
    actual = matvec(x, expert, codes, scale)
    assert actual.dtype == torch.float32 and actual.shape == (pairs, out_dim)
    assert torch.equal(actual.isnan(), expected.isnan()) and actual.isnan().any() == (experts - 1 in expert)
    bound = float(expected.nan_to_num().abs().max()) if pairs else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6 * bound, equal_nan=True)
    torch.library.opcheck(matvec.default, (x, expert, codes, scale.clamp(max=130)))      # its checks want no NaN
    with pytest.raises(RuntimeError, match="MXFP4 weights must be"):
        matvec(torch.zeros(1, in_dim + 2), torch.tensor([0]), codes[..., :-1].contiguous(), scale)
    with pytest.raises(RuntimeError, match="MXFP4 scales must be"):
        matvec(torch.zeros(1, in_dim), torch.tensor([0]), codes, scale[:, :-1].contiguous())


@pytest.mark.parametrize("form", list(FORMS))
def test_the_custom_op_is_registered_soundly(form: str) -> None:
    """torch.library.opcheck: the custom op's schema, fake (shape-only) implementation and dispatch agree."""
    generator = torch.Generator().manual_seed(1)
    experts = make_experts(generator=generator, **FORMS[form])
    ids, weights = routing(5, generator)
    torch.library.opcheck(torch.ops.kestrel.moe_experts_grouped.default,
                          (torch.randn(5, DIM, generator=generator), ids, weights, *moe_module._tensors(experts),
                           "situ", 4.0, 25.0, False))


def test_no_tokens() -> None:
    experts = make_experts(True, torch.Generator().manual_seed(0))
    out = moe_experts(torch.zeros(0, DIM), torch.zeros(0, TOP_K, dtype=torch.long), torch.zeros(0, TOP_K), experts,
                      ACTIVATIONS["situ"])
    assert out.shape == (0, DIM)


def test_gradients_match_the_per_token_formula() -> None:
    generator = torch.Generator().manual_seed(5)
    dense = make_experts(False, generator)
    experts = ExpertWeights(*(w.requires_grad_() for w in (dense.w1, dense.w3, dense.w2)))
    z = torch.randn(9, DIM, generator=generator, requires_grad=True)
    ids, weights = routing(9, generator)
    weights.requires_grad_()
    probe = torch.randn(9, DIM, generator=generator)
    leaves = [z, weights, experts.w1, experts.w3, experts.w2]
    actual = torch.autograd.grad((moe_experts(z, ids, weights, experts, ACTIVATIONS["situ"]) * probe).sum(), leaves)
    expected = torch.autograd.grad((per_token(z, ids, weights, experts, ACTIVATIONS["situ"]) * probe).sum(), leaves)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_table_expansion_equals_dequantize_mxfp4(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=generator)
    scale = torch.randint(0, 256, (3, 5, 4), dtype=torch.uint8, generator=generator)
    scale[0, 0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)      # smallest, subnormal-adjacent, largest, NaN
    expected = dequantize_mxfp4(packed, scale, dtype)
    actual = expand_mxfp4(packed, scale, dtype)
    assert actual.dtype == dtype and actual.shape == (3, 5, 128)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


class LargestNewTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any op creates (views of its inputs do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("mxfp4", [False, True])
def test_experts_are_used_in_place(tokens: int, mxfp4: bool) -> None:
    """Dense experts in the activation dtype are never copied; packed ones are expanded one expert matrix at a time."""
    generator = torch.Generator().manual_seed(4)
    dim = inter = 128
    experts = make_experts(mxfp4, generator, dim, inter)
    z = torch.randn(tokens, dim, generator=generator)
    ids, weights = routing(tokens, generator)
    moe_experts_grouped(z, ids, weights, experts, ACTIVATIONS["situ"])          # builds the expansion table once
    with LargestNewTensor() as mode:
        moe_experts_grouped(z, ids, weights, experts, ACTIVATIONS["situ"])
    matrix = inter * dim * 4
    assert mode.largest == matrix if mxfp4 else mode.largest < matrix


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("tokens", [2, 5, 6, 11])
def test_traced_experts_compute_the_float32_copys_products(tokens: int, kernel: bool, monkeypatch) -> None:
    """MXFP4 experts, packed or as a bfloat16 copy, hold the same values as a float32 copy; traced by torch.compile
    under float32 activations, all three run on the CPU kernel up to NATIVE_PAIRS_PER_EXPERT pairs per expert (of
    their dtype: 33 pairs are beyond float32's), or where it is not built, by pairs (up to twice as many pairs as
    experts for the copies, read converted; fewer pairs than experts packed, each expanding its tiles), and the
    grouped custom op beyond: every way the float32 copy's products (tokens*k = 6, 15, 18, 33 pairs against 8
    experts)."""
    generator = torch.Generator().manual_seed(11)
    packed = make_experts(True, generator)
    copies = {dtype: ExpertWeights(*(packed.dense(name, None, dtype) for name in ("w1", "w3", "w2")))
              for dtype in (torch.float32, torch.bfloat16)}
    forms = {"packed": packed, **copies}
    z = torch.randn(tokens, DIM, generator=generator)
    ids, weights = routing(tokens, generator)
    if not kernel:
        monkeypatch.setattr(cpu, "available", lambda: False)
    paths, outputs = [], {}

    def capture(gm: torch.fx.GraphModule, inputs):
        targets = {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
        paths.append(next((name for op, name in (("kestrel_cpu.expert_mlp", "kernel"),
                                                   ("kestrel.moe_experts_grouped", "grouped")) if
                           any(op in target for target in targets)), "by_pairs"))
        return gm.forward

    for form, experts in forms.items():
        torch._dynamo.reset()
        compiled = torch.compile(lambda z, e=experts: moe_experts(z, ids, weights, e, ACTIVATIONS["silu"]),
                                 backend=capture, fullgraph=True)
        with torch.inference_mode():
            outputs[form] = compiled(z)
    pairs = ids.numel()
    expected = []
    for experts in forms.values():
        if kernel and pairs <= moe_module.NATIVE_PAIRS_PER_EXPERT[experts.w2.dtype] * NUM_EXPERTS:
            expected.append("kernel")
        else:
            by_pairs = pairs < NUM_EXPERTS if experts.mxfp4 else pairs <= 2 * NUM_EXPERTS
            expected.append("by_pairs" if by_pairs else "grouped")
    assert paths == expected
    for form in ("packed", torch.bfloat16):
        torch.testing.assert_close(outputs[form], outputs[torch.float32], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs[torch.float32].double(), per_token(z, ids, weights, packed, ACTIVATIONS["silu"]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("fused", [False, True])
def test_few_rows_per_expert_run_as_one_padded_batched_gemm(dtype: torch.dtype, tolerance: float, fused: bool,
                                                            monkeypatch) -> None:
    """Dense experts in the activation dtype with at most PADDED_ROWS[dtype] pairs on every expert (uneven groups,
    expert 7 unused) go through the padded bmm, and it computes the formula (float64 on the same rounded
    inputs; the products round to the half dtype)."""
    generator = torch.Generator().manual_seed(12)
    dense = make_experts(False, generator, fused=fused)
    experts = ExpertWeights(*(None if w is None else w.to(dtype) for w in
                              (dense.w1, dense.w3, dense.w2, None, None, None, dense.w13)))
    rows = moe_module.PADDED_ROWS[dtype]
    ids = torch.tensor([[0, 1 + t % 6, 1 + (t + 3) % 6] for t in range(rows)])     # expert 0: rows pairs, 7 unused
    z = torch.randn(ids.shape[0], DIM, generator=generator).to(dtype)
    weights = torch.rand(ids.shape, generator=generator)
    calls = []
    monkeypatch.setattr(moe_module, "_padded_bmm", lambda *args: calls.append(args[2].shape)
                        or _padded_bmm(*args))
    actual = moe_experts(z, ids, weights, experts, ACTIVATIONS["silu"])
    assert len(calls) == (2 if fused else 3) and actual.dtype == dtype
    expected = per_token(z, ids, weights, experts, ACTIVATIONS["silu"])
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


@pytest.mark.parametrize("num_experts, shape, used, padded", [
    (32, (192, 96), 9, True),          # 23 idle experts of 36 KiB: 92 KiB per expert in use
    (64, (512, 512), 56, True),        # 8 idle of 512 KiB: 73 KiB per expert in use
    (64, (1024, 512), 20, False),      # 44 idle of 1 MiB: 2.2 MiB per expert in use
    (256, (512, 256), 113, False),     # 143 idle of 256 KiB: 324 KiB per expert in use
])
def test_the_padded_bmm_reads_idle_experts_only_where_they_are_cheap(num_experts, shape, used, padded, monkeypatch):
    """bf16 experts with few rows each take the padded bmm while the idle experts' bytes stay within
    EXPERT_VISIT_BYTES per expert in use, and the grouped GEMM beyond (each form's result is tested above)."""
    calls = []
    monkeypatch.setattr(moe_module, "_padded_bmm", lambda *args: calls.append("padded") or _padded_bmm(*args))
    weight = torch.zeros(num_experts, *shape, dtype=torch.bfloat16)
    counts = [1] * used + [0] * (num_experts - used)
    out = moe_module._per_expert(torch.ones(used, shape[1], dtype=torch.bfloat16), counts,
                                 ExpertWeights(weight, weight, weight), "w1")
    assert calls == (["padded"] if padded else []) and out.shape == (used, shape[0])
