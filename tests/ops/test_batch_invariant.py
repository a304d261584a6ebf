"""The batch-invariant operators of deterministic inference (kestrel.ops.batch_invariant): row i of a call over M rows
equals the op on row i alone, for M in 1..64, at one and two threads and in any memory layout; each within its
float32 error bound of a float64 computation; torch's own kernels everywhere else."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from kestrel.ops import backend, batch_invariant
from kestrel.ops.batch_invariant import invariant

U = 2.0 ** -24
"""float32's unit roundoff."""


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n roundings in sequence."""
    return n * U / (1 - n * U)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def weight_t(out: int, inp: int) -> torch.Tensor:
    """A row-major weight's transpose [in, out] (what F.linear multiplies by)."""
    return torch.randn(out, inp).t()


ROW_OPS = {
    # name: (op on rows [M, D], rows' width D); float32 weights, which bfloat16 rows take in bfloat16
    "linear (row-major weight)": (lambda x, w=weight_t(70, 40): x @ w.to(x.dtype), 40),
    "linear (column-major weight)": (lambda x, w=torch.randn(40, 70): x @ w.to(x.dtype), 40),
    "linear with bias": (lambda x, w=weight_t(70, 40), b=torch.randn(70):
                         F.linear(x, w.t().to(x.dtype), b.to(x.dtype)), 40),
    "matrix-vector": (lambda x, v=torch.randn(40): x @ v.to(x.dtype), 40),
    "einsum over heads": (lambda x, w=torch.randn(4, 10, 33):
                          torch.einsum("thd,hdr->thr", x.view(-1, 4, 10), w.to(x.dtype)), 40),
    "softmax": (lambda x: x.softmax(-1), 37),
    "log_softmax": (lambda x: x.log_softmax(-1), 37),
    "sum": (lambda x: x.sum(-1), 37),
    "mean of squares": (lambda x: x.pow(2).mean(-1), 4099),
    "sigmoid": (torch.sigmoid, 37),
    "silu": (F.silu, 37),
    "softplus": (F.softplus, 37),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ROW_OPS)
def test_rows_equal_alone(name, threads, dtype):
    op, width = ROW_OPS[name]
    torch.manual_seed(0)
    x = (torch.randn(64, width) * 3).to(dtype)
    with invariant():
        alone = torch.stack([op(x[i:i + 1])[0] for i in range(64)])
        for rows in range(1, 65):
            assert torch.equal(op(x[:rows]), alone[:rows]), f"{rows} rows"
            assert torch.equal(op(x[:rows].t().contiguous().t()), alone[:rows]), f"{rows} rows, column-major"


def test_einsum_output_layouts_do_not_change_later_sums():
    """An einsum's output is a permuted view whose strides depend on the row count; a sum over it must not: one
    token's L2 norm in a decode step of two sequences summed in another order than alone, before `sum` was made
    layout-proof."""
    torch.manual_seed(0)
    window, taps = torch.randn(2, 4, 96), torch.randn(96, 4)          # a decode step's conv: [N, W, C], [C, W]
    with invariant():
        two = torch.einsum("nwc,cw->nc", window, taps)
        one = torch.einsum("nwc,cw->nc", window[1:], taps)
        assert two.stride() != one.stride()
        assert torch.equal(two.view(2, 3, 32)[:, 0].pow(2).sum(-1)[1:], one.view(1, 3, 32)[:, 0].pow(2).sum(-1))


def test_products_within_their_error_bound():
    """Each output is K fused multiply-adds in sequence: |error| <= gamma_K sum_k |a_k b_k| against float64."""
    torch.manual_seed(1)
    for k in (1, 7, 16, 300, 2049):
        a, b = torch.randn(9, k), torch.randn(k, 35)
        exact = a.double() @ b.double()
        bound = gamma(k) * (a.double().abs() @ b.double().abs())
        with invariant():
            for got in (a @ b, a @ b.t().contiguous().t(), torch.bmm(a[None], b[None])[0]):
                assert ((got.double() - exact).abs() <= bound).all()


def test_the_two_product_kernels_agree_bit_for_bit():
    """invariant_mm (b's rows contiguous) and linear_rows (a row-major weight) sum in the same order."""
    torch.manual_seed(2)
    a, w = torch.randn(70, 131), torch.randn(45, 131)
    assert torch.equal(torch.ops.kestrel_cpu.invariant_mm(a, w.t().contiguous()),
                       torch.ops.kestrel_cpu.linear_rows(a, w, None))


def test_zero_padding_changes_nothing():
    """Keys past a sequence's end (probability exactly zero, values zero) leave its attention unchanged: softmax
    over a row padded with the mask's fill value, and a product over inputs padded with zeros."""
    torch.manual_seed(3)
    scores, values = torch.randn(5, 13), torch.randn(13, 20)
    fill = torch.finfo(torch.float32).min
    with invariant():
        probs = scores.softmax(-1)
        for pad in (1, 3, 16, 100):
            padded = torch.cat([scores, torch.full((5, pad), fill)], -1).softmax(-1)
            assert torch.equal(padded[:, :13], probs) and not padded[:, 13:].any()
            out = padded @ torch.cat([values, torch.zeros(pad, 20)])
            assert torch.equal(out, probs @ values)
            assert torch.equal(torch.cat([scores, torch.full((5, pad), fill)], -1).log_softmax(-1)[:, :13],
                               scores.log_softmax(-1))


