"""Per-request timings the engine client keeps: metrics figures and places in the queue.

The client (``rill.frontend.inproc``) keeps one ``RequestTracks``: it opens a
``RequestTrack`` when it submits a request, feeds it every output of the request on the
event loop, and when the request ends hands its figures to the ``MetricsSink``: queue time,
time to first token, inter-token gaps, prefill and decode time. The same tracks say where a
waiting request stands among the others. Times are monotonic seconds, passed in: nothing
here reads a clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rill.frontend.client import MetricsSink
from rill.types import RequestEvent, RequestId, RequestOutput

log = logging.getLogger("rill.client")

QUEUE_POSITIONS_TTL_S = 0.25
"""How long ``RequestTracks.queue_position`` reuses one pass over the queued requests."""


@dataclass
class RequestTrack:
    """Per-request timing the client keeps for metrics."""

    protocol: str
    arrival: float
    is_queued: bool = True
    scheduled_at: float | None = None
    last_token_at: float | None = None
    final_token_at: float | None = None
    """When the latest token came (kept across pauses, unlike ``last_token_at``)."""
    inter_token_s: list[float] = field(default_factory=list)
    num_generated: int = 0
    """Tokens generated so far (``usage``: counts a token whose text is still held back)."""

    def observe(self, output: RequestOutput, now: float) -> bool:
        """Take one output of the request, seen at ``now``; True when it is the one that took
        the request out of the queue (scheduled, or ended while waiting)."""
        has_left_queue = False
        if self.is_queued and (RequestEvent.SCHEDULED in output.events or output.finished):
            self.is_queued = False
            has_left_queue = True
            if RequestEvent.SCHEDULED in output.events:
                # The engine's own time: by the time the loop sees the event, a short prompt's
                # prefill has run already.
                self.scheduled_at = output.scheduled_time if output.scheduled_time is not None else now
        if RequestEvent.REGENERATING in output.events:
            self.num_generated = 0  # usage counts the new run only
        num_new = output.usage.completion_tokens - self.num_generated
        self.num_generated = output.usage.completion_tokens
        if num_new > 0 and output.last_token_time is not None:
            if self.last_token_at is not None:
                gap = (output.last_token_time - self.last_token_at) / num_new
                self.inter_token_s.extend([gap] * num_new)
            self.last_token_at = self.final_token_at = output.last_token_time
        if RequestEvent.REGENERATING in output.events or RequestEvent.PAUSED in output.events:
            self.last_token_at = None  # a pause or restart is not inter-token latency
        return has_left_queue

    def report(self, sink: MetricsSink, final: RequestOutput, now: float) -> None:
        """Hand the figures of the request ended by output ``final`` (seen at ``now``) to ``sink``."""
        first, scheduled, last = final.first_token_time, self.scheduled_at, self.final_token_at
        sink.observe_request(
            protocol=self.protocol,
            finish_reason=final.finish_reason or "error",
            queue_s=(self.scheduled_at - self.arrival) if self.scheduled_at else None,
            ttft_s=(final.first_token_time - self.arrival) if final.first_token_time else None,
            inter_token_s=self.inter_token_s,
            e2e_s=now - self.arrival,
            num_prompt_tokens=final.usage.prompt_tokens,
            num_generated_tokens=final.usage.completion_tokens,
            prefill_s=(first - scheduled) if first and scheduled else None,
            decode_s=(last - first) if first and last else None,
        )


class RequestTracks(dict[RequestId, RequestTrack]):
    """The tracks of the requests in flight, by id in arrival order, and how many of them still
    wait for the engine (``num_queued``)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_queued = 0
        self._positions: dict[RequestId, int] = {}  # queue_position's last pass
        self._positions_at: float | None = None

    def open(self, request_id: RequestId, protocol: str, now: float) -> None:
        """Start tracking a request submitted at ``now``; it waits in the queue."""
        self[request_id] = RequestTrack(protocol=protocol, arrival=now)
        self.num_queued += 1

    def drop(self, request_id: RequestId) -> None:
        """Stop tracking a request that never reached the engine (no figures are reported)."""
        track = self.pop(request_id, None)
        if track is not None and track.is_queued:
            self.num_queued -= 1

    def observe(self, output: RequestOutput, now: float, sink: MetricsSink | None) -> None:
        """Take one output seen at ``now``; when it ends its request, stop tracking it and hand
        its figures to ``sink`` (a failing sink is logged, never raised: metrics must never
        break a stream)."""
        track = self.get(output.request_id)
        if track is None:
            return
        if track.observe(output, now):
            self.num_queued -= 1
        if not output.finished:
            return
        del self[output.request_id]
        if sink is not None:
            try:
                track.report(sink, output, now)
            except Exception:
                log.exception("metrics sink failed")

    def queue_position(self, request_id: RequestId, now: float) -> tuple[int, int] | None:
        """``(position, num_waiting)``: the request's 1-based place among the tracked requests
        the engine has not scheduled yet (in arrival order), and how many those are; None once
        it runs, ends, or is unknown.

        Positions are computed in one pass for every request and reused for
        ``QUEUE_POSITIONS_TTL_S``, so many waiting clients asking cost one pass, not one each.
        """
        track = self.get(request_id)
        if track is None or not track.is_queued:
            return None
        is_stale = self._positions_at is None or now - self._positions_at > QUEUE_POSITIONS_TTL_S
        if is_stale or request_id not in self._positions:
            queued = [rid for rid, track in self.items() if track.is_queued]
            self._positions = {rid: index + 1 for index, rid in enumerate(queued)}
            self._positions_at = now
        return self._positions[request_id], len(self._positions)
