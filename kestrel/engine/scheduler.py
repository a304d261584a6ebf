"""Continuous batching over the hybrid cache: which sequences compute which tokens in the next step.

Each step has a token budget (max_prefill_tokens) shared by decode tokens and prefill chunks (at most
chunked_prefill_size per sequence). Running sequences go first, in priority order; waiting ones are admitted
while both pools have room: a state slot each (n for a request that will fork), and KV pages for their first
chunk plus one page of headroom per running sequence, so that admission never forces the next decode step to
preempt. When a running sequence needs a page and none is free, the lowest-priority running sequence is
preempted: its slot and pages are freed and it waits to be recomputed (prompt and output so far), which under
greedy decoding continues exactly where it stopped. The highest-priority sequence can always proceed, since one
sequence of up to the context length fits the KV pool, so nothing deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cache.kv_pool import KVPool
from .cache.page_table import PageTable
from .cache.state_pool import StatePool
from .request import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens start..start+length-1 of seq; when they reach its last token, sample the next one."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


class Scheduler:
    """Waiting and running queues over a state pool and a KV pool; every page handed out is recorded in the
    page table's row of the sequence's state slot."""

    def __init__(self, state_pool: StatePool, kv_pool: KVPool, page_table: PageTable, max_running: int,
                 chunked_prefill_size: int, max_prefill_tokens: int):
        self.state_pool = state_pool
        self.kv_pool = kv_pool
        self.page_table = page_table
        self.max_running = max_running
        self.chunk_size = chunked_prefill_size
        self.token_budget = max_prefill_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop seq from the queues and give back everything it holds."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        """The work of the next step (empty when nothing can run)."""
        chunks: list[ScheduledChunk] = []
        scheduled: set[Sequence] = set()
        budget = self.token_budget
        for seq in sorted(self.running, key=lambda s: s.priority_key):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            length = self._chunk_length(seq, budget)
            if not self._grow(seq, length, protected=scheduled):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, length))
            scheduled.add(seq)
            budget -= length
        self.waiting.sort(key=lambda s: s.priority_key)
        while self.waiting and budget > 0:
            length = self._admit(self.waiting[0], budget)
            if not length:
                break
            chunks.append(ScheduledChunk(self.waiting.pop(0), 0, length))
            budget -= length
        return chunks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start child from parent's state after the prompt: copied state slot, shared full pages, a copied
        partial page. When no page is free for the copy, child waits to be recomputed instead."""
        child.slot = parent.reserved_slots.pop()
        prompt_len = len(parent.request.prompt_ids)
        full = prompt_len // self.kv_pool.page_size
        partial = len(parent.pages) > full
        if partial and self.kv_pool.num_free == 0:
            self.state_pool.free(child.slot)
            child.slot = None
            self.add(child)
            return
        self.state_pool.copy(parent.slot, child.slot)
        self.kv_pool.share(parent.pages[:full])
        child.pages = parent.pages[:full]
        if partial:
            page = self.kv_pool.allocate(1)[0]
            self.kv_pool.copy_page(parent.pages[full], page)
            child.pages.append(page)
        self.page_table.set(child.slot, 0, child.pages)
        child.num_computed = parent.num_computed
        child.status = Status.RUNNING
        self.running.append(child)

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed
        return min(remaining, budget, self.chunk_size)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give seq a slot (and its forks' slots) and its first chunk's pages if the pools allow; returns the
        chunk's length, 0 if not admitted. With others running, one page per running sequence stays free;
        alone, the first chunk shrinks to the free pages."""
        slots = 1 + seq.forks_pending
        if len(self.running) + slots > self.max_running or self.state_pool.num_free < slots:
            return 0
        headroom = len(self.running) + 1 if self.running else 0
        usable = self.kv_pool.num_free - headroom - seq.forks_pending     # a partial page per fork, later
        length = min(self._chunk_length(seq, budget), usable * self.kv_pool.page_size)
        if length <= 0:
            return 0
        seq.slot = self.state_pool.allocate()
        seq.reserved_slots = [self.state_pool.allocate() for _ in range(slots - 1)]
        seq.pages = self.kv_pool.allocate(self.kv_pool.pages_for(length))
        self.page_table.set(seq.slot, 0, seq.pages)
        seq.num_computed = 0
        seq.status = Status.RUNNING
        self.running.append(seq)
        return length

    def _grow(self, seq: Sequence, length: int, protected: set[Sequence]) -> bool:
        """Make seq's pages cover `length` more tokens, preempting lower-priority sequences if needed.
        False when seq itself had to be preempted."""
        needed = self.kv_pool.pages_for(seq.num_computed + length) - len(seq.pages)
        while self.kv_pool.num_free < needed:
            victim = max((s for s in self.running if s not in protected), key=lambda s: s.priority_key)
            self._preempt(victim)
            if victim is seq:
                return False
        new = self.kv_pool.allocate(needed)
        self.page_table.set(seq.slot, len(seq.pages), new)
        seq.pages += new
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.num_preemptions += 1
        self.add(seq)

    def _release(self, seq: Sequence) -> None:
        for slot in ([seq.slot] if seq.slot is not None else []) + seq.reserved_slots:
            self.state_pool.free(slot)
        self.kv_pool.free(seq.pages)
        seq.slot, seq.pages, seq.reserved_slots, seq.num_computed = None, [], [], 0
