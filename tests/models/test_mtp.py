"""The MTP head: incremental (cached) draft logits equal the full computation, and depth indexes MTP layers."""

from __future__ import annotations

import torch

from helpers import tiny_model
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache


def test_mtp_with_cache_equals_full_forward():
    model, _ = tiny_model("k3.1-tiny")
    assert len(model.mtp_layers) == 1
    seq = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_batch = ForwardBatch.build([29])
        hidden = model(seq[:-1], full_batch)
        expected = model.mtp_logits(hidden, seq[1:], full_batch)

        cache = HybridCache.allocate(model.config, 1, 8, 4, dtype=torch.float32, mtp_layers=1)
        table = torch.arange(8)[None]
        got = []
        for start, end in ((0, 20), *((i, i + 1) for i in range(20, 29))):
            batch = ForwardBatch.build([end - start], [start], [0], table, 4)
            h = model(seq[start:end], batch, cache)
            got.append(model.mtp_logits(h, seq[start + 1:end + 1], batch, cache))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)
    assert cache.mla[-1].index_keys is None and cache.mla[-1].latent.values[:29].abs().sum() > 0
