"""Runs one scheduled step: one flat batch of every chunk's tokens through the model, logits where needed.

With several ranks, rank 0's runner turns the scheduled chunks into a `Step` (plain data: the cache copies and
page-table changes since the last step, then the batch) and sends it to the other ranks, whose runners `execute`
the same Step on their model shards; every rank of one stage ends with the full logits. Under DP attention each
DP group's pools have their own journal and page table (rank 0 records them all; a group's ranks apply its own),
the chunks come group by group, and each rank's attention reads its group's chunks. With pipeline stages the
step runs as micro-batches that flow from stage to stage (kestrel.distributed.pipeline), and the last stage sends
the logits to rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ..distributed.pipeline import StageLink, micro_batches
from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..models.kimi import KimiForCausalLM
from ..ops.torch.kda import compiled_chunk_terms
from .background_compile import BackgroundCompiler, module_calls
from .cache.device_ops import DeviceOps, Op, Part, apply_ops, read_parts
from .cache.hicache import Entry
from .cache.shards import gather_entry, shard_entry
from .cache.page_table import PageTable
from .decode_graphs import DecodeGraphs
from .expert_balance import ExpertBalancer
from .scheduler import ScheduledChunk
from .speculative.block import BlockDrafter
from .speculative.dflash import DFlashDrafter
from .speculative.mtp import DraftInput, MTPDrafter
from .speculative.staged import StagedDrafter

T = TypeVar("T")
PREFILL_TERMS = "KDA prefill chunk terms"
"""The background compiler's key for the KDA prefill's compiled chunk terms."""


@dataclass(frozen=True)
class Step:
    """One step as every rank runs it."""

    ops: list[list[Op]]        # per DP group: cache copies journaled since the last step (DeviceOps.take)
    table: list[list[int]]     # per DP group: page-table changes since the last step (PageTable.take)
    token_ids: list[int]       # every chunk's new tokens, chunk after chunk
    starts: list[int]          # per chunk: tokens of its sequence already in the caches
    lengths: list[int]         # per chunk: new tokens
    slots: list[int]           # per chunk: its sequence's state slot (and page-table row)
    width: int                 # page-table columns the batch reads
    all_rows: list[int]        # chunks that need logits at every position
    samples: list[int]         # chunks that need logits at their last position
    verify: bool = False       # a speculative verification: KDA keeps every token's state (ForwardBatch)
    groups: tuple[int, ...] = ()   # DP attention: chunks of each DP group (they come group by group)
    captures: tuple[tuple[int, int, int], ...] = ()   # (chunk, offset, state slot): see ScheduledChunk.capture

    def group_chunks(self, group: int) -> range:
        """The chunks of DP group `group` (all of them without DP attention)."""
        if not self.groups:
            return range(len(self.lengths))
        first = sum(self.groups[:group])
        return range(first, first + self.groups[group])


@dataclass(frozen=True)
class Save:
    """Read cache parts on every rank (after applying the cache copies journaled since the last step), for rank 0
    to gather: a PD handoff's state."""

    ops: list[list[Op]]        # per DP group, as Step.ops
    parts: list[Part]


@dataclass(frozen=True)
class Draft:
    """Draft on every rank from the hidden states kept since the last Draft (a model drafter's layers, embedding
    and LM head are sharded like the model's, so all ranks run it together; under pipeline stages, the last stage's
    ranks: spec.staged), then drop them."""

    inputs: list[DraftInput]


class RankFailure(RuntimeError):
    """A rank of a distributed instance failed; the instance cannot run any further step."""


class Peers(Protocol):
    """Rank 0's handle on the other ranks (engine.ranks.Ranks)."""

    def send(self, message: Step | Save | Draft) -> None: ...

    def gather(self, entry: Entry) -> list[Entry]: ...

    def explain(self, error: BaseException) -> str: ...


