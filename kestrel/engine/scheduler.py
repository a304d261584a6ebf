"""Continuous batching over the hybrid cache: which sequences compute which tokens in the next step.

Each step has a token budget (max_prefill_tokens) shared by decode tokens and prefill chunks (at most
chunked_prefill_size per sequence); while sequences decode, the engine may cap the prompt tokens further
(pacer.PrefillPacer). Running sequences go first, in priority order; waiting ones are admitted
while both pools have room: a state slot each (n for a request that will fork), and KV pages for their first
chunk plus one page of headroom per running sequence, so that admission never forces the next decode step to
preempt. When a running sequence needs a page and none is free, the lowest-priority running sequence is
preempted: its slot and pages are freed and it waits to be recomputed (prompt and output so far), which under
greedy decoding continues exactly where it stopped. The highest-priority sequence can always proceed, since one
sequence of up to the context length fits the KV pool, so nothing deadlocks.

With a prefix cache (radix.py), a sequence starts after the longest cached prefix of its tokens that ends at a
state snapshot, and its pages go into the tree as they fill. Its state is saved at the request's cache point (by default
before the prompt's last token; for a chat, where its messages end: the chunk that runs past that point saves the
KDA state there on the way, into a slot of its own, ScheduledChunk.capture) and when it finishes ("no_buffer");
with "extra_buffer" also after every prefill chunk that ends on a page boundary, and at the first
page boundary track_interval decode tokens after the last snapshot. What only the cache holds is evicted (least
recently used) before a request is refused or preempted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cache.kv_pool import KVPool
from .cache.page_table import PageTable
from .cache.radix import Hit, PrefixCache
from .cache.state_pool import StatePool
from .handoff import handoff_parts
from .request import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens start..start+length-1 of seq; when they reach its last token, sample the next one. A
    speculating sequence's chunk is its last token then its draft tokens, to verify."""

    seq: Sequence
    start: int
    length: int
    draft: tuple[int, ...] = ()
    capture: tuple[int, int] | None = None     # (offset, slot): a prompt chunk that runs past its request's cache
                                               # point saves the KDA state there, after offset tokens, into slot

    @property
    def samples(self) -> bool:
        return self.start + self.length - len(self.draft) == self.seq.num_tokens

    @property
    def decodes(self) -> bool:
        """Computes the sequence's last token only (and its draft tokens), an output token (before the step runs)."""
        return self.samples and self.length - len(self.draft) == 1 and self.start >= len(self.seq.request.prompt_ids)

    def token_ids(self) -> list[int]:
        return self.seq.tokens(self.start, self.start + self.length - len(self.draft)) + list(self.draft)


