"""MXFP4 packing against hand-made bytes, a brute-force rounding oracle, an independent error bound, and an
independently written OCP MX v1.0 reference quantizer (for the error itself, on weights and on a whole model)."""

import copy
import math

import pytest
import torch

from helpers import tiny_model
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.moe import RoutedExperts
from kestrel.models.quantize import quantize_experts
from kestrel.quant.mxfp4 import BLOCK, E2M1_VALUES, dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4

# The spec's table (model-spec section 7.1), code -> value.
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
POSITIVE_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int64 codes [..., K] in the spec's order: low nibble first."""
    codes = torch.stack((packed.long() & 0xF, packed.long() >> 4), dim=-1)
    return codes.flatten(-2)


def block_scales(scale: torch.Tensor) -> torch.Tensor:
    """float64 [..., K] of 2^(scale - 127), repeated over each block's 32 columns."""
    return torch.pow(2.0, scale.double() - 127).repeat_interleave(BLOCK, dim=-1)


def half_gap(magnitude: torch.Tensor) -> torch.Tensor:
    """Half the gap between the two E2M1 grid values around each magnitude in [0, 6]."""
    grid = torch.tensor(POSITIVE_GRID, dtype=torch.float64)
    upper = torch.searchsorted(grid, magnitude, right=True).clamp(1, len(grid) - 1)
    return (grid[upper] - grid[upper - 1]) / 2


def oracle_quantize_block(block: list[float]) -> tuple[int, list[int]]:
    """Brute force for one block: (scale byte, codes) by scanning all exponents and all 16 codes."""
    amax = max(abs(v) for v in block)
    exponent = -127
    while exponent < 127 and amax > 6 * 2.0**exponent:
        exponent += 1
    codes = []
    for v in block:
        distances = [abs(SPEC_E2M1[c] * 2.0**exponent - v) for c in range(16)]
        best = [c for c in range(16) if distances[c] == min(distances)]
        same_sign = [c for c in best if (c >= 8) == (math.copysign(1.0, v) < 0)]
        best = same_sign or best
        codes.append(min(best, key=lambda c: (c & 1, c)))  # a tie between magnitudes -> even code
    return exponent + 127, codes


def test_table_matches_spec():
    assert E2M1_VALUES.dtype == torch.float32
    assert E2M1_VALUES.tolist() == SPEC_E2M1
    assert torch.signbit(E2M1_VALUES[8])


@pytest.mark.parametrize(
    ("byte", "columns"),
    [(0x21, [0.5, 1.0]), (0x8F, [-6.0, -0.0]), (0x70, [0.0, 6.0]), (0xF7, [6.0, -6.0]), (0x5A, [-1.0, 3.0])],
)
def test_hand_made_bytes(byte, columns):
    packed = torch.full((1, 16), byte, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8), torch.float32)
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == columns
    assert torch.equal(torch.signbit(out[0, :2]), torch.tensor([math.copysign(1, c) < 0 for c in columns]))
    assert torch.equal(out[0, 0::2], out[0, 0].expand(16)) and torch.equal(out[0, 1::2], out[0, 1].expand(16))


