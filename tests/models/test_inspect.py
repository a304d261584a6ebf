"""`kestrel inspect` accounting: the published K3 figures, and agreement with a real model's tensors."""

from __future__ import annotations

import pytest
import torch

from helpers import FAMILY, tiny_model
from kestrel.config import load_config
from kestrel.models.inspect import inspect_config


def test_k3_reproduces_the_published_counts():
    report = inspect_config(load_config("k3"))
    assert report.total_params == pytest.approx(2.78e12, rel=0.002)        # 2.7795T text (+0.4B vision)
    assert report.active_params == pytest.approx(104.19e9, rel=0.0005)     # model card: 104.19B incl. lm_head
    assert report.kv_bytes_per_token == 24 * 576 * 2 == 27_648
    assert report.state_bytes_per_sequence == 449_372_160
    assert report.weight_bytes["float32"] == pytest.approx(11.1e6 * 4, rel=0.01)


def test_k31_adds_only_the_indexer():
    k3, k31 = inspect_config(load_config("k3")), inspect_config(load_config("k3.1-pro"))
    indexer = 24 * (4096 * 1536 + 128 * 7168 + 32 * 7168 + 128)
    assert k31.total_params - k3.total_params == indexer
    assert k31.kv_bytes_per_token - k3.kv_bytes_per_token == 24 * 128 * 2


def test_kimi_linear_48b_is_48b_a3b():
    report = inspect_config(load_config("kimi-linear-48b"))
    assert report.total_params == pytest.approx(49.1e9, rel=0.01)
    assert report.active_params == pytest.approx(3.1e9, rel=0.02)


@pytest.mark.parametrize("preset", FAMILY)
def test_counts_agree_with_a_built_model(preset):
    model, _ = tiny_model(preset)
    report = inspect_config(model.config, dtype=torch.float32)
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert sum(report.weight_bytes.values()) == stored
    params = sum(p.numel() for p in model.parameters())
    packed = sum(b.numel() * 2 for n, b in model.named_buffers() if n.endswith("_packed"))
    assert report.total_params == params + packed
