"""Cache writes the engine makes between steps (a fork's copied state and partial page, a prefix-cache hit's restored
snapshot, HiCache's spills and loads), journaled and applied in order at the start of the next step.

Journaling keeps the pools free of tensor work (each step applies every pending copy as one indexed copy per
layer), makes a read of a slot or page see every write journaled before it, and gives a distributed engine one
list to send: every rank applies the same copies to its own shard (spills and loads are one process's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...layers.cache import HybridCache
from .hicache import Entry, entry_to_pages, entry_to_slot, page_views, pages_to_entry, slot_to_entry, slot_views

Part = tuple[str, int]
"""("slot", slot) or ("page", page): one piece of an entry; its tensors are named "{i}.{name}" for part i."""

Op = tuple[str, list, list]
"""(kind, a, b): "slots" copies state slots a[i] -> b[i]; "pages" copies KV pages a[i] -> b[i]; "keep" commits the
last speculative verification's KDA state after its token a[i] to slot b[i]; "save" reads the parts a into one
entry and calls b[0] with it; "load" writes the entry b[0] into the parts a."""


class DeviceOps:
    """The journal: copy_slots, copy_pages, save and load record, take() hands over (and clears) what was recorded."""

    def __init__(self) -> None:
        self._ops: list[Op] = []

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Slot dst[i] gets every KDA layer's recurrent and conv state of slot src[i]."""
        self._record("slots", src, dst)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Page dst[i] gets every MLA layer's latents (and indexer keys) of page src[i]."""
        self._record("pages", src, dst)

    def keep_token_states(self, tokens: list[int], slots: list[int]) -> None:
        """Slot slots[i] gets the last verification's KDA state after its token tokens[i] (flat index)."""
        self._ops.append(("keep", list(tokens), list(slots)))

    def save(self, parts: list[Part], put: Callable[[Entry], None]) -> None:
        """Read parts into one entry of CPU tensors and hand it to put."""
        self._ops.append(("save", list(parts), [put]))

    def load(self, parts: list[Part], entry: Entry) -> None:
        """Write an entry of save's layout into parts (checked against the cache beforehand: see entry_spec)."""
        self._ops.append(("load", list(parts), [entry]))

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


def entry_spec(cache: HybridCache, parts: list[Part]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (shape, dtype) of the entry that saving parts of cache gives (what a loaded entry must match),
    from views of the cache (nothing is copied)."""
    views = {"slot": slot_views, "page": page_views}
    return {f"{i}.{name}": (t.shape, t.dtype) for i, (kind, index) in enumerate(parts)
            for name, t in views[kind](cache, index).items()}


def read_parts(cache: HybridCache, parts: list[Part]) -> Entry:
    """CPU copies of parts, as one entry (see Part)."""
    readers = {"slot": slot_to_entry, "page": pages_to_entry}
    return {f"{i}.{name}": t for i, (kind, index) in enumerate(parts)
            for name, t in readers[kind](cache, index).items()}


def _write(cache: HybridCache, parts: list[Part], entry: Entry) -> None:
    writers = {"slot": entry_to_slot, "page": entry_to_pages}
    for i, (kind, index) in enumerate(parts):
        prefix = f"{i}."
        writers[kind](cache, index, {name[len(prefix):]: t for name, t in entry.items() if name.startswith(prefix)})


def apply_ops(cache: HybridCache, ops: list[Op]) -> None:
    """Run the journaled copies on cache, in order."""
    for kind, src, dst in ops:
        if kind == "save":
            dst[0](read_parts(cache, src))
            continue
        if kind == "load":
            _write(cache, src, dst[0])
            continue
        if kind == "keep":
            for state in cache.kda:
                device = state.recurrent.device
                state.keep(torch.tensor(src, device=device), torch.tensor(dst, device=device))
            continue
        layers = cache.kda if kind == "slots" else cache.mla
        if not layers:             # a pipeline stage without layers of that kind
            continue
        device = (layers[0].recurrent if kind == "slots" else layers[0].latent.values).device
        if kind == "slots":
            s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
            for state in cache.kda:
                state.conv[d] = state.conv[s]
                state.recurrent[d] = state.recurrent[s]
        else:
            per_page = cache.rows_per_page
            rows = torch.arange(per_page, device=device)
            s = (torch.tensor(src, device=device).unsqueeze(1) * per_page + rows).flatten()
            d = (torch.tensor(dst, device=device).unsqueeze(1) * per_page + rows).flatten()
            for layer in cache.mla:
                for paged in (layer.latent, layer.index_keys):
                    if paged is not None:
                        paged.copy_rows(s, d)
