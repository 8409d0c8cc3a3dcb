"""The engine's live requests and how each one ends: ``RequestLedger``.

The core (``rill.engine.core``) runs the step; the ledger holds what outlives a step's work:
the requests by id, those touched since the last output (they get one), those with a
deadline. It records events, ends requests (normally, at their deadline, or by a failure)
and gathers the step's outputs.

Fault isolation: whatever is done for one request alone runs under ``isolated``; if it
raises, that request alone ends with ``GenerationError`` and its KV rows are freed
(``fail``), while every other request of the step carries on exactly as it would have.

Pure Python: the scheduler, sampler and KV manager it ends requests in are the core's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, cast

from rill.engine.kv_cache import KVManager
from rill.engine.output import take_outputs
from rill.engine.request import Request, RequestStatus
from rill.engine.sampler import Sampler
from rill.engine.scheduler import Scheduler
from rill.errors import ConstraintFailed, GenerationError, RequestTimeout
from rill.types import EngineStats, FinishReason, RequestEvent, RequestOutput

log = logging.getLogger("rill.engine")


class RequestLedger:
    """The live requests of one engine, their events, endings and outputs.

    Args:
        scheduler: the core's scheduler (a finished request leaves it).
        sampler: the core's sampler (a finished request's slot is removed).
        kv: the core's KV manager (a failed beam request's rows are dropped).
        stats: the core's counters (finished requests are counted by reason).
    """

    def __init__(self, scheduler: Scheduler, sampler: Sampler, kv: KVManager, stats: EngineStats) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.kv = kv
        self.stats = stats
        self.requests: dict[str, Request] = {}
        self.touched: dict[str, Request] = {}
        self.deadlines: dict[str, Request] = {}

    # -- fault isolation -----------------------------------------------------------------------
    def isolated(
        self, request: Request, stage: str, fn: Callable[..., Any], *args: Any, rows: Iterable[int] = ()
    ) -> None:
        """Call ``fn(*args)``; if it raises, fail ``request`` alone (``rows``: see ``fail``)."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure fails this request alone
            self.fail(request, stage, rows, exc=exc)

    def rows_of(self, request: Request) -> list[int]:
        """Every KV row a beam request holds now (empty for other requests: ``finish`` frees theirs).

        Taken before a beam step, because a step that fails half-way may have moved its beams
        to other rows of the same set.
        """
        if not request.is_beam:
            return []
        rows = set(request.beam.rows()) if request.beam is not None else set()
        if request.row is not None:
            rows.add(request.row)
        return sorted(rows)

    def fail(
        self,
        request: Request,
        stage: str,
        rows: Iterable[int] = (),
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> None:
        """End ``request`` with ``GenerationError`` after it raised while ``stage``; free its KV.

        ``rows`` (a beam request's, from ``rows_of``) are dropped: their content may be half
        updated. The client gets the stage, never the exception text (that goes to the log).
        A ``ConstraintFailed`` (the request's grammar could not be followed) is the client's
        own problem: it ends the request as it is, and the log gets its bounded message on one
        line, no traceback (the grammar module keeps it short: no grammar text in it).
        """
        if isinstance(exc, ConstraintFailed):
            if not request.is_finished:
                log.warning("request %s: %s", request.request_id, exc.message)
                self._drop_rows(request, rows)
                self.finish(request, "error", error=exc, flush=False)
            return
        if exc is not None:
            log.error(
                "request %s failed while %s; the other requests continue", request.request_id, stage, exc_info=exc
            )
        if request.is_finished:
            return
        self._drop_rows(request, rows)
        error = GenerationError(message or f"the request failed while {stage}; other requests are not affected")
        self.finish(request, "error", error=error, flush=False)

    def _drop_rows(self, request: Request, rows: Iterable[int]) -> None:
        rows = list(rows)
        if rows:
            for row in rows:
                if self.kv.is_live(row):
                    self.kv.drop(row)
            request.beam, request.row = None, None  # its rows are dropped above

    # -- finishing ----------------------------------------------------------------------------
    def finish(
        self, request: Request, reason: FinishReason, stop_reason: Any = None, error: Any = None, flush: bool = True
    ) -> None:
        """End ``request`` for ``reason``: its held text is flushed first (``flush``: a stop
        string found there makes the reason ``stop``), it leaves the scheduler (its row kept
        for the prefix cache) and the sampler, and it is counted."""
        if flush and request.output is not None:
            matched = request.output.flush()
            if matched is not None:
                reason, stop_reason = "stop", matched
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        # Counted before the request leaves the scheduler: another thread reading the stats
        # must never see the engine idle and the ending not yet counted.
        finished = self.stats.requests_finished_total
        finished[reason] = finished.get(reason, 0) + 1
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.remove(request)
            self.scheduler.release(request)
        request.status = RequestStatus.FINISHED
        if request.sampler_key is not None:
            self.sampler.remove(request.sampler_key)
            request.sampler_key = None
        self.touched[request.request_id] = request

    def check_deadlines(self, now: float) -> None:
        """End every request whose deadline ``now`` has reached (``RequestTimeout``)."""
        for request in list(self.deadlines.values()):
            if request.is_finished:
                self.deadlines.pop(request.request_id, None)
            elif now >= cast(float, request.deadline):  # self.deadlines holds only requests with one
                self.isolated(
                    request,
                    "finishing",
                    self.finish,
                    request,
                    "error",
                    None,
                    RequestTimeout("the request reached its time limit"),
                )

    def event(self, request: Request, event: RequestEvent) -> None:
        """Record ``event`` for the request's next output."""
        request.pending_events.append(event)
        self.touched[request.request_id] = request

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs of every request touched since the last call (``output.take_outputs``);
        finished requests leave the ledger."""
        outputs = take_outputs(self.touched.values(), self.requests)
        self.touched = {}
        return outputs
