"""kestrel_cpu::linear_rows (kestrel.ops.cpu) against float64 products: row counts either side of a vector and of
a chunk (64 rows with AVX-512, 32 with AVX2), weights of tails below a tile and a panel, with and without a bias,
a strided x; registered soundly (opcheck); a misshapen weight or bias is refused."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.cpu as cpu


@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()

CASES = [  # rows, out, in
    (0, 64, 32), (1, 3, 1), (5, 7, 31), (8, 64, 100), (16, 65, 64), (17, 129, 33), (31, 16, 48), (32, 200, 17),
    (33, 64, 64), (48, 70, 40), (64, 130, 129), (65, 64, 16), (100, 96, 24), (130, 33, 70),
]


@pytest.mark.parametrize("rows, out_dim, in_dim", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_equals_float64_products(rows: int, out_dim: int, in_dim: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_dim)
    x = torch.randn(rows, in_dim, generator=generator)
    w = torch.randn(out_dim, in_dim, generator=generator)
    b = torch.randn(out_dim, generator=generator) if bias else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    actual = torch.ops.kestrel_cpu.linear_rows(x, w, b)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_dim)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * in_dim ** 0.5)


def test_a_strided_x_and_soundness() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 24, generator=generator).T                    # [24, 40], column-major
    w, b = torch.randn(72, 40, generator=generator), torch.randn(72, generator=generator)
    torch.testing.assert_close(torch.ops.kestrel_cpu.linear_rows(x, w, b).double(),
                               x.double() @ w.double().T + b.double(), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.kestrel_cpu.linear_rows.default, (x, w, b))
    torch.library.opcheck(torch.ops.kestrel_cpu.linear_rows.default, (x.contiguous(), w, None))


def test_misshapen_operands_are_refused() -> None:
    x, w = torch.zeros(4, 8), torch.zeros(6, 8)
    for bad_w in (w.T.contiguous().T, w[:, :7], w.double()):
        with pytest.raises(RuntimeError, match="w must be a contiguous float32"):
            torch.ops.kestrel_cpu.linear_rows(x, bad_w)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.kestrel_cpu.linear_rows(x, w, torch.zeros(5))
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.kestrel_cpu.linear_rows(x.double(), w)
