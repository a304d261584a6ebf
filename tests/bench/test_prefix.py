"""The bench's prefix-cache report: the theoretical maximum counted by hand, and the server's hit rate read from
/metrics (checked against the gauges read directly and the per-response usage the server sent)."""

from __future__ import annotations

import json

import httpx

from kestrel.bench.prefix import HIT, QUERIED, metric, prefix_cache_report, theoretical_hits
from kestrel.bench.speculative import speculative_report
from kestrel.bench.workloads import RandomWorkload
from kestrel.cli import main

A = list(range(20, 32))                       # 12 tokens
B = A + list(range(40, 48))                   # A then 8 more
D = list(range(60, 70))                       # shares nothing


def test_theoretical_maximum_by_hand():
    """A: nothing before it. B: all of A (12). A again: all but its last token (11). D: nothing. A[:5] + [99]:
    the 5 tokens it shares with A."""
    prompts = [A, B, A, D, A[:5] + [99]]
    assert theoretical_hits(prompts) == (12 + 20 + 12 + 10 + 6, 12 + 11 + 5)
    assert theoretical_hits([]) == (0, 0)
    assert theoretical_hits([[5], [5]]) == (2, 0)          # a one-token prompt always computes its token


def test_report_without_gauges_or_tokens():
    report = prefix_cache_report("other_metric 1\n", None, None, "no /tokenize")
    assert report == {"server": None, "theoretical": {"unavailable": "no /tokenize"}}


def gauges(live) -> tuple[float, float]:
    text = httpx.get(live.url + "/metrics").text
    return metric(text, QUERIED), metric(text, HIT)


def test_run_reports_server_hit_rate_from_metrics(live, tmp_path):
    """A known workload, one request at a time: the result's theoretical maximum is the hand count, and its
    server numbers are the /metrics gauges' change over the run, which agree with the usage of each response."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3}) + "\n" for p in (A, B, A, D)))
    queried_before, hit_before = gauges(live)
    out = tmp_path / "results"
    assert main(["bench", "serve", "--base-url", live.url, "--output", str(out), "--workload", "file", "--file",
                 str(prompts), "--num-prompts", "4", "--warmup", "0"]) == 0
    queried_after, hit_after = gauges(live)
    result = json.loads((out / "file-c1.json").read_text())
    cache = result["prefix_cache"]
    assert cache["theoretical"] == {"prompt_tokens": 54, "cacheable_tokens": 23, "max_hit_rate": 23 / 54}
    served = sum(r["cached_tokens"] for r in result["requests"])
    assert served > 0
    assert cache["server"] == {"queried_tokens": queried_after - queried_before, "hit_tokens": hit_after - hit_before,
                               "hit_rate": (hit_after - hit_before) / (queried_after - queried_before)}
    assert (cache["server"]["queried_tokens"], cache["server"]["hit_tokens"]) == (54, served)
    assert cache["server"]["hit_tokens"] <= cache["theoretical"]["cacheable_tokens"]
    summary = (out / "summary.md").read_text()
    assert f"| {100 * served / 54:.1f} | {100 * 23 / 54:.1f} | - |" in summary        # no speculative decoding
    assert result["speculative"]["verifications"] == 0


def test_speculative_report_is_the_metrics_delta():
    def text(steps, drafted, accepted):
        return (f"kestrel_spec_verifications {steps}\nkestrel_spec_draft_tokens {drafted}\n"
                f"kestrel_spec_accepted_tokens {accepted}\n")
    report = speculative_report(text(10.0, 40.0, 12.0), text(30.0, 120.0, 42.0))
    assert report == {"verifications": 20, "draft_tokens": 80, "accepted_tokens": 30, "acceptance_length": 2.5}
    assert speculative_report(text(3.0, 9.0, 1.0), text(3.0, 9.0, 1.0))["acceptance_length"] is None
    assert speculative_report("other 1\n", text(1.0, 1.0, 1.0)) is None


def lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_each_concurrency_level_sends_its_own_prompts(live, tmp_path):
    """A sweep's levels send different prompts. Random filler text has no designed shared prefix, so a level's
    prompts (rebuilt from the seed its result records) start with at most a word or two of another level's, and the
    server serves no level from an earlier one's cached prompts: its hits stay within the level's own maximum."""
    out = tmp_path / "results"
    assert main(["bench", "serve", "--base-url", live.url, "--output", str(out), "--workload", "random",
                 "--num-prompts", "3", "--max-concurrency", "1,2", "--input-len", "24", "--output-len", "2",
                 "--seed", "5"]) == 0
    results = [json.loads((out / f"random-c{c}.json").read_text()) for c in (1, 2)]
    prompts = [[spec.body["prompt"] for spec in RandomWorkload(**{k: v for k, v in r["workload"].items()
                                                                  if k != "name"}).requests(4, live.url)]
               for r in results]
    assert max(lcp(a, b) for a in prompts[0] for b in prompts[1]) <= 2         # a word or two, by chance
    for r in results:
        cache = r["prefix_cache"]
        assert cache["server"]["hit_tokens"] <= cache["theoretical"]["cacheable_tokens"]
    assert "each concurrency level sent prompts of its own" in (out / "summary.md").read_text()
