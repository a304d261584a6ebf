"""The cookbook's subcommands on an argparse parser, as kestrel.cli registers them."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from kestrel.cookbook.anchors import anchors
from kestrel.cookbook.calculator import MODES
from kestrel.cookbook.cli import add_commands
from kestrel.cookbook.hardware import CPU
from kestrel.cookbook.recipe_request import STRATEGIES, RecipeRefused, RecipeRequest
from kestrel.cookbook.recipes import make_recipe


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kestrel")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_plan_json(capsys):
    assert run("plan", "--model", "k3", "--hardware", "b300", "--tp", "8", "--dcp", "8", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["state_bytes_per_slot_per_rank"] == 56_171_520
    assert result["kv_bytes_per_token"] == 27_648 and result["kv_bytes_per_token_per_rank"] == 3456
    assert result["fits"] is True and result["min_devices"]["b300"] == 8


def test_plan_table(capsys):
    assert run("plan", "--model", "k3.1-pro", "--batch", "1,64", "--context", "1048576") == 0
    out = capsys.readouterr().out
    assert "KDA state per slot       449,372,160 B (fp32); per rank 56,171,520 B" in out
    assert "index>weights at" in out and "memory ratio" in out
    assert "PD handoff" not in out
    assert run("plan", "--model", "k3", "--mode", "prefill", "--kv-dtype", "fp8", "--avg-request-len", "1000") == 0
    assert ("PD handoff               0.46 GB per 1,000-token prompt in kestrel's layout (pages of latents + indexer "
            "keys, plus the 0.45 GB KDA state): R prompts/s need R x 0.46 GB/s from prefill to decode") in \
        capsys.readouterr().out


def test_recipe_by_id_and_by_flags(capsys):
    assert run("recipe", "k3/b300/unified/balanced") == 0
    by_id = capsys.readouterr().out
    assert run("recipe", "--model", "k3", "--hardware", "b300", "--strategy", "balanced") == 0
    assert capsys.readouterr().out == by_id
    assert "--mamba-full-memory-ratio 7.21" in by_id and "kestrel serve" in by_id and "--dcp-size 8" in by_id


def test_recipe_list_names_every_cpu_lane_that_generates(capsys):
    """Every CPU combination the generator makes a recipe of is listed (Unified and both PD roles), and nothing else."""
    assert run("recipe", "--list") == 0
    listed = {line for line in capsys.readouterr().out.splitlines() if "/cpu/" in line}
    generated = set()
    for model, mode, strategy in itertools.product(anchors()["kestrel"]["cpu_models"], MODES, STRATEGIES):
        request = RecipeRequest(model=model, hardware=CPU, mode=mode, strategy=strategy)
        try:
            generated.add(make_recipe(request).id)
        except RecipeRefused:
            pass
    assert "k3.1-tiny/cpu/prefill/low-latency" in listed and "k3.1-tiny/cpu/decode/low-latency" in listed
    assert listed == generated


def test_recipe_json(capsys):
    assert run("recipe", "k3/gb300/decode/balanced", "--json") == 0
    recipe = json.loads(capsys.readouterr().out)
    assert recipe["id"] == "k3/gb300/decode/balanced" and recipe["nodes"] == 2 and recipe["ratio"] == "1.44"


@pytest.mark.parametrize("argv, message", [
    (("plan", "--hardware", "a100"), "unknown hardware 'a100'"),
    (("plan", "--tp", "7"), "not divisible by the attention TP size 7"),
    (("plan", "--batch", "1,x"), "--batch must be comma-separated integers"),
    (("recipe", "--hardware", "tpu7x"), "no recipe for tpu7x"),
    (("verify", "k3/b300/unified/low-latency,hicache=host"), "no kestrel command to run"),
])
def test_bad_input_raises_one_sentence(argv, message):
    with pytest.raises(ValueError, match=message):
        run(*argv)


def test_matrix_prints_both_tables(capsys, tmp_path):
    assert run("matrix", "--evidence-dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Verification matrix") and "# Claims ledger" in out
    assert run("matrix", "--evidence-dir", str(tmp_path), "--write", str(tmp_path / "docs")) == 0
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["claims.md", "hardware.md", "matrix.md",
                                                                     "wide-ep.md"]


def test_inspect_and_plan_count_a_ranks_weights_by_the_engines_rules(capsys):
    """`kestrel inspect --tp-size 2 --ep-size 2` and `kestrel plan --engine kestrel` agree on the bundled model's
    heaviest rank (its 96-wide MXFP4 experts split 64 + 32 would not be even; EP2 splits whole experts)."""
    from kestrel.cli import main
    from kestrel.engine.args import BUNDLED_MODEL

    assert main(["inspect", str(BUNDLED_MODEL), "--tp-size", "2", "--ep-size", "2", "--json"]) == 0
    per_rank = json.loads(capsys.readouterr().out)["weight_bytes_per_rank"]
    assert run("plan", "--model", str(BUNDLED_MODEL), "--hardware", "cpu", "--tp", "2", "--ep", "2", "--engine",
               "kestrel", "--batch", "1", "--json") == 0
    planned = json.loads(capsys.readouterr().out)
    assert max(per_rank) == per_rank[0] == planned["weight_bytes_per_rank_total"]
    assert main(["inspect", str(BUNDLED_MODEL), "--tp-size", "2", "--pp-size", "2", "--json"]) == 0
    staged = json.loads(capsys.readouterr().out)["weight_bytes_per_rank"]
    assert run("plan", "--model", str(BUNDLED_MODEL), "--hardware", "cpu", "--tp", "2", "--pp", "2", "--engine",
               "kestrel", "--batch", "1", "--json") == 0
    assert len(staged) == 4 and max(staged) == json.loads(capsys.readouterr().out)["weight_bytes_per_rank_total"]
    assert main(["inspect", str(BUNDLED_MODEL), "--tp-size", "2", "--json"]) == 0
    tp2 = json.loads(capsys.readouterr().out)["weight_bytes_per_rank"]
    assert sum(staged) == sum(tp2) and 0 < sum(staged[:2]) < sum(tp2)     # the two stages split TP2's weights
    assert main(["inspect", str(BUNDLED_MODEL), "--tp-size", "2", "--dp-size", "2", "--json"]) == 0
    dp2 = json.loads(capsys.readouterr().out)["weight_bytes_per_rank"]     # attention whole on each rank
    assert run("plan", "--model", str(BUNDLED_MODEL), "--hardware", "cpu", "--tp", "2", "--dp", "2", "--engine",
               "kestrel", "--batch", "1", "--json") == 0
    assert max(dp2) == json.loads(capsys.readouterr().out)["weight_bytes_per_rank_total"] and min(dp2) > max(tp2)


def test_no_buffer_with_the_overlap_scheduler_is_refused(capsys):
    """Issue 59 row 6: SGLang's mamba_hook.validate_mamba_no_buffer asserts disable_overlap_schedule (besides page
    size 1 and no trtllm_mha), so the planner refuses no_buffer with the overlap scheduler on: one sentence, exit 2."""
    from kestrel.cli import main
    argv = ["plan", "--model", "k3", "--hardware", "b300", "--tp", "8", "--radix-strategy", "no_buffer"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no_buffer" in err and "--disable-overlap-schedule" in err and err.count("\n") == 1
    assert main([*argv, "--disable-overlap-schedule", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["slots_per_request"] == 3
