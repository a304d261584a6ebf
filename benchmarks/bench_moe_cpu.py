"""Routed experts on the CPU: the old gather path against the in-place path, whole model forward steps, one run.

Two K3-architecture models in float32 with MXFP4 routed experts: a ~437M-parameter one (hidden 1024, 12 layers,
64 experts top-4 in a 512-d latent space, intermediate 256, random weights as `kestrel random-model` draws them) and
the bundled model (models/k3.1-tiny). Points: decode steps of 1, 16 and 32 sequences (each with 64 tokens of
context) and a prefill of PREFILL = 128 tokens. Each point times the model forward plus logits under four MoE paths:
- gather (old): kestrel's previous torch op, reimplemented below only to measure against: pairs padded to the
  busiest expert's count, the used experts' packed weights gathered (`weight[used]`) and dequantized with
  kestrel.quant.dequantize_mxfp4 on every call, one batched matmul per GEMM;
- in place, packed: kestrel.ops.torch.moe.moe_experts on the packed experts (the default);
- in place, bf16 copy / fp32 copy: the same op on a dense copy held by RoutedExperts.hold_dense_copy.
The paths run alternately, ROUNDS rounds of one step each after a warm-up; the table keeps each path's fastest step.
A second table per model runs it in bfloat16 (weights, activations, KV cache; the experts' bf16 copy used in place) and
compares at the same points torch._grouped_mm (a loop over the experts on the CPU) with the op's choice: one
zero-padded torch.bmm over all experts up to PADDED_ROWS rows per expert, while the idle experts it reads cost less
than the grouped GEMM's visits (EXPERT_VISIT_BYTES). A last table times the two forms of one grouped product of
larger bf16 experts and shows which the op takes.
"max |dlogit|" is the largest logit difference of the in-place packed path from the gather path at the prefill
point; the time spent inside RoutedExperts.forward is given for each fastest step.
Writes the section "moe-cpu" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_moe_cpu.py
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.config import parse_config  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402
from kestrel.layers.batch import ForwardBatch  # noqa: E402
from kestrel.layers.cache import HybridCache  # noqa: E402
from kestrel.layers.moe import RoutedExperts, hold_dense_experts  # noqa: E402
from kestrel.models.checkpoint import build_model, load_model  # noqa: E402
from kestrel.models.init import init_weights  # noqa: E402
from kestrel.models.kimi import KimiForCausalLM  # noqa: E402
from kestrel.models.presets import tiny_config  # noqa: E402
from kestrel.ops.torch import moe as torch_moe  # noqa: E402
from kestrel.quant import dequantize_mxfp4  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_moe_cpu.py"
ROUNDS = 3
CONTEXT = 64
PREFILL = 128
PAGE = 16
POINTS = [("decode, 1 sequence", 1, 1), ("decode, 16 sequences", 16, 1), ("decode, 32 sequences", 32, 1),
          (f"prefill, {PREFILL} tokens", 1, PREFILL)]
"""(label, sequences, new tokens per sequence)."""


def k3_437m() -> dict:
    """config.json of a K3-architecture model of 437M parameters (k3-tiny's schema at hidden 1024)."""
    raw = tiny_config("k3-tiny")
    text = raw["text_config"]
    text.update(vocab_size=32000, hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                num_experts=64, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=256,
                routed_expert_hidden_size=512, intermediate_size=2816, attn_res_block_size=4)
    text["linear_attn_config"].update(num_heads=8, head_dim=128, kda_layers=[i for i in range(1, 13) if i % 4],
                                      full_attn_layers=[4, 8, 12])
    return raw


def gather_moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: torch_moe.ExpertWeights, activation: torch_moe.GLUActivation,
                       mxfp8_activations: bool = False) -> torch.Tensor:
    """The old torch op, with the op's signature (MXFP4 experts only; MXFP8 activations not modelled):
    z [T, D], ids/weights [T, k] -> [T, D]."""
    top_k, flat = ids.shape[1], ids.flatten()
    order = flat.argsort(stable=True)
    tokens = order // top_k
    used, group = flat[order].unique_consecutive(return_inverse=True)
    counts = torch.bincount(group, minlength=len(used))
    row = torch.arange(len(order)) - (counts.cumsum(0) - counts)[group]
    width = int(counts.max())
    slot = group * width + row
    x = z.new_zeros(len(counts) * width, z.shape[1]).index_copy(0, slot, z.index_select(0, tokens))
    x = x.view(len(counts), width, -1)
    w1, w3, w2 = (dequantize_mxfp4(getattr(experts, n)[used], getattr(experts, f"{n}_scale")[used], z.dtype)
                  for n in ("w1", "w3", "w2"))
    h = activation(x @ w1.transpose(1, 2), x @ w3.transpose(1, 2))
    y = (h @ w2.transpose(1, 2)).flatten(0, 1).index_select(0, slot).float() * weights.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(z, dtype=torch.float32).index_add(0, tokens, y).to(z.dtype)


