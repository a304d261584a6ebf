"""Builds the prefix cache the engine arguments ask for: none (--disable-radix-cache), on the device alone, or with
HiCache's host-memory tier (--enable-hierarchical-cache) and optional file tier (--hicache-storage-backend file)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ...layers.cache import HybridCache
from ..args import EngineArgs
from .device_ops import entry_spec
from .hicache import FileBackend, HierarchicalStore, HostTier
from .kv_pool import KVPool
from .planner import MemoryPlan
from .radix import PrefixCache
from .state_pool import StatePool

STORAGE_PER_HOST = 8
"""The file tier holds this many times the host tier's bytes."""

SAMPLE_BYTES = 1 << 20
"""Bytes read from each end of each weight file for the model's namespace."""

log = logging.getLogger("kestrel")


def build_prefix_cache(args: EngineArgs, state_pool: StatePool, kv_pool: KVPool, cache: HybridCache,
                       plan: MemoryPlan) -> PrefixCache | None:
    if args.disable_radix_cache:
        if args.enable_hierarchical_cache:
            raise ValueError("--enable-hierarchical-cache needs the prefix cache; drop --disable-radix-cache.")
        return None
    log.info("prefix cache: %s; its snapshots take free state slots (%s B each) and its pages free KV pages, and "
             "both are evicted before a request waits", args.mamba_scheduler_strategy, f"{plan.state_bytes_per_slot:,}")
    if not args.enable_hierarchical_cache:
        return PrefixCache(state_pool, kv_pool)
    if args.tp_size * args.pp_size * args.dp_size > 1:
        raise ValueError("--enable-hierarchical-cache runs in one process for now; drop it or the parallel sizes.")
    host_bytes = int(args.hicache_size * 2**30) if args.hicache_size > 0 else \
        int(args.hicache_ratio * (plan.state_pool_bytes + plan.kv_pool_bytes))
    storage = None
    if args.hicache_storage_backend == "file":
        storage = FileBackend(args.hicache_storage_dir, STORAGE_PER_HOST * host_bytes)
    specs = {"page": entry_spec(cache, [("page", 0)]), "snapshot": entry_spec(cache, [("slot", 0)]),
             "tail snapshot": entry_spec(cache, [("slot", 0), ("page", 0)])}
    log.info("HiCache: host tier %.3f GiB%s", host_bytes / 2**30,
             f", file tier {STORAGE_PER_HOST * host_bytes / 2**30:.3f} GiB in {args.hicache_storage_dir}"
             if storage is not None else "")
    return PrefixCache(state_pool, kv_pool, HierarchicalStore(HostTier(host_bytes), storage),
                       model_namespace(Path(args.model)), specs)


def model_namespace(folder: Path) -> str:
    """A digest of the model: config.json, and each weight file's name, size and first and last MiB (so that a
    store shared across restarts never serves one model's cache to another)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(size - SAMPLE_BYTES, 0))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
