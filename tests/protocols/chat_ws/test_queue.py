"""FairQueue: FIFO admission, positions, notices, estimates, full queue."""

from __future__ import annotations

import pytest

from rill.errors import QueueFull
from rill.protocols.chat_ws.queue import FairQueue, Moved, QueueStatus, Started


def test_free_slot_starts_at_once() -> None:
    q = FairQueue(max_active=2, max_waiting=4)
    assert q.join("a") == Started("a")
    assert q.join("b") == Started("b")
    assert q.num_active == 2 and q.num_waiting == 0


def test_waiting_chats_get_fifo_positions_and_estimates() -> None:
    q = FairQueue(max_active=2, max_waiting=4, baseline_chat_s=10.0)
    q.join("a"), q.join("b")
    assert q.join("c") == QueueStatus(position=1, estimated_wait_s=10.0, queue_length=1)
    assert q.join("d") == QueueStatus(position=2, estimated_wait_s=10.0, queue_length=2)
    assert q.join("e") == QueueStatus(position=3, estimated_wait_s=20.0, queue_length=3)


def test_finish_starts_the_head_and_moves_the_rest() -> None:
    q = FairQueue(max_active=1, max_waiting=4)
    q.join("a"), q.join("b"), q.join("c")
    notices = q.finish("a", duration_s=4.0)
    assert notices[0] == Started("b")
    assert notices[1] == Moved("c", QueueStatus(1, q.estimate_wait_s(1), 1))
    assert q.num_active == 1 and q.num_waiting == 1


def test_leaving_while_queued_moves_only_those_behind() -> None:
    q = FairQueue(max_active=1, max_waiting=4)
    for t in "abcd":
        q.join(t)
    notices = q.leave("c")
    assert notices == [Moved("d", q.status("d"))]
    assert q.status("d").position == 2
    assert q.status("b").position == 1


def test_leaving_the_head_moves_everyone() -> None:
    q = FairQueue(max_active=1, max_waiting=4)
    for t in "abc":
        q.join(t)
    assert [n.ticket for n in q.leave("b")] == ["c"]


def test_a_newcomer_never_overtakes_waiting_chats() -> None:
    q = FairQueue(max_active=1, max_waiting=4)
    q.join("a"), q.join("b")
    q.leave("a")  # b starts
    assert q.join("c") == QueueStatus(1, q.estimate_wait_s(1), 1)


def test_full_queue_refuses_and_changes_nothing() -> None:
    q = FairQueue(max_active=1, max_waiting=1)
    q.join("a"), q.join("b")
    with pytest.raises(QueueFull, match="Queue full"):
        q.join("c")
    assert q.num_waiting == 1


def test_estimate_follows_finished_chat_durations() -> None:
    q = FairQueue(max_active=1, max_waiting=4, baseline_chat_s=10.0, ema_alpha=0.5)
    q.join("a")
    q.finish("a", duration_s=2.0)
    assert q.avg_chat_s == pytest.approx(6.0)
    assert q.estimate_wait_s(2) == 12.0


def test_unknown_ticket_and_double_join() -> None:
    q = FairQueue(max_active=1, max_waiting=1)
    assert q.leave("nobody") == []
    q.join("a")
    with pytest.raises(ValueError):
        q.join("a")
    with pytest.raises(ValueError):
        FairQueue(max_active=0, max_waiting=1)
