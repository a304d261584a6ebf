"""Batch-invariant operators for deterministic inference (`--enable-deterministic-inference`).

Inside `invariant()` (on the thread that enters it: the engine's, around each step), float32 and bfloat16 CPU calls
of the aten ops below compute every element of their result in one fixed order of operations that depends only on
that element's own inputs, never on how many rows share the call, where a row lies in it, or how many threads run
it (bfloat16 in float32, rounded once at the end; its products widen their operands, a copy of each weight per
call):

- products (mm, addmm, bmm, baddbmm, mv, addmv; F.linear, matmul and einsum reach them): each output one fused
  multiply-add per input, in input order from zero (kestrel_cpu::invariant_mm, or linear_rows where the second
  factor is a row-major weight's transpose; the two sum alike). torch's MKL and oneDNN GEMMs pick kernels and
  blockings by the row count, so one token's outputs changed with its batch.
- softmax and log_softmax: the row's maximum (exact), then its exponentials summed by one sequential float64 pass
  (cumsum), so keys appended past a sequence's end (probability zero) leave its sums as they are. torch's own
  vectorised sums regroup the terms when a row's padded length changes.
- sum and mean over dims: of a contiguous copy. torch picks its summation order by the memory layout, and layouts
  change with the batch (an einsum's output is a permuted view whose strides depend on the row count: one token's
  L2 norm summed its 48 squares in another order in a step of two sequences than alone).
- sigmoid, silu and softplus: composed of exp and log1p (vectorised the same way for every element) and IEEE
  arithmetic. torch's own kernels compute the last elements of each thread's range with scalar code that rounds
  differently, so a row's results depended on where the batch put it.

The rest of what the model runs was probed the same way (rows at batch sizes 1 to 64, one to eight threads, row- and
column-major) and is invariant already: elementwise arithmetic and exp, log, log1p, tanh, rsqrt (IEEE, or vectorised
to the end of the array in any layout), max, cumsum (sequential), layer_norm. tests/ops/test_batch_invariant.py
checks the replacements row by row; tests/engine/test_deterministic.py the whole forward, token by token. The routed
experts run on kestrel_cpu::expert_mlp, each token-expert pair summed alike however many share its expert
(INVARIANT_OPS, which kestrel.ops.backend's get_op hands out here). The KDA and MLA layers also take their
token-by-token forms for every token (kestrel.engine.deterministic), so a prefill chunk, a decode step and a
verification compute each token the same way.

The overrides are registered (torch.library, CPU dispatch key) while any thread is inside `invariant()`, so the rest
of the time torch's kernels run untouched; on other threads meanwhile, and for other dtypes and tensors that need
gradients, they call torch's own kernels through the ops' out= overloads, which they leave alone.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from . import cpu
from .tracing import constant_when_traced
from .torch.moe import moe_experts_native

_state = threading.local()
_registry = threading.Lock()
_library: torch.library.Library | None = None
_entered = 0
"""How many invariant() blocks are open, on all threads: the overrides are registered while any is."""


@constant_when_traced
def active() -> bool:
    """Whether this thread is inside `invariant()`. A constant to torch.compile's tracing (no compiled step runs in
    the mode), so graphs carry no guard on the thread-local state: one compiled on another thread would fail it."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def invariant() -> Iterator[None]:
    """Run this thread's float32 CPU products, sums, softmaxes and gates batch-invariantly (module docstring)."""
    global _library, _entered
    if not cpu.load():
        raise RuntimeError("deterministic inference needs kestrel's CPU kernels, which could not be built here "
                           "(the log says why).")
    with _registry:
        if _entered == 0:
            _library = _register()
        _entered += 1
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        with _registry:
            _entered -= 1
            if _entered == 0:
                _library._destroy()
                _library = None


def _ours(*tensors: torch.Tensor) -> bool:
    """Whether a call on these tensors takes the invariant path: on this thread inside invariant(), CPU tensors all
    float32 or all bfloat16, no gradient wanted."""
    return (active() and all(t.device.type == "cpu" for t in tensors)
            and len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in COMPUTED
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


COMPUTED = (torch.float32, torch.bfloat16)
"""The dtypes the invariant paths take: float32, and bfloat16 computed in float32 (its values convert exactly;
each result is rounded once, at the end)."""


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] or a [B, M, K] @ b [B, K, N] in float32 (bfloat16 operands widened: a copy), each output
    summed in input order by fused multiply-adds from zero."""
    a, b = a.float(), b.float()
    if a.dim() == 2 and b.t().is_contiguous():          # a row-major weight's transpose, or a column
        return torch.ops.kestrel_cpu.linear_rows(a, b.t(), None)
    if b.shape[-1] > 1 and b.stride(-1) != 1:
        b = b.contiguous()
    return torch.ops.kestrel_cpu.invariant_mm(a, b)


def _scaled(out: torch.Tensor, alpha: float, base: torch.Tensor | None = None, beta: float = 1.0) -> torch.Tensor:
    """beta * base + alpha * out, as addmm and its relatives define it (beta 0: base ignored, NaN included)."""
    if alpha != 1:
        out = out * alpha
    if base is None or beta == 0:
        return out
    return out + (base.float() if beta == 1 else base.float() * beta)


def _mm(a, b):
    if not _ours(a, b):
        return torch.mm(a, b, out=a.new_empty(a.shape[0], b.shape[1]))
    return product(a, b).to(a.dtype)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not _ours(bias, a, b):
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha,
                           out=a.new_empty(a.shape[0], b.shape[1], dtype=torch.result_type(bias, a)))
    return _scaled(product(a, b), alpha, bias, beta).to(a.dtype)


def _bmm(a, b):
    if not _ours(a, b):
        return torch.bmm(a, b, out=a.new_empty(a.shape[0], a.shape[1], b.shape[2]))
    return product(a, b).to(a.dtype)


def _baddbmm(base, a, b, *, beta=1, alpha=1):
    if not _ours(base, a, b):
        return torch.baddbmm(base, a, b, beta=beta, alpha=alpha,
                             out=a.new_empty(a.shape[0], a.shape[1], b.shape[2]))
    return _scaled(product(a, b), alpha, base, beta).to(a.dtype)


def _mv(a, v):
    if not _ours(a, v):
        return torch.mv(a, v, out=a.new_empty(a.shape[0]))
    return product(a, v.unsqueeze(1)).squeeze(1).to(a.dtype)


def _addmv(base, a, v, *, beta=1, alpha=1):
    if not _ours(base, a, v):
        return torch.addmv(base, a, v, beta=beta, alpha=alpha, out=a.new_empty(a.shape[0]))
    return _scaled(product(a, v.unsqueeze(1)).squeeze(1), alpha, base, beta).to(a.dtype)


def _exp_sum(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x - max over dim, its exp, and their sum (dim kept), in float32, summed by cumsum: sequentially in float64,
    position by position, so terms of zero appended at the end change nothing."""
    x = x.float()
    shifted = x - x.amax(dim, keepdim=True)
    e = shifted.exp()
    return shifted, e, e.cumsum(dim).narrow(dim, x.shape[dim] - 1, 1)


