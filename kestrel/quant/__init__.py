"""Weight and activation number formats: MXFP4 packing and MXFP8 fake quantization."""

from kestrel.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from kestrel.quant.mxfp8 import fake_quantize_mxfp8

__all__ = ["dequantize_mxfp4", "fake_quantize_mxfp8", "quantize_mxfp4"]
