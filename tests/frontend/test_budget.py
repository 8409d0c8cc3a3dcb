"""Issue 31: the server-wide session-memory budget (``MemoryBudget``, ``Lease``) and giving
freed memory back to the OS (``MemoryReturner``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rill import config as config_mod
from rill.errors import ConfigError, ResourceExhausted
from rill.frontend.budget import MemoryBudget, MemoryReturner, malloc_trim


def test_charges_stop_at_the_total_and_come_back_on_release():
    budget = MemoryBudget(total=100, per_principal=100)
    budget.charge("a", 60)
    budget.charge("b", 40)
    with pytest.raises(ResourceExhausted, match="--max-session-memory") as info:
        budget.charge("c", 1)
    assert info.value.retryable and info.value.code == "resource_exhausted"
    assert (budget.used, budget.refused) == (100, 1)
    budget.release("a", 60)
    budget.charge("c", 60)
    assert (budget.used_by("a"), budget.used_by("c"), budget.used) == (0, 60, 100)


def test_a_principal_past_its_share_is_refused_while_another_still_gets_in():
    budget = MemoryBudget(total=100, per_principal=30)
    budget.charge("a", 30)
    with pytest.raises(ResourceExhausted, match="--max-session-memory-per-principal"):
        budget.charge("a", 1)
    budget.charge("b", 30)
    assert (budget.used_by("a"), budget.used_by("b")) == (30, 30)


def test_the_default_share_is_a_quarter_of_the_total():
    assert MemoryBudget(total=1000).per_principal == 250
    assert MemoryBudget(total=10, per_principal=50).per_principal == 10  # never above the total


def test_a_refused_charge_charges_nothing():
    budget = MemoryBudget(total=10, per_principal=10)
    budget.charge("a", 8)
    assert not budget.try_charge("a", 3)
    assert budget.used == budget.used_by("a") == 8


def test_a_lease_gives_everything_back_on_close_and_charges_nothing_after():
    released: list[int] = []
    budget = MemoryBudget(total=100, per_principal=100, on_release=released.append)
    lease = budget.lease("a")
    lease.grow(30)
    lease.grow(20)
    lease.shrink(10)
    with pytest.raises(ResourceExhausted):
        lease.grow(61)
    assert lease.held == 40 == budget.used
    lease.close()
    lease.close()
    lease.grow(50)
    assert (lease.held, budget.used, budget.num_principals) == (0, 0, 0)
    assert released == [10, 40]


def test_releasing_more_than_held_never_goes_negative():
    budget = MemoryBudget(total=100, per_principal=100)
    budget.charge("a", 5)
    budget.release("a", 50)
    budget.release("b", 7)
    assert (budget.used, budget.used_by("a")) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.integers(0, 60)), max_size=60))
def test_accounting_matches_a_model_and_never_passes_either_bound(ops):
    budget = MemoryBudget(total=100, per_principal=45)
    leases = {p: budget.lease(p) for p in "abc"}
    for principal, is_grow, num_bytes in ops:
        lease = leases[principal]
        if is_grow:
            fits = lease.held + num_bytes <= 45 and budget.used + num_bytes <= 100
            assert lease.try_grow(num_bytes) == fits or num_bytes == 0
        else:
            lease.shrink(num_bytes)
        assert budget.used == sum(lease.held for lease in leases.values()) <= 100
        assert all(budget.used_by(p) == leases[p].held <= 45 for p in "abc")
    for lease in leases.values():
        lease.close()
    assert budget.used == 0 and budget.num_principals == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_returner_trims_once_enough_was_released_and_at_most_once_per_interval():
    trims: list[float] = []
    clock = FakeClock()
    started: list[tuple] = []

    def start(run, delay):  # runs trims when the test says, remembering the delay asked for
        started.append((run, delay))

    returner = MemoryReturner(
        lambda: trims.append(clock.now), threshold_bytes=100, interval_s=1.0, clock=clock, start=start
    )
    returner.released(60)
    assert started == []
    returner.released(40)
    assert [delay for _, delay in started] == [0.0]
    returner.released(500)  # one trim is already on its way
    assert len(started) == 1
    started.pop()[0]()
    assert trims == [0.0] and returner.num_trims == 1
    clock.now = 0.25
    returner.released(100)
    [(run, delay)] = started
    assert delay == pytest.approx(0.75)  # the rest of the interval since the last trim
    clock.now = 1.0
    run()
    assert trims == [0.0, 1.0]


def test_without_malloc_trim_the_returner_does_nothing():
    returner = MemoryReturner(None, threshold_bytes=1, start=lambda run, delay: pytest.fail("no trim to run"))
    returner.released(10**9)
    assert returner.num_trims == 0


def test_the_budget_tells_the_returner_of_every_release():
    returner = MemoryReturner(lambda: None, threshold_bytes=100, start=lambda run, delay: run())
    budget = MemoryBudget(total=1000, per_principal=1000, on_release=returner.released)
    lease = budget.lease("a")
    lease.grow(150)
    lease.close()
    assert returner.num_trims == 1


def test_malloc_trim_runs_where_the_c_library_has_it():
    trim = malloc_trim()
    if trim is not None:  # glibc
        trim()


def test_the_budget_flags_parse_sizes_and_default_to_a_quarter_share():
    cfg = config_mod.load({"connections.max_session_memory": "1GiB"}, env={})
    assert config_mod.session_memory_bytes(cfg.connections) == (1 << 30, 1 << 28)
    cfg = config_mod.load({}, env={"RILL_MAX_SESSION_MEMORY": "2GiB", "RILL_MAX_SESSION_MEMORY_PER_PRINCIPAL": "1GiB"})
    assert config_mod.session_memory_bytes(cfg.connections) == (2 << 30, 1 << 30)
    assert config_mod.session_memory_bytes(config_mod.load({}, env={}).connections) == (2 << 30, 512 << 20)
    with pytest.raises(ConfigError, match="max_session_memory_per_principal"):
        config_mod.load(
            {"connections.max_session_memory": "1MiB", "connections.max_session_memory_per_principal": "2MiB"}, env={}
        )
    with pytest.raises(ConfigError, match="max_session_memory"):
        config_mod.load({"connections.max_session_memory": "lots"}, env={})


def test_what_is_released_while_a_trim_runs_gets_a_trim_of_its_own():
    clock = FakeClock()
    started: list[tuple] = []
    returner: MemoryReturner

    def trim() -> None:  # sessions end while the trim runs
        returner.released(100)

    returner = MemoryReturner(
        trim, threshold_bytes=100, interval_s=1.0, clock=clock, start=lambda run, delay: started.append((run, delay))
    )
    returner.released(100)
    started.pop()[0]()
    assert returner.num_trims == 1
    [(run, delay)] = started  # the next trim, an interval after the first
    assert delay == 1.0


def test_a_lease_fits_to_a_size_as_far_as_the_budget_allows():
    budget = MemoryBudget(total=100, per_principal=60)
    lease = budget.lease("a")
    assert lease.fit(40) == 40
    assert lease.fit(90) == 60  # the share's room, no more
    assert lease.fit(10) == 10 and budget.used == 10


def test_start_up_objects_are_frozen_after_their_garbage_is_collected() -> None:
    """What start-up left as cyclic garbage is collected, not frozen for good; what is alive
    is moved out of the collector's walks, and thawing gives it back."""
    import gc
    import weakref

    from rill.frontend.budget import freeze_startup_objects, thaw_startup_objects

    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # type: ignore[attr-defined]
    gone = weakref.ref(garbage)
    del garbage
    alive = [Node() for _ in range(100)]
    try:
        frozen = freeze_startup_objects()
        assert gone() is None
        # Frozen objects that die later leave the count: other threads of this test process
        # (left by earlier tests) may free some between the freeze and this line.
        assert frozen >= len(alive) and 0 < gc.get_freeze_count() <= frozen
        assert not any(gc.is_tracked(o) and o in gc.get_objects() for o in alive[:1])
    finally:
        thaw_startup_objects()
    assert gc.get_freeze_count() == 0
