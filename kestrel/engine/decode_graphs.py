"""Decode steps replayed from CUDA graphs, so that one step is one host-to-device copy and one graph launch.

A decode step (one new token for each of n sequences) has shapes that depend only on n and on how many pages the
longest sequence spans. DecodeGraphs pads n up to the next captured batch size and the page-table width up to the
next power of two (so the indexer and attention work grows with the context, not with the context length), and
keeps one graph per (batch size, width), captured the first time the pair is needed. Every graph reads its inputs
from one static buffer (token ids, positions, state slots) and the device page table (rows by state slot), and
writes its logits into one static output, so graphs share everything but their recorded kernels (their
intermediates share one memory pool).

Padding rows are fresh sequences (position 0) in a scratch state slot, whose page-table row is all a scratch page;
the pools never hand either out, so padding computes values nobody reads and writes where nobody else reads.
Capturing runs the step once first (the warm-up that compiles the Triton kernels) with every row a padding row, so
that it never advances a real sequence.

Capture needs every op of the step free of host synchronisation and of shapes read from tensor values. The Triton
ops are (tests/engine/test_decode_graphs.py checks the whole step under the interpreter); the torch references
are not, so graphs are used only on CUDA with every decode op on its Triton kernel. Elsewhere the same static step
can run eagerly in place of a replay, which is how the tests check padding, buckets and capture on the CPU.

On the CPU the static step can instead be compiled (`--enable-torch-compile`): torch.compile traces each
(batch size, width) step into one graph, and inductor's C++ backend fuses its elementwise work into loops, so a
step is one call instead of ~250 small ops per layer. The torch decode ops trace without host syncs (the routed
experts run per pair in the graph, or grouped as one custom op: kestrel.ops.torch.moe). Compiling happens the
first time a pair is needed (tens of seconds on two cores); inductor caches the compiled code on disk
(TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_$USER by default), so a restarted server recompiles in seconds. A
step that fails to compile logs why and runs eagerly from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch._dynamo

from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..models.kimi import KimiForCausalLM
from ..ops import backend
from .cache.page_table import PageTable

log = logging.getLogger("kestrel")

DECODE_OPS = ("kda_decode", "paged_mla_decode", "paged_indexer_scores", "moe_experts", "attn_res_mix_norm")
"""The dispatched ops a decode step runs."""


def graphs_supported(device: torch.device) -> bool:
    """Whether decode steps on `device` can be captured: CUDA, with every decode op on its Triton kernel."""
    return device.type == "cuda" and all(backend.backend_for(op, device) == backend.TRITON for op in DECODE_OPS)


def batch_sizes(max_batch_size: int) -> list[int]:
    """The captured batch sizes, SGLang's set: 1, 2, 4, then every multiple of 8, and max_batch_size itself."""
    return sorted({*(b for b in (1, 2, 4) if b < max_batch_size), *range(8, max_batch_size, 8), max_batch_size})


class DecodeGraphs:
    """Decode steps of up to max_batch_size sequences, their pages in page_table, as graph replays.

    scratch_slot: a state slot of `cache` that nothing else uses, its page-table row all a page nothing else uses.
    capture: record CUDA graphs (default: on CUDA devices); otherwise each replay runs the static step eagerly, or
    compiled by torch.compile with the backend `compile` names ("inductor": the CPU's fast path; the tests also
    use "aot_eager", which traces the same graph without generating code).
    """

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable, max_batch_size: int,
                 scratch_slot: int, capture: bool | None = None, compile: str | None = None):
        self.model, self.cache, self.page_table = model, cache, page_table
        self.device = model.device
        self.sizes = batch_sizes(max_batch_size)
        self.scratch_slot = scratch_slot
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.forward = self._forward
        if compile:
            # One graph per (batch size, width); the model's weights are never replaced while it serves, so their
            # guards are skipped (they cost ~0.6 ms per call on the bundled model). Inductor writes the code that
            # calls its kernels in C++ too (cpp_wrapper): a Python wrapper spends ~0.3 ms per step on the bundled
            # model allocating and checking buffers, for twice the compile time.
            widths = page_table.max_pages.bit_length() + 1
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, len(self.sizes) * widths)
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            if compile == "inductor":
                options["cpp_wrapper"] = True
            self.forward = torch.compile(self._forward, backend=compile, dynamic=False, fullgraph=True,
                                         options=options)
        self.inputs = torch.zeros(3, max_batch_size, dtype=torch.long, device=self.device)
        self.logits = torch.empty(max_batch_size, model.config.vocab_size, device=self.device)
        self.steps: dict[tuple[int, int], Callable[[], object]] = {}
        """The replay of each captured (batch size, width): reads self.inputs, writes self.logits."""
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, longest: int) -> bool:
        """Whether a step of num_seqs sequences, the longest spanning `longest` pages, has a graph size."""
        return 1 <= num_seqs <= self.max_batch_size and longest <= self.page_table.max_pages

    def run(self, token_ids: list[int], prefix_lens: list[int], slots: list[int], longest: int) -> torch.Tensor:
        """Logits [n, vocab] fp32 of one decode step: sequence i adds token_ids[i] at position prefix_lens[i], with
        its state in slots[i] and its pages in that slot's page-table row; the longest spans `longest` pages. The
        result is overwritten by the next run."""
        n = len(token_ids)
        size = next(b for b in self.sizes if b >= n)
        width = min(1 << (longest - 1).bit_length(), self.page_table.max_pages)
        replay = self.steps.get((size, width)) or self._capture(size, width)
        pad = size - n
        values = [*token_ids, *[0] * pad, *prefix_lens, *[0] * pad, *slots, *[self.scratch_slot] * pad]
        self.inputs[:, :size].copy_(torch.tensor(values).view(3, size), non_blocking=True)
        replay()
        return self.logits[:n]

    def _capture(self, size: int, width: int) -> Callable[[], object]:
        ids, prefix, slots = self.inputs[:, :size]
        ids.zero_()
        prefix.zero_()
        slots.fill_(self.scratch_slot)

        def step() -> None:
            self.logits[:size].copy_(self.forward(ids, prefix, slots, width))

        self._forward(ids, prefix, slots, width)             # warm-up: compiles kernels, initialises libraries
        if self.forward is not self._forward:
            try:
                step()
            except Exception as e:      # inductor failed (no C++ compiler, an op it cannot trace): run eagerly
                log.warning("decode: torch.compile failed, decoding eagerly from now on: %s", e)
                self.forward = self._forward
        if not self.capture:
            replay = step
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step()
            replay = graph.replay
        self.steps[(size, width)] = replay
        return replay

    def _forward(self, ids: torch.Tensor, prefix: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Logits [size, vocab] of the decode step of ids, prefix lengths and slots [size]."""
        table = self.page_table.gather(slots, width)
        batch = ForwardBatch.for_decode(prefix, slots, table, self.cache.page_size)
        return self.model.compute_logits(self.model(ids, batch, self.cache))
