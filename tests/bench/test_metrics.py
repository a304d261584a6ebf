"""Metric definitions on hand-made request timelines (vLLM / SGLang / AgentX)."""

from __future__ import annotations

import pytest

from kestrel.bench.metrics import RequestRecord, percentile, summarize


def test_per_request_definitions():
    r = RequestRecord(start=1.0, chunk_times=[1.5, 1.7, 2.0, 2.6], prompt_tokens=10, output_tokens=4)
    assert r.ttft == pytest.approx(0.5) and r.e2el == pytest.approx(1.6)
    assert r.tpot == pytest.approx((2.6 - 1.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])
    assert RequestRecord(start=0, chunk_times=[1.0], output_tokens=1).tpot is None


def test_run_summary():
    records = [
        RequestRecord(start=0.0, chunk_times=[1.0, 2.0, 3.0], prompt_tokens=100, output_tokens=3),
        RequestRecord(start=1.0, chunk_times=[1.5, 3.5], prompt_tokens=50, output_tokens=2),
        RequestRecord(start=2.0, error="HTTP 500: boom"),
    ]
    m = summarize(records, duration=4.0, num_gpus=2)
    assert (m["completed"], m["failed"], m["failure_reasons"]) == (2, 1, {"HTTP 500: boom": 1})
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(5 / 4) and m["input_throughput"] == pytest.approx(150 / 4)
    assert m["total_token_throughput_per_gpu"] == pytest.approx(155 / 4 / 2)
    assert m["ttft_s"]["mean"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["tpot_s"]["median"] == pytest.approx((1.0 + 2.0) / 2)      # tpots 1.0 and 2.0
    assert m["itl_s"]["mean"] == pytest.approx((1 + 1 + 2) / 3)
    assert m["agentx"]["span_s"] == pytest.approx(3.5)                   # first start 0 -> last end 3.5
    assert m["agentx"]["total_tput_per_gpu"] == pytest.approx(155 / 3.5 / 2)
    assert m["agentx"]["p90_interactivity"] == pytest.approx(1 / percentile([1.0, 2.0], 90))


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([5], 99) == 5
