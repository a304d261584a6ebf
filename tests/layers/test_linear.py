"""kestrel.layers.linear: up to four rows take kestrel_cpu.linear_dots eagerly, within float32's bound of the float64
product; the oneDNN GEMM path and the blocked GEMM equal F.linear (float32 rounding), traced and untraced (with the
CPU kernels off where few rows would take linear_dots); every other case is F.linear itself, gradients included;
hold_column_major re-lays exactly the weights its rule names, keeping their values; a fused LinearGroup is one
product equal to its members'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kestrel.layers.linear as linear_module
from kestrel.layers.linear import (BLOCK, ONEDNN_MIN_WEIGHT, PACKED_MIN_ROWS, PACKED_MIN_WEIGHT, Linear, LinearGroup,
                                   fuse_linear_groups, hold_column_major, linear, onednn_linear, pack_onednn,
                                   pack_onednn_weights, prefers_onednn)
from kestrel.layers.parallel import RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * in_features ** -0.5


@pytest.mark.parametrize("rows", [(0,), (1,), (7,), (64,), (3, 5)])
def test_large_float32_weights_take_onednn_and_equal_f_linear(rows, monkeypatch, torch_paths):
    monkeypatch.setattr(linear_module, "ONEDNN", True)               # whatever this machine's CPU prefers
    weight, bias = weights(1024, 1024), torch.randn(1024, generator=torch.Generator().manual_seed(1))
    x = torch.randn(*rows, 1024, generator=torch.Generator().manual_seed(2))
    calls = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or F.linear(*args[:3]))
    with torch.inference_mode():
        linear(x, weight, bias)
    assert calls                                                  # the oneDNN op ran
    monkeypatch.undo()
    monkeypatch.setattr(linear_module, "ONEDNN", True)
    with torch.inference_mode():
        actual = linear(x, weight, bias)
    torch.testing.assert_close(actual, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, layout, dots", [
    ((1,), "row-major", True), ((4,), "row-major", True), ((2, 2), "row-major", True), ((0,), "row-major", True),
    ((5,), "row-major", False), ((1,), "column-major", True), ((3,), "column-major", True),
    ((5,), "column-major", False), ((1,), "strided", False),
])
@pytest.mark.parametrize("onednn", [False, True])
def test_up_to_four_rows_take_linear_dots_eagerly(rows, layout, dots, onednn, monkeypatch):
    """Up to DOTS_ROWS rows by a row- or column-major float32 weight take kestrel_cpu.linear_dots eagerly on every
    CPU, within float32's bound of the float64 product (gamma_{in+1} of the absolute products, any summation order);
    more rows and other strides do not, nor a traced graph, nor anything with the CPU kernels off."""
    from kestrel.ops import cpu

    assert cpu.load()
    monkeypatch.setattr(linear_module, "ONEDNN", onednn)
    weight, bias = weights(1024, 1024), torch.randn(1024, generator=torch.Generator().manual_seed(12))
    if layout == "column-major":
        weight = linear_module.column_major(weight)
    elif layout == "strided":
        weight = torch.cat([weight, weight], dim=1)[:, ::2]
    x = torch.randn(*rows, 1024, generator=torch.Generator().manual_seed(13))
    calls, op = [], torch.ops.kestrel_cpu.linear_dots
    monkeypatch.setattr(torch.ops.kestrel_cpu, "linear_dots", lambda *args: calls.append(1) or op(*args))
    with torch.inference_mode():
        actual = linear(x, weight, bias)
        assert bool(calls) == dots and actual.shape == (*rows, 1024)
        n, u = 1025, 2.0 ** -24
        bound = n * u / (1 - n * u) * (x.double().abs() @ weight.double().abs().T + bias.double().abs())
        assert ((actual.double() - (x.double() @ weight.double().T + bias.double())).abs() <= bound).all()
        calls.clear()
        torch.compile(lambda x: linear(x, weight, bias), backend="aot_eager", fullgraph=True)(x)
        assert not calls
        cpu.set_enabled(False)
        try:
            off = linear(x, weight, bias)
        finally:
            cpu.set_enabled(True)
        assert not calls
        assert ((off.double() - (x.double() @ weight.double().T + bias.double())).abs() <= bound).all()
    torch._dynamo.reset()


def test_intel_cpus_keep_mkl_every_other_cpu_takes_onednn(monkeypatch, torch_paths):
    intel, amd = ("processor\t: {}\nvendor_id\t: {}\nflags\t\t: avx512f\n".format(i, vendor)
                  for i, vendor in enumerate(["GenuineIntel", "AuthenticAMD"]))
    assert not prefers_onednn(intel + intel)
    assert prefers_onednn(amd) and prefers_onednn(intel + amd) and prefers_onednn("")
    monkeypatch.setattr(linear_module, "ONEDNN", False)
    weight, x = weights(1024, 1024), torch.randn(3, 1024, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_custom_op_traces_into_a_compiled_graph(monkeypatch, torch_paths):
    monkeypatch.setattr(linear_module, "ONEDNN", True)
    weight, x = weights(1024, 1024), torch.randn(4, 1024, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        eager = linear(x, weight)
        traced = torch.compile(lambda x: linear(x, weight), backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(traced, eager)
    torch.library.opcheck(onednn_linear, (x, weight, None), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("shape, bias", [((1, 1024, 1024), True), ((1, 1, 96, 64), False), ((2, 96, 64), False)])
def test_one_row_compiles_to_a_reduction_in_the_graph_on_onednns_cpus(shape, bias, onednn, monkeypatch):
    """Traced by torch.compile where oneDNN runs, a single row (any weight size) is compiled_matvec's products and
    sum, with no GEMM call in the graph; two rows keep the GEMM, and so does a single row where MKL runs. Compiled by
    inductor, the result is F.linear's."""
    monkeypatch.setattr(linear_module, "ONEDNN", onednn)
    *rows, out_features, in_features = shape
    weight = weights(out_features, in_features)
    x = torch.randn(*rows, in_features, generator=torch.Generator().manual_seed(4))
    b = torch.randn(out_features, generator=torch.Generator().manual_seed(5)) if bias else None
    graphs = []

    def capture(gm: torch.fx.GraphModule, inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    with torch.inference_mode():
        expected = F.linear(x, weight, b)
        torch.testing.assert_close(torch.compile(lambda x: linear(x, weight, b), backend=capture, fullgraph=True,
                                                 dynamic=False)(x), expected, atol=1e-5, rtol=1e-5)
        gemms = {target for target in graphs[0] if "linear" in target}
        assert bool(gemms) == (x.numel() > in_features or not onednn), graphs[0]
        compiled = torch.compile(lambda x: linear(x, weight, b), fullgraph=True, dynamic=False)(x)
        torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, min_weight, layout, kernel", [
    ((16,), 1 << 16, "row-major", True), ((4, 8), 1 << 16, "row-major", True),     # 16 and 32 rows
    ((64,), 1 << 16, "row-major", True),
    ((15,), 1 << 16, "row-major", False), ((65,), 1 << 16, "row-major", False),   # outside ROWS_KERNEL
    ((32,), 1 << 20, "row-major", False),                                         # a smaller weight
    ((32,), 1 << 16, "column-major", False),                                      # a weight held column-major
])
def test_a_batched_steps_rows_take_the_rows_kernel_where_mkl_runs(rows, min_weight, layout, kernel, monkeypatch):
    """Where MKL runs, ROWS_KERNEL rows against a weight of ROWS_KERNEL_MIN_WEIGHT elements or more (row-major, as
    kestrel_cpu.linear_rows reads it) take the kernel, eagerly and compiled by inductor, equal to F.linear in float32
    rounding; other row counts, smaller weights and oneDNN's CPUs do not."""
    monkeypatch.setattr(linear_module, "ROWS_KERNEL_MIN_WEIGHT", min_weight)
    weight, bias = weights(256, 512), torch.randn(256, generator=torch.Generator().manual_seed(9))
    if layout == "column-major":
        weight = linear_module.column_major(weight)
    x = torch.randn(*rows, 512, generator=torch.Generator().manual_seed(10))
    expected = F.linear(x, weight, bias)
    for onednn in (False, True):
        monkeypatch.setattr(linear_module, "ONEDNN", onednn)
        graphs = []

        def capture(gm: torch.fx.GraphModule, inputs):
            graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
            return gm.forward

        with torch.inference_mode():
            eager = linear(x, weight, bias)
            torch.compile(lambda x: linear(x, weight, bias), backend=capture, fullgraph=True, dynamic=False)(x)
            compiled = torch.compile(lambda x: linear(x, weight, bias), fullgraph=True, dynamic=False)(x)
        assert ("kestrel_cpu.linear_rows" in graphs[0]) == (kernel and not onednn), graphs[0]
        for actual in (eager, compiled):
            assert actual.shape == (*rows, 256)
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        torch._dynamo.reset()


