"""The KV pool's page accounting: which pages are free, in use (by how many requests) or evictable, and which cached
prefix page each key names (prefix caching: engine/prefix_cache.py computes the keys and decides what to share)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PagePool:
    """Every page but the scratch page (0) is in exactly one state: *free* (no KV worth keeping), *in use* (held
    by ``refs`` > 0 requests' block tables) or *evictable* (held by none, but it keeps a cached prefix page's
    K/V under its key). So free + evictable + in use = total at every moment. An allocation takes free pages
    first, then evicts the least recently released evictable pages (their keys are dropped): ``num_available``
    = free + evictable is what an allocation can take now.

    A key names at most one page and a page holds at most one key; a request holding a cached page shares it
    (its refcount grows). Pages are released in reverse block-table order, so a prefix's later pages are evicted
    before its earlier ones (a chain of keys is useless past its first missing page)."""

    def __init__(self, num_pages: int, first: int = 1):
        self.total = num_pages - first
        self._free = list(range(num_pages - 1, first - 1, -1))  # popped from the end: lowest page first
        self._refs = [0] * num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}

    @property
    def num_available(self) -> int:
        """Pages an allocation can take now: free and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.total - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a key (evictable or in use)."""
        return len(self._key_of)

    def can_take(self, num_fresh: int, shared: Sequence[int] = ()) -> bool:
        """Whether ``num_fresh`` pages can be taken once ``shared`` (cached pages, some perhaps evictable) are
        held: sharing an evictable page takes it out of what an allocation can evict."""
        reclaimed = sum(1 for p in shared if self._refs[p] == 0)
        return num_fresh <= self.num_available - reclaimed

    def take(self, num_fresh: int, shared: Sequence[int] = ()) -> list[int]:
        """Hold ``shared`` (cached pages) and ``num_fresh`` new pages; returns the new ones. Raises if they do not
        fit (:meth:`can_take`), changing nothing."""
        if not self.can_take(num_fresh, shared):
            raise RuntimeError(f"KV pool exhausted: {num_fresh} pages wanted, {self.num_available} free")
        for page in shared:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        fresh = [self._free.pop() if self._free else self._evict() for _ in range(num_fresh)]
        for page in fresh:
            self._refs[page] = 1
        return fresh

    def release(self, pages: Sequence[int]) -> None:
        """Drop one hold on each page (a request's block-table row); pages nobody holds become evictable (keyed)
        or free."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of ``keys`` (from the first) that are cached."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def publish(self, page: int, key: bytes) -> bool:
        """Name an in-use page's (now written) K/V by ``key``. False, changing nothing, when the key already names
        a page (an identical prefix written by another request in the same step) or the page holds a key."""
        if key in self._page_of or page in self._key_of or self._refs[page] == 0:
            return False
        self._key_of[page], self._page_of[key] = key, page
        return True

    def forget(self) -> None:
        """Drop every key: evictable pages become free; pages in use stay with their requests, uncached."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._key_of.clear()
        self._page_of.clear()
