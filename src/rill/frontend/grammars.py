"""Grammar compiles at admission: off the event loop, in a bounded pool, one per principal at a time.

A constrained request (``response_format``, ``structured_outputs``, a forced tool call) needs
a grammar matcher before the engine takes it, and so does a ``/generate`` ``modify`` that sets
a new format. Compiling takes milliseconds for small schemas and hundreds of milliseconds for
large ones (llguidance drops the GIL meanwhile), so:

1. it never runs on the event loop: a 63 KB schema compiled there held ``/health`` for up to
   600 ms;
2. it runs in a small pool of its own (``--grammar-threads``), not the tokenizer's nor the
   default executor: however many compiles clients ask for, at most that many run at once,
   and prompts keep being tokenized meanwhile;
3. a principal has at most one compile in flight: the next one of the same principal WAITS
   for it (in arrival order) rather than being refused, because agents legitimately send
   several constrained requests at once under one key; what bounds a principal's compiles
   over time is the rate limit (``SubmissionPolicy`` counts a ``modify`` that compiles as one
   request in the principal's window), and what bounds them at once is this queue, so one
   principal's stream of schemas occupies at most one worker and others' compiles still run.

Other per-request CPU work of the kind runs the same way (``GrammarAdmission.run``): the OpenAI
API's JSON Schema validators of offered tools (a ``Submission``'s ``prepare``), which took 300 ms
for a 45 KB schema when they were built on the loop.

Formats compiled before are copied from ``GrammarCompiler``'s cache on the loop (~0.1 ms for a
45 KB schema, less than a hop to a worker) without waiting for the principal's turn, so a batch
of requests sharing one schema is not serialised behind itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rill.types import ResponseFormat

T = TypeVar("T")


class Compiler(Protocol):
    """What admission needs of the engine's grammar compiler (``rill.engine.grammar``)."""

    def matcher(self, fmt: ResponseFormat | None) -> Any:
        """A fresh matcher for ``fmt``, compiled or copied from the cache; ``InvalidRequest``
        when it cannot be enforced."""
        ...

    def is_cached(self, fmt: ResponseFormat | None) -> bool:
        """Whether ``matcher(fmt)`` would only copy a compiled grammar."""
        ...

    def cached(self, fmt: ResponseFormat | None) -> Any:
        """A copy of ``fmt``'s compiled matcher, or None if it is not compiled (never compiles)."""
        ...


class GrammarAdmission:
    """Compiles constraints in a bounded pool, one at a time per principal (see module docstring).

    Args:
        num_threads: worker threads; compiles past that wait in the pool's queue.
    """

    def __init__(self, *, num_threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="rill-grammar")
        self._turns: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, int] = {}

    async def matcher(self, compiler: Compiler, fmt: ResponseFormat, principal: str) -> Any:
        """A fresh matcher for ``fmt``: a copy of the compiled grammar, made at once, if there
        is one; else compiled in the pool once ``principal``'s earlier compile has ended
        (raises as ``Compiler.matcher``)."""
        copied = compiler.cached(fmt)  # a copy costs less than the hop to a worker, and waits for no one
        if copied is not None:
            return copied
        return await self.run(principal, compiler.matcher, fmt)

    async def run(self, principal: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool, once ``principal``'s earlier compile has ended: for any
        per-request CPU work of the same kind (a protocol's JSON Schema validators).

        A caller cancelled while it waits leaves the queue; one cancelled during its work lets
        the work finish before the principal's next one starts, so cancelling never lets
        compiles pile up."""
        lock = self._turns.get(principal)
        if lock is None:
            lock = self._turns[principal] = asyncio.Lock()
        self._waiting[principal] = self._waiting.get(principal, 0) + 1
        try:
            async with lock:
                future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
                try:
                    return await asyncio.shield(future)
                except asyncio.CancelledError:
                    await asyncio.wait([future])  # the worker runs on: hold the principal's turn until it ends
                    raise
        finally:
            # Only principals with a compile queued or running keep state here.
            self._waiting[principal] -= 1
            if not self._waiting[principal]:
                del self._waiting[principal]
                del self._turns[principal]

    def num_principals(self) -> int:
        """Principals with a compile queued or running (for tests: the state stays bounded)."""
        return len(self._turns)

    def close(self) -> None:
        """Stop the workers; compiles that have not started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
