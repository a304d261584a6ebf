"""The prefix cache: a tree of token pages (each node one full KV page) and snapshots of the KDA state.

Attention can resume anywhere its pages are cached, but the recurrent KDA layers can only resume where their state
was saved. So a hit is the longest cached prefix that ends at a snapshot: a node (its depth in pages, P tokens
each) plus a tail of fewer than P tokens; the snapshot holds every KDA layer's recurrent and conv state after
depth * P + len(tail) tokens, in a state slot of its own, and (when the tail is not empty) a reference to the page
that holds the tail's KV rows.

Who owns what (the tree never schedules; the scheduler asks it):
- A node's page carries one KV-pool reference for the tree; sequences reading it hold their own references. A
  node is evicted only as a leaf that no running sequence stands on (`locks`) and whose page only the tree holds.
- A snapshot owns its state slot outright; nothing writes to it after the copy that fills it, and a hit copies it
  into the sequence's own slot (copy on hit). A snapshot's tail page is shared: the rows before the tail's end
  never change (a page's rows are written once, in position order), and a hit copies the page before writing on.
- Every copy goes through the DeviceOps journal, so a snapshot is filled from the sequence's slot before the next
  step advances it, and a hit's copy reads the snapshot before anything can reuse its slot.

Eviction is least recently used, in two lists: leaves (a page each, taking their snapshots with them) and
snapshots (a slot each). Evicting only a snapshot keeps its pages: the node then no longer ends a full hit. Leaves
wait in a heap keyed by their last use, offered whenever a node becomes a leaf or a leaf is used (entries that went
stale are skipped when popped), so eviction under pressure never walks the whole tree.

With HiCache (hicache.py), what is evicted is first saved to the store (host memory, then disk), keyed by a chain
hash of the token pages up to it (seeded with the model's namespace); a lookup that finds pages and a snapshot
there beyond what the device tree holds loads them back into fresh pages and a fresh slot before the hit. The tree
keeps no index of the store: a page on the device remembers the tails of the snapshots it spilled that the store
still holds, and past the device's pages (at the root and at pages loaded back, whose snapshots may be a former
process's) a lookup asks the store for the key of each snapshot it could resume from, one per token. So what a tier
drops is forgotten with it, and a restarted engine finds what the last one left on disk. A store entry that is
missing, damaged or of another layout is a miss.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from .hicache import Entry, HierarchicalStore
from .kv_pool import KVPool
from .state_pool import StatePool

Spec = dict[str, tuple]
"""An entry's layout: tensor name -> (shape, dtype)."""


@dataclass(eq=False)
class Snapshot:
    """The KDA state after node.depth * P + len(tail) tokens, in `slot`; tail_page holds the tail's KV rows."""

    node: Node
    tail: tuple[int, ...]
    slot: int
    tail_page: int | None
    last_use: int
    locks: int = 0                     # admissions resuming from it, until their copy is journaled

    @property
    def length(self) -> int:
        return self.node.depth * self.node.page_size + len(self.tail)


@dataclass(eq=False)
class Node:
    """One full page of tokens (`key`) under its parent; the root (depth 0) holds none."""

    key: tuple[int, ...]
    page: int | None
    parent: Node | None
    depth: int
    page_size: int
    hash: str = ""                     # chain hash of the tokens up to its end (HiCache's key for its page)
    last_use: int = 0
    locks: int = 0                     # running sequences whose cached prefix ends here
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], Snapshot] = field(default_factory=dict)
    # The tails of its snapshots this process spilled to HiCache's store; None where the store may hold others (the
    # root and nodes loaded back from the store, after a restart say): a lookup asks the store for those.
    stored_tails: set[tuple[int, ...]] | None = field(default_factory=set)


@dataclass(frozen=True)
class Hit:
    """A cached prefix of `length` tokens: the pages of its full pages, and the snapshot it resumes from."""

    length: int
    pages: list[int]
    node: Node
    snapshot: Snapshot


@dataclass
class CacheStats:
    prompt_tokens: int = 0             # tokens of the prompts looked up
    cached_tokens: int = 0             # of those, tokens served from the cache
    hits: int = 0                      # admissions that resumed from the cache (a preempted sequence's too)
    snapshots_taken: int = 0
    pages_evicted: int = 0
    snapshots_evicted: int = 0
    pages_loaded: int = 0              # HiCache: pages and snapshots brought back from the store
    snapshots_loaded: int = 0


