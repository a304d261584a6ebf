"""Cache writes the engine makes between steps (a fork's copied state and partial page; later a prefix-cache hit's
restored snapshot), journaled and applied in order at the start of the next step.

Journaling keeps the pools free of tensor work (each step applies every pending copy as one indexed copy per
layer) and gives a distributed engine one list to send: every rank applies the same journal to its own shard.
"""

from __future__ import annotations

import torch

from ...layers.cache import HybridCache

Op = tuple[str, list[int], list[int]]
"""(kind, src, dst): kind "slots" copies state slots src[i] -> dst[i]; "pages" copies KV pages."""


class DeviceOps:
    """The journal: copy_slots and copy_pages record, take() hands over (and clears) what was recorded."""

    def __init__(self) -> None:
        self._ops: list[Op] = []

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Slot dst[i] gets every KDA layer's recurrent and conv state of slot src[i]."""
        self._record("slots", src, dst)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Page dst[i] gets every MLA layer's latents (and indexer keys) of page src[i]."""
        self._record("pages", src, dst)

    def take(self) -> list[Op]:
        ops, self._ops = self._ops, []
        return ops

    def _record(self, kind: str, src: list[int], dst: list[int]) -> None:
        if len(src) != len(dst) or len(set(dst)) != len(dst) or set(src) & set(dst):
            raise ValueError(f"a {kind} copy needs distinct destinations, none of them a source; got {src} -> {dst}.")
        if not src:
            return
        last = self._ops[-1] if self._ops else None
        if last is not None and last[0] == kind and not (set(src) | set(dst)) & set(last[2]) \
                and not set(dst) & set(last[1]):
            self._ops[-1] = (kind, last[1] + src, last[2] + dst)      # independent of the last op: one copy
        else:
            self._ops.append((kind, list(src), list(dst)))


def apply_ops(cache: HybridCache, ops: list[Op]) -> None:
    """Run the journaled copies on cache, in order."""
    for kind, src, dst in ops:
        device = (cache.kda[0].recurrent if kind == "slots" and cache.kda else cache.mla[0].latent.values).device
        if kind == "slots":
            s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
            for state in cache.kda:
                state.conv[d] = state.conv[s]
                state.recurrent[d] = state.recurrent[s]
        else:
            rows = torch.arange(cache.page_size, device=device)
            s = (torch.tensor(src, device=device).unsqueeze(1) * cache.page_size + rows).flatten()
            d = (torch.tensor(dst, device=device).unsqueeze(1) * cache.page_size + rows).flatten()
            for layer in cache.mla:
                for paged in (layer.latent, layer.index_keys):
                    if paged is not None:
                        paged.copy_rows(s, d)
