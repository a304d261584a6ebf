"""HiCache: the prefix cache's host-memory and storage tiers, and the copies between a HybridCache and their entries.

An entry is a key (a hex digest of the token prefix it caches, chosen by the radix tree) and a dict of CPU tensors:
one KV page (every MLA layer's latent and indexer-key rows, plus their FP8 scales) or one state snapshot (every KDA
layer's conv and recurrent state). A key names its content: putting a key again gives the same tensors, so the
tiers never compare contents, and a key must change whenever the content would (model, dtypes, page size).

The tiers are inclusive: HostTier is an LRU in memory whose evictions HierarchicalStore spills to a
StorageBackend (FileBackend: one checksummed file per entry on local disk); a storage hit is promoted back to the
host tier and keeps its file, so evicting it again costs no write. None of these classes is thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ...layers.cache import HybridCache

log = logging.getLogger("kestrel")

Entry = dict[str, torch.Tensor]


def entry_bytes(tensors: Entry) -> int:
    """The bytes an entry's tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StorageBackend(Protocol):
    """The last tier: any key-value store of entries (local files, later Mooncake or 3FS).

    get returns None on a miss, including an entry it found damaged (counted in corrupt); put returns False when it
    did not store the entry (too large, or the store failed) and may evict older entries to make room.
    """

    used_bytes: int
    corrupt: int

    def put(self, key: str, tensors: Entry) -> bool: ...
    def get(self, key: str) -> Entry | None: ...
    def delete(self, key: str) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...


class HostTier:
    """An LRU of entries in host memory, at most max_bytes of tensor data; entries are kept as given (pinned first
    when pin), shared with callers, who must not modify them."""

    def __init__(self, max_bytes: int, pin: bool = False):
        if pin and not torch.cuda.is_available():
            raise ValueError("pinning host memory needs CUDA; pass pin=False on a machine without it.")
        self.max_bytes = max_bytes
        self.pin = pin
        self.used_bytes = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def put(self, key: str, tensors: Entry) -> list[tuple[str, Entry]]:
        """Store an entry (replacing the key's), evicting least recently used ones to make room; returns the
        evicted entries, oldest first, or [(key, tensors)] itself when it alone exceeds max_bytes."""
        self.pop(key)
        size = entry_bytes(tensors)
        if size > self.max_bytes:
            return [(key, tensors)]
        evicted = []
        while self.used_bytes + size > self.max_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.used_bytes -= entry_bytes(old)
            evicted.append((old_key, old))
        if self.pin:
            tensors = {name: t if t.is_pinned() else t.pin_memory() for name, t in tensors.items()}
        self._entries[key] = tensors
        self.used_bytes += size
        return evicted

    def get(self, key: str) -> Entry | None:
        """The entry (now the most recently used), or None."""
        tensors = self._entries.get(key)
        if tensors is not None:
            self._entries.move_to_end(key)
        return tensors

    def pop(self, key: str) -> Entry | None:
        """Remove and return the entry, or None."""
        tensors = self._entries.pop(key, None)
        if tensors is not None:
            self.used_bytes -= entry_bytes(tensors)
        return tensors

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


# FileBackend's file: preamble (magic, format version, header length, checksum), JSON header, payload.
# The header lists the key and each tensor as [name, dtype, shape, nbytes]; the payload is the tensors' raw bytes
# in that order. The checksum is one CRC-32 of header + payload, so every byte past the preamble is covered and the
# preamble's own fields are checked directly; the key in the header catches a file renamed to another key.
# CRC-32, not a cryptographic hash: it guards against accidental damage (a write cut short by a crash, truncation,
# bit rot), which it catches in every burst up to 32 bits and all but 2**-32 of other cases, at about five times
# BLAKE2b's speed on one core, so checking stays cheaper than the disk read. A forger could recompute any unkeyed
# hash; against that the decoder trusts no field (no pickle, every size checked).
_MAGIC = b"KHIC"
_VERSION = 1
_PREAMBLE = struct.Struct("<4sIII")
_SUFFIX = ".hic"
_KEY = re.compile(r"[A-Za-z0-9_-]{1,200}")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)}


