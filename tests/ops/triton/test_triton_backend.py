"""The backend registry: auto picks torch on CPU tensors, a forced choice holds per family, the environment
variable applies to families without a choice, and mistakes are explained."""

from __future__ import annotations

import pytest

from kestrel.ops import backend
from kestrel.ops.torch import kda_decode as torch_kda_decode
from kestrel.ops.torch import paged_attention as torch_paged_attention
from kestrel.ops.triton import kda_decode as triton_kda_decode
from kestrel.ops.triton import mla_decode as triton_mla_decode


@pytest.fixture(autouse=True)
def clean_choices(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    backend.set_backend(None)
    yield
    backend.set_backend(None)


def test_every_op_has_both_implementations_with_one_signature() -> None:
    import inspect
    for op in backend.OPS:
        backend.set_backend(backend.TORCH)
        reference = backend.get_op(op, "cpu")
        backend.set_backend(backend.TRITON)
        kernel = backend.get_op(op, "cpu")
        assert reference is not kernel
        assert inspect.signature(reference) == inspect.signature(kernel), op


def test_auto_runs_torch_on_cpu() -> None:
    assert backend.get_op("kda_decode", "cpu") is torch_kda_decode.kda_decode
    assert backend.backend_for("moe_experts", "cpu") == backend.TORCH


def test_forced_family_leaves_the_others_alone(monkeypatch) -> None:
    backend.set_backend(backend.TRITON, "kda")
    assert backend.get_op("kda_decode", "cpu") is triton_kda_decode.kda_decode
    assert backend.get_op("paged_mla_decode", "cpu") is torch_paged_attention.paged_mla_decode
    monkeypatch.setenv(backend.ENV_VAR, backend.TRITON)
    assert backend.get_op("paged_mla_decode", "cpu") is triton_mla_decode.paged_mla_decode
    backend.set_backend(backend.TORCH, "attention")
    assert backend.get_op("paged_mla_decode", "cpu") is torch_paged_attention.paged_mla_decode


def test_mistakes_are_explained(monkeypatch) -> None:
    with pytest.raises(ValueError, match="unknown ops backend"):
        backend.set_backend("cuda")
    with pytest.raises(ValueError, match="unknown op family"):
        backend.set_backend(backend.TORCH, "mlp")
    with pytest.raises(ValueError, match="unknown op"):
        backend.get_op("flash_attention", "cpu")
    monkeypatch.setenv(backend.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="KESTREL_OPS_BACKEND"):
        backend.get_op("moe_experts", "cpu")
    monkeypatch.setenv(backend.ENV_VAR, backend.TRITON)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.get_op("moe_experts", "cpu")
