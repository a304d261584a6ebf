"""The command line: inspect output, random checkpoints, greedy generation, and exit status 2 on bad input."""

from __future__ import annotations

import json

import pytest
import torch

from kestrel.cli import main
from kestrel.models.checkpoint import load_model
from helpers import greedy_generate


def test_inspect_json_for_a_published_model(capsys):
    assert main(["inspect", "k3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert round(report["total_params"] / 1e12, 2) == 2.78 and round(report["active_params"] / 1e9, 1) == 104.2


def test_inspect_table(capsys):
    assert main(["inspect", "k3.1-pro"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split("  ", 1) for line in out.splitlines())
    assert rows["active parameters per token"].strip().startswith("104.37B") and "24 indexer" in out


def test_random_model_then_generate(tmp_path, capsys):
    assert main(["random-model", "k3.1-tiny", "--out", str(tmp_path), "--seed", "3"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,5,9", "--max-tokens", "6"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    model = load_model(tmp_path, dtype=torch.float32)
    assert printed == greedy_generate(model, [[1, 5, 9]], 6, stop_token_id=model.config.eos_token_id)[0]


def test_generate_from_a_jsonl_file(tmp_path, capsys):
    main(["random-model", "kimi-linear-tiny", "--out", str(tmp_path / "m")])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [3, 4]}\n{"prompt_token_ids": [5]}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tmp_path / "m"), "--input", str(prompts), "--output", str(out),
                 "--max-tokens", "3", "--ignore-eos", "--page-size", "4"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_token_ids"] for r in rows] == [[3, 4], [5]]
    assert all(len(r["outputs"][0]["token_ids"]) == 3 and r["outputs"][0]["finish_reason"] == "length" for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["inspect", "/no/such/model"], "does not exist"),
    (["random-model", "k3", "--out", "/tmp/x"], "more than half of this machine's"),
    (["generate", "--model", "/no/such", "--prompt-ids", "1"], "is not a model folder"),
    (["generate", "--speculative-algorithm", "NEXTN", "--speculative-token-map", "/no/such.pt", "--prompt-ids", "1"],
     "--speculative-token-map /no/such.pt: no such file."),
    (["serve", "--dp-size", "2", "--disaggregation-mode", "prefill"], "runs one node's unified instances"),
])
def test_bad_input_exits_2_with_one_sentence(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_generate_input(tmp_path, capsys):
    main(["random-model", "kimi-linear-tiny", "--out", str(tmp_path)])
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,x"]) == 2
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "100000"]) == 2
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello"]) == 2
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--temperature", "-1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kestrel generate:")]
    assert len(errors) == 4
    assert "integers in [0, 256)" in errors[1] and "no tokenizer.json" in errors[2] and "temperature" in errors[3]
