"""The routed experts: sum_k weights[t, k] * W2_e act(W1_e z_t, W3_e z_t) over each token's chosen experts e.

The reference for the Triton grouped GEMM, and the CPU path itself. Token-expert pairs are sorted by expert, so each
expert's tokens form one contiguous slice of rows, multiplied against that expert's weights in place: the stacked
dense weights in one grouped GEMM when they are in the activation dtype (no copy; in bf16 and fp16 few rows per
expert are padded into one batched GEMM, `PADDED_ROWS`, where the idle experts it also reads are cheap,
`EXPERT_VISIT_BYTES`), by oneDNN from each expert's packed copy of its float32 weights where the layer holds one
(`ExpertWeights.onednn_w13`), or each expert's MXFP4 tile expanded for this call (only the experts in use, one tile
at a time). The gated activation runs once over all pairs, and the weighted rows are added back to their tokens
with index_add. No weight matrix is copied per token.

oneDNN's packed copies (`--moe-onednn-experts`, kestrel.layers.moe.pack_onednn_experts: +4 bytes per weight)
multiply an expert's few rows 1.6-2.9x faster than torch._grouped_mm, which calls MKL's sgemm once per expert:
measured on an AMD EPYC (2 threads, 64 experts, all in use, random weights), [512, 256] experts took 2.6-3.6 ms
against 5.2-8.3 at 2-16 rows per expert, [1024, 512] ones 5.8-9.4 against 16.6-22.9; at one row 0.6-0.7x the time.
In the 437M K3 of benchmarks/bench_llamacpp.py (float32 expert copy), prefills of 128 tokens ran 1.2-1.4x faster
(two same-process A/Bs, medians: 402 against 333 and 364 against 266 tok/s) and of 512 tokens 1.11x. On an Intel
Xeon (AVX-512 and AMX), where MKL is the faster, they were 1.2-1.4x slower than the grouped GEMM up to 128 tokens,
and the engine holds none there (kestrel.layers.moe.EXPERT_PACKED_MIN_WEIGHT).

MXFP4 on the CPU: three compute formats, measured by benchmarks/bench_moe_cpu.py (docs/benchmarks.md, "moe-cpu") on
a 437M-parameter K3 (64 experts top-4, 11 MoE layers, 277M routed weights) in float32, one thread; time per step
spent in the routed experts, at decode of 1 / 32 sequences and a prefill of 128 tokens (one run; runs vary by
~20%):
- packed (the default): 0.53 bytes per weight (140 MiB), nothing more; each call expands the tiles of the experts
  in use, one 65,536-entry table lookup per byte (`expand_mxfp4`, ~1.5 ns per weight, ~10x faster than
  `kestrel.quant.dequantize_mxfp4`). 25 / 257 / 361 ms: the expansion dominates once most experts are in use.
  Decode steps and short prefills (eager and compiled) instead decode the packed weights in registers as the CPU
  kernel reads them (`moe_experts_native`, up to NATIVE_PAIRS_PER_EXPERT pairs per expert), the fastest of the
  three there: the 437M K3's eager batch-1 decode spent 13.5 ms per step in its 11 MoE layers with it against 48.9
  expanding tiles.
- a dense bfloat16 copy (`kestrel.layers.moe.RoutedExperts.hold_dense_copy`): +2 bytes per weight (+528 MiB);
  exact (bfloat16 holds every MXFP4 value); used in place by bfloat16 models, cast per call by float32 ones
  (eagerly; the compiled decode step reads it in place, converting as it multiplies: `moe_experts_native`).
  17 / 135 / 196 ms.
- a dense float32 copy: +4 bytes per weight (+1,056 MiB), used in place. 13 / 153 / 215 ms.
The previous path (used experts gathered and dequantized whole every call) took 281 / 4,350 / 5,909 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...quant import dequantize_mxfp4, fake_quantize_mxfp8
from .. import cpu

SILU, SITU = "silu", "situ"
_PAIR_INT = {2: torch.int32, 4: torch.int64}
"""The integer dtype as wide as two values of a 2- or 4-byte float: one gather moves both values of a packed byte."""


PADDED_ROWS = {torch.bfloat16: 16, torch.float16: 16}
"""The most rows per expert for which _per_expert may pad every expert's group to the largest and run one batched
GEMM (torch.bmm) instead of torch._grouped_mm, which loops over the experts on the CPU. Measured on the CPU (2
threads, 64 experts [512, 512] and [512, 256], 32 experts [192, 96]): a bf16 bmm costs about its weight read up to
16 rows per expert, 1.8-10x faster than the grouped GEMM of the same rows. Never in float32: its bmm over every
expert took 1.5-3x the grouped GEMM at 1-2 rows per expert (1 and 2 threads; at 2, 32 experts [192, 96] top-2, 5
tokens: 353 against 203 us; 64 experts [512, 256] top-4, 5 tokens: 2.4 against 1.0 ms)."""

NATIVE_PAIRS_PER_EXPERT = {torch.float32: 4, torch.bfloat16: 16, torch.uint8: 16}
"""Up to how many token-expert pairs per expert the experts run on the CPU kernel (moe_experts_native), eagerly and
in traced graphs, by their weights' dtype (uint8: MXFP4), rather than by pairs or grouped. Measured on an Intel
Xeon (AVX-512; 2 threads; eager calls, alternating, medians per layer over 11 layers so that the weights stream
from memory), the 437M K3's 64 experts [512, 256] top-4, ms per layer:
- against the compiled moe_experts_by_pairs at 1 / 8 / 32 / 64 tokens: float32 0.30 / 2.12 / 4.39 / 7.25 against
  0.34 / 2.33 / 6.86 / 13.80, bfloat16 0.28 / 1.51 / 3.18 / 4.36 against 0.20 / 1.54 / 5.32 / 8.95; the bundled-size
  32 experts [192, 96] top-2 in float32 at 1 / 8 / 32 / 64 tokens 0.05 / 0.16 / 0.34 / 0.56 against 0.07 / 0.21 /
  0.42 / 0.66. MXFP4 at 1 / 8 / 32 tokens 0.21 / 1.13 / 2.58 against 1.39 / 25.1 / 25.8 compiled as before the
  kernel took them (by pairs, then grouped), and the bfloat16 copy 0.33 / 1.74 / 3.46 on the kernel.
