"""Decode steps replayed from CUDA graphs, so that one step is one host-to-device copy and one graph launch.

A decode step (one new token for each of n sequences) has shapes that depend only on n and on how many pages the
longest sequence spans. DecodeGraphs pads n up to the next captured batch size and the page-table width up to the
next power of two (so the indexer and attention work grows with the context, not with the context length), and
keeps one graph per (batch size, width), captured the first time the pair is needed. Every graph reads its inputs
from one static buffer (token ids, positions, state slots, page table) and writes its logits into one static
output, so graphs share everything but their recorded kernels (their intermediates share one memory pool).

Padding rows are fresh sequences (position 0) in a scratch state slot and a scratch page that the pools never hand
out: they compute values nobody reads and write where nobody else reads. Capturing runs the step once first (the
warm-up that compiles the Triton kernels) with every row a padding row, so that it never advances a real sequence.

Capture needs every op of the step free of host synchronisation and of shapes read from tensor values. The Triton
ops are (tests/engine/test_decode_graphs.py checks the whole step under the interpreter); the torch references
are not, so graphs are used only on CUDA with every decode op on its Triton kernel. Elsewhere the same static step
can run eagerly in place of a replay, which is how the tests check padding, buckets and capture on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..models.kimi import KimiForCausalLM
from ..ops import backend

DECODE_OPS = ("kda_decode", "paged_mla_decode", "paged_indexer_scores", "moe_experts", "attn_res_mix_norm")
"""The dispatched ops a decode step runs."""


def graphs_supported(device: torch.device) -> bool:
    """Whether decode steps on `device` can be captured: CUDA, with every decode op on its Triton kernel."""
    return device.type == "cuda" and all(backend.backend_for(op, device) == backend.TRITON for op in DECODE_OPS)


def batch_sizes(max_batch_size: int) -> list[int]:
    """The captured batch sizes, SGLang's set: 1, 2, 4, then every multiple of 8, and max_batch_size itself."""
    return sorted({*(b for b in (1, 2, 4) if b < max_batch_size), *range(8, max_batch_size, 8), max_batch_size})


class DecodeGraphs:
    """Decode steps of up to max_batch_size sequences spanning up to max_pages pages each, as graph replays.

    scratch_slot and scratch_page: a state slot and a KV page of `cache` that nothing else uses (padding rows').
    capture: record CUDA graphs (default: on CUDA devices); otherwise each replay runs the static step eagerly.
    """

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, max_batch_size: int, max_pages: int,
                 scratch_slot: int, scratch_page: int, capture: bool | None = None):
        self.model, self.cache = model, cache
        self.device = model.lm_head.weight.device
        self.sizes = batch_sizes(max_batch_size)
        self.max_pages = max_pages
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.inputs = torch.zeros(max_batch_size * (3 + max_pages), dtype=torch.long, device=self.device)
        self.logits = torch.empty(max_batch_size, model.config.vocab_size, device=self.device)
        self.steps: dict[tuple[int, int], Callable[[], object]] = {}
        """The replay of each captured (batch size, width): reads self.inputs, writes self.logits."""
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, longest_table: int) -> bool:
        """Whether a step of num_seqs sequences, the longest spanning longest_table pages, has a graph size."""
        return 1 <= num_seqs <= self.max_batch_size and longest_table <= self.max_pages

    def run(self, token_ids: list[int], prefix_lens: list[int], slots: list[int],
            page_rows: list[list[int]]) -> torch.Tensor:
        """Logits [n, vocab] fp32 of one decode step: sequence i adds token_ids[i] at position prefix_lens[i],
        with its state in slots[i] and its KV in pages page_rows[i]. The result is overwritten by the next run."""
        n = len(token_ids)
        size = next(b for b in self.sizes if b >= n)
        width = min(1 << (max(map(len, page_rows)) - 1).bit_length(), self.max_pages)
        replay = self.steps.get((size, width)) or self._capture(size, width)
        pad = size - n
        table = [page for row in page_rows for page in row + [self.scratch_page] * (width - len(row))]
        values = [*token_ids, *[0] * pad, *prefix_lens, *[0] * pad, *slots, *[self.scratch_slot] * pad, *table,
                  *[self.scratch_page] * (pad * width)]
        self.inputs[:len(values)].copy_(torch.tensor(values), non_blocking=True)
        replay()
        return self.logits[:n]

    def _views(self, size: int, width: int) -> tuple[torch.Tensor, ...]:
        """The static inputs of graph (size, width): token ids, prefix lengths, slots [size] and the page table
        [size, width], laid out one after another at the start of self.inputs (as run() writes them)."""
        ids, prefix, slots = self.inputs[:3 * size].view(3, size)
        return ids, prefix, slots, self.inputs[3 * size:size * (3 + width)].view(size, width)

    def _capture(self, size: int, width: int) -> Callable[[], object]:
        ids, prefix, slots, table = self._views(size, width)
        ids.zero_()
        prefix.zero_()
        slots.fill_(self.scratch_slot)
        table.fill_(self.scratch_page)

        def step() -> None:
            batch = ForwardBatch.for_decode(prefix, slots, table, self.cache.page_size)
            self.logits[:size].copy_(self.model.compute_logits(self.model(ids, batch, self.cache)))

        step()                                               # warm-up: compiles kernels, initialises libraries
        if not self.capture:
            replay = step
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step()
            replay = graph.replay
        self.steps[(size, width)] = replay
        return replay
