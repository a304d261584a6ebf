"""`kestrel verify` on this CPU: the bundled model's record verifies its row by the model card's perplexity, a random
checkpoint's records speed only, and a checkout with uncommitted changes is refused (or marked, with --allow-dirty).
Git state comes from temporary repositories, never from this checkout (other work may leave it dirty)."""

from __future__ import annotations

import json
import subprocess

import pytest

from kestrel.cli import main
from kestrel.cookbook import verify as verify_module
from kestrel.cookbook.evidence import git_state, load_records
from kestrel.cookbook.matrix import RUNS, VERIFIED, matrix_rows
from kestrel.cookbook.recipes import RecipeRequest
from kestrel.cookbook.verify import ACCURACY_CHECK, DirtyTreeError, SmokeSettings, command_line, verify
from kestrel.engine.args import BUNDLED_MODEL

BUNDLED_RECIPE = "k3.1-tiny/cpu/unified/low-latency"
RANDOM_RECIPE = "kimi-linear-tiny/cpu/unified/low-latency"
SMALL = SmokeSettings(requests=2, prompt_len=6, max_tokens=4)
CARD = json.loads((BUNDLED_MODEL / "eval.json").read_text())


def git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A temporary git repository with one commit; verify reads its state in place of this checkout's."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    (path / "code.py").write_text("x = 1\n")
    git(path, "add", "code.py")
    git(path, "commit", "-q", "-m", "first")
    return path


@pytest.fixture
def use_repo(repo, monkeypatch):
    monkeypatch.setattr(verify_module, "git_state", lambda: git_state(repo))
    return repo


def test_git_state_names_the_commit_and_local_changes(repo, tmp_path):
    assert git_state(repo) == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False}
    (repo / "evidence").mkdir()
    (repo / "evidence" / "record.json").write_text("{}")                 # records are not code that ran
    assert not git_state(repo)["dirty"]
    (repo / "code.py").write_text("x = 2\n")
    assert git_state(repo)["dirty"]
    assert git_state(tmp_path / "elsewhere")["commit"] is None


def test_the_bundled_model_is_verified_by_its_held_out_perplexity(use_repo, tmp_path):
    record = verify(BUNDLED_RECIPE, SMALL, tmp_path)
    assert record.path.parent == tmp_path and record.hardware_id == "cpu"
    assert record.git == {"commit": git(use_repo, "rev-parse", "HEAD"), "dirty": False}
    assert record.engine_args["model"].startswith("the bundled k3.1-tiny")
    assert record.engine_args["dtype"] == "float32"
    bench = record.benchmark
    assert bench["output_tokens"] == 8 and bench["concurrency"] == 2
    assert bench["output_tokens_per_s"] > 0 and bench["ttft_s"] > 0 and bench["tpot_s"] > 0
    accuracy = record.accuracy
    assert accuracy["check"] == ACCURACY_CHECK and accuracy["passed"], accuracy
    assert accuracy["tokens"] == CARD["sample"]["tokens"] == 2141
    assert accuracy["reference"] == CARD["sample"]["perplexity"]
    assert accuracy["value"] == pytest.approx(CARD["sample"]["perplexity"], rel=1e-3)   # the card: float32 too
    [row] = matrix_rows(load_records(tmp_path), [RecipeRequest.from_id(BUNDLED_RECIPE)])
    assert row.badge == VERIFIED and row.evidence == (record.path.name,)
    assert "heldout_perplexity 71.94 vs 71.94 (tolerance 0.1%) passed" in row.summary


def test_a_random_checkpoint_records_speed_only_and_is_never_verified(use_repo, tmp_path):
    record = verify(RANDOM_RECIPE, SMALL, tmp_path)
    assert record.engine_args["model"] == "random kimi-linear-tiny checkpoint (seed 0)"
    assert record.accuracy is None and record.benchmark["output_tokens"] == 8
    [row] = matrix_rows(load_records(tmp_path), [RecipeRequest.from_id(RANDOM_RECIPE)])
    assert row.badge == RUNS


def test_a_dirty_checkout_is_refused_in_one_sentence(use_repo, tmp_path, capsys):
    (use_repo / "code.py").write_text("x = 2\n")
    evidence = tmp_path / "evidence"
    with pytest.raises(DirtyTreeError, match="uncommitted changes"):
        verify(RANDOM_RECIPE, SMALL, evidence)
    assert main(["verify", RANDOM_RECIPE, "--evidence-dir", str(evidence)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("kestrel verify: the checkout has uncommitted changes")
    assert message.endswith("commit them first (or pass --allow-dirty to mark the record dirty).")
    assert message.count(". ") == 0 and "\n" not in message
    assert not evidence.exists()


def test_allow_dirty_marks_the_record(use_repo, tmp_path, capsys):
    (use_repo / "code.py").write_text("x = 2\n")
    assert main(["verify", RANDOM_RECIPE, "--requests=2", "--prompt-len=6", "--max-tokens=4", "--allow-dirty",
                 "--evidence-dir", str(tmp_path)]) == 0
    [record] = load_records(tmp_path)
    assert record.git == {"commit": git(use_repo, "rev-parse", "HEAD"), "dirty": True}
    assert record.command.endswith("--max-tokens=4 --allow-dirty")
    assert "(uncommitted changes)" in capsys.readouterr().out


def test_no_git_checkout_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(verify_module, "git_state", lambda: git_state(tmp_path / "not-a-repo"))
    with pytest.raises(DirtyTreeError, match="not a git checkout; run it from a clone"):
        verify(RANDOM_RECIPE, SMALL, tmp_path)


def test_verify_runs_only_what_kestrel_can_launch_here(use_repo, tmp_path):
    evidence = tmp_path / "evidence"
    with pytest.raises(ValueError, match="has no kestrel command to run: kestrel's HiCache runs in one process"):
        verify("k3/b300/unified/low-latency,hicache=host", SMALL, evidence)
    with pytest.raises(ValueError, match="kestrel verify runs the CPU recipes"):
        verify("k3/b300/unified/low-latency", SMALL, evidence)
    with pytest.raises(ValueError, match="one half of a PD deployment"):
        verify("k3.1-tiny/cpu/prefill/low-latency", SMALL, evidence)
    with pytest.raises(ValueError, match="--requests must be at least 1"):
        verify(RANDOM_RECIPE, SmokeSettings(requests=0), evidence)
    assert not evidence.exists()


def test_default_settings_make_the_plain_command():
    assert command_line(BUNDLED_RECIPE, SmokeSettings()) == f"kestrel verify {BUNDLED_RECIPE}"
    assert command_line(BUNDLED_RECIPE, SmokeSettings(), allow_dirty=True).endswith(" --allow-dirty")
