"""The server-wide session-memory budget, and giving freed memory back to the OS.

``MemoryBudget`` is the one account of what clients make the server hold besides the KV
cache: Evergreen session stores, batch ``/ws`` kept generations, outputs waiting for a
client that does not read. Everything that holds such memory charges it to the budget under
its principal (``rill.auth.principal``) and releases it when dropped. A charge past the
total (``--max-session-memory``) or past the principal's share
(``--max-session-memory-per-principal``) is refused with ``ResourceExhausted``, so no client
(and no set of clients) can make the process grow without bound, and one principal cannot
take the whole budget from the others.

The budget is pure accounting (a lock, counters; no I/O, no clock): callers report sizes.
A ``Lease`` is one holder's running total (a session, a stream) that grows, shrinks, and
gives everything back on ``close``.

``MemoryReturner`` is told how many bytes were released and, past a threshold, asks the C
allocator to give free pages back to the OS (glibc's ``malloc_trim``): without it a process
whose clients briefly held a few hundred MB keeps that RSS for good, since glibc returns
only the top of its heap on its own.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

from rill.engine.allocator import malloc_trim
from rill.errors import ResourceExhausted

log = logging.getLogger("rill.frontend.budget")

__all__ = ["MemoryBudget", "Lease", "MemoryReturner", "malloc_trim", "format_bytes"]


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` as a short size for messages (``512 MiB``, ``2 GiB``, ``100 B``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.4g} {unit}"
    return f"{num_bytes} B"


class MemoryBudget:
    """Bytes held for clients, server-wide and per principal, with both bounds enforced.

    Thread-safe (sessions may charge from worker threads). ``on_release`` (optional) is
    called with the number of bytes given back by every release, outside the lock.

    Args:
        total: most bytes held for all principals together.
        per_principal: most bytes one principal may hold (at most ``total``).
        on_release: told of every release (``MemoryReturner.released``).
    """

    def __init__(
        self, total: int, per_principal: int | None = None, on_release: Callable[[int], None] | None = None
    ) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, not {total}")
        self.total = total
        self.per_principal = min(total, per_principal if per_principal is not None else max(1, total // 4))
        if self.per_principal < 1:
            raise ValueError(f"per_principal must be >= 1, not {per_principal}")
        self.on_release = on_release
        self.used = 0
        self.refused = 0
        """Charges refused so far (either bound)."""
        self._by_principal: dict[str, int] = {}
        self._lock = threading.Lock()

    def used_by(self, principal: str) -> int:
        """Bytes ``principal`` holds now."""
        return self._by_principal.get(principal, 0)

    def room_for(self, principal: str) -> int:
        """Most bytes ``principal`` could be charged now (both bounds)."""
        with self._lock:
            return max(0, min(self.per_principal - self._by_principal.get(principal, 0), self.total - self.used))

    @property
    def num_principals(self) -> int:
        """Principals holding any bytes now."""
        return len(self._by_principal)

    def try_charge(self, principal: str, num_bytes: int) -> bool:
        """Charge ``num_bytes`` to ``principal`` if both bounds allow it; False (nothing
        charged) if not. Zero or fewer bytes always succeed and charge nothing."""
        return self._charge(principal, num_bytes) is None

    def charge(self, principal: str, num_bytes: int) -> None:
        """Charge ``num_bytes`` to ``principal``.

        Raises:
            ResourceExhausted: the server-wide budget or the principal's share would be passed
                (nothing is charged).
        """
        refusal = self._charge(principal, num_bytes)
        if refusal is not None:
            raise ResourceExhausted(refusal)

    def _charge(self, principal: str, num_bytes: int) -> str | None:
        if num_bytes <= 0:
            return None
        with self._lock:
            held = self._by_principal.get(principal, 0)
            if held + num_bytes > self.per_principal:
                self.refused += 1
                return (
                    f"this client holds {format_bytes(held)} of session memory and may hold at most "
                    f"{format_bytes(self.per_principal)} (--max-session-memory-per-principal); "
                    "end sessions or read pending output, then retry"
                )
            if self.used + num_bytes > self.total:
                self.refused += 1
                return (
                    f"the server's session memory ({format_bytes(self.total)}, --max-session-memory) is "
                    "used up by open sessions; retry later"
                )
            self._by_principal[principal] = held + num_bytes
            self.used += num_bytes
        return None

    def release(self, principal: str, num_bytes: int) -> None:
        """Give back ``num_bytes`` charged to ``principal`` (never more than it holds)."""
        if num_bytes <= 0:
            return
        with self._lock:
            held = self._by_principal.get(principal, 0)
            num_bytes = min(num_bytes, held)
            if held - num_bytes > 0:
                self._by_principal[principal] = held - num_bytes
            else:
                self._by_principal.pop(principal, None)
            self.used -= num_bytes
        if self.on_release is not None and num_bytes:
            self.on_release(num_bytes)

    def lease(self, principal: str) -> Lease:
        """A new, empty running total charged to ``principal``."""
        return Lease(self, principal)


class Lease:
    """One holder's share of a ``MemoryBudget``: grows and shrinks as the holder does, and
    gives everything back on ``close`` (idempotent; a closed lease charges nothing more)."""

    def __init__(self, budget: MemoryBudget, principal: str) -> None:
        self.budget = budget
        self.principal = principal
        self.held = 0
        self.is_closed = False

    def grow(self, num_bytes: int) -> None:
        """Hold ``num_bytes`` more.

        Raises:
            ResourceExhausted: past the server-wide budget or the principal's share.
        """
        if self.is_closed or num_bytes <= 0:
            return
        self.budget.charge(self.principal, num_bytes)
        self.held += num_bytes

    def try_grow(self, num_bytes: int) -> bool:
        """``grow`` that answers False instead of raising (nothing charged then)."""
        if self.is_closed or num_bytes <= 0:
            return True
        if not self.budget.try_charge(self.principal, num_bytes):
            return False
        self.held += num_bytes
        return True

    def shrink(self, num_bytes: int) -> None:
        """Hold ``num_bytes`` fewer (at most what is held)."""
        num_bytes = min(num_bytes, self.held)
        if num_bytes <= 0:
            return
        self.held -= num_bytes
        self.budget.release(self.principal, num_bytes)

    def fit(self, num_bytes: int) -> int:
        """Hold as close to ``num_bytes`` as the budget allows now (all of it if it fits, else
        what is held plus the room left); return what is held after."""
        if num_bytes <= self.held:
            self.shrink(self.held - num_bytes)
        elif not self.try_grow(num_bytes - self.held):
            self.try_grow(min(num_bytes - self.held, self.budget.room_for(self.principal)))
        return self.held

    def close(self) -> None:
        """Give back everything held; later grows charge nothing."""
        self.is_closed = True
        self.shrink(self.held)


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (imported modules, the model's Python
    objects, the app) out of the garbage collector's reach; return how many were moved.

    Called once the model is loaded. A full collection walks every tracked object, and a
    loaded server holds ~300k of them before any client comes: each full collection then
    paused both the event loop and the engine thread for ~140 ms (the GIL), and one ran every
    ~75k objects that outlived a step, as under a long scored response. Frozen objects are
    never collected, so the collection first clears what start-up left as garbage.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_startup_objects() -> None:
    """Undo ``freeze_startup_objects`` when a server stops: a process that goes on (a test
    running servers in its own process, one after the other) collects their cycles again."""
    gc.unfreeze()


TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Released bytes that make a trim worth its cost (it walks the whole heap)."""

