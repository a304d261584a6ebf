"""nn.Linear whose float32 CPU inference runs on oneDNN's GEMM instead of MKL's, on CPUs where MKL is the slower, and
a batched step's rows on kestrel's own kernel where MKL runs.

torch's CPU matmul is MKL's sgemm. On an AMD EPYC (Zen 5, AVX-512, 2 threads) MKL streams a [1, 1024] x [1024, 1024]
decode matvec from memory at 14 GB/s and multiplies 32 rows at 95 GFLOPS; oneDNN (torch's
`mkldnn._linear_pointwise`) does the same at 23 GB/s and 149 GFLOPS. There the 437M K3 of
benchmarks/bench_llamacpp.py decodes 1.2-1.4x faster compiled at one sequence and 1.3x at 32. On an Intel Xeon
(AVX-512 and AMX, 2 threads) it is the other way round: MKL streams the matvec at 24 GB/s against oneDNN's 20,
and the same 437M K3 decodes compiled at 37 tok/s with MKL against 30 with oneDNN at one sequence, as fast at 32
sequences (164 tok/s), and prefills 128 and 512 tokens as fast or faster. MKL is Intel's, tuned for Intel's CPUs,
so the rule is the CPU's vendor: Intel keeps MKL (but see ROWS_KERNEL below), every other CPU takes oneDNN.
Smaller weights keep MKL (but see PACKED_MIN_WEIGHT below): the op is opaque to torch.compile (a custom op, called
back through Python from compiled code), which would cost more than it saves on matrices of a few hundred thousand
elements (most of the bundled model's). Training (grad enabled), other dtypes and other devices take F.linear
unchanged.

Where MKL runs, products of 4 to 15 rows against large weights go by blocks (`blocked_linear`): MKL's sgemm streams
the whole weight once per two or three of those rows (on the Intel Xeon, 2 threads: [3, 1024] x [1024, 32000] 3.0 ms,
[4, ...] 5.6, [8, ...] 9.1, [12, ...] 12.4), a batched GEMM over blocks of the weight's rows keeps each block in
cache for all of them (3.7, 4.9 and 6.1 ms; benchmarks/bench_linear.py, "linear"). Batched decode of 4-15 sequences
and verifications of a few drafts per sequence are such products.

The weights `linear` leaves to MKL that have at most COLUMN_MAJOR_MAX_IN input features are held column-major for
inference (`hold_column_major`: same shape and values, transposed storage), where MKL's sgemm multiplies by them
faster: on the Intel Xeon at 1 and 2 threads, the bundled model's [192, 192], [768, 192] and LM head [4096, 192]
1.1-1.6x at 1 row and 1.3-2.2x at 5 and 8 (benchmarks/bench_linear.py, "linear"); in a sweep of 256-2048 outputs
by 128-384 inputs, 0.9-2.0x, mostly 1.1-1.5x. With more input features it loses at 2 threads ([1024, 512] 0.65x at
1 row, [256, 1024] 0.50x at 5), and on weights of fewer than COLUMN_MAJOR_MIN_OUT outputs ([4, 192]: 0.8-0.9x).
The bundled model decodes ~8% faster eagerly, and verifies 4 block drafts ~12% faster.

Where oneDNN runs, the weights it multiplies are held a second time for inference in oneDNN's own blocked layout
(`pack_onednn_weights`: an opaque copy, +4 bytes per weight of those matrices), which products of more than one row
take: given a plain weight, oneDNN re-lays it on every call. On the AMD EPYC (2 threads, [4096, 1024] x 2 to 128
rows) the packed weight multiplies 1.1-2.6x faster, the most at 2-16 rows (a batched decode, a verification's
drafts; benchmarks/bench_linear.py, "linear"), and one packed for PACK_ROWS rows serves every row count as fast as
one packed for it. A single row keeps the plain weight: streamed from memory, the packed one read 22% slower (the
437M K3's [32000, 1024] LM head, 5.5 against 4.5 ms).

Weights of PACKED_MIN_WEIGHT elements up to ONEDNN_MIN_WEIGHT (the bundled model's LM head [4096, 192]) are packed
too, and multiply PACKED_MIN_ROWS rows or more from the packed copy. Timed after the reads of a model step's other
weights (1 thread, this AMD EPYC), MKL multiplied [4096, 192] by 4-32 rows in 0.35-0.80 ms against 0.22-0.59 packed,
and [2048, 192] by 4-32 in 0.15-0.38 against 0.11-0.32, while at 1-3 rows MKL led (column-major, 0.11-0.26 against
0.21-0.30 ms) and smaller weights lost (e.g. [820, 192], 0.5-0.8x). In the engine, in same-process A/Bs on the
bundled model, the block draft's decoding (per step a 5-token verification and the draft's 4-token LM head) ran
6-13% faster at 1 and 8 sequences, eagerly and compiled, and plain compiled decoding of 8 sequences 10%.

Traced by torch.compile (the CPU's compiled decode steps) where oneDNN runs, a single row is not a GEMM call at
all: `compiled_matvec` writes it as products summed over the input dim, which inductor's C++ backend turns into one
vectorised loop over the weight, fused with the step's other work. On the AMD EPYC (2 threads, compiled) such loops
streamed the 437M K3's [512, 1024] and [1024, 512] weights at 31-34 GB/s against MKL's 12-13 and oneDNN's 19-20, its
[32000, 1024] LM head at 33-35 against oneDNN's 30-31, and multiplied the bundled model's small weights twice as fast
as MKL from cache; batch-1 decode steps took 22 against 28 ms (437M) and 1.08 against 1.15-1.24 ms (bundled-size).
The loops read a row-major weight faster than a column-major one (by ~1.4x on the bundled model's), so engines that
compile keep every weight row-major (`hold_column_major` is for eager inference). Where MKL runs, single rows stay
MKL's: on the Intel Xeon such loops streamed 17-18 GB/s against MKL's 21-25, and in one process switching between
the two, the 437M K3's compiled batch-1 decode ran 32.8 tok/s with MKL for every weight against 28.6 with the loops
(medians of 6 rounds; 29.5 with the loops for the weights below 2^19 elements); the bundled-size model's, 575
against 581, level.

Where MKL runs, the rows of a batched decode step (ROWS_KERNEL: 16 to 64) multiply weights of ROWS_KERNEL_MIN_WEIGHT
elements or more on kestrel.ops.cpu's `linear_rows`, which reads each weight from memory once for all of the rows and
broadcasts each of its elements against vectors of them (MKL's sgemm streamed these at 4-10 GB/s). On the Intel Xeon
(2 threads, weights cycled so that they come from memory, alternating) the 437M K3's weights of 2^19 elements or more
took 0.56-0.86x MKL's time at 16 and 32 rows ([32000, 1024] 8.4 against 12.2 ms and 9.3 against 16.4; [1024, 1024]
0.36 against 0.41 and 0.37 against 0.55), 0.63-0.95x at 48 and 64, and lost from 96 rows on; smaller weights lost at
every row count ([128, 1024] 1.5-2.0x MKL's time), and at 4 to 15 rows blocked_linear was as fast (bench_linear.py
times the same weights from cache). In one process switching between the two, the 437M K3's compiled 32-sequence
decode ran 196 against 188 tok/s (medians of 6 rounds; per-round ratios 0.94-1.16).

Eagerly (kestrel's default decode), products of up to DOTS_ROWS rows run on kestrel.ops.cpu's `linear_dots`, on
every CPU: each row of a row-major weight is read once into whole vectors and dotted with each row of x (a
column-major one, held so for MKL's batched products, is read by rows of its storage, each input adding its row to
vectors of outputs). On the
AMD EPYC (weights cycled so that they come from memory) it streamed the 437M K3's [1024, 1024] at 29 GB/s on 2
threads against MKL's 15 and oneDNN's 20, its [32000, 1024] LM head at 28 against 15 and 31, and 4 rows of them 1.3-
2.4x faster than either; at one thread 17-22 GB/s against MKL's 13-16 and oneDNN's 13-22. The 437M K3's eager batch-1
decode step took 46 ms with it (and the experts and KDA state on their kernels) against 91 before.

A layer's projections of one input form a `LinearGroup`, which `fuse_linear_groups` turns into one product (one GEMM
call instead of several) where the fused weight is small (FUSE_MAX_WEIGHT) or the rows take linear_dots.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.ops import batch_invariant
from kestrel.ops import cpu as cpu_kernels

ONEDNN_MIN_WEIGHT = 1 << 20
"""Weights of at least this many elements (4 MB in float32) take oneDNN."""
BLOCKED_MIN_WEIGHT = 1 << 22
"""Where MKL runs, weights of at least this many elements (16 MB in float32) multiply BLOCKED_ROWS rows by blocks."""
BLOCKED_ROWS = (4, 15)
"""The row counts (first, last) MKL multiplies with a pass over the weight per few rows (from 16 on it blocks them
itself)."""
BLOCK = 128
"""Weight rows per block of blocked_linear."""
COLUMN_MAJOR_MAX_IN = 384
"""The most input features of a weight held column-major (module docstring)."""
COLUMN_MAJOR_MIN_OUT = 16
"""The fewest output features of a weight held column-major."""
ROWS_KERNEL = (16, 64)
"""The row counts (first, last) that large weights (ROWS_KERNEL_MIN_WEIGHT) multiply on kestrel_cpu.linear_rows where
MKL runs (module docstring)."""
ROWS_KERNEL_MIN_WEIGHT = 1 << 19
"""The fewest elements (2 MB in float32) of a weight that ROWS_KERNEL rows multiply on the kernel."""
DOTS_ROWS = 4
"""Up to this many rows, eager products are kestrel_cpu.linear_dots' (module docstring)."""
PACK_ROWS = 32
"""The row count oneDNN lays packed weights out for (module docstring: any count from 4 to 128 serves 1 to 128 rows
alike; one packed for 1 row is no faster than the plain weight at more)."""
PACKED_MIN_WEIGHT = 1 << 19
"""Where oneDNN runs, the weights packed for it: those of at least this many elements (2 MB in float32). Those below
ONEDNN_MIN_WEIGHT, left to MKL otherwise, take oneDNN from their packed copy at PACKED_MIN_ROWS rows or more."""
PACKED_MIN_ROWS = 4
FUSE_MAX_WEIGHT = ONEDNN_MIN_WEIGHT
"""The most elements of a LinearGroup's fused weight that multiplies every row count. Fusing saves GEMM calls, which
costs the bundled model's small products ~5-10 us each; products by larger weights are bound by reading them (the
437M K3's compiled batch-1 decode ran 1-4% slower with its KDA, MLA, MLP and MoE input projections fused, in three
pairs of runs), and their members keep their oneDNN copies for batched rows. A larger fused weight multiplies only
the rows that take linear_dots (`takes_dots`), which read it in one pass as they would its members: the 437M K3's
eager decode step ran ~7% faster at 1 and 4 sequences with them fused, ~10% slower at 16 with the fused weight
multiplying every row count (oneDNN re-laid the unpacked weight on every call)."""


