"""A bounded pool of worker threads for blocking work the server does for clients (speech
recognition, OCR): one place for the bound, the order and the cancellation rules.

``WorkerPool.run(fn, *args)`` runs ``fn`` on one of ``workers`` threads, never on the event
loop. At most ``max_pending`` calls wait or run at once, server-wide: the next one gets
``ResourceExhausted`` (retryable) at once, before it queues; ``check_room`` lets a caller refuse
before costly preparation (decoding a file). Callers wait their turn in arrival order. A caller
cancelled while it waits leaves the line at once; one cancelled while its call runs stops
waiting at once (``on_cancel`` tells the work, e.g. a ``threading.Event`` it polls), and its
place is given back only when the thread has finished, so the bound always counts the threads
really busy.

Worker threads run at a lower scheduling priority than the engine (``background_priority``):
on a machine where recognition, synthesis and decoding share the cores, the engine's next
token goes first and the voice work takes the time left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rill.errors import ResourceExhausted

T = TypeVar("T")

log = logging.getLogger("rill.workers")

BACKGROUND_NICE = 10
"""How much lower than the engine's the priority of the voice and OCR threads is (Linux nice):
the scheduler then gives a busy engine thread about nine tenths of a core they both want."""


def background_priority() -> None:
    """Lower the calling thread's scheduling priority by ``BACKGROUND_NICE`` (Linux; a no-op
    elsewhere). Threads and processes it starts afterwards inherit it: CTranslate2's and ONNX
    Runtime's compute threads made when a model loads there, Tesseract's process."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: the work still runs
        log.debug("could not lower a worker thread's priority: %s", exc)


@dataclass
class PoolCounters:
    """What tests and metrics read: calls running and waiting, cancelled callers, and the
    seconds workers spent."""

    num_running: int = 0
    num_waiting: int = 0
    num_cancelled_total: int = 0
    busy_s_total: float = 0.0


class WorkerPool:
    """``workers`` threads behind a server-wide bound of ``max_pending`` calls.

    Args:
        name: the threads' name prefix; ``busy`` words the refusal (``"speech recognition is
            busy"``) with ``what`` naming a call (``"transcriptions"``) and ``setting`` the
            flag that sets the bound.
        counters: where the pool counts (a service's own counters, extending ``PoolCounters``).
    """

    def __init__(
        self,
        *,
        name: str,
        workers: int,
        max_pending: int,
        busy: str,
        what: str,
        setting: str,
        counters: PoolCounters | None = None,
    ) -> None:
        self.workers = workers
        self.max_pending = max_pending
        self.counters = counters if counters is not None else PoolCounters()
        self._busy, self._what, self._setting = busy, what, setting
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=name, initializer=background_priority
        )
        self._slots: asyncio.Semaphore | None = None
        self._num_pending = 0
        self._lock = threading.Lock()  # counters touched by several worker threads

    @property
    def num_pending(self) -> int:
        """Calls waiting for a worker or running (what ``max_pending`` bounds)."""
        return self._num_pending

    def check_room(self) -> None:
        """``ResourceExhausted`` when ``max_pending`` calls wait or run already."""
        if self._num_pending >= self.max_pending:
            raise ResourceExhausted(
                f"{self._busy} ({self._num_pending} {self._what} waiting or running, "
                f"{self._setting} {self.max_pending}); retry later"
            )

    async def run(self, fn: Callable[..., T], *args: Any, on_cancel: Callable[[], None] | None = None) -> T:
        """``fn(*args)`` on a worker thread, once a worker is free (see the module docstring)."""
        self.check_room()
        self._num_pending += 1
        self.counters.num_waiting += 1
        try:
            await self._slots_made().acquire()
        except BaseException:
            self._num_pending -= 1
            raise
        finally:
            self.counters.num_waiting -= 1
        loop = asyncio.get_running_loop()
        job = self._executor.submit(self._timed, fn, *args)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            self.counters.num_cancelled_total += 1
            raise

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            self.counters.num_running += 1
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.counters.num_running -= 1
                self.counters.busy_s_total += time.perf_counter() - started

    def _release(self) -> None:
        self._num_pending -= 1
        assert self._slots is not None
        self._slots.release()

    def _slots_made(self) -> asyncio.Semaphore:
        # Made on first use, on the event loop that serves (an asyncio primitive binds to it).
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        return self._slots

    def shutdown(self) -> None:
        """Stop the worker threads (a call already running finishes; nothing waits)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