class Scheduler:
    """Waiting and running queues over a state pool and a KV pool; every page handed out is recorded in the
    page table's row of the sequence's state slot."""

    def __init__(self, state_pool: StatePool, kv_pool: KVPool, page_table: PageTable, max_running: int,
                 chunked_prefill_size: int, max_prefill_tokens: int, prefix_cache: PrefixCache | None = None,
                 extra_buffer: bool = False, track_interval: int = 256, lookahead: int = 0):
        """lookahead: draft tokens a speculating sequence verifies per step (pages kept for them)."""
        self.state_pool = state_pool
        self.kv_pool = kv_pool
        self.page_table = page_table
        self.prefix_cache = prefix_cache
        self.extra_buffer = extra_buffer
        self.track_interval = track_interval
        self.lookahead = lookahead
        self.max_running = max_running
        self.chunk_size = chunked_prefill_size
        self.token_budget = max_prefill_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def groups(self) -> list[Scheduler]:
        """The DP groups' schedulers: this one alone (dp_scheduler.DPScheduler holds one per group)."""
        return [self]

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop seq from the queues and give back everything it holds (a completed sequence's state is cached
        first)."""
        if seq.finish_reason in ("stop", "length") and seq.cache_node is not None \
                and seq.num_computed == seq.num_tokens - 1:       # (not when it stopped inside a verified draft)
            self._insert_pages(seq)
            self._snapshot(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def decoding(self) -> int:
        """Running sequences waiting for their next output token (that have computed every token but their last,
        an output token)."""
        return sum(seq.status is Status.RUNNING and seq.num_computed == seq.num_tokens - 1
                   >= len(seq.request.prompt_ids) for seq in self.running)

    def prefilling(self) -> bool:
        """Whether prompt tokens (or outputs to recompute) wait: queued sequences, or running ones not caught up."""
        return bool(self.waiting) or any(seq.num_computed < seq.num_tokens - 1 for seq in self.running)

    def schedule(self, prompt_limit: int | None = None) -> list[ScheduledChunk]:
        """The work of the next step (empty when nothing can run): at most prompt_limit tokens of prompts (and of
        outputs recomputed after a preemption) in it; None: what the token budget leaves."""
        chunks: list[ScheduledChunk] = []
        scheduled: set[Sequence] = set()
        budget = self.token_budget
        prompt = budget if prompt_limit is None else prompt_limit
        for seq in sorted(self.running, key=lambda s: s.priority_key):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            decoding = seq.num_computed == seq.num_tokens - 1
            length = self._chunk_length(seq, budget if decoding else min(budget, prompt))
            if length == 0:
                continue
            draft, seq.draft = (seq.draft[:budget - length] if decoding else ()), ()
            if not self._grow(seq, length + len(draft), protected=scheduled):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, length + len(draft), draft))
            scheduled.add(seq)
            budget -= length + len(draft)
            if not decoding:
                prompt -= length
        self.waiting.sort(key=lambda s: s.priority_key)
        while self.waiting and min(budget, prompt) > 0:
            length = self._admit(self.waiting[0], min(budget, prompt))
            if not length:
                break
            seq = self.waiting.pop(0)
            chunks.append(ScheduledChunk(seq, seq.num_computed, length))
            budget -= length
            prompt -= length
        return [self._capture(chunk) for chunk in chunks]        # after admissions: they come first

    def record_progress(self, seq: Sequence) -> None:
        """After a step computed seq's tokens up to num_computed: its newly full pages go into the prefix cache,
        and its state too where the strategy takes a snapshot."""
        if seq.cache_node is None:
            return
        if seq.capture_slot is not None:         # the step saved the state at the cache point
            self._insert_pages(seq, seq.request.cache_point)
            self._snapshot(seq, seq.capture_slot)
            seq.capture_slot = None
        self._insert_pages(seq)
        computed, prompt = seq.num_computed, len(seq.request.prompt_ids)
        at_cache_point = computed == seq.request.cache_point > 0
        aligned = self.extra_buffer and computed % self.kv_pool.page_size == 0
        if at_cache_point or (aligned and (computed < prompt or computed - seq.last_snapshot >= self.track_interval)):
            self._snapshot(seq)

    def _insert_pages(self, seq: Sequence, end: int | None = None) -> None:
        """Put seq's full pages of computed tokens (of its first `end` tokens) that are not in the prefix cache yet
        into it."""
        page_size = self.kv_pool.page_size
        full = (seq.num_computed if end is None else end) // page_size
        if full > seq.cached_pages:
            node = self.prefix_cache.insert(seq.cache_node, seq.tokens(seq.cached_pages * page_size, full * page_size),
                                            seq.pages[seq.cached_pages:full])
            seq.cache_node.locks -= 1
            node.locks += 1
            seq.cache_node, seq.cached_pages = node, full

    def release_beyond(self, seq: Sequence) -> None:
        """Free seq's pages past those its computed tokens and next verification need (after a verification whose
        rejected draft tokens had pages)."""
        keep = self.kv_pool.pages_for(seq.num_computed + 1 + self.lookahead)
        self.kv_pool.free(seq.pages[keep:])
        del seq.pages[keep:]

    def _snapshot(self, seq: Sequence, captured: int | None = None) -> None:
        """Save seq's state after its computed tokens in the prefix cache (copied from its slot); or, with
        captured, the slot a step filled with its state at its cache point, after the tokens before that point."""
        end = seq.num_computed if captured is None else seq.request.cache_point
        start = seq.cached_pages * self.kv_pool.page_size
        tail_page = seq.pages[seq.cached_pages] if end > start else None
        if captured is None:
            self.prefix_cache.snapshot(seq.cache_node, seq.tokens(start, end), tail_page, seq.slot)
        else:
            self.prefix_cache.adopt(seq.cache_node, seq.tokens(start, end), tail_page, captured)
        seq.last_snapshot = end

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start child from parent's state after the prompt: copied state slot, shared full pages, a copied
        partial page. When no page is free for the copy, child waits to be recomputed instead."""
        child.slot = parent.reserved_slots.pop()
        prompt_len = len(parent.request.prompt_ids)
        full = prompt_len // self.kv_pool.page_size
        partial = len(parent.pages) > full
        if partial and self.kv_pool.num_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.reclaim_pages(1)
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
        child.cache_node, child.cached_pages, child.last_snapshot = parent.cache_node, parent.cached_pages, \
            parent.last_snapshot
        if child.cache_node is not None:
            child.cache_node.locks += 1
        child.status = Status.RUNNING
        self.running.append(child)

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed, budget, self.chunk_size)

    def _capture(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """With a prefix cache, a prompt chunk that runs past its request's cache point saves the state there into a
        state slot of its own (ScheduledChunk.capture), which becomes the cache's snapshot after the step; when no
        slot is free or can be freed, the chunk stops at the cache point instead (its state is then saved from the
        sequence's slot)."""
        seq = chunk.seq
        offset = seq.request.cache_point - chunk.start
        if self.prefix_cache is None or not 0 < offset < chunk.length:
            return chunk
        if self.state_pool.num_free == 0 and not self.prefix_cache.reclaim_slots(1):
            return dataclasses.replace(chunk, length=offset)
        seq.capture_slot = self.state_pool.allocate()
        return dataclasses.replace(chunk, capture=(offset, seq.capture_slot))

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give seq a slot (and its forks' slots) and its first chunk's pages if the pools allow (evicting what
        only the prefix cache holds if need be), starting after its longest cached prefix; returns the chunk's
        length, 0 if not admitted. With others running, one page per running sequence stays free; alone, the first
        chunk shrinks to the free pages."""
        slots = 1 + seq.forks_pending
        if len(self.running) + slots > self.max_running:
            return 0
        hit = self._lookup(seq)
        try:
            return self._admit_from(seq, hit, slots, budget)
        finally:
            if hit is not None:
                hit.snapshot.locks -= 1
                hit.node.locks -= seq.cache_node is not hit.node

    def _lookup(self, seq: Sequence) -> Hit | None:
        """The cached prefix seq resumes from (locked until admission ends), or None. A request that wants prompt
        logprobs computes its whole prompt."""
        cache = self.prefix_cache
        if cache is None or seq.request.prompt_logprobs is not None or seq.prefilled is not None:
            return None
        hit = cache.match(seq.tokens(0, seq.num_tokens), seq.num_tokens - 1)
        if hit is not None:
            hit.snapshot.locks += 1
            hit.node.locks += 1
        return hit

    def _admit_from(self, seq: Sequence, hit: Hit | None, slots: int, budget: int) -> int:
        """Admission resuming after hit, or after the prompt of a prefilled sequence (loading its state), or from
        the start."""
        cache, start = self.prefix_cache, hit.length if hit is not None else 0
        if seq.prefilled is not None:
            start = len(seq.request.prompt_ids)
        if self.state_pool.num_free < slots and cache is not None:
            cache.reclaim_slots(slots - self.state_pool.num_free)
        if self.state_pool.num_free < slots:
            return 0
        shared = hit.pages if hit is not None else []
        headroom = (len(self.running) + 1 if self.running else 0) + seq.forks_pending   # a partial page per fork
        seq.num_computed = start
        wanted = self._chunk_length(seq, budget)
        missing = self.kv_pool.pages_for(start + wanted) - len(shared) + headroom - self.kv_pool.num_free
        if missing > 0 and cache is not None:
            cache.reclaim_pages(missing)
        usable = self.kv_pool.num_free - headroom
        length = min(wanted, (len(shared) + usable) * self.kv_pool.page_size - start)
        if length <= 0:
            return 0
        seq.slot = self.state_pool.allocate()
        seq.reserved_slots = [self.state_pool.allocate() for _ in range(slots - 1)]
        self.kv_pool.share(shared)
        seq.pages = shared + self.kv_pool.allocate(self.kv_pool.pages_for(start + length) - len(shared))
        if hit is not None:
            cache.stats.hits += 1
            self.state_pool.copy(hit.snapshot.slot, seq.slot)
            if hit.snapshot.tail_page is not None:
                self.kv_pool.ops.copy_pages([hit.snapshot.tail_page], [seq.pages[len(shared)]])
        elif seq.prefilled is not None:
            handoff, seq.prefilled = seq.prefilled, None
            self.kv_pool.ops.load(handoff_parts(seq.slot, seq.pages[:handoff.num_pages]), handoff.tensors)
        if cache is not None:
            seq.cache_node = hit.node if hit is not None else cache.root
            seq.cache_node.locks += hit is None
            seq.cached_pages = len(shared)
            seq.last_snapshot = start
            if seq.request.num_cached_tokens is None:       # a request's first admission: its prompt was looked up
                cache.stats.prompt_tokens += len(seq.request.prompt_ids)
                cache.stats.cached_tokens += hit.length if hit is not None else 0
        if seq.request.num_cached_tokens is None:
            seq.request.num_cached_tokens = hit.length if hit is not None else 0
        self.page_table.set(seq.slot, 0, seq.pages)
        seq.num_computed = start
        seq.status = Status.RUNNING
        self.running.append(seq)
        return length

    def _grow(self, seq: Sequence, length: int, protected: set[Sequence]) -> bool:
        """Make seq's pages cover `length` more tokens, preempting lower-priority sequences if needed.
        False when seq itself had to be preempted."""
        needed = self.kv_pool.pages_for(seq.num_computed + length) - len(seq.pages)
        if self.kv_pool.num_free < needed and self.prefix_cache is not None:
            self.prefix_cache.reclaim_pages(needed - self.kv_pool.num_free)
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
        for slot in [s for s in (seq.slot, seq.capture_slot) if s is not None] + seq.reserved_slots:
            self.state_pool.free(slot)
        self.kv_pool.free(seq.pages)
        if seq.cache_node is not None:
            seq.cache_node.locks -= 1
        seq.slot, seq.capture_slot, seq.pages, seq.reserved_slots, seq.num_computed = None, None, [], [], 0
        seq.cache_node, seq.cached_pages, seq.draft = None, 0, ()