def test_accuracy_of_softmax_and_gates():
    """Against float64. softmax: d = x - max rounds by u |d|, which exp turns into a relative error, exp adds 1 ulp
    (2 u), the float64 sum's rounding to float32 u and the division u: relative error <= (|d_i| + max |d| + 6) u;
    log_softmax = d - log(sum): the same absolute error, plus u of the result. sigmoid, silu, softplus: exp or log1p
    within 1 ulp and two IEEE operations: 6 u relative."""
    torch.manual_seed(4)
    x = torch.randn(16, 300) * 4
    exact = x.double()
    d = (exact - exact.amax(-1, keepdim=True)).abs()
    allowed = (d + d.amax(-1, keepdim=True) + 6) * U
    with invariant():
        probs, logs = x.softmax(-1).double(), x.log_softmax(-1).double()
        gates = [(f(x), f(exact)) for f in (torch.sigmoid, F.silu, F.softplus)]
    assert ((probs - exact.softmax(-1)).abs() <= allowed * exact.softmax(-1)).all()
    assert ((logs - exact.log_softmax(-1)).abs() <= allowed + U * exact.log_softmax(-1).abs()).all()
    for got, want in gates:
        assert ((got.double() - want).abs() <= 6 * U * want.abs()).all()


def test_torch_kernels_for_other_dtypes():
    """In the mode, float64 calls of every overridden op (and, outside it, the ops themselves) compute what they
    should (through torch's own kernels: their out= overloads), against an independent float64 formula."""
    torch.manual_seed(5)
    a, b, v = (torch.randn(*shape, dtype=torch.float64) for shape in ((6, 9), (9, 4), (9,)))
    bias, batch = torch.randn(4, dtype=torch.float64), torch.randn(3, 6, 9, dtype=torch.float64)
    products = (a.unsqueeze(-1) * b).sum(1)
    for context in (invariant(), torch.no_grad()):
        with context:
            assert torch.allclose(a @ b, products, rtol=1e-12)
            assert torch.allclose(torch.addmm(bias, a, b, beta=2, alpha=3), 2 * bias + 3 * products, rtol=1e-12)
            assert torch.allclose(a @ v, (a * v).sum(1), rtol=1e-12)
            assert torch.allclose(torch.addmv(torch.ones(6, dtype=torch.float64), a, v), 1 + (a * v).sum(1),
                                  rtol=1e-12)
            assert torch.allclose(torch.bmm(batch, b.expand(3, 9, 4)), (batch.unsqueeze(-1) * b).sum(2), rtol=1e-12)
            assert torch.allclose(torch.baddbmm(torch.zeros(3, 6, 4, dtype=torch.float64), batch, b.expand(3, 9, 4)),
                                  (batch.unsqueeze(-1) * b).sum(2), rtol=1e-12)
            assert torch.allclose(a.softmax(-1), a.exp() / a.exp().sum(-1, keepdim=True), rtol=1e-12)
            assert torch.allclose(a.log_softmax(0), a - a.exp().sum(0).log(), rtol=1e-12)
            assert torch.allclose(a.mean(-1), a.sum(-1) / 9, rtol=1e-12)
            assert torch.equal((a > 0).sum(-1), (a > 0).long().sum(-1))        # bool sums promote to int64
            assert torch.allclose(torch.sigmoid(a), 1 / (1 + (-a).exp()), rtol=1e-12)
            assert torch.allclose(F.silu(a), a / (1 + (-a).exp()), rtol=1e-12)
            assert torch.allclose(F.softplus(a), (1 + a.exp()).log(), rtol=1e-12)
    x = torch.randn(5, 7, requires_grad=True)
    with invariant():                           # a gradient wanted: torch's kernels, and their backward
        (x @ torch.randn(7, 3)).sum().backward()
    assert x.grad is not None


def test_torch_kernels_on_other_threads_and_after_the_mode():
    """The overrides are registered only while a thread is in the mode: another thread meanwhile, and every thread
    after it, gets torch's own kernels (the same bits as before)."""
    torch.manual_seed(6)
    a, b = torch.randn(7, 300), torch.randn(300, 70)
    expected = (a @ b, a.softmax(-1), torch.sigmoid(a), a.sum(-1))
    with invariant():
        other = ThreadPoolExecutor(1).submit(lambda: (a @ b, a.softmax(-1), torch.sigmoid(a), a.sum(-1))).result()
    after = (a @ b, a.softmax(-1), torch.sigmoid(a), a.sum(-1))
    assert all(torch.equal(x, y) for x, y in zip(other, expected))
    assert all(torch.equal(x, y) for x, y in zip(after, expected))


def test_backend_swaps_the_routed_experts_in_the_mode():
    reference = backend.get_op("moe_experts", "cpu")
    with invariant():
        assert backend.get_op("moe_experts", "cpu") is batch_invariant.INVARIANT_OPS["moe_experts"]
    assert backend.get_op("moe_experts", "cpu") is reference
    assert not batch_invariant.active()
