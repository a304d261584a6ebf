"""kestrel.ops.tracing: constant_when_traced marks a function as torch.compiler.assume_constant_result does, and
tracing folds its result; a kestrel process that serves eagerly never imports torch._dynamo or inductor (their
import took ~2 s of every process's start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kestrel.ops.tracing import constant_when_traced


def test_the_mark_is_assume_constant_results() -> None:
    def ours() -> bool:
        return True

    def torchs() -> bool:
        return True

    assert vars(constant_when_traced(ours)) == vars(torch.compiler.assume_constant_result(torchs)) != {}


def test_a_marked_function_is_a_constant_to_the_traced_graph() -> None:
    """The graph keeps the value the function returned while tracing, with no guard on it."""
    answer = [True]
    calls = []

    @constant_when_traced
    def on() -> bool:
        calls.append(1)
        return answer[0]

    step = torch.compile(lambda x: x + 1 if on() else x - 1, backend="eager", fullgraph=True)
    x = torch.zeros(3)
    assert torch.equal(step(x), x + 1)
    answer[0] = False
    assert torch.equal(step(x), x + 1) and on() is False
    assert len(calls) == 2              # once traced, once called here


STARTUP = """
import sys
import kestrel.cli
from kestrel.engine.llm import LLM
from kestrel.engine.sampling import SamplingParams
import kestrel.ops.cpu as cpu
assert cpu.load()
out = LLM("models/k3.1-tiny").generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
assert len(out[0].outputs[0].token_ids) == 2
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_an_eager_engine_never_imports_the_compiler() -> None:
    root = Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", STARTUP], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
