"""kestrel.ops.cpu's build: where the C++ compiler is missing or fails, load() logs why and returns False, so that
callers take their torch paths (the kernels' results are tested with their ops: test_moe_experts, test_kda_decode),
and the cache holds no partial library."""

from __future__ import annotations

import logging

import pytest

import kestrel.ops.cpu as cpu


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])
def test_a_failed_build_leaves_the_torch_paths(compiler: str, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu, "CACHE", tmp_path / "cpu-kernels")
    monkeypatch.setenv("CXX", str(tmp_path / compiler) if compiler.startswith("no-") else compiler)
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        assert cpu.load.__wrapped__() is False
    assert "kestrel's CPU kernels failed to build, using the torch paths" in caplog.text
    assert not any((tmp_path / "cpu-kernels").glob("*.so"))
