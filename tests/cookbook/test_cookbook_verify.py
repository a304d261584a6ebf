"""`kestrel verify` on this CPU: a real smoke run writes a complete record that verifies its matrix row."""

from __future__ import annotations

import pytest

from kestrel.cookbook.evidence import load_records
from kestrel.cookbook.matrix import VERIFIED, matrix_rows
from kestrel.cookbook.recipes import RecipeRequest
from kestrel.cookbook.verify import ACCURACY_CHECK, SmokeSettings, command_line, verify

RECIPE = "kimi-linear-tiny/cpu/unified/low-latency"
SMALL = SmokeSettings(requests=2, prompt_len=6, max_tokens=4)


def test_verify_writes_a_record_that_verifies_the_row(tmp_path):
    record = verify(RECIPE, SMALL, tmp_path)
    assert record.path.parent == tmp_path and record.hardware_id == "cpu"
    assert record.command == "kestrel verify kimi-linear-tiny/cpu/unified/low-latency --requests=2 --prompt-len=6 " \
                             "--max-tokens=4"
    bench = record.benchmark
    assert bench["output_tokens"] == 8 and bench["concurrency"] == 2
    assert bench["output_tokens_per_s"] > 0 and bench["ttft_s"] > 0 and bench["tpot_s"] > 0
    accuracy = record.accuracy
    assert accuracy["check"] == ACCURACY_CHECK and accuracy["positions"] == 8
    assert accuracy["passed"], accuracy
    assert record.software["kestrel"] and record.hardware["cpu_cores"] >= 1
    assert record.engine_args["mamba_full_memory_ratio"] > 0
    records = load_records(tmp_path)
    [row] = matrix_rows(records, [RecipeRequest.from_id(RECIPE)])
    assert row.badge == VERIFIED and row.evidence == (record.path.name,)


def test_verify_runs_only_what_kestrel_can_launch_here(tmp_path):
    with pytest.raises(ValueError, match="has no kestrel command to run: kestrel's engine runs on one device"):
        verify("k3/b300/unified/balanced", SMALL, tmp_path)
    with pytest.raises(ValueError, match="--requests must be at least 1"):
        verify(RECIPE, SmokeSettings(requests=0), tmp_path)
    assert not list(tmp_path.iterdir())


def test_default_settings_make_the_plain_command():
    assert command_line(RECIPE, SmokeSettings()) == f"kestrel verify {RECIPE}"