class FileBackend:
    """Entries as files in one directory (one owner at a time), at most max_bytes of files, least recently used
    deleted first. A file is written under a temporary name and renamed into place, so a reader never sees half of
    one; a file that is missing, truncated or fails any check is a miss, deleted and counted in corrupt. A new
    FileBackend indexes the directory's files (oldest modification first), so a restarted server gets disk hits."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.corrupt = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        for tmp in self.directory.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        files = [(p.stat(), p.stem) for p in self.directory.glob("*" + _SUFFIX) if _KEY.fullmatch(p.stem)]
        for stat, key in sorted(files, key=lambda f: f[0].st_mtime_ns):
            self._sizes[key] = stat.st_size
            self.used_bytes += stat.st_size
        self._evict(self.max_bytes)

    def put(self, key: str, tensors: Entry) -> bool:
        """Write the entry (replacing the key's), deleting the oldest files to make room; False (nothing stored)
        when the file would exceed max_bytes or the write fails."""
        header, payload = _encode(_check_key(key), tensors)
        size = _PREAMBLE.size + len(header) + sum(chunk.nbytes for chunk in payload)
        if size > self.max_bytes:
            return False
        self.delete(key)
        self._evict(self.max_bytes - size)
        crc = zlib.crc32(header)
        for chunk in payload:
            crc = zlib.crc32(chunk, crc)
        tmp = self.directory / f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_PREAMBLE.pack(_MAGIC, _VERSION, len(header), crc))
                f.write(header)
                for chunk in payload:
                    f.write(chunk)
            os.replace(tmp, self._path(key))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("HiCache could not write %s (%s); the entry is not stored.", key, e)
            return False
        self._sizes[key] = size
        self.used_bytes += size
        return True

    def get(self, key: str) -> Entry | None:
        """The entry (now the most recently used), or None on a miss or a damaged file (then deleted)."""
        if key not in self._sizes:
            return None
        path = self._path(key)
        try:
            tensors = _decode(path.read_bytes(), key)
        except (OSError, ValueError) as e:
            log.warning("HiCache file %s is unreadable (%s); deleted it and treated it as a miss.", path, e)
            self.corrupt += 1
            self.delete(key)
            return None
        self._sizes.move_to_end(key)
        os.utime(path)   # the next restart indexes by modification time
        return tensors

    def delete(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self._path(key).unlink(missing_ok=True)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def _evict(self, budget: int) -> None:
        """Delete the oldest files until at most budget bytes remain."""
        while self.used_bytes > budget:
            self.delete(next(iter(self._sizes)))

    def _path(self, key: str) -> Path:
        return self.directory / (key + _SUFFIX)


def _check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise ValueError(f"HiCache key {key!r} is not 1-200 letters, digits, '_' or '-'; use a hex digest.")
    return key


def _encode(key: str, tensors: Entry) -> tuple[bytes, list[np.ndarray]]:
    """The JSON header and the payload's chunks (each tensor's bytes, uint8, without a copy where contiguous)."""
    specs, payload = [], []
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES or t.device.type != "cpu":
            raise ValueError(f"FileBackend stores CPU tensors of {', '.join(_DTYPES)}; {name} is {t.dtype} on "
                             f"{t.device}.")
        chunk = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        specs.append([name, dtype, list(t.shape), chunk.nbytes])
        payload.append(chunk)
    header = json.dumps({"key": key, "tensors": specs}, separators=(",", ":")).encode()
    return header, payload


def _decode(data: bytes, key: str) -> Entry:
    """The entry a file's bytes hold; ValueError (saying why) unless every check passes."""
    if len(data) < _PREAMBLE.size:
        raise ValueError("shorter than the preamble")
    magic, version, header_len, crc = _PREAMBLE.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"not a version-{_VERSION} HiCache file")
    body = memoryview(data)[_PREAMBLE.size:]
    if header_len > len(body) or zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    header = json.loads(bytes(body[:header_len]))
    if not isinstance(header, dict) or header.get("key") != key or not isinstance(header.get("tensors"), list):
        raise ValueError("header belongs to another key or is malformed")
    tensors, offset = {}, _PREAMBLE.size + header_len
    for spec in header["tensors"]:
        name, dtype, shape, nbytes = _check_spec(spec)
        if offset + nbytes > len(data):
            raise ValueError("payload shorter than its header says")
        out = torch.empty(shape, dtype=dtype)
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, np.uint8, nbytes, offset)
        tensors[name] = out
        offset += nbytes
    if offset != len(data):
        raise ValueError("payload longer than its header says")
    return tensors


def _check_spec(spec: object) -> tuple[str, torch.dtype, list[int], int]:
    """A header's [name, dtype, shape, nbytes], checked for types and consistency."""
    if not (isinstance(spec, list) and len(spec) == 4 and isinstance(spec[0], str) and spec[1] in _DTYPES
            and isinstance(spec[2], list) and all(type(n) is int and n >= 0 for n in spec[2]) and type(spec[3]) is int):
        raise ValueError("malformed tensor spec")
    name, dtype, shape, nbytes = spec[0], _DTYPES[spec[1]], spec[2], spec[3]
    if nbytes != prod(shape) * dtype.itemsize:
        raise ValueError(f"{name}'s byte length does not match its shape")
    return name, dtype, shape, nbytes


@dataclass
class HiCacheStats:
    """Counters since start (hits, misses, damaged files) and what each tier holds now."""

    host_hits: int
    storage_hits: int
    misses: int
    corrupt: int
    host_entries: int
    host_bytes: int
    storage_entries: int
    storage_bytes: int


