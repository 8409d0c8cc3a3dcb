"""Writes one OpenAI generation response to the ASGI connection: the SSE stream or the JSON body.

The adapter hands a ``Responder`` the request's ``ResponseSession`` and its choices'
``RequestStream``s; the responder merges the streams' outputs in arrival order (each stream
coalescing while the client is slow), feeds them to the session, writes what it returns (SSE
keep-alives when nothing came for ``--sse-keepalive-s``), and meanwhile awaits the ASGI
``http.disconnect`` message: a client that goes away closes every stream at once, which
aborts its requests in the engine, not only at the next failed write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rill.errors import RillError
from rill.frontend.stream import RequestStream
from rill.protocols._shared import sse
from rill.protocols.openai_http import codec
from rill.protocols.openai_http.session import ResponseSession
from rill.types import RequestOutput

log = logging.getLogger("rill.openai_http")

JSON_MEDIA_TYPE = "application/json"


class Responder(Response):
    """Writes one generation response while watching for the client going away.

    Not a ``StreamingResponse``: that one only notices a disconnect when a write fails (or
    polls); here a watcher task awaits ``http.disconnect`` and the streams are closed the
    moment it arrives, also during a long prefill when nothing is being written.
    """

    def __init__(
        self, session: ResponseSession, streams: list[RequestStream], *, is_streaming: bool, keepalive_s: float
    ) -> None:
        super().__init__(status_code=200)
        self.session = session
        self.streams = streams
        self.is_streaming = is_streaming
        self.keepalive_s = keepalive_s if keepalive_s and keepalive_s > 0 else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._write_stream(send) if self.is_streaming else self._write_body(send))
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work in done and not work.cancelled() and work.exception() is not None:
                exc = work.exception()
                if not isinstance(exc, OSError):  # a write to a closed socket is a disconnect
                    log.error("error while writing a response", exc_info=exc)
        finally:
            # Abort first: the engine should drop the requests before anything else happens.
            await close_all(self.streams)
            for task in (work, watcher):
                task.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)

    async def _write_stream(self, send: Send) -> None:
        headers = [(b"content-type", sse.MEDIA_TYPE.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in sse.HEADERS.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        session = self.session
        await _send_body(send, b"".join(session.start()))
        try:
            async for item in _merge(self.streams, self.keepalive_s):
                if item is None:
                    await _send_body(send, sse.KEEP_ALIVE)
                    continue
                events = await _take(session, item)
                if events:
                    await _send_body(send, b"".join(events))
                if session.failed is not None:
                    break
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as exc:  # the status is sent already: report it in the stream
            log.error("error while streaming a response", exc_info=exc)
            await _send_body(send, b"".join(session.fail(exc)))
        await _send_body(send, b"".join(session.end()), more=False)

    async def _write_body(self, send: Send) -> None:
        session = self.session
        try:
            async for item in _merge(self.streams, None):
                assert item is not None  # no keep-alive ticks without a timeout
                await _take(session, item)
                if session.failed is not None:
                    break
            if session.failed is not None:
                raise session.failed
            # Per-token detail of a long prompt or reply takes long to build (a 3,885-token prompt
            # scored with 20 alternatives: ~0.4 s): in a worker, so the loop keeps serving others.
            body = await asyncio.to_thread(session.body) if session.builds_per_token_detail else session.body()
            status, headers = 200, {}
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as exc:
            if not isinstance(exc, RillError):
                log.error("error while building a response", exc_info=exc)
            wire = codec.error_for(exc)
            body, status, headers = wire.body, wire.status, wire.headers
        raw_headers = [(b"content-type", JSON_MEDIA_TYPE.encode()), (b"content-length", str(len(body)).encode())]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        await _send_body(send, body, more=False)


def error_response(exc: BaseException) -> Response:
    """An OpenAI error JSON response for ``exc`` (unexpected errors are logged, not shown)."""
    if not isinstance(exc, RillError):
        log.error("unexpected error in the OpenAI API", exc_info=exc)
    wire = codec.error_for(exc)
    return Response(wire.body, status_code=wire.status, headers=wire.headers, media_type=JSON_MEDIA_TYPE)


def count_rejection(metrics: Any, exc: BaseException) -> None:
    """Count a refused request in ``rill_requests_rejected_total`` (``metrics`` None: nothing)."""
    if metrics is not None:
        metrics.observe_rejection(protocol=codec.PROTOCOL, code=codec.error_detail(exc)[1].code or "internal_error")


async def _send_body(send: Send, body: bytes, more: bool = True) -> None:
    if body or not more:
        await send({"type": "http.response.body", "body": body, "more_body": more})


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def close_all(streams: list[RequestStream]) -> None:
    """Close every stream (aborting its request if it still runs), whatever each close raises."""
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def _take(session: ResponseSession, item: tuple[int, RequestOutput]) -> list[bytes]:
    """``session.on_output(*item)``, in a worker when the output brings a scored prompt to
    echo or show (thousands of per-token entries to build: not on the event loop)."""
    if session.builds_per_token_detail and item[1].prompt_logprobs is not None:
        return await asyncio.to_thread(session.on_output, *item)
    return session.on_output(*item)


async def _merge(streams: list[RequestStream], idle_s: float | None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """Outputs of all streams as ``(choice index, output)`` in arrival order, until all finish.

    Yields ``None`` after ``idle_s`` seconds without output (the caller sends a keep-alive).
    Only one ``__anext__`` per stream is outstanding, so each stream keeps coalescing
    deltas while the client is slow instead of queueing them here.
    """
    if len(streams) == 1:
        # One choice (nearly every request): the writer awaits its stream itself. The general
        # path below costs two more task wake-ups, a task, a wait and a timeout's machinery a
        # token: under 32 streams, about a fifth of the server process's event-loop time.
        stream = streams[0]
        while True:
            try:
                output = await stream.next_within(idle_s)
            except StopAsyncIteration:
                return
            if output is None:
                yield None
                continue
            yield 0, output
            if output.finished:
                return
    pending: dict[asyncio.Future[RequestOutput | None], int] = {
        asyncio.ensure_future(_next(stream)): i for i, stream in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield None
                continue
            for future in sorted(done, key=lambda f: pending[f]):
                index = pending.pop(future)
                output = future.result()
                if output is None:
                    continue
                yield index, output
                if not output.finished:
                    pending[asyncio.ensure_future(_next(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()


async def _next(stream: RequestStream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