def prefers_onednn(cpuinfo: str) -> bool:
    """Whether oneDNN is the faster float32 GEMM on the CPU /proc/cpuinfo's text describes: any CPU but Intel's."""
    vendors = {line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("vendor_id")}
    return vendors != {"GenuineIntel"}


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


ONEDNN = torch.backends.mkldnn.is_available() and prefers_onednn(_cpuinfo())
"""Whether large float32 weights take oneDNN on this machine."""


@torch.library.custom_op("kestrel::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, in] @ weight [out, in]^T + bias [out] -> [R, out], float32 on the CPU, by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32 in oneDNN's blocked GEMM layout (an opaque mkldnn tensor of the same shape and
    values), which onednn_linear takes in its place without re-laying it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, in] @ weight [out, in]^T + bias -> [R, out] as one batched GEMM over the weight's blocks of BLOCK rows
    (out a multiple of BLOCK): each block is read once for all R rows."""
    blocks = weight.view(-1, BLOCK, weight.shape[1])                                   # [out / BLOCK, BLOCK, in]
    out = torch.bmm(x.expand(blocks.shape[0], *x.shape), blocks.transpose(1, 2))       # [out / BLOCK, R, BLOCK]
    out = out.transpose(0, 1).reshape(x.shape[0], weight.shape[0])
    return out if bias is None else out + bias


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, in] @ weight [out, in]^T + bias -> [R, out] on kestrel.ops.cpu's kernel (loaded), each weight read once
    for all R rows (module docstring)."""
    return torch.ops.kestrel_cpu.linear_rows(x, weight, bias)


