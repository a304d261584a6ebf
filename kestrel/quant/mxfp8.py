"""MXFP8 fake quantization: round activations to E4M3 with one E8M0 power-of-two scale per block.

Used to emulate the MXFP8 activations of K3's W4A8 quantization-aware training recipe; off by
default in the model. The result stays in the input's dtype and passes gradients straight through.
"""

import torch
from torch import Tensor

__all__ = ["fake_quantize_mxfp8"]

_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448 = 1.75 * 2^8
_E4M3_MAX_EXPONENT = 8
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127


def fake_quantize_mxfp8(x: Tensor, block: int = 32) -> Tensor:
    """Round x [..., K] (float, K % block == 0) to MXFP8 and return it in x's dtype and shape.

    Per block of `block` values along the last dim, the scale is the OCP rule
    2^e with e = floor(log2(amax)) - 8, clamped to the E8M0 range [-127, 127]; each value x / 2^e
    is clamped to +-448 (saturation) and rounded to float8_e4m3fn (nearest, ties to even).
    Zero blocks stay zero; a block holding NaN or Inf becomes all NaN rather than a silently
    wrong scale. Straight-through estimator: forward is the quantized value, backward is identity.
    """
    _check_blocks(x, block)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    blocks = x.detach().to(compute_dtype).unflatten(-1, (x.shape[-1] // block, block))
    scale = _block_scale(blocks.abs().amax(dim=-1, keepdim=True))
    elements = (blocks / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    quantized = (elements.to(compute_dtype) * scale).flatten(-2).to(x.dtype)
    # Exactly `quantized` in the forward pass (x - x.detach() is 0), gradient 1 with respect to x.
    return quantized + (x - x.detach())


def _block_scale(amax: Tensor) -> Tensor:
    """Power-of-two scale 2^(floor(log2(amax)) - 8) per block, in amax's dtype; NaN if amax is not finite."""
    _, power = torch.frexp(amax)  # amax = m * 2^power, m in [0.5, 1), so floor(log2(amax)) = power - 1
    exponent = (power - 1 - _E4M3_MAX_EXPONENT).clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    return scale.masked_fill(~torch.isfinite(amax), float("nan"))


def _check_blocks(x: Tensor, block: int) -> None:
    if block <= 0:
        raise ValueError(f"fake_quantize_mxfp8 needs a positive block size, got {block}.")
    if not x.is_floating_point():
        raise ValueError(f"fake_quantize_mxfp8 needs a floating-point tensor, got dtype {x.dtype}.")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"fake_quantize_mxfp8 needs the last dim to be a multiple of block={block}, "
            f"got shape {tuple(x.shape)}."
        )