def test_every_code_in_both_nibbles():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    out = dequantize_mxfp4(packed, torch.full((16, 1), 127, dtype=torch.uint8), torch.float32)
    for byte in range(256):
        row, col = divmod(byte, 16)
        low, high = out[row, 2 * col].item(), out[row, 2 * col + 1].item()
        assert (low, high) == (SPEC_E2M1[byte % 16], SPEC_E2M1[byte // 16])
        assert math.copysign(1, low) == math.copysign(1, SPEC_E2M1[byte % 16])
        assert math.copysign(1, high) == math.copysign(1, SPEC_E2M1[byte // 16])


def test_scale_byte_is_a_power_of_two():
    packed = torch.full((1, 32), 0x21, dtype=torch.uint8)
    scale = torch.tensor([[128, 126]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scale, torch.float32)
    assert out[0, :2].tolist() == [1.0, 2.0]  # 128 doubles
    assert out[0, 32:34].tolist() == [0.25, 0.5]  # 126 halves
    extremes = dequantize_mxfp4(packed[:, :16], torch.tensor([[0]], dtype=torch.uint8), torch.float64)
    assert extremes[0, :2].tolist() == [2.0**-128, 2.0**-127]
    sixes = torch.full((1, 16), 0x77, dtype=torch.uint8)
    largest = dequantize_mxfp4(sixes, torch.tensor([[254]], dtype=torch.uint8), torch.float64)
    assert largest[0, 0].item() == 6 * 2.0**127


def test_scale_0xff_is_nan_for_its_block_only():
    packed = torch.full((2, 32), 0x21, dtype=torch.uint8)
    scale = torch.tensor([[0xFF, 127], [127, 127]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scale)
    assert out.dtype == torch.bfloat16
    assert torch.isnan(out[0, :32]).all()
    assert not torch.isnan(out[0, 32:]).any() and not torch.isnan(out[1]).any()


def test_quantize_never_emits_nan_scale():
    w = torch.tensor([3.0e38, -3.4e38] + [0.0] * 30, dtype=torch.float32)
    _, scale = quantize_mxfp4(w)
    assert scale.item() == 253  # amax just under 2^128 needs 2^126: 6 * 2^126 > 3.4e38
    _, scale = quantize_mxfp4(torch.full((32,), 6 * 2.0**127, dtype=torch.float64))
    assert scale.item() == 254


def random_grid_blocks(rows: int, blocks: int, scale_low: int, scale_high: int, seed: int):
    """Random packed blocks led by a code of magnitude 4 or 6, so the quantizer must pick the same scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, blocks, BLOCK), generator=g)
    codes[..., 0] = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (rows, blocks), generator=g)]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).flatten(-2)
    scale = torch.randint(scale_low, scale_high + 1, (rows, blocks), generator=g).to(torch.uint8)
    return packed, scale


@pytest.mark.parametrize(
    ("dtype", "scale_low", "scale_high"),
    [(torch.float64, 0, 254), (torch.float32, 20, 230), (torch.bfloat16, 20, 230)],
)
def test_round_trip_on_the_grid_is_exact(dtype, scale_low, scale_high):
    packed, scale = random_grid_blocks(8, 6, scale_low, scale_high, seed=0)
    w = dequantize_mxfp4(packed, scale, dtype)
    packed2, scale2 = quantize_mxfp4(w)
    assert torch.equal(packed2, packed) and torch.equal(scale2, scale)
    assert torch.equal(dequantize_mxfp4(packed2, scale2, dtype), w)


def test_round_trip_of_any_grid_value_is_exact_and_stable():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 4, BLOCK), generator=g)
    powers = torch.pow(2.0, torch.randint(-20, 20, (4, 4, 1), generator=g).float())
    w = (torch.tensor(SPEC_E2M1)[codes] * powers).flatten(-2)
    packed, scale = quantize_mxfp4(w)
    dq = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(dq, w)
    packed2, scale2 = quantize_mxfp4(dq)
    assert torch.equal(packed2, packed) and torch.equal(scale2, scale)


def test_rounding_matches_brute_force_oracle():
    g = torch.Generator().manual_seed(2)
    magnitudes = torch.pow(10.0, torch.empty(6, 1).uniform_(-6, 6, generator=g))
    w = torch.randn(6, 4 * BLOCK, generator=g) * magnitudes
    w[0, :BLOCK] = 0.0
    w[1, :BLOCK] = -w[1, :BLOCK].abs() * 1e-3
    w[1, 0] = 1.0  # most of that block rounds to -0
    packed, scale = quantize_mxfp4(w)
    codes = unpack_codes(packed)
    for row in range(w.shape[0]):
        for blk in range(w.shape[1] // BLOCK):
            cols = slice(blk * BLOCK, (blk + 1) * BLOCK)
            want_scale, want_codes = oracle_quantize_block(w[row, cols].double().tolist())
            assert scale[row, blk].item() == want_scale
            assert codes[row, cols].tolist() == want_codes


@pytest.mark.parametrize("unit", [1.0, 0.125, 2.0**40])
def test_exact_midpoints_round_half_to_even(unit):
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    by_hand = [0, 2, 2, 4, 4, 6, 6]  # the neighbouring code with mantissa bit 0
    above = [math.nextafter(m, 7.0) for m in midpoints]  # just past a tie: the upper code
    below = [math.nextafter(m, 0.0) for m in midpoints]  # just before a tie: the lower code
    values = [6.0] + midpoints + [-m for m in midpoints] + above + below
    values += [0.0] * (BLOCK - len(values))
    want = [7] + by_hand + [c | 8 for c in by_hand] + [1, 2, 3, 4, 5, 6, 7] + [0, 1, 2, 3, 4, 5, 6]
    want += [0] * (BLOCK - len(want))
    packed, scale = quantize_mxfp4(torch.tensor(values, dtype=torch.float64) * unit)
    assert scale.item() == 127 + round(math.log2(unit))
    assert unpack_codes(packed).tolist() == want


def assert_within_error_bound(w: torch.Tensor) -> None:
    packed, scale = quantize_mxfp4(w)
    dq = dequantize_mxfp4(packed, scale, torch.float64)
    exact = w.double()
    s = block_scales(scale)
    magnitude = exact.abs() / s
    assert (magnitude <= 6).all(), "a value clipped: its block scale is too small"
    bound = half_gap(magnitude) * s
    assert ((exact - dq).abs() <= bound).all()
    amax = magnitude.unflatten(-1, (-1, BLOCK)).amax(-1)
    unclamped = (scale > 0) & (amax > 0)
    assert (amax[unclamped] > 3).all(), "the block scale is not the smallest power of two that avoids clipping"
    where_max = exact.abs().unflatten(-1, (-1, BLOCK)).argmax(-1, keepdim=True)
    max_w = exact.unflatten(-1, (-1, BLOCK)).gather(-1, where_max)
    max_dq = dq.unflatten(-1, (-1, BLOCK)).gather(-1, where_max)
    assert ((max_w - max_dq).abs() <= bound.unflatten(-1, (-1, BLOCK)).gather(-1, where_max)).all()


@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_error_bound_normal_weights(magnitude, dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8 * BLOCK, generator=g, dtype=torch.float64) * magnitude
    assert_within_error_bound(w.to(dtype))


@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30])
def test_error_bound_heavy_tailed_weights(magnitude):
    g = torch.Generator().manual_seed(4)
    cauchy = torch.tan(torch.pi * (torch.rand(16, 8 * BLOCK, generator=g, dtype=torch.float64) - 0.5))
    assert_within_error_bound((cauchy * magnitude).float())


def test_error_bound_rows_spanning_the_float32_range():
    g = torch.Generator().manual_seed(5)
    magnitudes = torch.pow(10.0, torch.linspace(-37, 37, 32)).unsqueeze(1)
    rows = torch.randn(32, 4 * BLOCK, generator=g) * magnitudes
    assert_within_error_bound(rows)


def test_zero_and_subnormal_blocks_get_the_smallest_scale():
    w = torch.zeros(2, 2 * BLOCK)
    w[1, BLOCK:] = 1e-40  # float32 subnormal: the exponent clamps at -127
    packed, scale = quantize_mxfp4(w)
    assert scale.tolist() == [[0, 0], [0, 0]]
    assert (packed[:, : BLOCK // 2] == 0).all()
    assert_within_error_bound(w)
    packed, _ = quantize_mxfp4(-torch.zeros(BLOCK))
    assert (packed == 0x88).all()


def test_stacked_experts_equal_per_expert():
    g = torch.Generator().manual_seed(6)
    experts = torch.randn(3, 8, 4 * BLOCK, generator=g) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    packed, scale = quantize_mxfp4(experts)
    assert packed.shape == (3, 8, 2 * BLOCK) and scale.shape == (3, 8, 4)
    for e in range(3):
        p, s = quantize_mxfp4(experts[e])
        assert torch.equal(packed[e], p) and torch.equal(scale[e], s)
        assert torch.equal(dequantize_mxfp4(packed, scale)[e], dequantize_mxfp4(p, s))
    p1, s1 = quantize_mxfp4(experts[1, 0])
    assert torch.equal(p1, packed[1, 0]) and torch.equal(s1, scale[1, 0])


def test_input_dtype_only_changes_the_values_it_holds():
    w = torch.randn(4, 2 * BLOCK, generator=torch.Generator().manual_seed(7)).bfloat16()
    for dtype in (torch.float16, torch.float32, torch.float64):
        p_ref, s_ref = quantize_mxfp4(w.to(dtype))
        p, s = quantize_mxfp4(w)
        assert torch.equal(p, p_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (torch.zeros(4, 48), "multiple of 32"),
        (torch.tensor(1.0), "multiple of 32"),
        (torch.zeros(4, 32, dtype=torch.int32), "floating-point"),
        (torch.tensor([float("nan")] + [0.0] * 31), "NaN or Inf"),
        (torch.tensor([float("-inf")] + [0.0] * 31), "NaN or Inf"),
        (torch.tensor([7 * 2.0**127] + [0.0] * 31, dtype=torch.float64), "largest MXFP4 magnitude"),
    ],
)
def test_quantize_rejects_bad_input(w, message):
    with pytest.raises(ValueError, match=message):
        quantize_mxfp4(w)


@pytest.mark.parametrize(
    ("packed", "scale", "message"),
    [
        (torch.zeros(4, 17, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "disagree"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "disagree"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), "disagree"),
        (torch.zeros(16, dtype=torch.uint8), torch.tensor(0, dtype=torch.uint8), "disagree"),
        (torch.zeros(4, 16), torch.zeros(4, 1, dtype=torch.uint8), "uint8"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.int32), "uint8"),
    ],
)
def test_dequantize_rejects_mismatched_tensors(packed, scale, message):
    with pytest.raises(ValueError, match=message):
        dequantize_mxfp4(packed, scale)


def ocp_reference(w: torch.Tensor, avoid_clipping: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX v1.0 conversion, float64, per block of 32 along the last dim: shared exponent
    e = floor(log2(amax)) - 2 (E2M1's emax; from math.frexp, exact), every value divided by 2^e, magnitudes above 6
    saturated to 6, then rounded to the nearest E2M1 magnitude (a tie to the even code) with the value's sign.
    With avoid_clipping, e goes one up in the blocks where amax / 2^e > 6, so nothing saturates (kestrel's rule).
    An all-zero block gets e = -127. Returns the dequantized weight and the exponents [..., K/32] (float64)."""
    blocks = w.double().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1)
    floor_log2 = [math.frexp(a)[1] - 1 for a in amax.flatten().tolist()]
    exponent = torch.tensor([f - 2 if a > 0 else -127 for f, a in zip(floor_log2, amax.flatten().tolist())],
                            dtype=torch.float64).view(amax.shape)
    if avoid_clipping:
        exponent = torch.where(amax > 6 * torch.pow(2.0, exponent), exponent + 1, exponent)
    scale = torch.pow(2.0, exponent).unsqueeze(-1)
    magnitude = (blocks / scale).abs().clamp(max=6.0)
    grid = torch.tensor(POSITIVE_GRID, dtype=torch.float64)
    distance = (magnitude.unsqueeze(-1) - grid).abs()
    nearest = distance == distance.amin(-1, keepdim=True)
    code = (nearest * (2 - torch.arange(len(grid)) % 2)).argmax(-1)        # of two nearest codes, the even one
    return (grid[code] * torch.sign(blocks) * scale).flatten(-2), exponent


def relative_error(w: torch.Tensor, approx: torch.Tensor) -> float:
    return ((w.double() - approx).norm() / w.double().norm()).item()


def test_quantization_error_is_the_ocp_reference_error_with_no_clipping():
    """kestrel's scale is the OCP one except in blocks where OCP would saturate (amax / 2^e > 6), where it is one
    step up; the dequantized weight, and so its error, equal the reference with that rule exactly. Never saturating
    costs some accuracy against OCP's rule on normal weights: relative error 0.1181 against 0.1131 here."""
    w = torch.randn(64, 8 * BLOCK, generator=torch.Generator().manual_seed(8)) * 0.02
    packed, scale = quantize_mxfp4(w)
    exponent = scale.double() - 127
    ocp, ocp_exponent = ocp_reference(w, avoid_clipping=False)
    no_clip, no_clip_exponent = ocp_reference(w, avoid_clipping=True)
    would_clip = no_clip_exponent != ocp_exponent
    assert 0.2 < would_clip.float().mean() < 0.4
    assert torch.equal(exponent[~would_clip], ocp_exponent[~would_clip])
    assert torch.equal(exponent[would_clip], ocp_exponent[would_clip] + 1)
    dequantized = dequantize_mxfp4(packed, scale, torch.float64)
    assert torch.equal(dequantized, no_clip)
    assert relative_error(w, dequantized) == relative_error(w, no_clip)
    assert relative_error(w, ocp) < relative_error(w, dequantized) < 1.1 * relative_error(w, ocp)


@torch.no_grad()
def test_quantized_model_computes_with_the_reference_quantized_experts():
    """Oracle for quantize_experts: the dense model with every routed expert replaced by the reference quantizer's
    weights; the MXFP4 model's logits must equal that model's (float32 rounding apart), not just be near the
    unquantized ones."""
    model, _ = tiny_model("kimi-linear-tiny")
    reference = copy.deepcopy(model)
    for experts in (m for m in reference.modules() if isinstance(m, RoutedExperts)):
        for name in ("w1", "w3", "w2"):
            weight = getattr(experts, name)
            weight.copy_(ocp_reference(weight, avoid_clipping=True)[0].float())
    quantized = quantize_experts(model)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    batch = ForwardBatch.build([40])
    expected = reference.compute_logits(reference(ids, batch)).double()
    got = quantized.compute_logits(quantized(ids, batch)).double()
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    dense = model.compute_logits(model(ids, batch)).double()
    assert (dense - expected).abs().max() > 1e-2 * expected.abs().max()      # quantization did change the experts


def test_fake_quantization_is_the_round_trip_with_a_straight_through_gradient():
    """QAT's forward value is what the export will store; its gradient passes through unchanged."""
    w = (torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(5)) * 0.02).requires_grad_()
    fake = fake_quantize_mxfp4(w)
    packed, scale = quantize_mxfp4(w.detach())
    assert torch.equal(fake.detach(), dequantize_mxfp4(packed, scale, torch.float32))
    assert not torch.equal(fake.detach(), w.detach())
    upstream = torch.randn_like(w)
    fake.backward(upstream)
    assert torch.equal(w.grad, upstream)
