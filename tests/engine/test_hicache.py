"""HiCache tiers: bitwise round trips, damaged files as misses, LRU order and byte accounting, restarts, and a
HybridCache's pages and slots through the store."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch

from kestrel.config import parse_config
from kestrel.engine.cache.hicache import (EntryMismatch, FileBackend, HierarchicalStore, HostTier, entry_bytes,
                                          entry_to_pages, entry_to_slot, pages_to_entry, slot_to_entry)
from kestrel.layers.cache import HybridCache
from kestrel.models.presets import tiny_config

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32, torch.float64,
          torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def random_bits(shape, dtype, seed=0) -> torch.Tensor:
    """A tensor of random bit patterns (NaNs and infinities included for floats)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def entry(seed=0, rows=4) -> dict:
    return {"latent": random_bits((rows, 8), torch.float8_e4m3fn, seed),
            "scales": random_bits((rows,), torch.float32, seed + 1)}


def file_of(backend: FileBackend, key: str):
    return backend.directory / f"{key}.hic"


def test_every_dtype_round_trips_bitwise_through_each_tier(tmp_path):
    tensors = {str(d): random_bits((3, 5), d, seed=i) for i, d in enumerate(DTYPES)}
    tensors |= {"scalar": torch.tensor(1.5), "empty": torch.empty(0, 7, dtype=torch.bfloat16),
                "strided": random_bits((6, 4), torch.float32).t()}
    disk = FileBackend(tmp_path, max_bytes=1 << 20)
    assert disk.put("ab12", tensors)
    assert_same(FileBackend(tmp_path, max_bytes=1 << 20).get("ab12"), tensors)
    host = HostTier(max_bytes=1 << 20)
    assert host.put("ab12", tensors) == []
    assert_same(host.get("ab12"), tensors)
    with pytest.raises(ValueError, match="use a hex digest"):
        disk.put("../ab12", tensors)
    with pytest.raises(ValueError, match="complex64"):
        disk.put("cd34", {"z": torch.zeros(2, dtype=torch.complex64)})


