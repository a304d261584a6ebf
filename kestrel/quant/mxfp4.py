"""MXFP4 weights in the compressed-tensors "mxfp4-pack-quantized" layout used by K3 checkpoints.

A weight [..., K] is cut into blocks of 32 consecutive values along its last (input) dim. Each
block stores one E8M0 scale byte (2^(byte - 127); 0xFF is NaN) and 32 E2M1 codes packed two per
byte: byte j of a row holds column 2j in its low nibble and column 2j+1 in its high nibble.
"""

import torch
from torch import Tensor

__all__ = ["BLOCK", "E2M1_VALUES", "quantize_mxfp4", "dequantize_mxfp4", "fake_quantize_mxfp4"]

BLOCK = 32
"""Values per E8M0 scale, along the last dim."""

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""float32 [16]: E2M1 code -> value. Bit 3 is the sign, bit 0 the mantissa bit."""

_E2M1_MAX = 6.0
_SCALE_BIAS = 127
_SCALE_NAN = 0xFF
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127

# Midpoint i lies between magnitude codes i and i+1. Round-half-to-even sends a tie to whichever
# of the two codes is even: the lower one for i = 0, 2, 4, 6, the upper one for i = 1, 3, 5.
_MIDPOINTS = (E2M1_VALUES[1:8] + E2M1_VALUES[0:7]) / 2
_TIES_TO_LOWER = _MIDPOINTS[0::2].contiguous()  # 0.25, 1.25, 2.5, 5
_TIES_TO_UPPER = _MIDPOINTS[1::2].contiguous()  # 0.75, 1.75, 3.5


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize w [..., K] (any float dtype, K % 32 == 0) to MXFP4.

    Returns (packed uint8 [..., K/2], scale uint8 [..., K/32]).

    Rule, per block of 32 values along the last dim: the scale is the smallest power of two
    s = 2^e with amax / s <= 6, so no value clips; e is clamped to the E8M0 range [-127, 127]
    and an all-zero block gets e = -127. Each value w/s is rounded to the nearest E2M1 value,
    ties going to the code whose mantissa bit is 0 (round half to even). Negative values that
    round to zero keep their sign (code 8, -0). Leading dims are arbitrary. Raises ValueError on
    NaN/Inf and on magnitudes above 6 * 2^127 (reachable only from float64), which would clip.
    """
    _check_last_dim(w)
    compute_dtype = torch.promote_types(w.dtype, torch.float32)
    blocks = w.to(compute_dtype).unflatten(-1, (w.shape[-1] // BLOCK, BLOCK))
    amax = blocks.abs().amax(dim=-1)
    _check_representable(amax)
    exponent = _block_exponent(amax)
    codes = _e2m1_codes(torch.ldexp(blocks, -exponent.unsqueeze(-1)))
    packed = _pack_nibbles(codes.flatten(-2))
    return packed, (exponent + _SCALE_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Expand packed uint8 [..., K/2] and scale uint8 [..., K/32] to [..., K] in `dtype`.

    Value = E2M1(code) * 2^(scale - 127); a block whose scale byte is 0xFF is NaN.
    """
    _check_packed(packed, scale)
    compute_dtype = torch.promote_types(dtype, torch.float32)
    lut = E2M1_VALUES.to(device=packed.device, dtype=compute_dtype)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    blocks = lut[codes.long()].unflatten(-1, (scale.shape[-1], BLOCK))
    exponent = scale.to(torch.int32) - _SCALE_BIAS
    values = torch.ldexp(blocks, exponent.unsqueeze(-1))
    values = values.masked_fill((scale == _SCALE_NAN).unsqueeze(-1), float("nan"))
    return values.flatten(-2).to(dtype)


def fake_quantize_mxfp4(w: Tensor) -> Tensor:
    """w [..., K] rounded to MXFP4 and back, in w's dtype, for quantization-aware training.

    Straight-through estimator: the forward value is dequantize(quantize(w)), the gradient is the identity.
    """
    packed, scale = quantize_mxfp4(w.detach())
    return dequantize_mxfp4(packed, scale, w.dtype) + (w - w.detach())


def _block_exponent(amax: Tensor) -> Tensor:
    """int32 e of the smallest 2^e with amax <= 6 * 2^e, clamped to [-127, 127]; -127 for amax == 0.

    With amax = m * 2^E and m in [0.5, 1): 6 * 2^(E-3) = 0.75 * 2^E covers m <= 0.75 and
    6 * 2^(E-4) = 0.375 * 2^E never does, so e = E - 3; otherwise e = E - 2. Exact, no log2.
    """
    mantissa, power = torch.frexp(amax)
    exponent = power - torch.where(mantissa <= 0.75, 3, 2).to(power.dtype)
    exponent = torch.where(amax == 0, _MIN_EXPONENT, exponent)
    return exponent.clamp(_MIN_EXPONENT, _MAX_EXPONENT)


def _e2m1_codes(y: Tensor) -> Tensor:
    """uint8 E2M1 codes (0..15) of y, rounded to nearest, ties to even; |y| must be <= 6."""
    magnitude = y.abs()
    # bucketize(right=False) counts midpoints strictly below |y| (a tie stays on the lower code),
    # bucketize(right=True) counts midpoints at or below |y| (a tie moves to the upper code).
    code = torch.bucketize(magnitude, _TIES_TO_LOWER.to(y.device, y.dtype), right=False)
    code += torch.bucketize(magnitude, _TIES_TO_UPPER.to(y.device, y.dtype), right=True)
    code |= torch.signbit(y).to(code.dtype) << 3
    return code.to(torch.uint8)


def _pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2]: column 2j in the low nibble, 2j+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _check_last_dim(w: Tensor) -> None:
    if not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4 needs a floating-point weight, got dtype {w.dtype}.")
    if w.dim() == 0 or w.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"quantize_mxfp4 needs the last dim to be a multiple of {BLOCK}, got shape {tuple(w.shape)}; "
            "pad the input dim or keep this weight unquantized."
        )


def _check_representable(amax: Tensor) -> None:
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_mxfp4 got a weight containing NaN or Inf, which MXFP4 cannot represent.")
    largest = _E2M1_MAX * 2.0**_MAX_EXPONENT
    if amax.numel() and amax.max() > largest:
        raise ValueError(f"quantize_mxfp4 got a value beyond the largest MXFP4 magnitude {largest:.6g}.")


def _check_packed(packed: Tensor, scale: Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(
            f"dequantize_mxfp4 needs uint8 packed and scale tensors, got {packed.dtype} and {scale.dtype}."
        )
    half_block = BLOCK // 2
    if (
        packed.dim() == 0
        or scale.dim() == 0
        or packed.shape[:-1] != scale.shape[:-1]
        or packed.shape[-1] != half_block * scale.shape[-1]
    ):
        raise ValueError(
            f"dequantize_mxfp4 got packed {tuple(packed.shape)} and scale {tuple(scale.shape)}, which disagree: "
            f"they must share leading dims and packed's last dim must be {half_block}x scale's."
        )
