"""Paged MLA KV: pages of page_size tokens, reference-counted so that forked sequences and the prefix cache share
them."""

from __future__ import annotations

from .device_ops import DeviceOps


class KVPool:
    """Hands out page numbers of a HybridCache's MLA cache (all MLA layers' latents and indexer keys at once)."""

    def __init__(self, num_pages: int, page_size: int, ops: DeviceOps):
        self.num_pages = num_pages
        self.page_size = page_size
        self.ops = ops
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._cache_refs = [0] * num_pages       # of _refs, those the prefix cache holds
        self.num_cached_only = 0                 # pages only the prefix cache holds (it can evict them)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages running sequences hold."""
        return self.num_pages - self.num_free - self.num_cached_only

    def cached_only(self, page: int) -> bool:
        """Whether only the prefix cache holds page."""
        return 0 < self._cache_refs[page] == self._refs[page]

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold `tokens` tokens."""
        return -(-tokens // self.page_size)

    def allocate(self, count: int, cache: bool = False) -> list[int]:
        """`count` pages, owned by the caller (the prefix cache when `cache`); the caller checks num_free first."""
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
            self._cache_refs[page] = int(cache)
        self.num_cached_only += count if cache else 0
        return pages

    def share(self, pages: list[int], cache: bool = False) -> None:
        """One more owner for each page (the prefix cache when `cache`)."""
        for page in pages:
            before = self.cached_only(page)
            self._refs[page] += 1
            self._cache_refs[page] += cache
            self.num_cached_only += self.cached_only(page) - before

    def free(self, pages: list[int], cache: bool = False) -> None:
        """Drop one owner of each page (the prefix cache when `cache`); a page with none left is free again."""
        for page in pages:
            before = self.cached_only(page)
            self._refs[page] -= 1
            self._cache_refs[page] -= cache
            self.num_cached_only += self.cached_only(page) - before
            if self._refs[page] == 0:
                self._free.append(page)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page src's contents to page dst in every MLA layer before the next step."""
        self.ops.copy_pages([src], [dst])