- against the grouped op (each expert's rows by MKL, MXFP4 tiles expanded first) at 64 / 128 / 256 tokens, 4 / 8 /
  16 pairs per expert: MXFP4 4.97 / 8.26 / 18.4 against 37.6 / 41.2 / 34.4, bfloat16 5.69 / 9.61 / 19.5 against
  30.3 / 29.6 / 36.4; but float32, which MKL multiplies in place, 7.77 against 7.04 at 64 tokens, and 4.60 / 5.24 /
  6.58 against 4.65 / 4.77 / 6.10 at 16 / 32 / 48 (so float32 could leave the kernel from 2 pairs per expert for the
  grouped op, which a traced graph calls through Python with a host sync; not measured in the engine).
Not measured beyond 16 pairs per expert."""

EXPERT_VISIT_BYTES = 256 * 1024
"""The bytes of weights read in the time torch._grouped_mm spends on one expert in use on the CPU (~15 us at ~20
GB/s). The padded bmm reads every expert, idle ones too, so _per_expert takes it only while the idle experts' bytes
stay within this many per expert in use: measured in bf16 on one thread (benchmarks/bench_moe_cpu.py, "the op's
choice"), the bmm won up to ~300 KiB of idle weights per expert in use and lost from ~330 KiB (64 experts [1024,
512] top-4 at 5 tokens: 4.8 ms against 1.7 grouped, 2.4 MiB idle per expert in use)."""


_pair_tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
"""_mxfp4_pair_table's tables, once built (torch.compile reads a built one as an input instead of rebuilding it)."""


