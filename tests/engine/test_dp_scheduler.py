"""DPScheduler (DP attention): each sequence lives in one DP group's pools, joins the least loaded group, and a step's
chunks come group by group; a full group makes newcomers go to the other, and a group's releases free its own pools
only. The pools are the real ones (no model: chunks are only scheduled)."""

from __future__ import annotations

from kestrel.engine.cache.device_ops import DeviceOps
from kestrel.engine.cache.kv_pool import KVPool
from kestrel.engine.cache.page_table import PageTable
from kestrel.engine.cache.state_pool import StatePool
from kestrel.engine.dp_scheduler import DPScheduler
from kestrel.engine.request import Request, Sequence
from kestrel.engine.sampling import SamplingParams
from kestrel.engine.scheduler import Scheduler

SLOTS, PAGES, PAGE = 2, 8, 4


def group() -> Scheduler:
    ops = DeviceOps()
    return Scheduler(StatePool(SLOTS, ops), KVPool(PAGES, PAGE, ops), PageTable(SLOTS, PAGES, 0, "meta"),
                     max_running=SLOTS, chunked_prefill_size=16, max_prefill_tokens=64)


def sequence(name: str, length: int) -> Sequence:
    request = Request(name, None, list(range(3, 3 + length)), SamplingParams(max_tokens=4), arrival=0)
    seq = Sequence(request, 0, None, None)
    request.sequences.append(seq)
    return seq


def test_sequences_stay_in_their_groups_pools():
    dp = DPScheduler([group(), group()])
    a, b, c = sequence("a", 9), sequence("b", 5), sequence("c", 3)
    for seq in (a, b, c):
        dp.add(seq)
    assert [a.dp_group, b.dp_group, c.dp_group] == [0, 1, 0]
    chunks = dp.schedule()
    assert [chunk.seq for chunk in chunks] == [a, c, b]                  # group by group
    g0, g1 = dp.groups
    assert g0.kv_pool.num_free == PAGES - 3 - 1 and g1.kv_pool.num_free == PAGES - 2   # a: 3 pages, c: 1; b: 2
    assert g0.state_pool.num_free == 0 and g1.state_pool.num_free == SLOTS - 1
    d = sequence("d", 4)
    dp.add(d)                        # group 0 holds two sequences, group 1 one
    groups = [(chunk.seq.dp_group, chunk.seq) for chunk in dp.schedule()]
    assert d.dp_group == 1 and (1, d) in groups and groups == sorted(groups, key=lambda g: g[0])
    a.finish_reason = "abort"
    dp.finish(a)
    assert g0.kv_pool.num_free == PAGES - 1 and g1.kv_pool.num_free == PAGES - 3
    assert dp.running == [c, b, d] and dp.max_running == SLOTS
