"""Continuation store of batch /ws: bounds by count, tokens and TTL; tombstones; busy ids."""

from __future__ import annotations

from rill.protocols.batch_ws.store import ContinuationStore, Evicted, Kept

A, B, C = ("", "a"), ("", "b"), ("", "c")


def test_count_bound_evicts_oldest_and_leaves_a_tombstone() -> None:
    store = ContinuationStore(max_entries=2, max_tokens=100, ttl_s=10.0)
    for i, key in enumerate((A, B, C)):
        store.keep(key, [1, 2], "t", None, now=float(i))
    assert len(store) == 2 and store.num_tokens == 4
    assert store.claim(A, now=3.0) == Evicted("evicted")
    store.release(A)
    assert store.claim(A, now=3.0) is None  # the tombstone is told once
    kept = store.claim(C, now=3.0)
    assert isinstance(kept, Kept) and kept.token_ids == [1, 2] and kept.num_cached_tokens == 1
    assert store.num_tokens == 2


def test_token_bound_and_ttl_evict_with_tombstones() -> None:
    store = ContinuationStore(max_entries=10, max_tokens=5, ttl_s=10.0)
    store.keep(A, [1, 2, 3], "abc", None, now=0.0)
    store.keep(B, [1, 2, 3], "abc", None, now=1.0)  # 6 tokens > 5: "a" goes
    assert len(store) == 1 and store.num_tokens == 3
    assert store.claim(A, now=2.0) == Evicted("evicted")
    store.release(A)
    assert store.claim(B, now=11.5) == Evicted("expired")  # kept at 1.0, ttl 10
    store.release(B)
    assert store.claim(B, now=11.6) is None
    store.keep(C, list(range(6)), "x", None, now=12.0)  # larger than the whole budget
    assert len(store) == 0 and store.claim(C, now=12.0) == Evicted("evicted")


def test_busy_ids_and_keep_clears_an_old_tombstone() -> None:
    store = ContinuationStore(max_entries=1, max_tokens=100, ttl_s=10.0)
    store.keep(A, [1], "x", None, now=0.0)
    store.keep(B, [1], "x", None, now=0.0)  # "a" evicted
    assert store.claim(A, now=0.0) == Evicted("evicted") and store.is_busy(A)
    store.keep(A, [1, 2], "xy", None, now=1.0, num_cached_tokens=0)
    store.release(A)
    assert not store.is_busy(A)
    assert store.claim(A, now=1.0) == Kept([1, 2], "xy", None, 11.0, 0)


def test_tombstones_are_bounded() -> None:
    store = ContinuationStore(max_entries=1, max_tokens=100, ttl_s=10.0)
    for i in range(3000):
        store.keep(("", str(i)), [1], "x", None, now=0.0)
    assert len(store._tombstones) == 1024  # max(1024, 4 * max_entries)
    assert store.claim(("", "0"), now=0.0) is None  # the oldest tombstones are forgotten
