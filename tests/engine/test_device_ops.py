"""The journal of between-step cache copies: merged copies leave the caches as copies made one at a time."""

import random

import pytest
import torch

from kestrel.engine.cache.device_ops import DeviceOps, apply_ops
from kestrel.layers.cache import HybridCache
from kestrel.config import parse_config
from kestrel.models.presets import tiny_config

SLOTS, PAGES, PAGE = 6, 6, 4


def _cache() -> HybridCache:
    cache = HybridCache.allocate(parse_config(tiny_config("k3.1-tiny")), SLOTS, PAGES, PAGE, torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for state in cache.kda:
        state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
        state.recurrent.copy_(torch.randn(state.recurrent.shape, generator=gen))
    for layer in cache.mla:
        for paged in (layer.latent, layer.index_keys):
            if paged is not None:
                paged.values.copy_(torch.randn(paged.values.shape, generator=gen))
    return cache


def _one_at_a_time(cache: HybridCache, kind: str, src: int, dst: int) -> None:
    if kind == "slots":
        for state in cache.kda:
            state.conv[dst] = state.conv[src].clone()
            state.recurrent[dst] = state.recurrent[src].clone()
    else:
        for layer in cache.mla:
            for paged in (layer.latent, layer.index_keys):
                if paged is not None:
                    paged.values[dst * PAGE:(dst + 1) * PAGE] = paged.values[src * PAGE:(src + 1) * PAGE].clone()


def _tensors(cache: HybridCache) -> list[torch.Tensor]:
    return [t for s in cache.kda for t in (s.conv, s.recurrent)] + [
        p.values for layer in cache.mla for p in (layer.latent, layer.index_keys) if p is not None]


@pytest.mark.parametrize("seed", range(20))
def test_journal_equals_copies_in_order(seed: int) -> None:
    rng = random.Random(seed)
    journaled, expected, ops = _cache(), _cache(), DeviceOps()
    for _ in range(12):
        kind = rng.choice(["slots", "pages"])
        src, dst = rng.sample(range(SLOTS), 2)
        ops.copy_slots([src], [dst]) if kind == "slots" else ops.copy_pages([src], [dst])
        _one_at_a_time(expected, kind, src, dst)
    taken = ops.take()
    if seed == 0:                           # seed 0 has independent neighbours: they merge into fewer copies
        assert len(taken) < 12
    apply_ops(journaled, taken)
    assert ops.take() == []
    for a, b in zip(_tensors(journaled), _tensors(expected)):
        assert torch.equal(a, b)


def test_a_copy_onto_its_own_source_is_refused() -> None:
    with pytest.raises(ValueError, match="distinct destinations"):
        DeviceOps().copy_slots([1, 2], [2, 3])
