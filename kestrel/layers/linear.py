"""nn.Linear whose float32 CPU inference runs on oneDNN's GEMM instead of MKL's.

torch's CPU matmul is MKL's sgemm. On an AMD EPYC (Zen 5, AVX-512, 2 threads) MKL streams a [1, 1024] x [1024, 1024]
decode matvec from memory at 14 GB/s and multiplies 32 rows at 95 GFLOPS; oneDNN (torch's
`mkldnn._linear_pointwise`) does the same at 23 GB/s and 149 GFLOPS. There the 437M K3 of
benchmarks/bench_llamacpp.py decodes 1.2-1.4x faster compiled at one sequence and 1.3x at 32. Not measured on an
Intel CPU. Small weights keep MKL: the op is opaque to torch.compile (a custom op, called back through Python
from compiled code), which would cost more than it saves on matrices of a few hundred thousand elements (the
bundled model's). Training (grad enabled), other dtypes and other devices take F.linear unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_WEIGHT = 1 << 20
"""Weights of at least this many elements (4 MB in float32) take oneDNN."""
ONEDNN = torch.backends.mkldnn.is_available()


@torch.library.custom_op("kestrel::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, in] @ weight [out, in]^T + bias [out] -> [R, out], float32 on the CPU, by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [..., in], weight [out, in] -> [..., out]; oneDNN where it is the faster GEMM (module docstring)."""
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and weight.numel() >= ONEDNN_MIN_WEIGHT and ONEDNN):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return onednn_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
