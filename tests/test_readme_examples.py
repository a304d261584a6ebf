"""README.md's `kestrel` examples run: every `kestrel plan | recipe | inspect | matrix | random-model` line of its code
blocks goes through kestrel.cli.main and exits 0. `[...]` marks optional flags: each example runs once without them
and once with all of them. Commands that need a server or a long run (serve, generate, bench, eval, verify) are left
out; the ones that write files write into a temporary folder."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kestrel.cli import main
from kestrel.engine.args import BUNDLED_MODEL

README = Path(__file__).resolve().parents[1] / "README.md"
RUN = ("plan", "recipe", "inspect", "matrix", "random-model")
CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
OPTIONAL = re.compile(r"\[([^\[\]]*)\]")
COMMENT = re.compile(r"\s+#.*$")


def readme_examples() -> list[str]:
    """Every `kestrel <RUN command>` line of README's code blocks, comments stripped."""
    lines = [COMMENT.sub("", line).strip() for block in CODE_BLOCK.findall(README.read_text())
             for line in block.splitlines()]
    return [line for line in lines if line.startswith("kestrel ") and line.split()[1] in RUN]


def variants(example: str) -> list[str]:
    """The example without its optional flags, and with all of them."""
    return list(dict.fromkeys([OPTIONAL.sub("", example), OPTIONAL.sub(r"\1", example)]))


def argv(command: str, tmp_path: Path) -> list[str]:
    """The command's arguments with README's placeholders and output folders made real."""
    placeholders = {"path/to/model-or-config.json": str(BUNDLED_MODEL / "config.json"), "DIR": str(tmp_path / "model"),
                    "docs/cookbook": str(tmp_path / "docs")}
    return [placeholders.get(token, token) for token in shlex.split(command)[1:]]


EXAMPLES = [command for example in readme_examples() for command in variants(example)]


def test_the_readme_has_examples_of_every_command_run_here():
    assert {command.split()[1] for command in EXAMPLES} == set(RUN)


@pytest.mark.parametrize("command", EXAMPLES)
def test_readme_example_runs(command, tmp_path, capsys):
    assert main(argv(command, tmp_path)) == 0, capsys.readouterr().err