TRIM_INTERVAL_S = 1.0
"""At most one trim per this many seconds."""


class MemoryReturner:
    """Gives freed memory back to the OS once enough was released: at most once per
    ``interval_s``, in a thread of its own (a trim of a large heap takes milliseconds, which
    the event loop must not wait for).

    Args:
        trim: what returns memory (``malloc_trim()``); None: nothing to do (not glibc).
        threshold_bytes: released bytes since the last trim that start the next one.
        interval_s: least time between two trims; releases within it start a trim when it ends.
        clock: monotonic seconds (tests pass their own).
        start: runs a trim off the caller's thread (tests pass one that runs it at once).
    """

    def __init__(
        self,
        trim: Callable[[], object] | None,
        threshold_bytes: int = TRIM_THRESHOLD_BYTES,
        interval_s: float = TRIM_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        start: Callable[[Callable[[], None], float], None] | None = None,
    ) -> None:
        self.trim = trim
        self.threshold_bytes = threshold_bytes
        self.interval_s = interval_s
        self.clock = clock
        self.start = start or _start_thread
        self.num_trims = 0
        self._released = 0
        self._last_trim: float | None = None
        self._is_scheduled = False
        self._lock = threading.Lock()

    def released(self, num_bytes: int) -> None:
        """``num_bytes`` were given back; trim (soon) once enough were."""
        if self.trim is None:
            return
        with self._lock:
            self._released += num_bytes
            delay = self._schedule()
        if delay is not None:
            self.start(self._run, delay)

    def _schedule(self) -> float | None:
        """Under the lock: the delay of the trim to start now, or None (not enough released,
        or one is already on its way)."""
        if self._released < self.threshold_bytes or self._is_scheduled:
            return None
        self._is_scheduled = True
        if self._last_trim is None:
            return 0.0
        return max(0.0, self._last_trim + self.interval_s - self.clock())

    def _run(self) -> None:
        with self._lock:
            self._released = 0  # what is released from now on needs the next trim
            self._last_trim = self.clock()
        try:
            assert self.trim is not None
            self.trim()
            self.num_trims += 1
        except Exception:  # returning memory is an optimisation: never let it fail a caller
            log.debug("malloc_trim failed", exc_info=True)
        finally:
            with self._lock:
                self._is_scheduled = False
                # Enough may have been released while this trim ran: the next one, an interval on.
                delay = self._schedule()
            if delay is not None:
                self.start(self._run, delay)


def _start_thread(run: Callable[[], None], delay_s: float) -> None:
    timer = threading.Timer(delay_s, run)
    timer.name = "rill-malloc-trim"
    timer.daemon = True
    timer.start()