@pytest.mark.parametrize("rows, out_features, onednn, blocked", [
    ((4,), 2 * BLOCK, False, True), ((3, 5), 2 * BLOCK, False, True),     # 4 and 15 rows: by blocks
    ((3,), 2 * BLOCK, False, False), ((16,), 2 * BLOCK, False, False),    # MKL's own passes are fine there
    ((8,), 2 * BLOCK + 1, False, False),                                  # not a multiple of BLOCK
    ((8,), 2 * BLOCK, True, False),                                       # oneDNN's CPUs take oneDNN
])
def test_mid_row_counts_against_large_weights_go_by_blocks(rows, out_features, onednn, blocked, monkeypatch):
    """Where MKL runs, 4-15 rows against a large weight take blocked_linear, equal to F.linear in float32
    rounding, eagerly and traced; other row counts and shapes do not."""
    monkeypatch.setattr(linear_module, "ONEDNN", onednn)
    for name in ("ONEDNN_MIN_WEIGHT", "BLOCKED_MIN_WEIGHT"):          # the weights here: 2 BLOCK x 512
        monkeypatch.setattr(linear_module, name, 1 << 16)
    monkeypatch.setattr(linear_module, "onednn_linear", lambda x, w, b: F.linear(x, w, b))
    calls, blocked_linear = [], linear_module.blocked_linear
    monkeypatch.setattr(linear_module, "blocked_linear", lambda *args: calls.append(1) or blocked_linear(*args))
    weight, bias = weights(out_features, 512), torch.randn(out_features, generator=torch.Generator().manual_seed(7))
    x = torch.randn(*rows, 512, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        actual = linear(x, weight, bias)
        traced = torch.compile(lambda x: linear(x, weight, bias), backend="aot_eager", fullgraph=True)(x)
    assert bool(calls) == blocked and actual.shape == (*rows, out_features)
    torch.testing.assert_close(actual, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(traced, actual, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["grad enabled", "small weight", "bfloat16"])
def test_every_other_case_is_f_linear_bit_for_bit(case):
    big = case != "small weight"
    weight = weights(1024 if big else 256, 1024)
    assert (weight.numel() >= ONEDNN_MIN_WEIGHT) == big
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(4))
    if case == "bfloat16":
        weight, x = weight.bfloat16(), x.bfloat16()
    with torch.inference_mode(case != "grad enabled"):
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_module_trains_like_nn_linear():
    """Same parameters and names as nn.Linear, and the same gradients (training takes F.linear)."""
    ours, theirs = Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5))
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert torch.equal(ours.weight.grad, theirs.weight.grad) and torch.equal(ours.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("onednn", [False, True])
def test_hold_column_major_re_lays_the_small_input_weights_f_linear_runs(onednn, monkeypatch):
    """Float32 weights of at most 384 inputs and at least 16 outputs that `linear` leaves to F.linear become
    column-major with the same values (outputs equal F.linear's within float32 rounding); wider inputs, fewer
    outputs, other dtypes, weights `linear` hands to oneDNN or blocks, and an LM head tied to its embedding keep
    their layout."""
    monkeypatch.setattr(linear_module, "ONEDNN", onednn)
    # where MKL runs, "big" [512, 384] goes by blocks; oneDNN's CPUs leave it (below ONEDNN_MIN_WEIGHT) to F.linear
    monkeypatch.setattr(linear_module, "BLOCKED_MIN_WEIGHT", 1 << 16)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(32, 192)} | {
        name: Linear(i, o, bias=name == "proj") for name, (o, i) in {
            "proj": (192, 192), "narrow": (16, 384), "wide": (192, 512), "few": (15, 192), "bf16": (64, 192),
            "head": (32, 192), "big": (512, 384)}.items()})
    model["bf16"].to(torch.bfloat16)
    model["head"].weight = model["embed"].weight
    before = {name: m.weight.detach().clone() for name, m in model.items()}
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        expected = {name: F.linear(x[:, :m.in_features].to(m.weight.dtype), before[name],
                                   m.bias) for name, m in model.items() if isinstance(m, Linear)}
        assert hold_column_major(model) == 2 + onednn
        for name, m in model.items():
            if isinstance(m, Linear):
                column_major = name in ("proj", "narrow") or (name == "big" and onednn)
                assert m.weight.stride() == ((1, m.out_features) if column_major else (m.in_features, 1)), name
                assert torch.equal(m.weight, before[name])
                actual = linear(x[:, :m.in_features].to(m.weight.dtype), m.weight, m.bias)
                torch.testing.assert_close(actual, expected[name], atol=1e-5, rtol=1e-5)
    assert model["head"].weight is model["embed"].weight and model["embed"].weight.is_contiguous()


