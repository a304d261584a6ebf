"""A bounded soak: 400 seeded requests of every kind (valid, invalid, streamed, n > 1, stop strings, JSON
mode, aborted streams, disconnects) against one server, which must answer each as asked and end holding nothing:
no slot, page, request, stream or task left over, and its memory within a stated bound. `benchmarks/bench_soak.py`
runs the long version (20,000 requests), kept out of `make test` for time."""

from __future__ import annotations

import asyncio
import resource

from kestrel.bench.soak import soak
from helpers import assert_idle
from server_helpers import VOCAB, LiveServer
from test_limits import wait_until

RSS_GROWTH_BOUND_MIB = 100
"""How much the server process may grow over the soak, after a warm-up (caches, allocator pools) has run."""


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_400_mixed_requests_are_answered_and_leave_nothing_behind(model_folder):
    live = LiveServer(model_folder, page_size=4, max_running_requests=16)
    engine = live.engine
    try:
        warm_up = asyncio.run(soak(live.url, 100, 16, VOCAB, seed=1))
        assert warm_up.problems == []
        wait_until(lambda: engine.num_requests == 0, "the warm-up did not finish")
        tasks, rss = live.num_tasks(), rss_mib()

        report = asyncio.run(soak(live.url, 400, 16, VOCAB, seed=0))
        assert report.problems == []
        assert report.answered + report.refused + report.abandoned == report.sent == 400
        assert min(report.answered, report.refused, report.abandoned) > 40       # every kind was exercised

        scheduler = engine.engine.scheduler
        wait_until(lambda: engine.num_requests == 0 and not engine.engine.requests, "requests were left behind")
        wait_until(lambda: live.num_tasks() <= tasks, "asyncio tasks were left behind")
        assert_idle(scheduler)
        assert rss_mib() - rss < RSS_GROWTH_BOUND_MIB
        with live.client() as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        live.stop()
