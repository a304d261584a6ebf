"""Marks for torch.compile's tracing that leave torch._dynamo unimported until something compiles (importing it
takes ~1.7 s of every kestrel process's start-up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

CONSTANT_MARK = "_dynamo_marked_constant"
"""The attribute torch.compiler.assume_constant_result sets (tests/ops/test_tracing.py checks it does)."""


def constant_when_traced(fn: F) -> F:
    """torch.compiler.assume_constant_result(fn) without importing torch._dynamo: tracing calls fn once and keeps
    its result as a constant."""
    setattr(fn, CONSTANT_MARK, True)
    return fn