def damage_cases(size: int):
    """(name, function of the file's bytes -> its new bytes): every single flipped byte, and truncations."""
    for i in range(size):
        yield f"flip {i}", lambda b, i=i: b[:i] + bytes([b[i] ^ 0x40]) + b[i + 1:]
    for n in (0, 10, 30, size // 2, size - 1):
        yield f"truncate to {n}", lambda b, n=n: b[:n]
    yield "extra byte", lambda b: b + b"\0"


def test_any_damaged_byte_or_truncation_is_a_miss_and_the_file_is_deleted(tmp_path):
    disk = FileBackend(tmp_path, max_bytes=1 << 20)
    disk.put("ab12", entry())
    path = file_of(disk, "ab12")
    good = path.read_bytes()
    cases = list(damage_cases(len(good)))
    for count, (name, damage) in enumerate(cases, 1):
        disk.put("ab12", entry())
        path.write_bytes(damage(good))
        assert disk.get("ab12") is None, name
        assert not path.exists() and "ab12" not in disk and disk.used_bytes == 0, name
        assert disk.corrupt == count
    disk.put("ab12", entry())
    path.unlink()
    assert disk.get("ab12") is None and disk.corrupt == len(cases) + 1 and disk.used_bytes == 0


def forge(path, key: str, specs: list, payload: bytes, version: int = 1, header: bytes | None = None) -> None:
    """A file with a valid checksum over a header that may lie."""
    header = header if header is not None else json.dumps({"key": key, "tensors": specs}).encode()
    crc = zlib.crc32(header + payload)
    path.write_bytes(struct.pack("<4sIII", b"KHIC", version, len(header), crc) + header + payload)


@pytest.mark.parametrize("specs, payload, version, header", [
    ([["x", "float32", [2], 8]], bytes(8), 2, None),                  # another format version
    ([["x", "float32", [3], 8]], bytes(8), 1, None),                  # shape disagrees with the byte length
    ([["x", "float32", [2], 8]], bytes(12), 1, None),                 # payload longer than the header says
    ([["x", "float32", [4], 16]], bytes(8), 1, None),                 # payload shorter
    ([["x", "complex64", [1], 8]], bytes(8), 1, None),                # a dtype it does not store
    ([["x", "float32", [-2], -8]], bytes(0), 1, None),                # negative sizes
    ([["x", "float32", [2], 8.0]], bytes(8), 1, None),                # a float where an int belongs
    ([], b"", 1, b"\xff{not json"),                                   # not a header at all
    ([], b"", 1, b"[1, 2]"),
])
def test_a_wrong_header_under_a_valid_checksum_is_a_miss(tmp_path, specs, payload, version, header):
    disk = FileBackend(tmp_path, max_bytes=1 << 20)
    disk.put("ab12", entry())
    forge(file_of(disk, "ab12"), "ab12", specs, payload, version, header)
    assert disk.get("ab12") is None and disk.corrupt == 1 and not file_of(disk, "ab12").exists()


def test_another_entrys_file_renamed_to_this_key_is_a_miss(tmp_path):
    disk = FileBackend(tmp_path, max_bytes=1 << 20)
    disk.put("aa", entry(seed=1))
    disk.put("bb", entry(seed=2))
    os.replace(file_of(disk, "aa"), file_of(disk, "bb"))
    assert disk.get("bb") is None and disk.corrupt == 1 and not file_of(disk, "bb").exists()
    assert disk.get("aa") is None and disk.corrupt == 2      # its file is gone too
    assert len(disk) == 0 and disk.used_bytes == 0 and list(tmp_path.iterdir()) == []


def test_file_lru_deletes_the_oldest_files_and_refuses_an_entry_larger_than_the_budget(tmp_path):
    probe = FileBackend(tmp_path / "probe", max_bytes=1 << 20)
    probe.put("aa", entry())
    size = file_of(probe, "aa").stat().st_size
    disk = FileBackend(tmp_path / "disk", max_bytes=3 * size)
    for key in ("aa", "bb", "cc"):
        assert disk.put(key, entry())
    assert disk.get("aa") is not None                       # now bb is the oldest
    assert disk.put("dd", entry())
    assert "bb" not in disk and not file_of(disk, "bb").exists()
    assert sorted(p.name for p in disk.directory.iterdir()) == ["aa.hic", "cc.hic", "dd.hic"]
    assert disk.used_bytes == sum(p.stat().st_size for p in disk.directory.iterdir()) == 3 * size
    assert not disk.put("ee", entry(rows=100))              # larger than the whole budget: skipped, nothing evicted
    assert len(disk) == 3 and not file_of(disk, "ee").exists()
    disk.delete("aa")
    assert disk.used_bytes == 2 * size and not file_of(disk, "aa").exists()


def test_a_restart_indexes_the_files_oldest_first_and_trims_to_its_budget(tmp_path):
    disk = FileBackend(tmp_path, max_bytes=1 << 20)
    for second, key in enumerate(("aa", "bb", "cc"), 1):
        disk.put(key, entry(seed=second))
        os.utime(file_of(disk, key), ns=(second * 10**9, second * 10**9))
    disk.get("aa")                                           # a hit makes aa the newest on disk too
    (tmp_path / ".dd.0123.tmp").write_bytes(b"half a file")  # a write the last run did not finish
    (tmp_path / "notes.txt").write_text("not ours")
    size = file_of(disk, "aa").stat().st_size
    restarted = FileBackend(tmp_path, max_bytes=2 * size)
    assert "bb" not in restarted and not file_of(disk, "bb").exists()
    assert len(restarted) == 2 and restarted.used_bytes == 2 * size
    assert not (tmp_path / ".dd.0123.tmp").exists() and (tmp_path / "notes.txt").exists()
    assert_same(restarted.get("cc"), entry(seed=3))
    assert_same(restarted.get("aa"), entry(seed=1))


def test_host_tier_evicts_least_recently_used_and_counts_bytes():
    size = entry_bytes(entry())
    host = HostTier(max_bytes=3 * size)
    for key in ("aa", "bb", "cc"):
        assert host.put(key, entry()) == []
    host.get("aa")
    evicted = host.put("dd", entry(seed=5))
    assert [key for key, _ in evicted] == ["bb"] and host.used_bytes == 3 * size
    assert [key for key, _ in host.put("ee", entry(rows=8))] == ["cc", "aa"]   # twice the size: two go
    assert host.used_bytes == 3 * size and len(host) == 2
    big = entry(rows=100)
    assert host.put("ff", big) == [("ff", big)] and "ff" not in host          # never fits: handed back
    assert host.pop("dd") is not None and host.used_bytes == 2 * size
    host.put("ee", entry())                                                    # replacing a key recounts it
    assert host.used_bytes == size and host.get("zz") is None


class CountingFiles(FileBackend):
    writes = 0

    def put(self, key, tensors):
        self.writes += 1
        return super().put(key, tensors)


def test_store_spills_host_evictions_to_storage_and_promotes_storage_hits(tmp_path):
    size = entry_bytes(entry())
    storage = CountingFiles(tmp_path, max_bytes=1 << 20)
    store = HierarchicalStore(HostTier(max_bytes=2 * size), storage)
    for seed, key in enumerate(("aa", "bb", "cc")):
        store.put(key, entry(seed=seed))
    assert "aa" not in store.host and "aa" in storage and "aa" in store and storage.writes == 1
    assert_same(store.get("aa"), entry(seed=0))              # storage hit, promoted; bb spills
    assert "aa" in store.host and "bb" in storage and storage.writes == 2
    assert_same(store.get("cc"), entry(seed=2))              # host hit
    store.get("bb")                                          # promoted; aa spills again, but its file is kept
    assert storage.writes == 2
    assert store.get("zz") is None
    store.discard("bb")
    assert "bb" not in store and not file_of(storage, "bb").exists()
    store.put("big", entry(rows=100))                        # too large for the host: straight to storage
    assert "big" not in store.host and "big" in storage
    stats = store.stats()
    assert (stats.host_hits, stats.storage_hits, stats.misses, stats.corrupt) == (1, 2, 1, 0)
    assert (stats.host_entries, stats.host_bytes) == (len(store.host), store.host.used_bytes)
    assert (stats.storage_entries, stats.storage_bytes) == (len(storage), storage.used_bytes)

    hostonly = HierarchicalStore(HostTier(max_bytes=size))
    hostonly.put("aa", entry())
    hostonly.put("bb", entry())
    assert hostonly.get("aa") is None and hostonly.stats().misses == 1 and hostonly.stats().storage_bytes == 0


def tiny_cache(kv_dtype, page_size=4, seed=0) -> HybridCache:
    """A k3.1-tiny HybridCache (3 slots, 5 pages) filled with random bits."""
    cache = HybridCache.allocate(parse_config(tiny_config("k3.1-tiny")), 3, 5, page_size, torch.float32,
                                 kv_dtype=kv_dtype)
    for i, t in enumerate(all_tensors(cache)):
        t.copy_(random_bits(t.shape, t.dtype, seed=seed + i))
    return cache


def all_tensors(cache: HybridCache) -> list[torch.Tensor]:
    tensors = [t for layer in cache.kda for t in (layer.conv, layer.recurrent)]
    for layer in cache.mla:
        for paged in (layer.latent, layer.index_keys):
            tensors += [t for t in (paged.values, paged.scales) if paged is not None and t is not None]
    return tensors


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_pages_and_slots_round_trip_through_host_and_disk_bitwise(tmp_path, kv_dtype):
    cache = tiny_cache(kv_dtype)
    original = [t.clone() for t in all_tensors(cache)]
    page, slot = pages_to_entry(cache, 2), slot_to_entry(cache, 1)
    assert "mla.0.index_keys" in page and ("mla.0.latent_scales" in page) == (kv_dtype == torch.float8_e4m3fn)
    store = HierarchicalStore(HostTier(max_bytes=entry_bytes(slot)), FileBackend(tmp_path, max_bytes=1 << 22))
    store.put("page2", page)
    store.put("slot1", slot)                                 # the page spills to disk
    assert "page2" not in store.host
    noise = tiny_cache(kv_dtype, seed=99)                    # overwrite page 2 and slot 1, then restore them
    entry_to_pages(cache, 2, pages_to_entry(noise, 2))
    entry_to_slot(cache, 1, slot_to_entry(noise, 1))
    entry_to_slot(cache, 1, store.get("slot1"))
    entry_to_pages(cache, 2, store.get("page2"))
    assert store.stats().storage_hits == 1 and store.stats().host_hits == 1
    for t, o in zip(all_tensors(cache), original):
        assert torch.equal(bits(t), bits(o))


def test_an_entry_that_does_not_fit_the_cache_raises_entry_mismatch_and_writes_nothing():
    cache = tiny_cache(torch.float8_e4m3fn)
    before = [t.clone() for t in all_tensors(cache)]
    with pytest.raises(EntryMismatch, match="the cache holds"):            # no scales
        entry_to_pages(cache, 0, pages_to_entry(tiny_cache(torch.float32), 0))
    with pytest.raises(EntryMismatch, match=r"\[2, 40\] in the entry"):     # another page size
        entry_to_pages(cache, 0, pages_to_entry(tiny_cache(torch.float8_e4m3fn, page_size=2), 0))
    snapshot = slot_to_entry(cache, 0)
    snapshot["kda.3.recurrent"] = snapshot["kda.3.recurrent"].bfloat16()
    with pytest.raises(EntryMismatch, match="kda.3.recurrent is torch.bfloat16"):
        entry_to_slot(cache, 2, snapshot)
    for t, b in zip(all_tensors(cache), before):
        assert torch.equal(bits(t), bits(b))
    with pytest.raises(ValueError, match="page 5 is out of range"):
        pages_to_entry(cache, 5)
    with pytest.raises(ValueError, match="slot -1 is out of range"):
        slot_to_entry(cache, -1)
