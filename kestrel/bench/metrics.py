"""Serving metrics from request timelines, with the definitions vLLM's and SGLang's benchmark tools use, plus
AgentX's tokens/s per GPU and p90 interactivity (shared/reference/workloads.md sections 3 and 5).

Per request (times from its dispatch): TTFT = first chunk carrying choices; E2EL = last such chunk;
TPOT = (E2EL - TTFT) / (output tokens - 1) for requests with more than one token; ITL = every gap between
consecutive chunks, pooled over requests. Throughputs divide by the run's duration (first dispatch to last
completion); AgentX divides total (input + output, cached included) tokens by the first-start-to-last-end span
of successful requests and by the GPU count, and reports p90 interactivity = 1 / p90(TPOT).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timeline (seconds on the run's clock) and token counts."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens the server served from its prefix cache (usage, when sent)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99 (None without values)."""
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{p}": None for p in PERCENTILES if p != 50}}
    ordered = sorted(values)
    out: dict[str, float | None] = {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
                                    "std": statistics.pstdev(ordered)}
    for p in PERCENTILES:
        if p != 50:
            out[f"p{p}"] = percentile(ordered, p)
    return out


def percentile(ordered: list[float], p: float) -> float:
    """Linear-interpolated percentile of sorted values (numpy's default)."""
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], duration: float, num_gpus: int = 1) -> dict:
    """Every metric of one run; duration is first dispatch to last completion (seconds)."""
    ok = [r for r in records if r.ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    span = (max(r.chunk_times[-1] for r in ok) - min(r.start for r in ok)) if ok else 0.0
    p90_tpot = percentile(sorted(tpots), 90) if tpots else None
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": dict(Counter(r.error or "no output" for r in records if not r.ok)),
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": prompt / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "output_throughput_per_gpu": output / duration / num_gpus if duration else 0.0,
        "total_token_throughput_per_gpu": (prompt + output) / duration / num_gpus if duration else 0.0,
        "ttft_s": distribution([r.ttft for r in ok]),
        "tpot_s": distribution(tpots),
        "itl_s": distribution([gap for r in ok for gap in r.itls]),
        "e2el_s": distribution([r.e2el for r in ok]),
        "agentx": {
            "total_tput_per_gpu": (prompt + output) / span / num_gpus if span else 0.0,
            "p90_interactivity": 1 / p90_tpot if p90_tpot else None,
            "span_s": span,
        },
        "num_gpus": num_gpus,
    }
