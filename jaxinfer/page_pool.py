"""The host-side allocator of KV-cache pages, with prefix caching. Pure Python: no JAX, no threads.

Every page is either referenced (held by at least one live request; a prefix-cached page may be held
by several) or free. Free pages are of two kinds:
  - blank: no reusable content; handed out first.
  - cached: full pages whose tokens are known, keyed by a chained hash of the tokens up to and
    including them (`page_hashes`), kept in least-recently-freed order and evicted in that order only
    when no blank page is left. A new request whose prompt starts with the same tokens takes them
    back (`take_cached`) and skips prefilling them.
The chained key makes a page's identity its whole prefix, so equal pages under different prefixes
(attention reads everything before them) never match. Page 0 is the null page (kv_cache.NULL_PAGE):
never handed out.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxinfer.kv_cache import NULL_PAGE

PageHash = bytes


def page_hashes(token_ids: Sequence[int], page_size: int, num_pages: int | None = None) -> list[PageHash]:
    """Chained keys of the first `num_pages` full pages of `token_ids` (all full pages by default):
    key i = sha256(key i-1 + the page's tokens), so a key names the page's whole prefix."""
    keys: list[PageHash] = []
    extend_page_hashes(keys, token_ids, page_size, num_pages)
    return keys


def extend_page_hashes(
    keys: list[PageHash], token_ids: Sequence[int], page_size: int, num_pages: int | None = None
) -> None:
    """Appends to `keys`, the page_hashes of a prefix of `token_ids`, the keys of its next full pages
    up to `num_pages` in all: a sequence that only grows hashes each page once."""
    full = len(token_ids) // page_size
    n = full if num_pages is None else min(num_pages, full)
    start = len(keys)
    ids = np.asarray(token_ids[start * page_size : n * page_size], np.int64)
    parent = keys[-1] if keys else b""
    for i in range(n - start):
        parent = hashlib.sha256(parent + ids[i * page_size : (i + 1) * page_size].tobytes()).digest()[:16]
        keys.append(parent)


class PagePool:
    """Reference counts, a blank list and an LRU of cached pages over pages 1 .. num_pages - 1.

    enable_prefix_caching=False: `cache` is a no-op and `take_cached` finds nothing.
    """

    def __init__(self, num_pages: int, *, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be at least 2 (page 0 is the null page)")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_pages
        self._blank: list[int] = [p for p in range(num_pages - 1, 0, -1) if p != NULL_PAGE]  # pop() -> low
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._page_of: dict[PageHash, int] = {}
        self._hash_of: dict[int, PageHash] = {}

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: blank ones plus cached ones nobody holds."""
        return len(self._blank) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages whose content is kept for reuse (held or not)."""
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with no reusable content, or None (and nothing taken) when fewer are free. Cached
        pages are evicted, least recently freed first, only once no blank page is left."""
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._blank:
                page = self._blank.pop()
            else:
                page, _ = self._cached_free.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def num_cached_prefix(self, keys: Sequence[PageHash]) -> int:
        """How many leading `keys` are cached (take_cached without taking)."""
        n = 0
        while n < len(keys) and keys[n] in self._page_of:
            n += 1
        return n

    def take_cached(self, keys: Sequence[PageHash]) -> list[int]:
        """The cached pages of the longest prefix of `keys` found, each now held once more."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached_free[page]
            self._refs[page] += 1
            pages.append(page)
        return pages

    def cache(self, page: int, key: PageHash) -> None:
        """Marks a held, full page as holding the content `key` names. If another page already holds
        that key: while it is held it stays the cached copy and this page stays plain (two requests
        computed the same prefix at once); once it is free, this page, the more recently used, takes
        the key and the old copy becomes blank, so a live copy is never lost to the old one's eviction."""
        if not self.enable_prefix_caching or page in self._hash_of:
            return
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is not held")
        other = self._page_of.get(key)
        if other is not None:
            if self._refs[other] > 0:
                return
            del self._cached_free[other], self._hash_of[other]
            self._blank.append(other)
        self._page_of[key] = page
        self._hash_of[page] = key

    def free(self, pages: Sequence[int]) -> None:
        """Drops one hold on each page. Callers pass a request's pages last to first, so that its tail
        (least likely to be shared) is evicted first."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"page {page} freed more often than held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._cached_free[page] = None
                else:
                    self._blank.append(page)

    def check(self) -> None:
        """Raises if the bookkeeping disagrees with itself (tests; the scheduler's invariants)."""
        free = set(self._blank) | set(self._cached_free)
        if len(free) != len(self._blank) + len(self._cached_free) or NULL_PAGE in free:
            raise RuntimeError("page pool: a page is free twice, or the null page is free")
        for page in range(1, self.num_pages):
            if (self._refs[page] == 0) != (page in free):
                raise RuntimeError(
                    f"page pool: page {page} has {self._refs[page]} holds, free={page in free}"
                )
        if any(self._page_of[key] != page for page, key in self._hash_of.items()):
            raise RuntimeError("page pool: hash maps disagree")
