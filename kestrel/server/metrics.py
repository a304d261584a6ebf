"""Prometheus metrics of the server: request outcomes, latencies, token counts, queue and pool occupancy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """One registry per server, so that tests and several apps in a process do not collide."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kestrel_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("kestrel_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kestrel_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kestrel_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kestrel_generation_tokens", "Generated tokens", registry=r)
        gauges = {
            "kestrel_num_requests_running": ("Requests holding a state slot", lambda s: s.running),
            "kestrel_num_requests_waiting": ("Requests queued or preempted", lambda s: s.waiting),
            "kestrel_kv_cache_usage_ratio": ("Share of KV pages in use",
                                             lambda s: s.kv_pages_used / s.kv_pages_total),
            "kestrel_state_pool_usage_ratio": ("Share of KDA state slots in use",
                                               lambda s: s.state_slots_used / s.state_slots_total),
            "kestrel_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache since start",
                                                    lambda s: s.cache_prompt_tokens),
            "kestrel_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache since start",
                                                lambda s: s.cache_hit_tokens),
            "kestrel_prefix_cache_hit_rate": ("Share of looked-up prompt tokens served from the prefix cache",
                                              lambda s: s.cache_hit_tokens / max(s.cache_prompt_tokens, 1)),
            "kestrel_prefix_cache_pages": ("KV pages held by the prefix cache", lambda s: s.cache_pages),
            "kestrel_prefix_cache_snapshots": ("KDA state snapshots held by the prefix cache",
                                               lambda s: s.cache_snapshots),
            "kestrel_spec_verifications": ("Speculative verification steps since start",
                                           lambda s: s.spec_verifications),
            "kestrel_spec_draft_tokens": ("Draft tokens verified since start", lambda s: s.spec_draft_tokens),
            "kestrel_spec_accepted_tokens": ("Draft tokens accepted since start", lambda s: s.spec_accepted_tokens),
            "kestrel_spec_acceptance_length": ("Mean tokens emitted per verification step",
                                               lambda s: (s.spec_accepted_tokens + s.spec_verifications)
                                               / max(s.spec_verifications, 1)),
            "kestrel_spec_draft_seconds": ("Seconds spent drafting since start", lambda s: s.spec_draft_seconds),
            "kestrel_spec_verify_seconds": ("Seconds spent in verification forwards since start",
                                            lambda s: s.spec_verify_seconds),
            "kestrel_expert_load_imbalance": ("Expert parallelism: max / mean of the EP ranks' token-expert pairs "
                                              "over the last --eplb-rebalance-num-iterations steps",
                                              lambda s: s.expert_rank_imbalance),
            "kestrel_eplb_rebalances": ("EPLB rebalances since start", lambda s: s.eplb_rebalances),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda read=read: read(engine.stats()))
        self.engine = engine
        self.spec_histogram = Gauge("kestrel_spec_accepted_verifications", "Verification steps by draft tokens "
                                    "accepted", ["accepted"], registry=r)
        self.expert_load = Gauge("kestrel_expert_rank_tokens", "Expert parallelism: token-expert pairs each EP rank "
                                 "computed over the last --eplb-rebalance-num-iterations steps", ["ep_rank"], registry=r)

    def render(self) -> bytes:
        stats = self.engine.stats()
        for accepted, count in enumerate(stats.spec_accepted_histogram):
            self.spec_histogram.labels(str(accepted)).set(count)
        for rank, pairs in enumerate(stats.expert_rank_load):
            self.expert_load.labels(str(rank)).set(pairs)
        return generate_latest(self.registry)


@dataclass
class RequestTimer:
    """Times one request for the latency histograms."""

    metrics: Metrics
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    tokens: int = 0

    def tokens_seen(self, total: int) -> None:
        """The request now has `total` generated tokens (summed over its choices)."""
        if total > 0 and self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.first_token - self.start)
        self.tokens = total

    def done(self, outcome: str, prompt_tokens: int) -> None:
        end = time.perf_counter()
        self.metrics.requests.labels(outcome).inc()
        if outcome != "success":
            return
        self.metrics.e2e.observe(end - self.start)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(self.tokens)
        if self.first_token is not None and self.tokens > 1:
            self.metrics.tpot.observe((end - self.first_token) / (self.tokens - 1))
