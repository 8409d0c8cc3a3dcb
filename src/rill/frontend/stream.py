"""RequestStream: the async iterator a protocol adapter reads one request's outputs from.

One slot, coalescing: if the consumer is slower than the engine, pending deltas are merged
into one (vLLM's ``RequestOutputCollector``), so a slow client never blocks the engine and
the memory held per stream stays bounded by the request's own output. Closing the stream
before the request finished cancels it in the engine at once.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from rill.types import RequestId, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from rill.frontend.client import EngineClient


class RequestStream:
    """Outputs of one request, as an async iterator, plus its controls.

    Iterating yields ``RequestOutput`` deltas; the last one has ``finished=True`` and then
    iteration stops. Use ``async with`` (or ``aclose()``) so that leaving early cancels the
    request. Controls (``pause``, ``modify``, …) are forwarded to the engine client.
    """

    def __init__(
        self,
        client: "EngineClient",
        request_id: RequestId,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        on_close: Callable[[RequestId], None] | None = None,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.is_finished = False
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()
        self._closed = False
        self._on_close = on_close

    # -- producer side (called on the event loop by the client's dispatcher) --------------
    def put(self, output: RequestOutput) -> None:
        """Queue one delta, merging it into a pending one the consumer has not taken yet."""
        if self._closed:
            return
        self._pending = output if self._pending is None else self._pending.merge(output)
        self._ready.set()

    # -- consumer side ---------------------------------------------------------------
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished and self._pending is None:
            raise StopAsyncIteration
        await self._ready.wait()
        output = self._pending
        assert output is not None  # _ready is only set together with _pending
        self._pending = None
        self._ready.clear()
        if output.finished:
            self.is_finished = True
        return output

    def get_nowait(self) -> RequestOutput | None:
        """Take the pending delta if there is one (no waiting)."""
        output, self._pending = self._pending, None
        self._ready.clear()
        if output is not None and output.finished:
            self.is_finished = True
        return output

    async def __aenter__(self) -> "RequestStream":
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
        self.sampling = await self.client.modify(self.request_id, patch)
        return self.sampling

    def regenerate(self) -> None:
        """Drop the generation and restart from the prompt with the current parameters.

        ``RateLimited`` (the generation goes on unchanged) when the principal's bucket cannot
        cover the discarded tokens."""
        self.client.regenerate(self.request_id)
