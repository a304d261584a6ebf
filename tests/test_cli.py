"""The command line: inspect output, random checkpoints, greedy generation, stop-string escapes, help for every flag,
and exit status 2 on bad input."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kestrel.cli import _parser, main
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


def test_stop_strings_take_backslash_escapes():
    """`--stop "\\n"` as a shell passes it (a backslash and an n) is a newline; an escaped backslash stays one."""
    args = _parser().parse_args(["generate", "--prompt", "x", "--stop", "\\n", "--stop", "a\\\\nb", "--stop", "é\\t"])
    assert args.stop == ["\n", "a\\nb", "é\t"]


def test_generate_stops_at_a_newline_written_as_backslash_n(capsys):
    """The bundled model's greedy continuation, generated again with `--stop "\\n"`, ends before its first newline."""
    argv = ["generate", "--prompt", "ROMEO.\nBut soft, what light", "--max-tokens", "12", "--dtype", "float32"]
    assert main(argv) == 0
    full = capsys.readouterr().out.removesuffix("\n")
    assert "\n" in full
    assert main([*argv, "--stop", "\\n"]) == 0
    assert capsys.readouterr().out == full.split("\n")[0] + "\n"


def test_generate_prints_the_logprobs_it_was_asked_for(capsys):
    """--logprobs 2 on the bundled model's greedy continuation: each position lists its token (the most likely
    one, greedy) and at most 2 alternatives, and the cumulative logprob is the sum of the tokens' own."""
    argv = ["generate", "--prompt", "ROMEO.\nBut soft", "--max-tokens", "6", "--dtype", "float32", "--logprobs", "2"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    chosen = [position[str(token)] for token, position in zip(record["token_ids"], record["logprobs"], strict=True)]
    assert len(chosen) == 6 and all(len(position) <= 3 for position in record["logprobs"])
    assert all(logprob == max(position.values()) for logprob, position in zip(chosen, record["logprobs"]))
    assert record["cumulative_logprob"] == pytest.approx(sum(chosen), abs=1e-5)


def subcommand_parsers(parser: argparse.ArgumentParser, path: str = "kestrel"):
    """(command path, parser) of every subcommand below parser, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{path} {name}", sub
                yield from subcommand_parsers(sub, f"{path} {name}")


def test_every_flag_has_help_and_shows_its_default():
    """Every flag and positional of every subcommand says what it is; --help shows defaults that have a value."""
    parsers = dict(subcommand_parsers(_parser()))
    assert {"kestrel serve", "kestrel generate", "kestrel bench serve", "kestrel eval perplexity",
            *(f"kestrel {name}" for name in ("plan", "recipe", "verify", "matrix", "site"))} <= set(parsers)
    missing = [(path, action.dest) for path, p in parsers.items() for action in p._actions
               if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()]
    assert missing == []
    serve_help = " ".join(parsers["kestrel serve"].format_help().split())
    assert "tokens per KV page (default: 16)" in serve_help and "HTTP port (default: 8000)" in serve_help
    assert "(default: None)" not in serve_help and "(default: False)" not in serve_help
