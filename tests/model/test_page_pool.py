"""PagePool: every page free, in use or evictable (the three add up at every moment), shared pages counted per
holder, evictable pages taken least recently released first (a prefix's later pages before its earlier ones),
one page per key."""
from __future__ import annotations

import random

import pytest

from tllm_spec.model.page_pool import PagePool


def check(pool: PagePool, held: dict[int, list[int]]) -> None:
    holders = [p for pages in held.values() for p in pages]
    assert pool.num_in_use == len(set(holders))
    assert pool.num_available + pool.num_in_use == pool.total
    assert 0 not in holders  # the scratch page is never handed out


def test_random_operations_keep_the_accounting():
    rng, pool, held, keys = random.Random(0), PagePool(33), {}, 0
    for step in range(3000):
        op = rng.random()
        if op < 0.45:
            cached = [k for k in range(keys)]
            run = pool.lookup([k.to_bytes(4, "little") for k in rng.sample(cached, min(len(cached), 2))])
            fresh = rng.randint(1, 6)
            if pool.can_take(fresh, run):
                held[step] = run + pool.take(fresh, run)
            else:
                with pytest.raises(RuntimeError):
                    pool.take(fresh, run)
        elif op < 0.8 and held:
            pool.release(held.pop(rng.choice(list(held))))
        elif op < 0.97 and held:
            pages = held[rng.choice(list(held))]
            pool.publish(rng.choice(pages), keys.to_bytes(4, "little"))
            keys += 1
        else:
            pool.forget()
        check(pool, held)
    for pages in held.values():
        pool.release(pages)
    assert pool.num_in_use == 0 and pool.num_available == pool.total


def test_eviction_order_and_sharing():
    pool = PagePool(7)  # pages 1..6
    a = pool.take(3)
    for i, page in enumerate(a):
        assert pool.publish(page, bytes([i]))
    pool.release(a)  # released last page first: it is evicted first
    assert (pool.num_evictable, pool.num_available) == (3, 6)
    b = pool.take(1, pool.lookup([bytes([0]), bytes([1])]))  # shares a[0], a[1]
    assert pool.num_evictable == 1 and pool.num_in_use == 3
    assert pool.lookup([bytes([0]), bytes([1]), bytes([2])]) == a
    c = pool.take(3)  # two free pages, then a[2] evicted (its key dropped)
    assert a[2] in c and pool.lookup([bytes([0]), bytes([1]), bytes([2])]) == a[:2]
    assert not pool.can_take(1)
    pool.release(c)
    pool.release(a[:2] + b)
    assert pool.num_in_use == 0 and pool.num_evictable == 2


def test_one_page_per_key():
    pool = PagePool(5)
    first, second = pool.take(1), pool.take(1)
    assert pool.publish(first[0], b"k")
    assert not pool.publish(second[0], b"k")  # an identical prefix written twice: the second stays uncached
    assert not pool.publish(first[0], b"other")  # a page holds one key
    pool.release(second)
    pool.release(first)
    assert pool.num_evictable == 1 and pool.num_available == 4
    pool.forget()
    assert pool.num_evictable == 0 and pool.lookup([b"k"]) == [] and pool.num_available == 4
