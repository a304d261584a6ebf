"""Scheduling under data-parallel attention: one Scheduler per DP group, each over its group's pools.

A DP group's ranks hold the caches of that group's sequences only, so every sequence lives in one group: it joins
the group holding the fewest sequences when it arrives (ties: the lowest group), and stays there; preempted, it
waits in its group; its forks join it. A step runs every group's chunks at once, group by group (the MoE layers
compute all of them together); each group has its own token budget and concurrency cap, as each SGLang DP rank
has.
"""

from __future__ import annotations

from .cache.kv_pool import KVPool
from .request import Sequence
from .scheduler import ScheduledChunk, Scheduler


class DPScheduler:
    """The Scheduler interface the engine uses, over one Scheduler per DP group (`groups`, in group order)."""

    def __init__(self, groups: list[Scheduler]):
        self.groups = groups

    @property
    def running(self) -> list[Sequence]:
        return [seq for group in self.groups for seq in group.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for group in self.groups for seq in group.waiting]

    @property
    def max_running(self) -> int:
        """Sequences one request can run at once: a group's cap (a request's sequences share its group)."""
        return self.groups[0].max_running

    @property
    def kv_pool(self) -> KVPool:
        """A group's KV pool (every group's pools have the same sizes): what one request can use."""
        return self.groups[0].kv_pool

    @property
    def num_preemptions(self) -> int:
        return sum(group.num_preemptions for group in self.groups)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence in the group holding the fewest (a preempted one waits in its own group's queue,
        where its Scheduler puts it)."""
        seq.dp_group = min(range(len(self.groups)),
                           key=lambda g: len(self.groups[g].running) + len(self.groups[g].waiting))
        self.groups[seq.dp_group].add(seq)

    def has_work(self) -> bool:
        return any(group.has_work() for group in self.groups)

    def decoding(self) -> int:
        return sum(group.decoding() for group in self.groups)

    def prefilling(self) -> bool:
        return any(group.prefilling() for group in self.groups)

    def schedule(self, prompt_limit: int | None = None) -> list[ScheduledChunk]:
        """Every group's chunks, each group taking an equal share of prompt_limit (the step runs them all)."""
        share = None if prompt_limit is None else max(1, prompt_limit // len(self.groups))
        return [chunk for group in self.groups for chunk in group.schedule(share)]

    def finish(self, seq: Sequence) -> None:
        self.groups[seq.dp_group].finish(seq)

    def record_progress(self, seq: Sequence) -> None:
        self.groups[seq.dp_group].record_progress(seq)

    def release_beyond(self, seq: Sequence) -> None:
        self.groups[seq.dp_group].release_beyond(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.dp_group = parent.dp_group
        self.groups[parent.dp_group].fork(parent, child)
