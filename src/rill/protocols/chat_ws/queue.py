"""A fair FIFO admission queue for chats (pure): positions, wait estimates, notices.

At most ``max_active`` chats generate at once; the others wait in arrival order. Every
change (a chat joins, leaves, finishes) returns the ``Notice``s to deliver: ``Started`` for a
chat that may begin now and ``Moved`` for each waiting chat whose position changed. The
queue never reads a clock: callers pass the duration of each finished chat, which feeds an
exponential moving average used for ``estimated_wait_s``.

One instance is shared by every connection of a server; it is not thread-safe (the
adapter calls it from the event loop only). Pure: stdlib and ``rill.errors``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from rill.errors import QueueFull

Ticket = Hashable


@dataclass(frozen=True)
class QueueStatus:
    """Where one waiting chat stands: 1-based ``position``, seconds, waiting count."""

    position: int
    estimated_wait_s: float
    queue_length: int


@dataclass(frozen=True)
class Started:
    """The chat holding ``ticket`` may start generating now."""

    ticket: Ticket


@dataclass(frozen=True)
class Moved:
    """The waiting chat holding ``ticket`` now stands at ``status``."""

    ticket: Ticket
    status: QueueStatus


Notice = Started | Moved


class FairQueue:
    """FIFO admission with ``max_active`` slots and ``max_waiting`` places in line.

    Args:
        max_active: chats generating at once (>= 1).
        max_waiting: chats allowed to wait; one more is refused with ``QueueFull``.
        baseline_chat_s: the assumed duration of a chat before any has finished.
        ema_alpha: weight of the newest chat duration in the moving average.
    """

    def __init__(
        self, max_active: int, max_waiting: int, baseline_chat_s: float = 10.0, ema_alpha: float = 0.3
    ) -> None:
        if max_active < 1 or max_waiting < 0:
            raise ValueError("max_active must be >= 1 and max_waiting >= 0")
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.avg_chat_s = baseline_chat_s
        self._alpha = ema_alpha
        self._active: set[Ticket] = set()
        self._waiting: OrderedDict[Ticket, None] = OrderedDict()

    @property
    def num_active(self) -> int:
        """Chats generating now."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Chats waiting for a slot."""
        return len(self._waiting)

    def join(self, ticket: Ticket) -> Started | QueueStatus:
        """Admit ``ticket`` at once (``Started``) or put it last in line (its ``QueueStatus``).

        Raises:
            QueueFull: ``max_waiting`` chats already wait (nothing changes).
            ValueError: the ticket is already in the queue.
        """
        if ticket in self._active or ticket in self._waiting:
            raise ValueError(f"ticket {ticket!r} already joined")
        if len(self._active) < self.max_active and not self._waiting:
            self._active.add(ticket)
            return Started(ticket)
        if len(self._waiting) >= self.max_waiting:
            raise QueueFull(f"Queue full ({self.max_waiting} chats waiting)")
        self._waiting[ticket] = None
        return self.status(ticket)

    def status(self, ticket: Ticket) -> QueueStatus:
        """The current status of a waiting ticket (``KeyError`` if it is not waiting)."""
        position = list(self._waiting).index(ticket) + 1
        return QueueStatus(position, self.estimate_wait_s(position), len(self._waiting))

    def estimate_wait_s(self, position: int) -> float:
        """Seconds until the chat at ``position`` starts: one average chat per full round of slots."""
        return round(math.ceil(position / self.max_active) * self.avg_chat_s, 1)

    def leave(self, ticket: Ticket) -> list[Notice]:
        """Remove ``ticket`` (waiting or active; unknown tickets are ignored) and return the
        notices for the chats that start or move up because of it."""
        if ticket in self._waiting:
            index = list(self._waiting).index(ticket)
            del self._waiting[ticket]
            return self._moved(from_index=index)
        if ticket in self._active:
            self._active.discard(ticket)
            return self._admit()
        return []

    def finish(self, ticket: Ticket, duration_s: float) -> list[Notice]:
        """An active chat ended after ``duration_s``: update the estimate, free its slot."""
        if ticket in self._active and duration_s >= 0:
            self.avg_chat_s = (1 - self._alpha) * self.avg_chat_s + self._alpha * duration_s
        return self.leave(ticket)

    def _admit(self) -> list[Notice]:
        notices: list[Notice] = []
        num_started = 0
        while self._waiting and len(self._active) < self.max_active:
            ticket, _ = self._waiting.popitem(last=False)
            self._active.add(ticket)
            notices.append(Started(ticket))
            num_started += 1
        if num_started:
            notices += self._moved(from_index=0)
        return notices

    def _moved(self, from_index: int) -> list[Notice]:
        # Everyone behind the removed place moved up by at least one; the length changed
        # for all, but only a position change is worth a message.
        tickets = list(self._waiting)
        return [Moved(t, self.status(t)) for t in tickets[from_index:]]
