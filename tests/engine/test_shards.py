"""A PD handoff's state between layouts: split for each rank of a layout, every share has the names and shapes of
that rank's caches, and the shares gather back to the single-process entry bit for bit. (That the gathered entry of
real ranks equals one process's caches is tests/distributed/test_tp_logits.py's.)"""

from __future__ import annotations

import pytest
import torch

from kestrel.config import parse_config
from kestrel.distributed.layout import ParallelLayout
from kestrel.engine.cache.device_ops import entry_spec, read_parts
from kestrel.engine.cache.shards import gather_entry, shard_entry
from kestrel.engine.handoff import handoff_parts
from kestrel.layers.cache import FP8, HybridCache
from kestrel.models.presets import tiny_config

PAGE, PARTS = 4, handoff_parts(1, [2, 0])


def filled_cache(config, layout: ParallelLayout, kv_dtype) -> HybridCache:
    cache = HybridCache.allocate(layout.cache_config(config), 2, 3, PAGE, torch.float32, kv_dtype=kv_dtype,
                                 dcp_size=layout.dcp_size)
    gen = torch.Generator().manual_seed(0)
    for state in cache.kda:
        for t in (state.conv, state.recurrent):
            t.copy_(torch.randn(t.shape, generator=gen))
    for layer in cache.mla:
        for rows in (layer.latent, layer.index_keys):
            if rows is not None:
                rows.values.copy_(torch.randn(rows.values.shape, generator=gen).to(rows.values.dtype))
                if rows.scales is not None:
                    rows.scales.copy_(torch.rand(rows.scales.shape, generator=gen))
    return cache


@pytest.mark.parametrize("preset", ["k3.1-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("sizes", [dict(tp_size=2), dict(pp_size=2), dict(tp_size=2, pp_size=2),
                                   dict(tp_size=2, dcp_size=2), dict(tp_size=2, pp_size=2, dcp_size=2)])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_shares_fit_each_ranks_caches_and_gather_back(preset, sizes, kv_dtype):
    config = parse_config(tiny_config(preset))
    entry = read_parts(filled_cache(config, ParallelLayout(), kv_dtype), PARTS)
    layout = ParallelLayout(**sizes)
    shares = [shard_entry(entry, layout.with_rank(r), config) for r in range(layout.world_size)]
    for rank, share in enumerate(shares):
        spec = entry_spec(filled_cache(config, layout.with_rank(rank), kv_dtype), PARTS)
        assert {name: (t.shape, t.dtype) for name, t in share.items()} == spec
    gathered = gather_entry(shares, layout, config)
    assert gathered.keys() == entry.keys()
    for name, tensor in entry.items():
        assert torch.equal(gathered[name].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