def compiled_matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] holding one row @ weight [out, in]^T + bias -> [..., out], written as products summed over the
    input dim, for torch.compile: inductor's C++ backend makes it one vectorised loop over the weight, with no call
    into a GEMM library (module docstring). Eagerly it materialises every product."""
    out = (x.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


def _large(weight: torch.Tensor) -> bool:
    """Whether `linear` may hand weight to oneDNN or blocked_linear (both read it row-major) instead of F.linear."""
    return weight.numel() >= (ONEDNN_MIN_WEIGHT if ONEDNN else BLOCKED_MIN_WEIGHT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [..., in], weight [out, in] -> [..., out]; oneDNN where it is the faster GEMM (from `packed`,
    weight's pack_onednn copy, when given and x has more than one row; below ONEDNN_MIN_WEIGHT, from `packed` at
    PACKED_MIN_ROWS rows or more); where MKL runs, kestrel_cpu.linear_rows for ROWS_KERNEL rows by a large weight
    and blocks where MKL would stream the weight once per few rows (module docstring). Traced by torch.compile on
    oneDNN's CPUs, a single row is a reduction in the graph (`compiled_matvec`). Inside
    batch_invariant.invariant() (deterministic inference), F.linear: its batch-invariant product."""
    if (x.device.type != "cpu" or not x.dtype == weight.dtype == torch.float32 or torch.is_grad_enabled()
            or batch_invariant.active()):
        return F.linear(x, weight, bias)
    if ONEDNN and torch.compiler.is_dynamo_compiling() and x.numel() == x.shape[-1]:
        return compiled_matvec(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if _dots(rows, weight):
        return torch.ops.kestrel_cpu.linear_dots(rows.contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if (not ONEDNN and ROWS_KERNEL[0] <= rows.shape[0] <= ROWS_KERNEL[1] and weight.numel() >= ROWS_KERNEL_MIN_WEIGHT
            and weight.is_contiguous() and cpu_kernels.available()):
        return linear_rows(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    large = _large(weight)
    if large or packed is not None:
        if large and ONEDNN:
            gemm_weight = weight if packed is None or rows.shape[0] == 1 else packed
            return onednn_linear(rows.contiguous(), gemm_weight, bias).view(*x.shape[:-1], weight.shape[0])
        if packed is not None and rows.shape[0] >= PACKED_MIN_ROWS:         # a mid-size weight, on oneDNN's CPUs
            return onednn_linear(rows.contiguous(), packed, bias).view(*x.shape[:-1], weight.shape[0])
        first, last = BLOCKED_ROWS
        if large and first <= rows.shape[0] <= last and weight.shape[0] % BLOCK == 0:
            return blocked_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def takes_dots(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies x [..., in] by weight on kestrel_cpu.linear_dots (module docstring)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and not batch_invariant.active() and _dots(x.reshape(-1, x.shape[-1]), weight))


def _dots(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """`takes_dots` once linear has checked the device, dtypes, gradients and deterministic inference."""
    return (rows.shape[0] <= DOTS_ROWS and (weight.is_contiguous() or weight.stride() == (1, weight.shape[0]))
            and not torch.compiler.is_dynamo_compiling() and cpu_kernels.available())


def column_major_pays(weight: torch.Tensor) -> bool:
    """Whether MKL multiplies by weight [out, in] faster held column-major (module docstring): float32 on the CPU,
    left to F.linear by `linear`, at most COLUMN_MAJOR_MAX_IN inputs and at least COLUMN_MAJOR_MIN_OUT outputs."""
    out_features, in_features = weight.shape
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not _large(weight)
            and in_features <= COLUMN_MAJOR_MAX_IN and out_features >= COLUMN_MAJOR_MIN_OUT)


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] with the same values, stored column-major (a transposed view of the transposed copy)."""
    return weight.t().contiguous().t()


def hold_column_major(model: nn.Module) -> int:
    """Store every Linear weight of model where column_major_pays column-major, in place (same shape and values:
    a transposed view of the transposed copy); returns how many. Weights shared with other modules (an LM head tied
    to the embedding) keep their layout. For eager inference: training's GEMMs were not measured, and compiled
    single rows read row-major weights faster (module docstring)."""
    shared = {id(p) for module in model.modules() if not isinstance(module, Linear)
              for p in module.parameters(recurse=False)}
    held = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear) and id(m.weight) not in shared
            and column_major_pays(m.weight) and m.weight.is_contiguous()}
    for weight in held.values():
        weight.data = column_major(weight.data)
    return len(held)


def pack_onednn_weights(model: nn.Module) -> int:
    """Give every Linear of model whose products may take oneDNN from a packed copy (`linear`'s rule: float32 CPU
    weights of at least ONEDNN_MIN_WEIGHT or PACKED_MIN_WEIGHT elements, on CPUs that prefer oneDNN) its weight's
    pack_onednn copy; returns the bytes they add (as many as the weights'). For inference: the copies do not follow
    later changes to the weights."""
    if not ONEDNN:
        return 0
    held = [m for m in model.modules() if isinstance(m, Linear)
            and (_large(m.weight) or m.weight.numel() >= PACKED_MIN_WEIGHT)
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    for module in held:
        module.packed = pack_onednn(module.weight)
    return sum(m.weight.numel() * m.weight.element_size() for m in held)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`, from a pack_onednn copy of its weight
    once `pack_onednn_weights` gives it one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("packed", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class LinearGroup(nn.Module):
    """Bias-free Linears of one layer that read the same input: run one by one, or, once `fuse`d for inference, as
    one product by a weight that holds theirs as row blocks (each member's weight then a view of its block), one
    GEMM call instead of several; a fused weight of FUSE_MAX_WEIGHT elements or more only for the rows that take
    linear_dots. It owns no parameters: the members keep theirs, under the checkpoint's names."""

    def __init__(self, *members: Linear):
        super().__init__()
        self.members = members                      # a tuple, not submodules: the state dict keeps its names
        self.sizes: list[int] = []
        self.register_buffer("weight", None, persistent=False)

    @property
    def large(self) -> bool:
        """Whether the fused weight has FUSE_MAX_WEIGHT elements or more (so multiplies only linear_dots' rows)."""
        return self.weight is not None and self.weight.numel() >= FUSE_MAX_WEIGHT

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> each member's output [..., out_i] (views of one product's columns once fused)."""
        if self.weight is None or (self.large and not takes_dots(x, self.weight)):
            return tuple(member(x) for member in self.members)
        return linear(x, self.weight).split(self.sizes, dim=-1)

    def fuse(self, column_major_ok: bool = True) -> bool:
        """Hold the members' weights as blocks of one (column-major where column_major_ok and column_major_pays);
        False, leaving them as they are, unless they are plain Linears without bias of one dtype, device and input
        width."""
        weights = [member.weight for member in self.members]
        if (any(type(member) is not Linear or member.bias is not None for member in self.members)
                or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1):
            return False
        fused = torch.cat([w.detach() for w in weights])
        if column_major_ok and column_major_pays(fused):
            fused = column_major(fused)
        self.weight, self.sizes = fused, [w.shape[0] for w in weights]
        for w, block in zip(weights, fused.split(self.sizes)):
            w.data = block
        return True


def fuse_linear_groups(model: nn.Module, column_major_ok: bool = True) -> int:
    """LinearGroup.fuse for every group of model, larger groups first, skipping a group that shares a member with
    one already fused (a layer's group may take a sublayer's); returns how many were fused. For inference; each fused
    weight takes hold_column_major's layout rule itself (unless not column_major_ok), and its members (views of it)
    are not re-laid after."""
    fused = set()
    count = 0
    for group in sorted((m for m in model.modules() if isinstance(m, LinearGroup)), key=lambda g: -len(g.members)):
        if fused.isdisjoint(map(id, group.members)) and group.fuse(column_major_ok):
            fused.update(map(id, group.members))
            count += 1
    return count
