"""Runs one scheduled step: one flat batch of every chunk's tokens through the model, logits where needed.

With several ranks, rank 0's runner turns the scheduled chunks into a `Step` (plain data: the cache copies and
page-table changes since the last step, then the batch) and sends it to the other ranks, whose runners `execute`
the same Step on their model shards; every rank ends with the full logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..models.kimi import KimiForCausalLM
from .cache.device_ops import DeviceOps, Op, apply_ops
from .cache.page_table import PageTable
from .decode_graphs import DecodeGraphs
from .scheduler import ScheduledChunk


@dataclass(frozen=True)
class Step:
    """One step as every rank runs it."""

    ops: list[Op]              # cache copies journaled since the last step (DeviceOps.take)
    table: list[int]           # page-table changes since the last step (PageTable.take)
    token_ids: list[int]       # every chunk's new tokens, chunk after chunk
    starts: list[int]          # per chunk: tokens of its sequence already in the caches
    lengths: list[int]         # per chunk: new tokens
    slots: list[int]           # per chunk: its sequence's state slot (and page-table row)
    width: int                 # page-table columns the batch reads
    all_rows: list[int]        # chunks that need logits at every position
    samples: list[int]         # chunks that need logits at their last position
    verify: bool = False       # a speculative verification: KDA keeps every token's state (ForwardBatch)


class RankFailure(RuntimeError):
    """A rank of a distributed instance failed; the instance cannot run any further step."""


class Peers(Protocol):
    """Rank 0's handle on the other ranks (engine.ranks.Ranks)."""

    def send(self, step: Step) -> None: ...

    def explain(self, error: BaseException) -> str: ...


class ModelRunner:
    """Builds the ForwardBatch (token ids, prefix lengths, state slots, their page-table rows) and runs the model.

    Each step first applies the cache copies journaled in ops since the last step, and the page table's changes.
    With decode_graphs, steps of one token per sequence that fit a graph size replay a captured graph instead.
    With peers (rank 0 of several), each step is sent to the other ranks before it runs here; a failure then
    stops the instance: this and every later run raise RankFailure.
    """

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable, ops: DeviceOps,
                 decode_graphs: DecodeGraphs | None = None, peers: Peers | None = None):
        self.model = model
        self.cache = cache
        self.page_table = page_table
        self.ops = ops
        self.device = model.lm_head.weight.device
        self.decode_graphs = decode_graphs
        self.peers = peers
        self.failure: str | None = None
        self.hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], all_rows: set[int], verify: bool = False) -> list[torch.Tensor | None]:
        """Logits (fp32) per chunk: [length, vocab] for chunks in all_rows (their indices; prompt logprobs need
        every position), [1, vocab] at the last token for chunks that sample, None for the rest. verify: the
        chunks are speculative verifications (see Step)."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        step = Step(self.ops.take(), self.page_table.take(),
                    [t for c in chunks for t in c.token_ids()],
                    [c.start for c in chunks], [c.length for c in chunks], [c.seq.slot for c in chunks],
                    max(len(c.seq.pages) for c in chunks), sorted(all_rows),
                    [i for i, c in enumerate(chunks) if c.samples], verify)
        graphs = self.decode_graphs
        if (graphs is not None and not all_rows and all(c.length == 1 for c in chunks)
                and graphs.fits(len(chunks), step.width)):
            self._apply_changes(step)
            logits = graphs.run(step.token_ids, step.starts, step.slots, step.width)
            return [logits[i:i + 1] if c.samples else None for i, c in enumerate(chunks)]
        if self.peers is None:
            return self.execute(step)
        try:
            self.peers.send(step)
            return self.execute(step)
        except Exception as e:     # the ranks may now disagree about the caches: no step can run any more
            self.failure = f"the distributed instance stopped: {self.peers.explain(e)}"
            raise RankFailure(self.failure) from e

    @torch.inference_mode()
    def execute(self, step: Step) -> list[torch.Tensor | None]:
        """Run step on this rank's model (see run for what comes back)."""
        self._apply_changes(step)
        slots = torch.tensor(step.slots, device=self.device)
        batch = ForwardBatch.build(step.lengths, step.starts, slots, self.page_table.gather(slots, step.width),
                                   self.cache.page_size, self.device, keep_token_states=step.verify)
        hidden = self.model(torch.tensor(step.token_ids, device=self.device), batch, self.cache)
        self.hidden = hidden                  # [T, D]: what a model drafter reads after the step
        ends = batch.cu_seqlens[1:].tolist()
        all_rows = set(step.all_rows)
        wanted = sorted(all_rows | set(step.samples))
        out: list[torch.Tensor | None] = [None] * len(step.lengths)
        if not wanted:
            return out
        rows = [torch.arange(ends[i] - step.lengths[i] if i in all_rows else ends[i] - 1, ends[i],
                             device=self.device) for i in wanted]
        logits = self.model.compute_logits(hidden[torch.cat(rows)]).split([len(r) for r in rows])
        for i, chunk_logits in zip(wanted, logits):
            out[i] = chunk_logits
        return out

    def _apply_changes(self, step: Step) -> None:
        apply_ops(self.cache, step.ops)
        for state in self.cache.kda:        # the last verification's states are committed: drop the rest
            state.token_states = None
        self.page_table.apply(step.table)