@pytest.mark.parametrize("rows", [(1,), (5,), (32,), (3, 43)])
def test_a_packed_weight_multiplies_as_the_plain_one(rows, monkeypatch, torch_paths):
    """oneDNN multiplies by pack_onednn's copy in place of the plain weight (it is the one the op receives) at more
    than one row, by the plain weight at one; equal to F.linear within float32 rounding, with a bias too."""
    monkeypatch.setattr(linear_module, "ONEDNN", True)
    weight, bias = weights(1024, 1024), torch.randn(1024, generator=torch.Generator().manual_seed(10))
    packed = pack_onednn(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    x = torch.randn(*rows, 1024, generator=torch.Generator().manual_seed(11))
    received, op = [], linear_module.onednn_linear
    monkeypatch.setattr(linear_module, "onednn_linear", lambda x, w, b: received.append(w) or op(x, w, b))
    with torch.inference_mode():
        actual = linear(x, weight, bias, packed)
    assert len(received) == 1 and received[0] is (weight if x.numel() == 1024 else packed)
    torch.testing.assert_close(actual, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32])
def test_a_mid_size_weight_takes_its_packed_copy_from_four_rows(rows, monkeypatch, torch_paths):
    """A weight of PACKED_MIN_WEIGHT up to ONEDNN_MIN_WEIGHT elements (the bundled model's LM head [4096, 192], held
    column-major as the engine holds it) is packed too, and multiplies PACKED_MIN_ROWS rows or more by oneDNN from
    the packed copy, fewer by F.linear (the CPU kernels off: few rows take linear_dots); equal to F.linear within
    float32 rounding."""
    monkeypatch.setattr(linear_module, "ONEDNN", True)
    module = Linear(192, 4096, bias=False)
    assert PACKED_MIN_WEIGHT <= module.weight.numel() < ONEDNN_MIN_WEIGHT
    expected_weight = module.weight.detach().clone()
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(13))
    received, op = [], linear_module.onednn_linear
    monkeypatch.setattr(linear_module, "onednn_linear", lambda x, w, b: received.append(w) or op(x, w, b))
    with torch.inference_mode():
        assert hold_column_major(module) == 1 and pack_onednn_weights(module) == 4096 * 192 * 4
        actual = module(x)
    assert [w is module.packed for w in received] == ([True] if rows >= PACKED_MIN_ROWS else [])
    torch.testing.assert_close(actual, F.linear(x, expected_weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("onednn", [False, True])
def test_pack_onednn_weights_packs_the_weights_onednn_multiplies(onednn, monkeypatch):
    """Only float32 Linears (row-parallel ones too) of at least PACKED_MIN_WEIGHT elements get a packed copy, only on
    CPUs that take oneDNN; the bytes they add are counted; every module's output stays F.linear's, eagerly and
    compiled by inductor (the packed copy a buffer the graph reads)."""
    monkeypatch.setattr(linear_module, "ONEDNN", onednn)
    model = torch.nn.ModuleDict({"big": Linear(1024, 1024), "row": RowParallelLinear(1024, 1024),
                                 "small": Linear(1024, 256), "bf16": Linear(1024, 1024).bfloat16()})
    x = torch.randn(7, 1024, generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        expected = {name: F.linear(x.to(m.weight.dtype), m.weight, m.bias) for name, m in model.items()}
        assert pack_onednn_weights(model) == (2 * 1024 * 1024 * 4 if onednn else 0)
        assert [name for name, m in model.items() if m.packed is not None] == (["big", "row"] if onednn else [])
        for name, m in model.items():
            tolerance = 1e-2 if name == "bf16" else 1e-5
            torch.testing.assert_close(m(x.to(m.weight.dtype)), expected[name], atol=tolerance, rtol=tolerance)
        compiled = torch.compile(model["big"], fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(compiled, expected["big"], atol=1e-5, rtol=1e-5)


class Block(torch.nn.Module):
    """Three projections of one input in a group, and a group over two of them registered first (as a latent MoE's
    group takes its shared experts' gate and up)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.a, self.b, self.c = (Linear(in_features, out, bias=False) for out in (24, 40, 8))
        self.pair = LinearGroup(self.b, self.c)
        self.trio = LinearGroup(self.a, self.b, self.c)
        with torch.no_grad():
            for i, m in enumerate((self.a, self.b, self.c)):
                m.weight.copy_(weights(*m.weight.shape, seed=i))


@pytest.mark.parametrize("in_features", [192, 512])       # column-major where column_major_pays, else row-major
def test_a_fused_group_multiplies_once_and_equals_its_members(in_features, monkeypatch):
    block = Block(in_features)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(3))
    state = {name: t.clone() for name, t in block.state_dict().items()}
    with torch.inference_mode():
        separate = block.trio(x)
        assert fuse_linear_groups(block) == 1                    # the larger group; the pair shares its members
        assert block.pair.weight is None and block.state_dict().keys() == state.keys()
        fused = block.trio.weight
        assert fused.shape == (72, in_features) and fused.is_contiguous() == (in_features > 384)
        for m, start in zip((block.a, block.b, block.c), (0, 24, 64)):      # each member's weight: a view of its rows
            assert m.weight.data_ptr() == fused[start:].data_ptr()
            assert torch.equal(m.weight, state[f"{member_name(block, m)}.weight"])
        calls = []
        monkeypatch.setattr(linear_module, "linear", lambda *args: calls.append(1) or linear(*args))
        together = block.trio(x)
        assert len(calls) == 1
        for got, expected in zip(together, separate):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert block.pair(x)[0].shape == (5, 40)                 # an unfused group still runs its members


def member_name(block: torch.nn.Module, member: torch.nn.Module) -> str:
    return next(name for name, m in block.named_children() if m is member)


@pytest.mark.parametrize("rows, fused_product", [(1, True), (4, True), (5, False)])
def test_a_large_fused_group_multiplies_fused_only_the_rows_that_take_linear_dots(rows, fused_product, monkeypatch):
    """A fused weight of FUSE_MAX_WEIGHT elements or more: one linear_dots call for up to DOTS_ROWS rows (one pass
    over the weight, as its members' would be), the members (and their oneDNN copies) for more."""
    monkeypatch.setattr(linear_module, "FUSE_MAX_WEIGHT", 72 * 512)
    block = Block(512)                                      # row-major (column_major_pays: at most 384 inputs)
    assert block.trio.fuse() and block.trio.large
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    weights_multiplied = []
    monkeypatch.setattr(linear_module, "linear", lambda x, w, *rest: weights_multiplied.append(w.shape[0])
                        or linear(x, w, *rest))
    with torch.inference_mode():
        together = block.trio(x)
    assert weights_multiplied == ([72] if fused_product else [24, 40, 8])
    for got, member in zip(together, (block.a, block.b, block.c)):
        torch.testing.assert_close(got, x @ member.weight.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["bias", "row parallel", "dtypes", "widths"])
def test_a_group_fuses_only_bias_free_linears_of_one_dtype_and_width(case, monkeypatch):
    members = [Linear(64, 16, bias=False), Linear(64, 32, bias=False)]
    if case == "bias":
        members[1] = Linear(64, 32)
    elif case == "row parallel":
        members[1] = RowParallelLinear(64, 32)
    elif case == "dtypes":
        members[1].to(torch.bfloat16)
    elif case == "widths":
        members[1] = Linear(48, 32, bias=False)
    before = [m.weight.detach().clone() for m in members]
    group = LinearGroup(*members)
    assert not group.fuse() and group.weight is None
    assert all(torch.equal(m.weight, w) and m.weight.is_contiguous() for m, w in zip(members, before))