class HierarchicalStore:
    """The tiers as one store: put goes to the host tier, whose evictions spill to storage (when there is one);
    get looks in the host tier, then in storage, promoting a storage hit back to the host tier."""

    def __init__(self, host: HostTier, storage: StorageBackend | None = None):
        self.host = host
        self.storage = storage
        self.host_hits = self.storage_hits = self.misses = 0

    def put(self, key: str, tensors: Entry) -> None:
        self._spill(self.host.put(key, tensors))

    def get(self, key: str) -> Entry | None:
        tensors = self.host.get(key)
        if tensors is not None:
            self.host_hits += 1
            return tensors
        tensors = self.storage.get(key) if self.storage is not None else None
        if tensors is None:
            self.misses += 1
            return None
        self.storage_hits += 1
        self._spill(self.host.put(key, tensors))
        return tensors

    def discard(self, key: str) -> None:
        """Forget the key in every tier (say, after its entry did not match the cache)."""
        self.host.pop(key)
        if self.storage is not None:
            self.storage.delete(key)

    def __contains__(self, key: object) -> bool:
        return key in self.host or (self.storage is not None and key in self.storage)

    def stats(self) -> HiCacheStats:
        storage = self.storage
        return HiCacheStats(
            host_hits=self.host_hits, storage_hits=self.storage_hits, misses=self.misses,
            corrupt=storage.corrupt if storage is not None else 0,
            host_entries=len(self.host), host_bytes=self.host.used_bytes,
            storage_entries=len(storage) if storage is not None else 0,
            storage_bytes=storage.used_bytes if storage is not None else 0)

    def _spill(self, evicted: list[tuple[str, Entry]]) -> None:
        if self.storage is None:
            return
        for key, tensors in evicted:
            if key not in self.storage:
                self.storage.put(key, tensors)


class EntryMismatch(ValueError):
    """An entry's tensors are not the ones the cache holds (names, shapes or dtypes): treat it as a miss."""


def pages_to_entry(cache: HybridCache, page: int) -> Entry:
    """CPU copies of one page's rows: "mla.{j}.latent" [rows, D] (+ "mla.{j}.latent_scales" [rows] fp32 when FP8),
    and likewise "mla.{j}.index_keys" when the layer has an indexer; rows: page_size, or this rank's share of them
    under decode context parallelism."""
    return {name: view.to("cpu", copy=True) for name, view in page_views(cache, page).items()}


def entry_to_pages(cache: HybridCache, page: int, tensors: Entry) -> None:
    """Write an entry of pages_to_entry back into page; EntryMismatch (nothing written) if it does not fit."""
    _copy_into(page_views(cache, page), tensors)


def slot_to_entry(cache: HybridCache, slot: int) -> Entry:
    """CPU copies of one slot's state: "kda.{i}.conv" [kernel-1, 3*H*K] and "kda.{i}.recurrent" [H, K, V]."""
    return {name: view.to("cpu", copy=True) for name, view in slot_views(cache, slot).items()}


def entry_to_slot(cache: HybridCache, slot: int, tensors: Entry) -> None:
    """Write an entry of slot_to_entry back into slot; EntryMismatch (nothing written) if it does not fit."""
    _copy_into(slot_views(cache, slot), tensors)


def page_views(cache: HybridCache, page: int) -> Entry:
    """One page's rows in the cache itself (views, no copy), named as pages_to_entry names them."""
    if not cache.mla:                    # a pipeline stage without MLA layers
        return {}
    per_page = cache.rows_per_page
    num_pages = cache.mla[0].latent.values.shape[0] // per_page
    if not 0 <= page < num_pages:
        raise ValueError(f"page {page} is out of range; the cache has {num_pages} pages.")
    rows = slice(page * per_page, (page + 1) * per_page)
    views = {}
    for j, layer in enumerate(cache.mla):
        for part, paged in (("latent", layer.latent), ("index_keys", layer.index_keys)):
            if paged is not None:
                views[f"mla.{j}.{part}"] = paged.values[rows]
                if paged.scales is not None:
                    views[f"mla.{j}.{part}_scales"] = paged.scales[rows]
    return views


def slot_views(cache: HybridCache, slot: int) -> Entry:
    """One slot's state in the cache itself (views, no copy), named as slot_to_entry names them."""
    if not cache.kda:                    # a pipeline stage without KDA layers
        return {}
    num_slots = cache.kda[0].conv.shape[0]
    if not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot} is out of range; the cache has {num_slots} slots.")
    views = {}
    for i, layer in enumerate(cache.kda):
        views[f"kda.{i}.conv"] = layer.conv[slot]
        views[f"kda.{i}.recurrent"] = layer.recurrent[slot]
    return views


def _copy_into(views: Entry, tensors: Entry) -> None:
    """Copy tensors into the cache's views after checking all of them, so a mismatch writes nothing."""
    if tensors.keys() != views.keys():
        raise EntryMismatch(f"the entry holds {sorted(tensors)}, but the cache holds {sorted(views)}.")
    for name, view in views.items():
        t = tensors[name]
        if t.shape != view.shape or t.dtype != view.dtype:
            raise EntryMismatch(f"{name} is {t.dtype} {list(t.shape)} in the entry, but {view.dtype} "
                                f"{list(view.shape)} in the cache.")
    for name, view in views.items():
        view.copy_(tensors[name])
