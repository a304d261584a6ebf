"""Evidence records, the badges derived from them, the claims ledger's statuses, and the generated docs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kestrel.cookbook.evidence import (DEFAULT_EVIDENCE_DIR, Record, file_name, load_records, read_record,
                                       write_record)
from kestrel.cookbook.ledger import (CONSISTENT, CONTRADICTED, REPRODUCED, UNVERIFIED, claims, evaluate,
                                     ledger_rows)
from kestrel.cookbook.matrix import NOT_VERIFIED, RUNS, VERIFIED, badge, matrix_rows
from kestrel.cookbook.publish import write_docs
from kestrel.cookbook.recipes import RecipeRequest

CPU_RECIPE = "k3.1-tiny/cpu/unified/low-latency"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cookbook"


def record(recipe=CPU_RECIPE, hardware_id="cpu", speed=True, passed=True, created="2026-11-30T00:00:00Z"):
    return Record(recipe=recipe, hardware_id=hardware_id, hardware={}, software={},
                  git={"commit": "0123456789abcdef0123", "dirty": False}, command="kestrel verify",
                  created=created, engine_args={},
                  benchmark={"output_tokens_per_s": 12.5, "concurrency": 8} if speed else None,
                  accuracy={"check": "heldout_perplexity", "value": 71.94 if passed else 90.0, "reference": 71.94,
                            "tolerance": 1e-3, "passed": passed})


def test_badges_come_from_records_only():
    assert badge([]) == NOT_VERIFIED
    assert badge([record(passed=False)]) == RUNS
    assert badge([record(speed=True, passed=True)]) == VERIFIED
    assert badge([record(speed=False, passed=True)]) == NOT_VERIFIED
    requests = [RecipeRequest.from_id(CPU_RECIPE), RecipeRequest.from_id("k3/b300/unified/balanced")]
    rows = matrix_rows([record(), record(recipe="k3/b300/unified/balanced")], requests)
    assert [r.badge for r in rows] == [VERIFIED, NOT_VERIFIED]         # a CPU record does not verify a B300 cell
    assert rows[1].sglang_status == "Verified"                          # SGLang's badge is shown, not adopted
    rows = matrix_rows([record(recipe="k3-tiny/cpu/unified/low-latency", hardware_id="cpu")], requests[:1])
    assert [r.recipe for r in rows] == [CPU_RECIPE, "k3-tiny/cpu/unified/low-latency"]


def test_records_round_trip_and_bad_files_are_named(tmp_path):
    path = write_record(record(), tmp_path)
    assert read_record(path).as_dict() == record().as_dict()
    assert load_records(tmp_path)[0].accuracy_passed
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json is not a readable JSON file"):
        load_records(tmp_path)
    (tmp_path / "broken.json").write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="broken.json is not a kestrel evidence record"):
        load_records(tmp_path)
    assert load_records(tmp_path / "missing") == []


def test_claim_statuses():
    rows = {r.id: r for r in ledger_rows([])}
    assert rows["agentx-gb300-33.7k"].status == UNVERIFIED
    assert rows["dflash2-megakernel-450"].status == UNVERIFIED
    assert rows["sglang-b300-ll-nospec-c1"].status == CONSISTENT
    assert "1000 / 8.51 ms" in rows["sglang-b300-ll-nospec-c1"].reason
    assert rows["sglang-h200-ht-kv"].status == CONSISTENT
    assert rows["alibaba-m890-supernode"].status == CONSISTENT
    assert rows["mlperf-rubin-dsr1"].status == UNVERIFIED


def test_a_claim_beyond_the_roofline_is_contradicted_with_the_arithmetic():
    claim = copy.deepcopy(next(c for c in claims() if c["id"] == "sglang-b300-ll-nospec-c1"))
    claim["check"]["tpot_ms"] = 0.5                                     # 2,000 tok/s for one user on TP8
    row = evaluate(claim, [])
    assert row.status == CONTRADICTED
    assert "claimed 2,000.0 tok/s per user (1000 / 0.5 ms) > the roofline's" in row.reason
    assert "GB per rank per step" in row.reason and "7.7 TB/s" in row.reason


def test_a_record_of_ours_reproduces_a_claim():
    claim = {"id": "ours", "claim": "x", "source": "a public page", "conditions": "c",
             "check": {"kind": "record", "recipe": CPU_RECIPE, "metric": "benchmark.output_tokens_per_s",
                       "value": 12.0, "tolerance": 0.1}}
    assert evaluate(claim, [record()]).status == REPRODUCED
    assert evaluate(claim, []).status == UNVERIFIED
    claim["check"]["value"] = 50.0
    assert "outside 10% of the claimed 50.0" in evaluate(claim, [record()]).reason


def test_summaries_name_the_check_and_the_commit():
    [row] = matrix_rows([record()], [RecipeRequest.from_id(CPU_RECIPE)])
    assert row.summary == ("12.5 output tok/s at concurrency 8; heldout_perplexity 71.94 vs 71.94 (tolerance 0.1%) "
                           "passed; commit 0123456789ab (2026-11-30)")
    dirty = record()
    dirty.git["dirty"], dirty.accuracy = True, None
    [row] = matrix_rows([dirty], [RecipeRequest.from_id(CPU_RECIPE)])
    assert row.badge == RUNS
    assert row.summary == "12.5 output tok/s at concurrency 8; commit 0123456789ab (uncommitted changes) (2026-11-30)"


def test_committed_evidence_comes_from_committed_code_and_the_bundled_model():
    """The CPU records: the bundled model's verifies its row by the card's perplexity; the other tiny models, which
    have only random weights, record speed only; every record names a commit and none ran on a dirty tree."""
    records = load_records(DEFAULT_EVIDENCE_DIR)
    cpu = {r.recipe: r for r in records if r.hardware_id == "cpu"}
    assert set(cpu) == {CPU_RECIPE, "k3-tiny/cpu/unified/low-latency", "kimi-linear-tiny/cpu/unified/low-latency"}
    for r in records:
        assert r.git.get("commit") and r.git.get("dirty") is False and r.software["torch"]
    bundled = cpu.pop(CPU_RECIPE)
    assert bundled.command.startswith("kestrel verify ") and bundled.engine_args["model"].startswith("the bundled")
    assert bundled.accuracy["check"] == "heldout_perplexity" and bundled.accuracy_passed
    assert bundled.accuracy["tokens"] == 2141 and abs(bundled.accuracy["relative_difference"]) <= 1e-3
    for r in cpu.values():
        assert r.engine_args["model"].startswith("random ") and r.accuracy is None
    rows = {row.recipe: row.badge for row in matrix_rows(records)}
    assert rows[CPU_RECIPE] == VERIFIED and rows["k3-tiny/cpu/unified/low-latency"] == RUNS


def test_generated_docs_are_up_to_date(tmp_path):
    """docs/cookbook is derived, never hand-edited: regenerating it changes nothing."""
    for path in write_docs(tmp_path):
        committed = DOCS / path.name
        assert committed.is_file(), f"run `kestrel matrix --write docs/cookbook` ({committed} is missing)"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `kestrel matrix --write " \
                                                          "docs/cookbook`"


def test_records_are_plain_json():
    for path in DEFAULT_EVIDENCE_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        assert raw["schema"] == "kestrel.evidence/1" and path.name == file_name(read_record(path))
