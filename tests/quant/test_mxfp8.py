"""MXFP8 fake quantization against a per-block brute-force oracle, E4M3's error bound and the STE gradient."""

import pytest
import torch

from kestrel.quant.mxfp8 import fake_quantize_mxfp8


def e4m3_codes() -> list[tuple[int, float]]:
    """(code, value) of every finite non-negative OCP E4M3 value, built from the format: bias 7, no inf."""
    table = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # S.1111.111 is NaN
            if exponent == 0:
                value = mantissa / 8 * 2.0**-6
            else:
                value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            table.append((exponent * 8 + mantissa, value))
    return table


E4M3 = e4m3_codes()
E4M3_MAX = max(v for _, v in E4M3)


def floor_log2(x: float) -> int:
    e = 0
    while 2.0**e > x:
        e -= 1
    while 2.0 ** (e + 1) <= x:
        e += 1
    return e


def block_exponent(amax: float) -> int:
    return max(-127, min(127, floor_log2(amax) - 8))


def oracle_round_e4m3(v: float) -> float:
    """Nearest E4M3 value to v after saturation to +-448, ties to the even mantissa."""
    magnitude = min(abs(v), E4M3_MAX)
    best = min(abs(value - magnitude) for _, value in E4M3)
    _, value = min(((c, val) for c, val in E4M3 if abs(val - magnitude) == best), key=lambda cv: cv[0] & 1)
    return value if v >= 0 else -value


def oracle_fake_quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block brute force in float64 Python arithmetic."""
    out = []
    for row in x.double().reshape(-1, block).tolist():
        amax = max(abs(v) for v in row)
        if amax == 0:
            out.append([0.0] * block)
            continue
        scale = 2.0 ** block_exponent(amax)
        out.append([oracle_round_e4m3(v / scale) * scale for v in row])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def exponents_per_element(x: torch.Tensor, block: int) -> torch.Tensor:
    """float64 [..., K]: e of each element's block, from float64 log2 (exact for float32 amax)."""
    amax = x.double().abs().unflatten(-1, (-1, block)).amax(-1)
    e = (torch.floor(torch.log2(amax)) - 8).clamp(-127, 127)
    return e.repeat_interleave(block, dim=-1)


def test_oracle_table_is_ocp_e4m3():
    from_torch = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert E4M3_MAX == 448
    assert sorted(v for _, v in E4M3) == sorted(from_torch[:127].tolist())


@pytest.mark.parametrize("block", [32, 16, 8])
def test_matches_brute_force_oracle(block):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g) * torch.pow(10.0, torch.empty(4, 1).uniform_(-4, 4, generator=g))
    x[1, :block] = 0.0
    x[2, :block] /= x[2, :block].abs().max()
    x[2, 0] = 1.99  # amax 1.99 -> e = -8, and 1.99 * 2^8 = 509.4 saturates to 448
    assert torch.equal(fake_quantize_mxfp8(x, block).double(), oracle_fake_quantize(x, block))


def test_results_are_representable():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.pow(10.0, torch.linspace(-30, 30, 64)).unsqueeze(1)
    q = fake_quantize_mxfp8(x).double()
    elements = q / torch.pow(2.0, exponents_per_element(x, 32))
    assert (elements.abs() <= 448).all()
    assert torch.equal(elements.to(torch.float8_e4m3fn).double(), elements)


def test_error_within_half_ulp():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g) * torch.pow(10.0, torch.linspace(-20, 20, 64)).unsqueeze(1)
    x[:, ::7] *= 1e-4  # some values land in E4M3's subnormal range
    q = fake_quantize_mxfp8(x).double()
    exact = x.double()
    scaled = exact.abs() / torch.pow(2.0, exponents_per_element(x, 32))
    error = (q - exact).abs()
    normal = (scaled >= 2.0**-6) & (scaled <= 448)
    assert normal.any() and (~normal).any()
    assert (error[normal] <= 2.0**-4 * exact.abs()[normal]).all()
    subnormal = scaled < 2.0**-6  # spacing 2^-9 there
    ulp_half = 2.0**-10 * torch.pow(2.0, exponents_per_element(x, 32))
    assert (error[subnormal] <= ulp_half[subnormal]).all()


def test_saturates_to_448_times_scale():
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 500.0, 1.0  # e = floor(log2 500) - 8 = 0
    x[1, 0] = -511.0
    q = fake_quantize_mxfp8(x)
    assert q[0, :2].tolist() == [448.0, 1.0]
    assert q[1, 0].item() == -448.0
    assert torch.isfinite(q).all()


def test_zero_blocks_stay_zero_and_blocks_are_independent():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=g)
    x[:, 32:64] = 0.0
    x[1, 64:] *= 1e6
    q = fake_quantize_mxfp8(x)
    assert (q[:, 32:64] == 0).all()
    for row in range(3):
        for start in (0, 64):
            alone = fake_quantize_mxfp8(x[row, start : start + 32])
            assert torch.equal(q[row, start : start + 32], alone)


def test_non_finite_values_poison_only_their_block():
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    q = fake_quantize_mxfp8(x)
    assert torch.isnan(q[0, :32]).all() and torch.isnan(q[1, 32:]).all()
    assert torch.equal(q[0, 32:], torch.ones(32)) and torch.equal(q[1, :32], torch.ones(32))


def test_straight_through_gradient_is_identity():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 3, 64, generator=g) * 10).to(dtype).requires_grad_()
        q = fake_quantize_mxfp8(x)
        assert q.dtype == dtype and q.shape == x.shape
        assert torch.equal(q.detach(), fake_quantize_mxfp8(x.detach()))
        upstream = torch.randn(2, 3, 64, generator=g).to(dtype)
        q.backward(upstream)
        assert torch.equal(x.grad, upstream)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_keeps_dtype_and_matches_float32(dtype):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    q = fake_quantize_mxfp8(x)
    assert q.dtype == dtype
    assert torch.equal(q, fake_quantize_mxfp8(x.float()).to(dtype))


@pytest.mark.parametrize(
    ("x", "block", "message"),
    [
        (torch.zeros(4, 48), 32, "multiple of block=32"),
        (torch.tensor(1.0), 32, "multiple of block=32"),
        (torch.zeros(4, 32), 0, "positive block size"),
        (torch.zeros(4, 32, dtype=torch.int64), 32, "floating-point"),
    ],
)
def test_rejects_bad_input(x, block, message):
    with pytest.raises(ValueError, match=message):
        fake_quantize_mxfp8(x, block)
