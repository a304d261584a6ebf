"""Runs one scheduled step: one flat batch of every chunk's tokens through the model, logits where needed."""

from __future__ import annotations

import torch

from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..models.kimi import KimiForCausalLM
from .cache.device_ops import DeviceOps, apply_ops
from .cache.page_table import PageTable
from .decode_graphs import DecodeGraphs
from .scheduler import ScheduledChunk


class ModelRunner:
    """Builds the ForwardBatch (token ids, prefix lengths, state slots, their page-table rows) and runs the model.

    Each step first applies the cache copies journaled in ops since the last step, and the page table's changes.
    With decode_graphs, steps of one token per sequence that fit a graph size replay a captured graph instead.
    """

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable, ops: DeviceOps,
                 decode_graphs: DecodeGraphs | None = None):
        self.model = model
        self.cache = cache
        self.page_table = page_table
        self.ops = ops
        self.device = model.lm_head.weight.device
        self.decode_graphs = decode_graphs

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], all_rows: set[int]) -> list[torch.Tensor | None]:
        """Logits (fp32) per chunk: [length, vocab] for chunks in all_rows (their indices; prompt logprobs need
        every position), [1, vocab] at the last token for chunks that sample, None for the rest."""
        apply_ops(self.cache, self.ops.take())
        self.page_table.flush()
        graphs, width = self.decode_graphs, max(len(c.seq.pages) for c in chunks)
        if (graphs is not None and not all_rows and all(c.length == 1 for c in chunks)
                and graphs.fits(len(chunks), width)):
            logits = graphs.run([c.seq.tokens(c.start, c.start + 1)[0] for c in chunks], [c.start for c in chunks],
                                [c.seq.slot for c in chunks], width)
            return [logits[i:i + 1] if c.samples else None for i, c in enumerate(chunks)]
        slots = torch.tensor([c.seq.slot for c in chunks], device=self.device)
        batch = ForwardBatch.build([c.length for c in chunks], [c.start for c in chunks], slots,
                                   self.page_table.gather(slots, width), self.cache.page_size, self.device)
        ids = torch.tensor([t for c in chunks for t in c.seq.tokens(c.start, c.start + c.length)],
                           device=self.device)
        hidden = self.model(ids, batch, self.cache)
        ends = batch.cu_seqlens[1:].tolist()
        wanted = [i for i, c in enumerate(chunks) if i in all_rows or c.samples]
        out: list[torch.Tensor | None] = [None] * len(chunks)
        if not wanted:
            return out
        rows = [torch.arange(ends[i] - chunks[i].length if i in all_rows else ends[i] - 1, ends[i],
                             device=self.device) for i in wanted]
        logits = self.model.compute_logits(hidden[torch.cat(rows)]).split([len(r) for r in rows])
        for i, chunk_logits in zip(wanted, logits):
            out[i] = chunk_logits
        return out