class ModelRunner:
    """Builds the ForwardBatch (token ids, prefix lengths, state slots, their page-table rows) and runs the model.

    Each step first applies the cache copies journaled in ops since the last step, and the page table's changes.
    With decode_graphs, steps of one token per sequence that fit a graph size replay a captured graph instead,
    and so do verifications of equally many drafts per sequence where the graphs take them (compiled CPU steps).
    With prefill_compile (a torch.compile backend), the other steps' KDA chunk terms run compiled
    (kestrel.ops.torch.kda.compiled_chunk_terms), once compiled when compiling in the background (PREFILL_TERMS).
    With a model drafter (MTP layers, block draft), every forward's final hidden states are kept until the next
    draft reads them (`kept`).
    With peers (rank 0 of several), each step and draft is sent to the other ranks before it runs here; a failure
    then stops the instance: this and every later run raise RankFailure. Under DP attention rank 0's runner also takes
    the other DP groups' page tables and journals (`other_groups`, in group order), whose changes it sends.
    """

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable, ops: DeviceOps,
                 decode_graphs: DecodeGraphs | None = None, peers: Peers | None = None,
                 other_groups: list[tuple[PageTable, DeviceOps]] = (), prefill_compile: str | None = None,
                 drafter: MTPDrafter | BlockDrafter | DFlashDrafter | StagedDrafter | None = None,
                 background: BackgroundCompiler | None = None, balancer: ExpertBalancer | None = None):
        self.model = model
        self.balancer = balancer
        self.cache = cache
        self.page_table = page_table
        self.ops = ops
        self.journals = [(page_table, ops), *other_groups]
        self.device = model.device
        self.decode_graphs = decode_graphs
        self.prefill_compile = prefill_compile
        self.background = background
        self.peers = peers
        self.failure: str | None = None
        self.drafter = drafter
        self.kept: list[torch.Tensor] = []       # per forward since the last draft: its hidden states [T, D]
        par = model.par
        self.link = None              # the stage link (one per rank: a staged drafter's drafts travel on it too)
        if isinstance(drafter, StagedDrafter):
            self.link = drafter.link
        elif par.layout.pp_size > 1:
            self.link = StageLink(par.layout, par.via_host)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], all_rows: set[int], verify: bool = False) -> list[torch.Tensor | None]:
        """Logits (fp32) per chunk: [length, vocab] for chunks in all_rows (their indices; prompt logprobs need
        every position), [1, vocab] at the last token for chunks that sample, None for the rest. verify: the
        chunks are speculative verifications (see Step)."""
        groups = ()
        if len(self.journals) > 1:
            order = [c.seq.dp_group for c in chunks]
            if order != sorted(order):
                raise ValueError("under DP attention a step's chunks come group by group.")
            groups = tuple(order.count(g) for g in range(len(self.journals)))
        step = Step([ops.take() for _, ops in self.journals], [table.take() for table, _ in self.journals],
                    [t for c in chunks for t in c.token_ids()],
                    [c.start for c in chunks], [c.length for c in chunks], [c.seq.slot for c in chunks],
                    max(len(c.seq.pages) for c in chunks), sorted(all_rows),
                    [i for i, c in enumerate(chunks) if c.samples], verify, groups,
                    tuple((i, *c.capture) for i, c in enumerate(chunks) if c.capture is not None))
        graphs, q = self.decode_graphs, chunks[0].length
        if (graphs is not None and all(c.length == q for c in chunks) and graphs.available(len(chunks), step.width, q)
                and (verify if q > 1 else not all_rows)):
            self._apply_changes(step)
            out = graphs.run(step.token_ids, step.starts, step.slots, step.width, q)
            self._keep(out.hidden)
            for state, token_states in zip(self.cache.kda, out.token_states):
                state.token_states = token_states
            if verify:
                return list(out.logits.split(q))
            return [out.logits[i:i + 1] if c.samples else None for i, c in enumerate(chunks)]
        with self._module_calls():
            return self._everywhere(step, lambda: self.execute(step))

    @torch.inference_mode()
    def save(self, parts: list[Part]) -> Entry:
        """CPU copies of parts after every cache write journaled so far, in the single-process layout (gathered
        from every rank of a distributed instance: kestrel.engine.cache.shards)."""
        message = Save([ops.take() for _, ops in self.journals], parts)
        if self.peers is None:
            return self.read(message)
        entries = self._everywhere(message, lambda: self.peers.gather(self.read(message)))
        return gather_entry(entries, self.model.par.layout, self.model.config)

    def draft(self, inputs: list[DraftInput]) -> list[list[int]]:
        """The model drafter's tokens for inputs, which point into the hidden states kept since the last draft
        (dropped now, on every rank). Called once per engine step, inputs or not, so that no rank keeps more."""
        message = Draft(inputs)
        with self._module_calls():
            return self._everywhere(message, lambda: self.run_draft(message))

    def run_draft(self, draft: Draft) -> list[list[int]]:
        """Draft on this rank (see Draft)."""
        kept, self.kept = self.kept, []
        return self.drafter.draft(draft.inputs, kept)

    def _everywhere(self, message: Step | Save | Draft, here: Callable[[], T]) -> T:
        """here() after sending message to the other ranks, if any. A failure with peers stops the instance (the
        ranks may now disagree about the caches): this and every later call raise RankFailure."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        if self.peers is None:
            return here()
        try:
            self.peers.send(message)
            return here()
        except Exception as e:
            self.failure = f"the distributed instance stopped: {self.peers.explain(e)}"
            raise RankFailure(self.failure) from e

    def read(self, save: Save) -> Entry:
        """This rank's share of save's parts."""
        self._apply_ops(save.ops[self.model.par.layout.dp_rank])
        return read_parts(self.cache, save.parts)

    def execute(self, step: Step) -> list[torch.Tensor | None]:
        """Run step on this rank's model (see run for what comes back; under pipeline parallelism only rank 0
        gets logits); then the expert balancer's turn, when there is one."""
        out = self._execute(step)
        if self.balancer is not None:
            self.balancer.after_step()
        return out

    @torch.inference_mode()
    def _execute(self, step: Step) -> list[torch.Tensor | None]:
        self._apply_changes(step)
        if self.link is not None:
            return self._execute_stages(step)
        batch = self._batch(step, step.group_chunks(self.model.par.layout.dp_rank))
        if step.groups:
            tokens = [sum(step.lengths[i] for i in step.group_chunks(g)) for g in range(len(step.groups))]
            batch = dataclasses.replace(batch, dp_tokens=tuple(tokens))
        with compiled_chunk_terms(self._prefill_backend()):
            hidden = self.model(torch.tensor(step.token_ids, device=self.device), batch, self.cache)
        self._keep(hidden)
        out: list[torch.Tensor | None] = [None] * len(step.lengths)
        rows = self._logit_rows(step)
        if rows:
            logits = self.model.compute_logits(hidden[torch.cat(list(rows.values()))])
            for i, chunk_logits in zip(rows, logits.split([len(r) for r in rows.values()])):
                out[i] = chunk_logits
        return out

    def _module_calls(self) -> contextlib.AbstractContextManager:
        """What eager forwards (modules called) hold while compiling in the background (background_compile's
        module_calls). A compiled graph calls no module, and runs without it: were it to recompile here it would
        wait for the background compile, which may be waiting for module_calls."""
        return module_calls() if self.background is not None else contextlib.nullcontext()

    def _prefill_backend(self) -> str | None:
        """The backend the KDA chunk terms run compiled by now (None: eagerly)."""
        if self.background is not None and not self.background.ready(PREFILL_TERMS):
            return None
        return self.prefill_compile

    def _execute_stages(self, step: Step) -> list[torch.Tensor | None]:
        """This stage's share of step, micro-batch by micro-batch: the first stage embeds, the others receive the
        stream from the previous stage; all but the last send theirs on; the last computes the logits, which its
        first TP rank sends to rank 0 (and keeps every token's final hidden state for a model drafter, which drafts
        there: spec.staged). Rank 0 returns them (the other ranks, Nones)."""
        model, link, layout = self.model.model, self.link, self.link.layout
        out: list[torch.Tensor | None] = [None] * len(step.lengths)
        # a verification runs whole: the KDA token states it keeps are indexed by the step's tokens
        parts = [range(len(step.lengths))] if step.verify else micro_batches(step.lengths, layout.pp_size)
        firsts = [0] + torch.tensor(step.lengths).cumsum(0).tolist()      # each chunk's first token in the step
        wanted = self._logit_rows(step)
        rows_of = [{i: r for i, r in wanted.items() if i in chunks} for chunks in parts]
        hidden = []         # the last stage's final hidden states per micro-batch, for a model drafter
        for m, chunks in enumerate(parts):
            batch = self._batch(step, chunks)
            first = firsts[chunks.start]
            if layout.first_stage:
                stream = model.start(torch.tensor(step.token_ids[first:firsts[chunks.stop]], device=self.device))
            else:
                config = self.model.config
                shape = (config.stream_width(model.stage.start), batch.num_tokens, config.hidden_size)
                stream = link.recv_prev(shape, self.model.dtype, self.device, m)
            stream = model.run_layers(stream, batch, self.cache)
            if not layout.last_stage:
                link.send_next(stream, m)
                continue
            rows = rows_of[m]
            finished = model.finish(stream) if rows or self.drafter is not None else None
            if self.drafter is not None:
                hidden.append(finished)
            if rows:       # every TP rank of the stage computes them (the vocabulary is gathered), the first sends
                logits = self.model.compute_logits(finished[torch.cat(list(rows.values())) - first])
                if layout.tp_rank == 0:
                    link.send_logits(logits, m)
        link.wait()
        self._keep(torch.cat(hidden) if hidden else None)
        if layout.rank == 0:
            for m, rows in enumerate(rows_of):
                if rows:
                    logits = link.recv_logits(sum(len(r) for r in rows.values()), self.model.config.vocab_size,
                                              self.device, m)
                    for i, chunk_logits in zip(rows, logits.split([len(r) for r in rows.values()])):
                        out[i] = chunk_logits
        return out

    def _keep(self, hidden: torch.Tensor | None) -> None:
        """Keep a forward's final hidden states [T, D] for the next draft (with a model drafter; None on pipeline
        stages before the last, which only count the forwards)."""
        if self.drafter is not None:
            self.kept.append(hidden)

    def _batch(self, step: Step, chunks: range) -> ForwardBatch:
        """The ForwardBatch of step's chunks (a contiguous run of them)."""
        slots = torch.tensor(step.slots[chunks.start:chunks.stop], dtype=torch.long, device=self.device)
        captures = [(i - chunks.start, offset, slot) for i, offset, slot in step.captures if i in chunks]
        return ForwardBatch.build(step.lengths[chunks.start:chunks.stop], step.starts[chunks.start:chunks.stop],
                                  slots, self.page_table.gather(slots, step.width), self.cache.page_size,
                                  self.device, keep_token_states=step.verify, captures=captures)

    def _logit_rows(self, step: Step) -> dict[int, torch.Tensor]:
        """Chunk index -> the rows of step's tokens whose logits it needs (every position for all_rows, the last
        for samples), for the chunks that need any, in order."""
        ends = torch.tensor(step.lengths).cumsum(0).tolist()
        all_rows = set(step.all_rows)
        return {i: torch.arange(ends[i] - step.lengths[i] if i in all_rows else ends[i] - 1, ends[i],
                                device=self.device)
                for i in sorted(all_rows | set(step.samples))}

    def _apply_ops(self, ops: list[Op]) -> None:
        """Run journaled cache copies on this rank (a loaded entry comes in one process's layout: its share)."""
        layout, config = self.model.par.layout, self.model.config
        apply_ops(self.cache, [(kind, a, [shard_entry(b[0], layout, config)]) if kind == "load" else (kind, a, b)
                               for kind, a, b in ops])

    def _apply_changes(self, step: Step) -> None:
        group = self.model.par.layout.dp_rank
        self._apply_ops(step.ops[group])
        for state in self.cache.kda:        # the last verification's states are committed: drop the rest
            state.token_states = None
        self.page_table.apply(step.table[group])
