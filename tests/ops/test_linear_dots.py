"""kestrel_cpu::linear_dots (kestrel.ops.cpu) against float64 products within float32's bound for a dot product in
any summation order, for 0 to 4 rows, inputs either side of a vector, outputs either side of a tile and of a
parallel task, by row-major and column-major weights; each row's outputs the same alone as beside other rows, at one
thread and at two; registered soundly (opcheck); operands it does not take are refused."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.cpu as cpu

U = 2.0 ** -24


@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()


def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """|float32 result - exact| <= gamma_{in+1} (|x| @ |w|^T + |b|): in products and sums in any order, then the
    bias (Higham's bound for a dot product: every partial sum rounded once)."""
    n = x.shape[1] + 1
    gamma = n * U / (1 - n * U)
    return gamma * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs()))


CASES = [  # rows, out, in
    (0, 8, 16), (1, 1, 1), (1, 9, 15), (1, 17, 16), (2, 5, 33), (3, 64, 100), (4, 130, 48), (4, 7, 200),
    (1, 1000, 64), (2, 2100, 8),
]


def laid_out(w: torch.Tensor, layout: str) -> torch.Tensor:
    """w [out, in] with the same values, stored row-major or column-major (as hold_column_major lays it)."""
    return w if layout == "row-major" else w.t().contiguous().t()


@pytest.mark.parametrize("rows, out_dim, in_dim", CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_linear_dots_equals_float64_products_within_float32s_bound(rows, out_dim, in_dim, bias, layout) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_dim + in_dim)
    x = torch.randn(rows, in_dim, generator=generator)
    w = laid_out(torch.randn(out_dim, in_dim, generator=generator), layout)
    b = torch.randn(out_dim, generator=generator) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    actual = torch.ops.kestrel_cpu.linear_dots(x, w, b)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_dim)
    assert ((actual.double() - exact).abs() <= bound(x, w, b)).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_a_rows_outputs_do_not_depend_on_the_other_rows_or_the_threads(threads: int, layout: str) -> None:
    generator = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 1027, generator=generator), laid_out(torch.randn(300, 1027, generator=generator), layout)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([torch.ops.kestrel_cpu.linear_dots(x[i:i + 1], w) for i in range(4)])
        for rows in range(1, 5):
            assert torch.equal(torch.ops.kestrel_cpu.linear_dots(x[:rows], w), alone[:rows])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.ops.kestrel_cpu.linear_dots(x, w), alone)


def test_a_strided_batch_and_soundness() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 80, generator=generator)[:, :40]                  # rows 80 apart
    w, b = torch.randn(72, 40, generator=generator), torch.randn(72, generator=generator)
    exact = x.double() @ w.double().T + b.double()
    assert ((torch.ops.kestrel_cpu.linear_dots(x, w, b).double() - exact).abs() <= bound(x, w, b)).all()
    torch.library.opcheck(torch.ops.kestrel_cpu.linear_dots.default, (x, w, b))
    torch.library.opcheck(torch.ops.kestrel_cpu.linear_dots.default, (x.contiguous(), w, None))
    torch.library.opcheck(torch.ops.kestrel_cpu.linear_dots.default, (x, laid_out(w, "column-major"), b))


def test_operands_it_does_not_take_are_refused() -> None:
    x, w = torch.zeros(4, 8), torch.zeros(6, 8)
    for bad_x in (torch.zeros(5, 8), torch.zeros(8, 4).T, x.double()):
        with pytest.raises(RuntimeError, match="x must be float32 .M, in. with M <= 4"):
            torch.ops.kestrel_cpu.linear_dots(bad_x, w)
    for bad_w in (torch.zeros(6, 16)[:, ::2], w[:, :7], w.double()):
        with pytest.raises(RuntimeError, match="w must be a row- or column-major float32"):
            torch.ops.kestrel_cpu.linear_dots(x, bad_w)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.kestrel_cpu.linear_dots(x, w, torch.zeros(5))
