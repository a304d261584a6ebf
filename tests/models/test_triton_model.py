"""The whole model on the Triton backend (kernels under Triton's interpreter) against the torch backend: the same
greedy tokens through prefill and cached decode, for a K3.1 and a Kimi-Linear tiny model."""

from __future__ import annotations

import pytest
import torch

from helpers import greedy_generate, tiny_model
from kestrel.ops import backend

PROMPTS = [[5, 9, 14, 3, 77, 2, 31], [8]]


@pytest.fixture
def restore_backends():
    yield
    backend.set_backend(None)


@pytest.mark.parametrize("preset", ["k3.1-tiny", "kimi-linear-tiny"])
def test_triton_backend_gives_the_torch_backends_greedy_tokens(preset, restore_backends):
    model, _ = tiny_model(preset)
    backend.set_backend("torch")
    expected = greedy_generate(model, PROMPTS, 3, page_size=4)
    backend.set_backend("triton")
    assert backend.backend_for("moe_experts", "cpu") == "triton"
    with torch.no_grad():
        assert greedy_generate(model, PROMPTS, 3, page_size=4) == expected
