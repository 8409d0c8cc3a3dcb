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


def test_kept_generations_are_charged_to_their_owner_and_given_back_when_they_leave() -> None:
    from rill.frontend.budget import MemoryBudget
    from rill.protocols.batch_ws.store import kept_bytes

    size = kept_bytes([1, 2], "ab")
    budget = MemoryBudget(total=10 * size, per_principal=2 * size)
    store = ContinuationStore(max_entries=10, max_tokens=100, ttl_s=10.0, memory=budget)
    store.keep(A, [1, 2], "ab", None, now=0.0, owner="p")
    store.keep(B, [3, 4], "cd", None, now=0.0, owner="p")
    store.keep(C, [5, 6], "ef", None, now=0.0, owner="q")
    assert (budget.used_by("p"), budget.used_by("q")) == (2 * size, size)
    store.keep(("", "d"), [7, 8], "gh", None, now=1.0, owner="p")  # p's share is full: its oldest ("a") goes
    assert store.claim(A, now=1.0) == Evicted("evicted") and budget.used_by("p") == 2 * size
    assert isinstance(store.claim(B, now=1.0), Kept)  # taken out to be continued: no longer held
    assert budget.used_by("p") == size
    store.keep(("", "big"), list(range(50)), "x" * 50, None, now=1.0, owner="q")  # more than q's whole share
    assert store.claim(("", "big"), now=1.0) == Evicted("evicted") and budget.used_by("q") == size  # C kept
    assert store.claim(C, now=20.0) == Evicted("expired")  # expiry gives the bytes back too
    assert budget.used == 0


def test_a_full_server_budget_refuses_a_keep_without_dropping_anything() -> None:
    from rill.frontend.budget import MemoryBudget
    from rill.protocols.batch_ws.store import kept_bytes

    size = kept_bytes([1, 2], "ab")
    budget = MemoryBudget(total=3 * size, per_principal=3 * size)
    budget.charge("other", 2 * size)
    store = ContinuationStore(max_entries=10, max_tokens=100, ttl_s=10.0, memory=budget)
    store.keep(A, [1, 2], "ab", None, now=0.0, owner="p")
    store.keep(B, list(range(40)), "x" * 40, None, now=0.0, owner="p")  # "a" would not free enough
    assert len(store) == 1 and budget.used_by("p") == size
    assert store.claim(B, now=0.0) == Evicted("evicted")