class PrefixCache:
    """The tree over one KV pool and state pool (module docstring)."""

    def __init__(self, state_pool: StatePool, kv_pool: KVPool, store: HierarchicalStore | None = None,
                 namespace: str = "", specs: dict[str, Spec] | None = None):
        """store, namespace, specs: HiCache's tiers, a digest naming the model and cache layout, and the layouts of
        a "page" entry, a "snapshot" entry and a "tail snapshot" entry (device_ops.entry_spec)."""
        self.state_pool, self.kv_pool = state_pool, kv_pool
        self.page_size = kv_pool.page_size
        self.root = Node((), None, None, 0, self.page_size, hash=_digest(namespace, ()), stored_tails=None)
        self.store, self.specs = store, specs or {}
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        self._num_nodes = 0
        self._snapshots: dict[int, Snapshot] = {}        # by slot
        self._leaves: list[tuple[int, int, Node]] = []    # heap of (last use, id, node) offered as leaves

    @property
    def num_pages(self) -> int:
        """Pages the tree holds (one per node)."""
        return self._num_nodes

    @property
    def snapshots(self) -> list[Snapshot]:
        return list(self._snapshots.values())

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def match(self, tokens: list[int], limit: int, load: bool = True) -> Hit | None:
        """The longest cached prefix of tokens ending at a snapshot, at most `limit` tokens long (brought back
        from HiCache's store first when it holds a longer one than the device, unless not `load`)."""
        now, path, node = next(self._clock), [], self.root
        for start in range(0, limit - self.page_size + 1, self.page_size):
            node = node.children.get(tuple(tokens[start:start + self.page_size]))
            if node is None:
                break
            node.last_use = now
            path.append(node)
        if path:
            self._offer(path[-1])
        hit = None
        for node in reversed([self.root, *path]):
            start = node.depth * self.page_size
            usable = [s for tail, s in node.snapshots.items()
                      if start + len(tail) <= limit and tuple(tokens[start:start + len(tail)]) == tail]
            if usable:
                best = max(usable, key=lambda s: len(s.tail))
                best.last_use = now
                hit = Hit(best.length, [n.page for n in path[:node.depth]], node, best)
                break
        if load and self.store is not None and self._load(path, tokens, limit, hit.length if hit else 0):
            return self.match(tokens, limit, load=False)
        return hit

    def insert(self, node: Node, tokens: list[int], pages: list[int]) -> Node:
        """Record full pages (holding tokens, len(pages) * P of them) below node, where they follow; returns the
        node of the last. Where a node for a page's tokens exists already (another sequence computed them too),
        the tree keeps its own page."""
        now = next(self._clock)
        for i, page in enumerate(pages):
            key = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node, node.depth + 1, self.page_size, hash=_digest(node.hash, key))
                node.children[key] = child
                self.kv_pool.share([page], cache=True)
                self._num_nodes += 1
            child.last_use = now
            node = child
        self._offer(node)
        return node

    def snapshot(self, node: Node, tail: list[int], tail_page: int | None, slot: int) -> None:
        """Save the state in `slot`, the state after node's pages and then `tail` (fewer than P tokens, whose KV
        rows tail_page holds). Skipped when no state slot is free or can be freed by evicting a colder snapshot."""
        if self._known(node, tail, tail_page):
            return
        if self.state_pool.num_free == 0 and not self.reclaim_slots(1):
            return
        saved = self.state_pool.allocate()
        self.state_pool.copy(slot, saved)
        self._keep(node, tail, tail_page, saved)

    def adopt(self, node: Node, tail: list[int], tail_page: int | None, slot: int) -> None:
        """Keep `slot`, a state slot allocated for it that holds the state after node's pages and then `tail`, as
        that snapshot (freed instead when the cache holds it already)."""
        if self._known(node, tail, tail_page):
            self.state_pool.free(slot)
        else:
            self._keep(node, tail, tail_page, slot)

    def _known(self, node: Node, tail: list[int], tail_page: int | None) -> bool:
        """Whether node holds the snapshot after `tail` already (then marked used now); a ValueError for a tail
        that cannot end a snapshot."""
        if len(tail) >= self.page_size or (tail_page is None) != (not tail):
            raise ValueError(f"a snapshot's tail must be shorter than a page and have its page; got {len(tail)} "
                             f"tokens and page {tail_page}.")
        known = node.snapshots.get(tuple(tail))
        if known is not None:
            known.last_use = next(self._clock)
        return known is not None

    def _keep(self, node: Node, tail: list[int], tail_page: int | None, saved: int) -> None:
        key, now = tuple(tail), next(self._clock)
        if tail_page is not None:
            self.kv_pool.share([tail_page], cache=True)
        node.snapshots[key] = self._snapshots[saved] = Snapshot(node, key, saved, tail_page, now)
        self.stats.snapshots_taken += 1

    def reclaim_slots(self, count: int) -> int:
        """Evict up to `count` least recently used snapshots; returns how many slots that freed."""
        victims = heapq.nsmallest(count, (s for s in self._snapshots.values() if not s.locks),
                                  key=lambda s: s.last_use)
        for snap in victims:
            self._drop_snapshot(snap)
        return len(victims)

    def reclaim_pages(self, count: int) -> int:
        """Free up to `count` KV pages by evicting, least recently used first, leaves no sequence stands on and
        snapshots whose tail page only the tree holds; returns how many pages that freed."""
        before = self.kv_pool.num_free
        snapshots = [(s.last_use, id(s), s) for s in self._snapshots.values()
                     if not s.locks and self._sole(s.tail_page)]
        heapq.heapify(snapshots)
        held = []                       # leaves a sequence still holds: offered again afterwards
        while (snapshots or self._leaves) and self.kv_pool.num_free - before < count:
            if snapshots and (not self._leaves or snapshots[0][:2] < self._leaves[0][:2]):
                snap = heapq.heappop(snapshots)[2]
                if self._snapshots.get(snap.slot) is snap and self._sole(snap.tail_page):
                    self._drop_snapshot(snap)
                continue
            entry = heapq.heappop(self._leaves)
            node = entry[2]
            if node.parent is None or node.children or entry[0] != node.last_use:
                continue                # evicted, no longer a leaf, or offered again since
            if not self._evictable(node):
                held.append(entry)
                continue
            for snap in list(node.snapshots.values()):      # an admission's snapshot sits on a locked node
                self._drop_snapshot(snap)
            self._spill([("page", node.page)], node.hash)
            del node.parent.children[node.key]
            self.kv_pool.free([node.page], cache=True)
            self._num_nodes -= 1
            self.stats.pages_evicted += 1
            node.parent, parent = None, node.parent
            self._offer(parent)
        for entry in held:
            heapq.heappush(self._leaves, entry)
        return self.kv_pool.num_free - before

    def reset(self) -> None:
        """Drop everything the tree holds, without saving it to HiCache's store (nothing may be running)."""
        store, self.store = self.store, None
        for snap in list(self._snapshots.values()):
            self._drop_snapshot(snap)
        self.reclaim_pages(self._num_nodes)
        self.store = store
        self._leaves = []

    def nodes(self):
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _offer(self, node: Node) -> None:
        """Queue node for eviction if it is a leaf (at its last use); past twice the tree's size, the queue is
        rebuilt from the leaves, dropping stale entries."""
        if node.parent is None or node.children:
            return
        heapq.heappush(self._leaves, (node.last_use, id(node), node))
        if len(self._leaves) > 2 * self._num_nodes + 64:
            self._leaves = [(n.last_use, id(n), n) for n in self.nodes() if not n.children]
            heapq.heapify(self._leaves)

    def _evictable(self, node: Node) -> bool:
        return not node.children and node.locks == 0 and self._sole(node.page)

    def _sole(self, page: int | None) -> bool:
        return page is not None and self.kv_pool.cached_only(page)

    def _drop_snapshot(self, snap: Snapshot) -> None:
        parts = [("slot", snap.slot)] + ([("page", snap.tail_page)] if snap.tail else [])
        self._spill(parts, _snapshot_key(snap.node.hash, snap.tail))
        if self.store is not None and snap.node.stored_tails is not None:     # those the store still holds
            node = snap.node
            node.stored_tails = {t for t in node.stored_tails if _snapshot_key(node.hash, t) in self.store}
            node.stored_tails.add(snap.tail)
        del self._snapshots[snap.slot]
        del snap.node.snapshots[snap.tail]
        self.state_pool.free(snap.slot)
        if snap.tail_page is not None:
            self.kv_pool.free([snap.tail_page], cache=True)
        self.stats.snapshots_evicted += 1

    # HiCache: spilling what is evicted, and loading it back

    def _spill(self, parts: list[tuple[str, int]], key: str) -> None:
        """Save parts to the store under key, unless it holds the key already (journaled, so it reads them before
        anything reuses them)."""
        if self.store is not None and key not in self.store:
            self.state_pool.ops.save(parts, lambda entry: self.store.put(key, entry))

    def _load(self, path: list[Node], tokens: list[int], limit: int, best: int) -> bool:
        """Bring back from the store the longest prefix past `best` tokens that ends at a stored snapshot (its
        pages beyond the device path, then the snapshot); whether it did."""
        size, nodes, keys = self.page_size, [self.root, *path], []
        chain = [n.hash for n in nodes]
        for start in range(len(path) * size, limit - size + 1, size):
            key = tuple(tokens[start:start + size])
            digest = _digest(chain[-1], key)
            if digest not in self.store:
                break
            chain.append(digest)
            keys.append(key)
        for depth in range(len(chain) - 1, -1, -1):
            start = depth * size
            if start + size - 1 <= best:
                return False
            base = nodes[min(depth, len(path))]
            if depth <= len(path) and base.stored_tails is not None:     # no hashing: the tails it spilled
                tail = next((t for t in sorted(base.stored_tails, key=len, reverse=True) if len(t) > best - start
                             and start + len(t) <= limit and tuple(tokens[start:start + len(t)]) == t), None)
            else:
                tail = self._stored_tail(chain[depth], tokens[start:min(start + size - 1, limit)], best - start)
            if tail is not None:
                return self._bring_back(base, chain[base.depth + 1:depth + 1], keys[:depth - base.depth], tail)
        return False

    def _stored_tail(self, node_hash: str, tokens: list[int], shorter: int) -> tuple[int, ...] | None:
        """The longest prefix of tokens, longer than `shorter` tokens, that ends a snapshot the store holds after
        node_hash's node, or None."""
        keys = _snapshot_keys(node_hash, tokens)
        for length in range(len(tokens), max(shorter, -1), -1):
            if keys[length] in self.store:
                return tuple(tokens[:length])
        return None

    def _bring_back(self, base: Node, hashes: list[str], keys: list[tuple[int, ...]], tail: tuple[int, ...]) -> bool:
        """Load the stored pages `hashes` (holding the tokens `keys`) below base, then the snapshot with `tail` at
        the last of them (at base without pages); whether the store and the pools allowed it."""
        node_hash = hashes[-1] if hashes else base.hash
        pages = [self._get(digest, "page") for digest in hashes]
        snapshot = self._get(_snapshot_key(node_hash, tail), "tail snapshot" if tail else "snapshot")
        if snapshot is None and not hashes and base.stored_tails is not None:   # the store dropped it since
            base.stored_tails.discard(tail)
        if snapshot is None or any(p is None for p in pages):
            return False
        wanted = len(pages) + bool(tail)
        base.locks += 1
        if self.kv_pool.num_free < wanted:
            self.reclaim_pages(wanted - self.kv_pool.num_free)
        if self.state_pool.num_free == 0:
            self.reclaim_slots(1)
        base.locks -= 1
        if self.kv_pool.num_free < wanted or self.state_pool.num_free == 0:
            return False
        ops, node, now = self.state_pool.ops, base, next(self._clock)
        for digest, key, entry in zip(hashes, keys, pages):
            page = self.kv_pool.allocate(1, cache=True)[0]
            ops.load([("page", page)], entry)
            child = Node(key, page, node, node.depth + 1, self.page_size, digest, now, stored_tails=None)
            node.children[key] = child
            node = child
            self._num_nodes += 1
        self._offer(node)
        slot = self.state_pool.allocate()
        tail_page = self.kv_pool.allocate(1, cache=True)[0] if tail else None
        ops.load([("slot", slot)] + ([("page", tail_page)] if tail else []), snapshot)
        node.snapshots[tail] = self._snapshots[slot] = Snapshot(node, tail, slot, tail_page, now)
        self.stats.pages_loaded += len(pages)
        self.stats.snapshots_loaded += 1
        return True

    def _get(self, key: str, kind: str) -> Entry | None:
        """The store's entry under key if it has the layout of a `kind` entry; a mismatch is discarded."""
        entry = self.store.get(key)
        if entry is not None and {name: (t.shape, t.dtype) for name, t in entry.items()} != self.specs[kind]:
            self.store.discard(key)
            return None
        return entry


def _digest(parent: str, tokens: tuple[int, ...]) -> str:
    return hashlib.blake2b(parent.encode() + array("q", tokens).tobytes(), digest_size=16).hexdigest()


def _snapshot_key(node_hash: str, tail: tuple[int, ...]) -> str:
    return _snapshot_keys(node_hash, tail)[-1]


def _snapshot_keys(node_hash: str, tokens: Sequence[int]) -> list[str]:
    """The store's keys of the snapshots after node_hash's node and then tokens[:n], for n = 0 .. len(tokens)
    (hashing each token once)."""
    hasher = hashlib.blake2b(node_hash.encode() + b"snapshot", digest_size=16)
    data = memoryview(array("q", tokens).tobytes())
    keys = [hasher.hexdigest()]
    for offset in range(0, len(data), 8):
        hasher.update(data[offset:offset + 8])
        keys.append(hasher.hexdigest())
    return keys