def _mxfp4_pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65536] entries: entry 256 * scale + byte holds byte's two values (low nibble first) under E8M0 scale `scale`
    in dtype, as dequantize_mxfp4 computes them (NaN for scale 0xFF); each pair is one integer of twice dtype's width
    when there is one (so one gather moves both values), else a row [2]."""
    if (dtype, device) not in _pair_tables:
        _pair_tables[dtype, device] = _build_pair_table(dtype, device)
    return _pair_tables[dtype, device]


def _build_pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    packed = torch.arange(256, dtype=torch.uint8, device=device).repeat(256).view(4096, 16)    # 16 bytes per scale
    scale = torch.arange(256, dtype=torch.uint8, device=device).repeat_interleave(16).view(4096, 1)
    pairs = dequantize_mxfp4(packed, scale, dtype).view(65536, 2)
    return pairs.view(_PAIR_INT[dtype.itemsize]).flatten() if dtype.itemsize in _PAIR_INT else pairs


def expand_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_mxfp4(packed, scale, dtype) by one table lookup per byte: packed uint8 [..., K/2] and E8M0 scale
    uint8 [..., K/32] -> [..., K] in dtype."""
    index = (scale.int() << 8).unsqueeze(-1) | packed.unflatten(-1, (scale.shape[-1], 16))   # int32 [..., K/32, 16]
    values = _mxfp4_pair_table(dtype, packed.device).index_select(0, index.flatten()).view(dtype)
    return values.view(*packed.shape[:-1], 2 * packed.shape[-1])


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked routed experts (E experts, D model or latent width, I intermediate width).

    Dense: w1, w3 [E, I, D] and w2 [E, D, I] in a float dtype, scales None; w13 [E, 2I, D] when w1 and w3 are its
    two halves (a held dense copy stores them so: one GEMM then computes the gate and up projections). MXFP4: w1,
    w3 [E, I, D/2] and w2 [E, D, I/2] packed uint8 (two E2M1 codes per byte along the input dim,
    kestrel.quant.mxfp4's layout) with E8M0 scales w1_scale, w3_scale [E, I, D/32] and w2_scale [E, D, I/32] uint8.
    Dense float32 experts may also come as each expert's [2I, D] (w1 then w3) and [D, I] in oneDNN's packed layout
    (onednn_w13, onednn_w2: E opaque mkldnn tensors each), which float32 products take in their place.
    """

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w3_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13: torch.Tensor | None = None
    onednn_w13: tuple[torch.Tensor, ...] | None = None
    onednn_w2: tuple[torch.Tensor, ...] | None = None

    @property
    def mxfp4(self) -> bool:
        return self.w1_scale is not None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def dense(self, name: str, expert: int | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Weight `name` (w1, w3, w2, or w13 when set) in dtype: expert `expert`'s [out, in], the experts listed in
        an int64 tensor [P] ([P, out, in]), or all experts' [E, out, in] when expert is None. Dense weights of one
        expert or all, already in dtype, are returned in place (a view); MXFP4 ones are expanded."""
        weight = getattr(self, name)
        if not self.mxfp4:
            return (weight if expert is None else weight[expert]).to(dtype)
        scale = getattr(self, f"{name}_scale")
        if expert is not None:
            weight, scale = weight[expert], scale[expert]
        return expand_mxfp4(weight, scale, dtype)


@dataclass(frozen=True)
class GLUActivation:
    """The experts' gated activation: SiLU(gate) * up, or SiTU-GLU with its two betas."""

    kind: str = SILU
    beta: float = 1.0
    linear_beta: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [..., I] -> [..., I] in gate's dtype (SiTU computed in fp32). Float32 on the CPU, eagerly and
        without gradients, one call of the C++ kernel kestrel_cpu::glu (kestrel.ops.cpu) where these torch ops are
        up to ~11 (elementwise, so batch-invariant as deterministic inference needs); traced graphs keep the torch
        ops, which inductor fuses."""
        if (gate.device.type == "cpu" and gate.dtype == up.dtype == torch.float32 and not torch.is_grad_enabled()
                and not torch.compiler.is_dynamo_compiling() and cpu.available()):
            rows = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
            return torch.ops.kestrel_cpu.glu(*rows, self.kind == SITU, self.beta, self.linear_beta).view(gate.shape)
        if self.kind == SILU:
            return F.silu(gate) * up
        g, u = gate.float(), up.float()
        act = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        return (act * self.linear_beta * torch.tanh(u / self.linear_beta)).to(gate.dtype)


def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                activation: GLUActivation, mxfp8_activations: bool = False) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(z[t]) -> [T, D] in z's dtype.

    z: [T, D] (fp32, fp16 or bf16); ids: [T, k] int64; weights: [T, k] fp32 routing weights. Each expert GEMM
    runs in z's dtype, its input rounded to MXFP8 first with mxfp8_activations (D and I multiples of 32); the
    weighted sum is accumulated in fp32. Differentiable with respect to z, weights and dense experts.

    Float32, bfloat16 or MXFP4 experts under float32 activations run on the CPU kernel (`moe_experts_native`) up
    to NATIVE_PAIRS_PER_EXPERT pairs per expert, eagerly (unless a gradient is wanted) as in a compiled step. Traced
    by torch.compile (the CPU's compiled decode step), the op takes no host sync: where the kernel does not take
    them, few pairs (`_by_pairs`) run `moe_experts_by_pairs` in the graph, and more run `moe_experts_grouped` as one
    opaque custom op. Eagerly the rest run `moe_experts_grouped`.
    """
    native = not mxfp8_activations and _native(z, ids.numel(), experts)
    if torch.compiler.is_dynamo_compiling():
        if native:
            return moe_experts_native(z, ids, weights, experts, activation)
        if not mxfp8_activations and _by_pairs(ids.numel(), experts):
            return moe_experts_by_pairs(z, ids, weights, experts, activation)
        return torch.ops.kestrel.moe_experts_grouped(z, ids, weights, *_tensors(experts), activation.kind,
                                                     activation.beta, activation.linear_beta, mxfp8_activations)
    if native and ids.numel() and not (torch.is_grad_enabled() and (z.requires_grad or weights.requires_grad)):
        return moe_experts_native(z, ids, weights, experts, activation)
    return moe_experts_grouped(z, ids, weights, experts, activation, mxfp8_activations)


def moe_experts_grouped(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                        activation: GLUActivation, mxfp8_activations: bool = False) -> torch.Tensor:
    """moe_experts with the pairs grouped by expert (module docstring): each expert's rows one product. Same shapes;
    differentiable with respect to z, weights and dense experts."""
    if ids.numel() == 0:
        return torch.zeros_like(z)
    quantize = fake_quantize_mxfp8 if mxfp8_activations else (lambda t: t)
    pairs = ids.flatten()
    order = pairs.argsort(stable=True)                       # [T * k]: the token-expert pairs, sorted by expert
    tokens = order // ids.shape[1]                           # each sorted pair's token
    counts = torch.bincount(pairs, minlength=experts.num_experts).tolist()
    x = quantize(z.index_select(0, tokens))                  # [P, D]: each expert's rows one contiguous slice
    if experts.w13 is not None or _onednn_copies(experts, "w13", x) is not None:
        gate, up = _per_expert(x, counts, experts, "w13").chunk(2, dim=-1)
    else:
        gate, up = (_per_expert(x, counts, experts, name) for name in ("w1", "w3"))
    y = _per_expert(quantize(activation(gate, up)), counts, experts, "w2")
    scaled = y.float() * weights.flatten().index_select(0, order).unsqueeze(-1)
    return torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add(0, tokens, scaled).to(z.dtype)


def _per_expert(x: torch.Tensor, counts: list[int], experts: ExpertWeights, name: str) -> torch.Tensor:
    """x [P, in], rows grouped by expert in expert order, counts[e] of expert e -> [P, out]: each group times its
    expert's weight `name` (w1, w3, w13 or w2; transposed), in x's dtype.

    Where the experts hold oneDNN-packed copies of the weight, each expert in use multiplies its group by its copy
    (module docstring). Otherwise dense weights already in x's dtype go to one grouped GEMM over all experts in
    place (torch._grouped_mm; an expert without rows is an empty group; with at most PADDED_ROWS rows per expert and
    idle experts worth at most EXPERT_VISIT_BYTES per expert in use, one padded torch.bmm) when more than a quarter
    of the experts are in use, unless a gradient is wanted (no CPU backward); otherwise each expert in use is
    multiplied in turn (a packed one expanded for its product only). On the CPU the grouped GEMM visits every
    expert, empty ones too: measured at one thread on 32 experts [96, 96], 33-36 us with 1 to 4 in use against 9-22
    us for a product each, even at 8."""
    groups = [(e, n) for e, n in enumerate(counts) if n]     # the experts in use and their number of pairs
    copies = _onednn_copies(experts, name, x)
    if copies is not None:
        parts = x.split([rows for _, rows in groups])
        return torch.cat([torch.ops.mkldnn._linear_pointwise(part, copies[e], None, "none", [], "")
                          for (e, _), part in zip(groups, parts)])
    weight = getattr(experts, name)
    if (not experts.mxfp4 and weight.dtype == x.dtype and 4 * len(groups) > len(counts)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        idle_bytes = (len(counts) - len(groups)) * weight[0].numel() * weight.element_size()
        if max(counts) <= PADDED_ROWS.get(x.dtype, 0) and idle_bytes <= len(groups) * EXPERT_VISIT_BYTES:
            return _padded_bmm(x, counts, weight)
        ends = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    parts = x.split([rows for _, rows in groups])
    return torch.cat([part @ experts.dense(name, e, x.dtype).t() for (e, _), part in zip(groups, parts)])


def _onednn_copies(experts: ExpertWeights, name: str, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The experts' oneDNN-packed copies of weight `name` (w13 or w2), where x's products take them: x in float32
    and no gradient wanted (the copies are for inference); else None."""
    copies = getattr(experts, f"onednn_{name}", None)
    if copies is None or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
        return None
    return copies


def _padded_bmm(x: torch.Tensor, counts: list[int], weight: torch.Tensor) -> torch.Tensor:
    """_per_expert's grouped product as one batched GEMM over all E experts in place: each group's rows copied into
    a zero-padded [E, max(counts), in] batch, multiplied by weight [E, out, in] (transposed), the rows read back
    -> [P, out]."""
    rows = max(counts)
    sizes = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), sizes)          # [P]
    rank = torch.arange(x.shape[0], device=x.device) - (sizes.cumsum(0) - sizes)[expert]      # row within its group
    slot = expert * rows + rank
    batch = x.new_zeros(len(counts) * rows, x.shape[1]).index_copy_(0, slot, x)
    return torch.bmm(batch.view(len(counts), rows, -1), weight.transpose(1, 2)).flatten(0, 1).index_select(0, slot)


def moe_experts_by_pairs(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                         activation: GLUActivation) -> torch.Tensor:
    """moe_experts (without MXFP8 activations) one token-expert pair at a time, with no host sync: each pair reads
    its expert's rows where they lie (a packed tile expanded where it is read), as products summed over the input
    dim, so that torch.compile fuses the read, the expansion and the reduction into one loop (no expert matrix is
    copied). Eagerly it is slow (it materializes each pair's weights); the compiled decode step runs it for few
    pairs. Same shapes as moe_experts."""
    num_tokens, top_k = ids.shape
    expert = ids.flatten()                                                         # [P]
    x = z.repeat_interleave(top_k, 0)                                              # [P, D]: pair p's token
    gate, up = ((experts.dense(name, expert, z.dtype) * x.unsqueeze(1)).sum(-1) for name in ("w1", "w3"))   # [P, I]
    h = activation(gate, up)
    y = (experts.dense("w2", expert, z.dtype) * h.unsqueeze(1)).sum(-1)                                    # [P, D]
    return (y.float().view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1).to(z.dtype)


def moe_experts_native(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                       activation: GLUActivation) -> torch.Tensor:
    """moe_experts for float32, bfloat16 or MXFP4 experts under float32 activations, by the CPU kernel
    kestrel_cpu::expert_mlp (kestrel.ops.cpu): the experts' three products as kestrel_cpu::expert_matvec computes
    them (each expert's rows read in place once for all of its pairs, MXFP4 ones decoded in registers, multiplied in
    float32), the activation between them and the weighted sum, in one call. Same shapes as moe_experts."""
    if not torch.compiler.is_dynamo_compiling() and not cpu.load():     # builds the kernels on first use
        raise RuntimeError("kestrel's CPU kernels could not be built here (the log says why).")
    fused, rows = experts.w13 is not None, z if z.stride(-1) == 1 else z.contiguous()
    return torch.ops.kestrel_cpu.expert_mlp(
        rows, ids, weights, experts.w13 if fused else experts.w1, None if fused else experts.w1_scale,
        None if fused else experts.w3, None if fused else experts.w3_scale, experts.w2, experts.w2_scale,
        activation.kind == SITU, activation.beta, activation.linear_beta)


def _native(z: torch.Tensor, pairs: int, experts: ExpertWeights) -> bool:
    """Whether the experts run on moe_experts_native (eagerly too, see moe_experts): contiguous float32, bfloat16 or
    MXFP4 experts and float32 activations on the CPU, at most NATIVE_PAIRS_PER_EXPERT (of their dtype) pairs per
    expert, the kernels available here."""
    used = (experts.w13, experts.w2) if experts.w13 is not None else (experts.w1, experts.w3, experts.w2)
    dtypes = (torch.uint8,) if experts.mxfp4 else (torch.float32, torch.bfloat16)
    scales = (experts.w1_scale, experts.w3_scale, experts.w2_scale) if experts.mxfp4 else ()
    return (z.device.type == "cpu" and z.dtype == torch.float32
            and all(w.dtype in dtypes and w.is_contiguous() for w in used)
            and all(s.is_contiguous() for s in scales)
            and pairs <= NATIVE_PAIRS_PER_EXPERT[experts.w2.dtype] * experts.num_experts and cpu.available())


def _by_pairs(pairs: int, experts: ExpertWeights) -> bool:
    """Whether a traced graph runs `pairs` token-expert pairs one by one (moe_experts_by_pairs, each reading its
    expert's rows) rather than the grouped op (each expert in use read once), where moe_experts_native does not take
    them: for packed experts, while there are fewer pairs than experts (each pair expands its expert's tiles); for
    dense ones, up to two pairs per expert.
    There by pairs reads up to twice the grouped op's bytes and still runs faster, the grouped op's per-expert MKL
    calls being far below the memory's bandwidth. Measured on the 437M K3's experts (64, top-4, 11 layers; compiled,
    2 threads, a decode of 32 sequences all running at once, 128 pairs): a float32 copy 214-231 tok/s by pairs
    against 123-132 grouped; a bfloat16 copy (by pairs) 248-277. Not re-measured beyond two pairs per expert
    (earlier measurements ran the float32 copy 13 sequences at a time: benchmarks/bench_llamacpp.py,
    MEM_FRACTION)."""
    if experts.mxfp4:
        return pairs < experts.num_experts
    return pairs <= 2 * experts.num_experts


def _tensors(experts: ExpertWeights) -> list[torch.Tensor | None]:
    """The experts' tensors in the custom op's argument order (not their oneDNN copies, which traced graphs never
    see: kestrel.layers.moe.RoutedExperts.weights)."""
    return [experts.w1, experts.w3, experts.w2, experts.w1_scale, experts.w3_scale, experts.w2_scale, experts.w13]


@torch.library.custom_op("kestrel::moe_experts_grouped", mutates_args=())
def _moe_experts_grouped(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w3: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor | None,
                         w3_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, w13: torch.Tensor | None,
                         kind: str, beta: float, linear_beta: float, mxfp8_activations: bool) -> torch.Tensor:
    """moe_experts_grouped as one op a compiled graph calls without tracing it (it reads its grouping on the host)."""
    experts = ExpertWeights(w1, w3, w2, w1_scale, w3_scale, w2_scale, w13)
    return moe_experts_grouped(z, ids, weights, experts, GLUActivation(kind, beta, linear_beta), mxfp8_activations)


@_moe_experts_grouped.register_fake
def _(z, ids, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, w13, kind, beta, linear_beta, mxfp8_activations):
    return torch.empty_like(z)
