"""The host-side page allocator: holds, blank and cached free pages, LRU eviction, chained page keys."""

import random

import pytest

from jaxinfer.kv_cache import NULL_PAGE
from jaxinfer.page_pool import PagePool, extend_page_hashes, page_hashes


def test_page_keys_name_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], page_size=4)
    assert len(a) == 2  # the partial third page has no key
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, num_pages=1) == a[:1]
    # The same second page under another first page is another key; the same first page is the same.
    b = page_hashes([1, 2, 3, 0, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]
    c = page_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert c[0] == a[0] and c[1] != a[1]
    # Extending keys page by page as a sequence grows gives the keys of the whole.
    grown: list[bytes] = []
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    for n in (1, 5, 9, 13):
        extend_page_hashes(grown, tokens[:n], 4)
    assert grown == page_hashes(tokens, 4) and len(grown) == 3
    # A key depends on every token's full value, not just its low byte.
    assert page_hashes([256, 0, 0, 0], 4) != page_hashes([0, 1, 0, 0], 4)


def test_allocate_all_or_nothing_and_never_the_null_page():
    pool = PagePool(6)
    assert pool.num_usable == 5 and pool.num_free == 5
    first = pool.allocate(3)
    assert sorted(first) == first and NULL_PAGE not in first
    assert pool.allocate(3) is None and pool.num_free == 2  # nothing taken by a refused request
    rest = pool.allocate(2)
    assert set(first + rest) == {1, 2, 3, 4, 5} and pool.num_used == 5
    assert pool.allocate(1) is None
    pool.free(rest)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(rest[:1])
    pool.check()
    with pytest.raises(ValueError, match="at least 2"):
        PagePool(1)


def test_cached_pages_are_shared_and_evicted_least_recently_freed_first():
    pool = PagePool(5)  # 4 usable pages
    keys = page_hashes(list(range(16)), 4)
    a = pool.allocate(3)
    for page, key in zip(a, keys):
        pool.cache(page, key)
    # A second request finds the longest cached prefix and holds those pages too.
    shared = pool.take_cached(keys[:2] + [b"unknown key....."])
    assert shared == a[:2] and pool.num_used == 3
    pool.free(a[::-1])  # the first request ends: its tail page becomes cached-free, the rest stay held
    assert pool.num_used == 2 and pool.num_free == 2 and pool.num_cached == 3
    pool.free(shared[::-1])
    assert pool.num_used == 0 and pool.num_cached == 3
    # Blank pages go first; then cached ones, least recently freed first: a[2], then a[1], then a[0].
    blank = pool.allocate(1)
    assert blank[0] not in a and pool.num_cached == 3
    assert pool.allocate(1) == [a[2]] and pool.num_cached == 2
    assert pool.num_cached_prefix(keys) == 2  # the evicted third key is gone; the first two remain
    assert pool.take_cached(keys) == a[:2]
    pool.free(a[:2][::-1])
    assert pool.allocate(2) == [a[1], a[0]] and pool.num_cached == 0
    assert pool.take_cached(keys) == []
    pool.check()


def test_a_key_computed_again_moves_to_the_newer_page_once_the_old_one_is_free():
    pool = PagePool(4)
    key = page_hashes([7, 7, 7, 7], 4)[0]
    x, y = pool.allocate(2)
    pool.cache(x, key)
    pool.cache(y, key)  # computed twice at once: x is held, so y stays a plain page
    pool.free([x, y])
    assert pool.take_cached([key]) == [x] and pool.num_cached == 1
    pool.free([x])
    # Computed again while the cached copy x is free: the held page z takes the key, x goes blank, so
    # evicting x's old slot in the LRU cannot lose the content z still holds.
    [z] = pool.allocate(1)
    assert z != x  # a blank page first
    pool.cache(z, key)
    assert pool.num_cached == 1 and pool.num_free == 2
    assert pool.allocate(2) is not None  # takes the two blank pages, x among them
    assert pool.take_cached([key]) == [z]
    pool.check()


def test_a_held_page_cannot_be_cached_and_disabled_caching_finds_nothing():
    pool = PagePool(4)
    key = page_hashes([7, 7, 7, 7], 4)[0]
    [y] = pool.allocate(1)
    pool.free([y])
    with pytest.raises(ValueError, match="not held"):
        pool.cache(y, page_hashes([1, 1, 1, 1], 4)[0])
    off = PagePool(4, enable_prefix_caching=False)
    [z] = off.allocate(1)
    off.cache(z, key)
    off.free([z])
    assert off.take_cached([key]) == [] and off.num_cached == 0


def test_random_holds_keep_the_books_balanced():
    rng = random.Random(0)
    pool = PagePool(33)
    held: list[list[int]] = []
    keys = [page_hashes([i] * 4, 4)[0] for i in range(40)]
    for _ in range(2000):
        action = rng.random()
        if action < 0.4:
            pages = pool.allocate(rng.randint(1, 6))
            if pages is not None:
                for page in pages:
                    if rng.random() < 0.5:
                        pool.cache(page, rng.choice(keys))
                held.append(pages)
        elif action < 0.6:
            taken = pool.take_cached(rng.sample(keys, 3))
            if taken:
                held.append(taken)
        elif held:
            pool.free(held.pop(rng.randrange(len(held)))[::-1])
        pool.check()
        assert pool.num_used == len({p for pages in held for p in pages})
    for pages in held:
        pool.free(pages)
    pool.check()
    assert pool.num_used == 0 and pool.num_free == 32
