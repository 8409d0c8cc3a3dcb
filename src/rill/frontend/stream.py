"""RequestStream: the async iterator a protocol adapter reads one request's outputs from.

One slot, coalescing: if the consumer is slower than the engine, pending deltas are merged
into one (vLLM's ``RequestOutputCollector``), so a slow client never blocks the engine.
What waits in the slot is charged to the server's session-memory budget under the
request's principal (a ``Lease``) until the consumer takes it: a client that does not read
can pile up at most its share, and past it (or past the server's budget) its request ends
with ``ResourceExhausted`` and what was pending is dropped. Closing the stream before the
request finished cancels it in the engine at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rill.errors import ResourceExhausted
from rill.types import RequestId, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from rill.frontend.budget import Lease
    from rill.frontend.client import EngineClient

OUTPUT_COST_BYTES = 256
"""Bytes a pending delta counts besides its tokens (its objects)."""
TOKEN_COST_BYTES = 96
"""Bytes each pending token counts besides its text: its id, its text's string object, list slots."""
LOGPROB_COST_BYTES = 96
"""Bytes each logprob entry (the chosen token's and every alternative's) counts."""


def output_bytes(output: RequestOutput) -> int:
    """What one delta is charged while it waits for its reader (an estimate of its memory)."""
    num_bytes = OUTPUT_COST_BYTES + 2 * len(output.text) + TOKEN_COST_BYTES * len(output.token_ids)
    num_bytes += sum(len(t) for t in output.token_texts)
    for entries in (output.logprobs, output.prompt_logprobs):
        for entry in entries or ():
            if entry is not None:
                num_bytes += LOGPROB_COST_BYTES * (1 + len(entry.top))
    return num_bytes


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class RequestStream:
    """Outputs of one request, as an async iterator, plus its controls.

    Iterating yields ``RequestOutput`` deltas; the last one has ``finished=True`` and then
    iteration stops. Use ``async with`` (or ``aclose()``) so that leaving early cancels the
    request. Controls (``pause``, ``modify``, …) are forwarded to the engine client.

    ``sampling`` is the request's parameters in force: the one record of them on this side of
    the engine, written by the engine client only (at admission, and when a ``modify`` is
    applied).
    """

    def __init__(
        self,
        client: EngineClient,
        request_id: RequestId,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        on_close: Callable[[RequestId], None] | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.is_finished = False
        self._pending: RequestOutput | None = None
        self._waiters: list[asyncio.Future[None]] = []  # readers waiting for a delta
        self._closed = False
        self._on_close = on_close
        self._lease = lease
        self._is_overflowed = False

    @property
    def is_closed(self) -> bool:
        """True once the reader closed the stream (``aclose``): nobody reads it any more."""
        return self._closed

    # -- producer side (called on the event loop by the client's dispatcher) --------------
    def put(self, output: RequestOutput) -> None:
        """Queue one delta, merging it into a pending one the consumer has not taken yet.

        Past the budget, the request is cancelled and the reader gets a final error output
        instead of what was pending; a final delta is always taken (it is one step's worth).
        """
        if self._closed or self._is_overflowed:
            return
        if self._lease is not None and not self._lease.try_grow(output_bytes(output)) and not output.finished:
            self._overflow()
            return
        self._pending = output if self._pending is None else self._pending.merge(output)
        self._wake()

    def _overflow(self) -> None:
        """The reader left too much unread: end the request, drop what it has not read."""
        self._is_overflowed = True
        assert self._lease is not None
        self.client.abort(self.request_id)
        self._pending = RequestOutput(
            request_id=self.request_id,
            finished=True,
            finish_reason="error",
            error=ResourceExhausted(
                "the client read this request's output too slowly: the unread output "
                "passed its share of the server's session memory "
                "(--max-session-memory-per-principal, --max-session-memory)"
            ),
        )
        self._lease.close()
        self._wake()

    def _wake(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _resolve(waiter)

    async def _wait(self, timeout_s: float | None = None) -> None:
        """Until a delta is put (or ``timeout_s`` passed): one future and at most one timer,
        which at a token a step is the reader's whole cost of waiting."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = None if timeout_s is None else loop.call_later(timeout_s, _resolve, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            if waiter in self._waiters:  # timed out or cancelled: no put took it off the list
                self._waiters.remove(waiter)

    def _taken(self) -> None:
        # What was pending is the reader's now: it no longer counts against the budget.
        if self._lease is not None:
            self._lease.shrink(self._lease.held)

    # -- consumer side ---------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._pending is None:
            if self.is_finished:
                raise StopAsyncIteration
            await self._wait()
        return self._hand_out(self._pending)

    async def next_within(self, timeout_s: float | None) -> RequestOutput | None:
        """The next delta, or None if none came within ``timeout_s`` seconds (None: no limit);
        raises ``StopAsyncIteration`` after the last one, as ``__anext__`` does."""
        if timeout_s is None:
            return await self.__anext__()
        if self._pending is None:
            if self.is_finished:
                raise StopAsyncIteration
            await self._wait(timeout_s)
            if self._pending is None:
                return None
        return self._hand_out(self._pending)

    def _hand_out(self, output: RequestOutput) -> RequestOutput:
        self._pending = None
        self._taken()
        if output.finished:
            self.is_finished = True
        return output

    def get_nowait(self) -> RequestOutput | None:
        """Take the pending delta if there is one (no waiting)."""
        output, self._pending = self._pending, None
        self._taken()
        if output is not None and output.finished:
            self.is_finished = True
        return output

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop listening; cancel the request in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        if not self.is_finished and not (self._pending is not None and self._pending.finished):
            self.client.abort(self.request_id)
        self._pending = None  # nobody will read it: drop it now, not when the stream is collected
        if self._lease is not None:
            self._lease.close()
        if self._on_close is not None:
            self._on_close(self.request_id)

    # -- controls ----------------------------------------------------------------------
    def abort(self) -> None:
        """Stop generating at the next token; a final output with ``cancelled`` follows."""
        self.client.abort(self.request_id)

    def pause(self) -> None:
        """Take the request out of the batch (it keeps its KV unless memory is needed)."""
        self.client.pause(self.request_id)

    def resume(self) -> None:
        """Put a paused request back into the batch."""
        self.client.resume(self.request_id)

    async def modify(self, patch: dict[str, Any]) -> SamplingParams:
        """Change sampling parameters from the next token on; returns the parameters now in
        force (a new ``response_format`` is compiled off the event loop first). Raises
        ``InvalidRequest`` if a value is invalid and ``RateLimited`` if a raised ``max_tokens``
        needs tokens the principal lacks (or its compile, requests it has not left); either
        way nothing changes. ``RequestNotFound`` if the request ended meanwhile."""
        return await self.client.modify(self.request_id, patch)

    async def regenerate(self) -> None:
        """Drop the generation and restart from the prompt with the current parameters.

        ``RateLimited`` (the generation goes on unchanged) when the principal's bucket cannot
        cover the discarded tokens."""
        await self.client.regenerate(self.request_id)