@dataclass(frozen=True)
class MoePath:
    """One way of running the routed experts: a name and a context that switches the model to it."""

    name: str
    switch: Callable[[KimiForCausalLM], AbstractContextManager[None]]


@contextmanager
def gather(model: KimiForCausalLM) -> Iterator[None]:
    """The switch to the old gather path (for every model: the torch op is swapped)."""
    original = torch_moe.moe_experts
    torch_moe.moe_experts = gather_moe_experts
    try:
        yield
    finally:
        torch_moe.moe_experts = original


def dense_copy(dtype: torch.dtype | None) -> Callable[[KimiForCausalLM], AbstractContextManager[None]]:
    """The switch to the in-place op on a held dense copy in dtype (None: on the packed experts)."""
    @contextmanager
    def switch(model: KimiForCausalLM) -> Iterator[None]:
        hold_dense_experts(model, dtype)
        try:
            yield
        finally:
            hold_dense_experts(model, None)
    return switch


PATHS = [MoePath("gather (old)", gather), MoePath("in place, packed", dense_copy(None)),
         MoePath("in place, bf16 copy", dense_copy(torch.bfloat16)),
         MoePath("in place, fp32 copy", dense_copy(torch.float32))]


@dataclass
class Sequences:
    """`count` sequences, each prefilled with CONTEXT random tokens, in their own cache slots and pages."""

    model: KimiForCausalLM
    count: int

    def __post_init__(self) -> None:
        pages = -(-max(CONTEXT + 1, PREFILL) // PAGE)
        self.cache = HybridCache.allocate(self.model.config, num_slots=self.count, num_pages=self.count * pages,
                                          page_size=PAGE, dtype=self.model.lm_head.weight.dtype)
        self.table = torch.arange(self.count * pages).view(self.count, pages)
        self.generator = torch.Generator().manual_seed(0)
        prompt = ForwardBatch.build([CONTEXT] * self.count, None, list(range(self.count)), self.table, PAGE)
        self.model(self.random_ids(self.count * CONTEXT), prompt, self.cache)

    def random_ids(self, n: int) -> torch.Tensor:
        return torch.randint(self.model.config.vocab_size, (n,), generator=self.generator)

    def step(self, sequences: int, new_tokens: int) -> Callable[[], torch.Tensor]:
        """A forward step returning the logits of each sequence's last new token: one token for each of the first
        `sequences` sequences (rerunning it rewrites the same position), or, with new_tokens > 1, a fresh prefill of
        sequence 0."""
        prefix = CONTEXT if new_tokens == 1 else 0
        batch = ForwardBatch.build([new_tokens] * sequences, [prefix] * sequences, list(range(sequences)),
                                   self.table[:sequences], PAGE)
        ids, last = self.random_ids(sequences * new_tokens), batch.cu_seqlens[1:] - 1
        return lambda: self.model.compute_logits(self.model(ids, batch, self.cache)[last])


def expert_bytes(model: KimiForCausalLM) -> int:
    """Bytes of the packed routed experts (codes and scales)."""
    return sum(b.nbytes for m in model.modules() if isinstance(m, RoutedExperts)
               for name, b in m.named_buffers() if name.endswith(("_packed", "_scale")))


@contextmanager
def timing_experts() -> Iterator[list[float]]:
    """Yields [seconds spent in RoutedExperts.forward], updated while the context lasts."""
    spent = [0.0]
    original = RoutedExperts.forward

    def timed(self: RoutedExperts, *args: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = original(self, *args)
        spent[0] += time.perf_counter() - start
        return out

    RoutedExperts.forward = timed
    try:
        yield spent
    finally:
        RoutedExperts.forward = original


def measure(model: KimiForCausalLM) -> tuple[list[list[object]], float]:
    """Rows (point, path, tokens/s, ratio to gather, ms per step in the routed experts) and the max logit difference
    of the packed path from the gather path at the prefill point."""
    rows, difference = [], 0.0
    pool = Sequences(model, max(sequences for _, sequences, _ in POINTS))
    for label, sequences, new_tokens in POINTS:
        step = pool.step(sequences, new_tokens)
        best = {p.name: (float("inf"), 0.0) for p in PATHS}          # (step seconds, seconds in the experts)
        logits = {}
        for round_ in range(ROUNDS):
            for path in PATHS:
                with path.switch(model):
                    if round_ == 0:
                        logits[path.name] = step()                     # warm-up, and the logits compared
                    with timing_experts() as spent:
                        start = time.perf_counter()
                        step()
                        best[path.name] = min(best[path.name], (time.perf_counter() - start, spent[0]))
        if new_tokens > 1:
            difference = float((logits["in place, packed"] - logits["gather (old)"]).abs().max())
        base = best["gather (old)"][0]
        for name, (seconds, experts) in best.items():
            rows.append([label, name, f"{sequences * new_tokens / seconds:,.1f}", f"{base / seconds:.2f}x",
                         f"{experts * 1e3:,.1f}"])
            print(rows[-1], flush=True)
    return rows, difference


@contextmanager
def padded_rows(rows: dict[torch.dtype, int]) -> Iterator[None]:
    """The routed experts' op with PADDED_ROWS = rows while the context lasts ({}: torch._grouped_mm always)."""
    original = torch_moe.PADDED_ROWS
    torch_moe.PADDED_ROWS = rows
    try:
        yield
    finally:
        torch_moe.PADDED_ROWS = original


GROUPED_FORMS = {"grouped GEMM (torch._grouped_mm)": {}, "the op's choice (padded bmm where it pays)":
                 torch_moe.PADDED_ROWS}
CHOICE_SHAPES = [(32, 192, 96, 2), (64, 512, 512, 4), (64, 1024, 512, 4), (128, 1024, 512, 8), (256, 512, 256, 8)]
"""(experts, out, in, top-k) of the bf16 experts in the op-level table: the bundled model's gate/up product, the
437M's, and larger experts (Kimi-Linear-48B's are 256 x [2048, 2304], top-8)."""
CHOICE_TOKENS = (5, 8, 16, 32)
CHOICE_CALLS = 10


def measure_bf16(model: KimiForCausalLM) -> list[list[object]]:
    """The model in bfloat16 with its experts' bf16 copy: rows (point, grouped form, tokens/s, ratio to
    torch._grouped_mm, ms per step in the routed experts)."""
    rows = []
    pool = Sequences(model, max(sequences for _, sequences, _ in POINTS))
    for label, sequences, new_tokens in POINTS:
        step = pool.step(sequences, new_tokens)
        best = {name: (float("inf"), 0.0) for name in GROUPED_FORMS}
        for round_ in range(ROUNDS + 1):                               # round 0: warm-up
            for name, form in GROUPED_FORMS.items():
                with padded_rows(form), timing_experts() as spent:
                    start = time.perf_counter()
                    step()
                    if round_:
                        best[name] = min(best[name], (time.perf_counter() - start, spent[0]))
        base = best["grouped GEMM (torch._grouped_mm)"][0]
        for name, (seconds, experts) in best.items():
            rows.append([label, name, f"{sequences * new_tokens / seconds:,.1f}", f"{base / seconds:.2f}x",
                         f"{experts * 1e3:,.1f}"])
            print(rows[-1], flush=True)
    return rows


def measure_choice() -> list[list[object]]:
    """One grouped product (the op's _per_expert) of bf16 experts at few rows per expert, random routing:
    torch._grouped_mm and the padded bmm, each the best of CHOICE_CALLS calls (alternating), and the form the op
    takes (grouped, padded, or a product per expert where at most a quarter of the experts are in use)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for experts, out, inp, top_k in CHOICE_SHAPES:
        weight = (torch.randn(experts, out, inp, generator=gen) * 0.05).to(torch.bfloat16)
        for tokens in CHOICE_TOKENS:
            ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
            counts = torch.bincount(ids, minlength=experts).tolist()
            x = torch.randn(len(ids), inp, generator=gen).to(torch.bfloat16)
            ends = torch.tensor(counts).cumsum(0).to(torch.int32)
            forms = {"grouped": lambda: torch._grouped_mm(x, weight.transpose(1, 2), offs=ends),
                     "padded": lambda: torch_moe._padded_bmm(x, counts, weight)}
            best = {name: float("inf") for name in forms}
            for _ in range(CHOICE_CALLS + 1):                         # the first call warms up
                for name, form in forms.items():
                    start = time.perf_counter()
                    form()
                    best[name] = min(best[name], time.perf_counter() - start)
            used = sum(1 for c in counts if c)
            taken = []
            padded_bmm = torch_moe._padded_bmm
            torch_moe._padded_bmm = lambda *args: taken.append("padded") or padded_bmm(*args)
            try:
                torch_moe._per_expert(x, counts, torch_moe.ExpertWeights(weight, weight, weight), "w1")
            finally:
                torch_moe._padded_bmm = padded_bmm
            form = taken[0] if taken else "grouped" if 4 * used > experts else "per expert"
            idle = (experts - used) * out * inp * 2 / used
            rows.append([f"{experts} x [{out}, {inp}] top-{top_k}", tokens, used, max(counts),
                         f"{idle / 1024:,.0f}", f"{best['grouped'] * 1e6:,.0f}", f"{best['padded'] * 1e6:,.0f}",
                         form])
            print(rows[-1], flush=True)
    return rows


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    models = {      # title -> the model in a dtype
        "K3 437M (hidden 1024, 12 layers, 64 experts top-4, latent 512, intermediate 256)":
            lambda dtype: init_weights(build_model(parse_config(k3_437m()), dtype), seed=0).eval(),
        "bundled k3.1-tiny (hidden 192, 6 layers, 32 experts top-2, latent 96, intermediate 96)":
            lambda dtype: load_model(BUNDLED_MODEL, dtype),
    }
    header = ["point", "MoE path", "tok/s", "vs gather", "ms / step in routed experts"]
    sections = []
    for title, make in models.items():
        model = make(torch.float32)
        packed = expert_bytes(model)
        copies = {dtype: hold_dense_experts(model, dtype) for dtype in (torch.bfloat16, torch.float32)}
        hold_dense_experts(model, None)
        print(title, flush=True)
        rows, difference = measure(model)
        model = make(torch.bfloat16)
        hold_dense_experts(model, torch.bfloat16)
        bf16_rows = measure_bf16(model)
        sections += [
            f"### {title}",
            f"Routed experts in memory: packed {packed / 2**20:,.0f} MiB; a bf16 copy adds "
            f"{copies[torch.bfloat16] / 2**20:,.0f} MiB, an fp32 copy {copies[torch.float32] / 2**20:,.0f} MiB. "
            f"max |dlogit| (in place, packed vs gather, prefill): {difference:.1e}.",
            markdown_table(header, rows),
            "In bfloat16, the experts' bf16 copy used in place, the op's two grouped forms:",
            markdown_table(["point", "grouped form", "tok/s", "vs torch._grouped_mm", "ms / step in routed experts"],
                           bf16_rows),
        ]
    choice_rows = measure_choice()
    sections += [
        "### The op's choice at larger experts",
        "One grouped product of bf16 experts (the op's `_per_expert`: the rows of T tokens routed top-k at random, "
        f"grouped by expert): `torch._grouped_mm` and the padded `torch.bmm`, each the best of {CHOICE_CALLS} calls, "
        "and the form the op takes: the padded bmm up to `PADDED_ROWS` rows per expert while the idle experts' "
        f"bytes stay within `EXPERT_VISIT_BYTES` ({torch_moe.EXPERT_VISIT_BYTES // 1024} KiB) per expert in use, "
        "since it reads every expert; else the grouped GEMM (or a product per expert where at most a quarter of "
        "the experts are in use).",
        markdown_table(["experts", "tokens", "experts in use", "most rows per expert",
                        "idle KiB per expert in use", "grouped us", "padded us", "the op takes"], choice_rows),
    ]
    load_after = os.getloadavg()[0]
    body = "\n\n".join([
        "## Routed experts on the CPU (moe-cpu)",
        "Whole-model forward steps (forward plus logits) in float32 with MXFP4 routed experts, under four MoE paths: "
        "the old gather path (used experts' weights gathered and dequantized every call, padded batched matmuls; "
        "reimplemented in the script), the in-place op on the packed experts (kestrel's default), and the in-place "
        "op on a dense bf16 or fp32 copy (`RoutedExperts.hold_dense_copy`). Decode points: one new token per "
        f"sequence after {CONTEXT} tokens of context; prefill: one sequence of {PREFILL} tokens. The paths ran "
        f"alternately, {ROUNDS} rounds of one step each after a warm-up; each keeps its fastest step, and \"ms / "
        "step in routed experts\" is the time that step spent inside `RoutedExperts.forward`. Then the same model "
        "in bfloat16 (weights, activations and KV cache; the experts' bf16 copy used in place) under the op's two "
        "grouped forms, alternating the same way: `torch._grouped_mm` (on the CPU a loop over the experts) and the "
        "op's choice, one zero-padded `torch.bmm` over all experts up to `PADDED_ROWS` (16 in bfloat16) rows per "
        "expert while the idle experts' bytes stay within `EXPERT_VISIT_BYTES` per expert in use (the last table "
        "measures that choice at larger experts).",
        f"{machine()}; load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores "
        "shared with other work, so compare the ratios, not the absolute rates.",
        *sections,
        f"Rerun: `{COMMAND}`",
    ])
    write_section("moe-cpu", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