def _softmax(x, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else x.dtype
    if not _ours(x) or x.dim() == 0 or x.numel() == 0:
        return torch.ops.aten._softmax.out(x, dim, half_to_float, out=torch.empty_like(x, dtype=out_dtype))
    _, e, total = _exp_sum(x, dim)
    return (e / total).to(out_dtype)


def _log_softmax(x, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else x.dtype
    if not _ours(x) or x.dim() == 0 or x.numel() == 0:
        return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=torch.empty_like(x, dtype=out_dtype))
    shifted, _, total = _exp_sum(x, dim)
    return (shifted - total.log()).to(out_dtype)


def _sum(x, dim, keepdim=False, *, dtype=None):
    if not _ours(x) or dtype not in (None, *COMPUTED):
        promoted = x.dtype if x.is_floating_point() or x.is_complex() else torch.int64   # as torch.sum promotes
        return torch.ops.aten.sum.IntList_out(x.contiguous() if _ours(x) else x, dim, keepdim, dtype=dtype,
                                              out=x.new_empty(0, dtype=dtype or promoted))
    total = torch.ops.aten.sum.IntList_out(x.float().contiguous(), dim, keepdim,
                                           out=x.new_empty(0, dtype=torch.float32))
    return total.to(dtype or x.dtype)


def _mean(x, dim, keepdim=False, *, dtype=None):
    if not _ours(x) or dtype not in (None, *COMPUTED):
        return torch.ops.aten.mean.out(x.contiguous() if _ours(x) else x, dim, keepdim, dtype=dtype,
                                       out=x.new_empty(0, dtype=dtype or x.dtype))
    mean = torch.ops.aten.mean.out(x.float().contiguous(), dim, keepdim, out=x.new_empty(0, dtype=torch.float32))
    return mean.to(dtype or x.dtype)


def _sigmoid(x):
    if not _ours(x):                 # an integer tensor's sigmoid is floating-point
        floating = x.is_floating_point() or x.is_complex()
        return torch.sigmoid(x, out=torch.empty_like(x, dtype=x.dtype if floating else torch.get_default_dtype()))
    return (1.0 / (1.0 + torch.exp(-x.float()))).to(x.dtype)


def _silu(x):
    if not _ours(x):
        return torch.ops.aten.silu.out(x, out=torch.empty_like(x))
    return (x.float() / (1.0 + torch.exp(-x.float()))).to(x.dtype)


def _softplus(x, beta=1, threshold=20):
    if not _ours(x):
        return torch.ops.aten.softplus.out(x, beta, threshold, out=torch.empty_like(x))
    scaled = x.float() * beta
    return torch.where(scaled > threshold, x.float(), torch.log1p(torch.exp(scaled)) / beta).to(x.dtype)


def _moe_experts(z, ids, weights, experts, activation, mxfp8_activations=False):
    """kestrel.ops.torch.moe's moe_experts on the CPU kernel (moe_experts_native), in float32 (bfloat16 activations
    widened, the result rounded back): torch's grouped GEMM sums each expert's rows by how many tokens chose it."""
    if mxfp8_activations:
        raise ValueError("deterministic inference runs the routed experts without MXFP8 activations.")
    return moe_experts_native(z.float(), ids, weights, experts, activation).to(z.dtype)


INVARIANT_OPS: dict[str, Callable] = {"moe_experts": _moe_experts}
"""kestrel.ops.backend's dispatched ops whose batch-invariant implementation differs from the torch reference."""

OVERRIDES: dict[str, Callable] = {
    "mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm, "mv": _mv, "addmv": _addmv,
    "sum.dim_IntList": _sum, "mean.dim": _mean, "_softmax": _softmax, "_log_softmax": _log_softmax,
    "sigmoid": _sigmoid, "silu": _silu, "softplus": _softplus,
}
"""The aten ops (their default overloads) replaced on the CPU."""


def _register() -> torch.library.Library:
    """OVERRIDES registered for the CPU (0.3 ms, and as long to remove: invariant() holds them for a step)."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():         # torch warns that it overrides its own kernels: that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, function in OVERRIDES.items():
            library.impl(name, function, "CPU")
    return library
