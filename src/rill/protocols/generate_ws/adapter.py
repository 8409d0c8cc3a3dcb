"""Starlette routes of the protocol: WebSocket ``/generate`` and ``POST /v1/generate``
(JSON, or Server-Sent Events with ``"stream": true``).

The only module of the package with I/O. It receives and decodes frames, asks the session
what to do, performs the actions (engine calls, sends, feedback writes) and pumps the
engine's ``RequestStream``. It makes no protocol decisions.

API keys (when configured): ``Authorization: Bearer KEY`` or, for browsers, the key
subprotocol or ``?api_key=KEY`` (``rill.auth.websocket_key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rill import __version__, auth
from rill.config import parse_size
from rill.deps import Deps
from rill.errors import EngineDead, InvalidRequest, ModelLoadError, RequestTimeout, RillError
from rill.feedback import FeedbackStore
from rill.frontend.stream import RequestStream
from rill.models.default import DEFAULT_MODEL_NAME
from rill.protocols._shared import sse
from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws import session as s

log = logging.getLogger("rill.protocols.generate_ws")

LOADING_STATUS_PERIOD_S = 0.5
QUEUE_STATUS_PERIOD_S = 0.5  # how often a waiting request's place is looked at (sent only when it changes)


class _Gone(Exception):
    """The client went away; stop sending."""


class GenerateService:
    """Shared state of the protocol: settings, the feedback store."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.client = deps.client
        self.http = deps.config.http
        self._feedback: FeedbackStore | None = None

    # -------------------------------------------------------------- shared services
    def limits(self) -> s.Limits:
        """What the session knows of the model (refreshed once it has loaded)."""
        info = self.client.model_info
        name = self.deps.config.engine.served_model_name or (info.name if info else None)
        if name is None:
            model = self.deps.config.engine.model
            name = (Path(model).stem if model.endswith(".gguf") else Path(model).name) if model else DEFAULT_MODEL_NAME
        return s.Limits(model_name=name, model_info=info, version=__version__,
                        max_feedback_per_generation=self.http.feedback_max_per_generation,
                        max_feedback_per_connection=self.http.feedback_max_per_connection)

    def feedback_store(self) -> FeedbackStore:
        """The store, opened on first use."""
        if self._feedback is None:
            days = self.http.feedback_retention_days
            self._feedback = FeedbackStore(
                self.http.data_dir, max_text_bytes=self.http.feedback_max_text_bytes,
                max_store_bytes=parse_size(self.http.feedback_max_store_bytes, "feedback_max_store_bytes"),
                max_principal_bytes=self.http.feedback_quota_bytes(),
                retention_s=None if days is None else days * 86400)
        return self._feedback

    def authorize(self, headers: Any, query: Any, subprotocols: Any = ()) -> tuple[bool, str | None]:
        """Check the API key (``rill.auth.websocket_key``: header, key subprotocol or query);
        returns (ok, key)."""
        key = auth.websocket_key(headers.get("authorization"), subprotocols, query.get("api_key"))
        return auth.is_authorized(self.deps.api_keys, key), key

    def principal(self, key: str | None, scope: Any) -> str:
        """Who asks (``rill.auth.principal``): the key when keys are on (it was checked), else
        the client's address (a key sent to a server without keys names nobody)."""
        return auth.principal(key, None) if self.deps.api_keys and key else auth.scope_principal(scope)

    def token_text(self, token_id: int) -> str:
        """Text of one token (for logprob alternatives)."""
        try:
            return self.client.decode([token_id])
        except Exception:  # noqa: BLE001 - a name for an alternative is cosmetic
            return ""

    # -------------------------------------------------------------- endpoints
    async def websocket(self, ws: WebSocket) -> None:
        """``/generate``: one connection, many generations in turn."""
        await ws.accept()
        ok, key = self.authorize(ws.headers, ws.query_params, ws.scope.get("subprotocols") or ())
        send_lock = asyncio.Lock()
        state = {"closed": False}

        async def send(msg: m.ServerMessage) -> None:
            if state["closed"]:
                raise _Gone
            async with send_lock:
                try:
                    await ws.send_text(codec.encode(msg))
                except Exception as exc:  # any send failure means the peer is gone
                    state["closed"] = True
                    raise _Gone from exc

        async def close(code: int, reason: str) -> None:
            if not state["closed"]:
                state["closed"] = True
                with contextlib.suppress(Exception):
                    await ws.close(code, reason)

        conn = _Connection(self, send, close, key, self.principal(key, ws.scope))
        if not ok:
            await conn.perform(conn.session.on_error(codec.Unauthorized(
                "a valid API key is required: send 'Authorization: Bearer KEY' or '?api_key=KEY'")))
            return
        try:
            while not state["closed"]:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                # Binary frames are accepted too: some clients send their JSON as bytes.
                data = message.get("text")
                await conn.handle_text(data if data is not None else message.get("bytes") or b"")
        except (WebSocketDisconnect, _Gone):
            pass
        except RuntimeError:  # receive after the socket closed
            pass
        finally:
            state["closed"] = True
            await conn.shutdown()

    async def rest(self, request: Request) -> Response:
        """``POST /v1/generate``: the spec's REST shape; SSE of the socket's messages with
        ``"stream": true``."""
        ok, key = self.authorize(request.headers, request.query_params)
        if not ok:
            return _json_error(codec.Unauthorized("a valid API key is required: send 'Authorization: Bearer KEY'"))
        body = await request.body()
        if len(body) > self.http.max_body_bytes:
            return _json_error(InvalidRequest(f"request body over {self.http.max_body_bytes} bytes"), 413)
        try:
            rest_req = codec.decode_rest(body)
        except Exception as exc:  # InvalidRequest; anything else is a bug, answered generically
            if not isinstance(exc, InvalidRequest):
                log.exception("a /v1/generate body could not be decoded")
            return _json_error(exc)
        principal = self.principal(key, request.scope)
        if rest_req.stream:
            return StreamingResponse(self._sse(rest_req, key, principal), media_type=sse.MEDIA_TYPE,
                                     headers=dict(sse.HEADERS))
        return await self._rest_once(rest_req, key, principal, request)

    async def _rest_once(self, rest_req: m.RestRequest, key: str | None, principal: str,
                         request: Request) -> Response:
        sent: list[m.ServerMessage] = []

        async def collect(msg: m.ServerMessage) -> None:
            sent.append(msg)

        conn = _Connection(self, collect, _no_close, key, principal)
        try:
            await conn.handle_message(rest_req.to_config())
            if conn.task is not None and not await _finished_before_disconnect(conn.task, request):
                return Response(status_code=499)  # nobody is listening; the finally aborts the generation
        finally:
            await conn.shutdown()
        init = next((x for x in sent if isinstance(x, m.Init)), None)
        for msg in sent:
            if isinstance(msg, m.Completion):
                response = m.RestResponse(id=msg.request_id or (init.request_id if init else ""),
                                          model=init.model if init else conn.session.limits.model_name,
                                          generated_text=msg.generated_text, finish_reason=msg.finish_reason,
                                          usage=msg.usage, timing=msg.timing)
                return Response(codec.encode(response), media_type="application/json")
            if isinstance(msg, m.Error):
                status = cast(int, _HTTP_STATUS.get(msg.error, 500))  # every entry of the table has one
                # Rounded up: a client that waits the header's whole seconds must not be early.
                headers = {"Retry-After": str(max(1, math.ceil(msg.retry_after_seconds)))} \
                    if isinstance(msg.retry_after_seconds, float) else None
                return Response(codec.encode(msg), status_code=status, media_type="application/json", headers=headers)
        return _json_error(RillError("the generation ended without a result"))

    async def _sse(self, rest_req: m.RestRequest, key: str | None, principal: str) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[m.ServerMessage | None] = asyncio.Queue()

        async def enqueue(msg: m.ServerMessage) -> None:
            queue.put_nowait(msg)  # unbounded but short: one generation's messages

        conn = _Connection(self, enqueue, _no_close, key, principal)

        async def drive() -> None:
            try:
                await conn.handle_message(rest_req.to_config())
                await conn.wait()
            finally:
                queue.put_nowait(None)

        driver = asyncio.create_task(drive())
        keepalive_s = self.http.sse_keepalive_s or None
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), keepalive_s)
                except TimeoutError:
                    yield sse.KEEP_ALIVE  # nothing to say for a while (queued, loading): keep proxies from closing
                    continue
                if msg is None:
                    break
                yield codec.encode_sse(msg)
        finally:
            # Client disconnect cancels this generator: stop the generation at once.
            driver.cancel()
            with contextlib.suppress(BaseException):
                await driver
            await conn.shutdown()


async def _finished_before_disconnect(task: asyncio.Task[None], request: Request) -> bool:
    """Wait for ``task``; False if the HTTP client went away first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return task.done()


_HTTP_STATUS = {entry.code: entry.status for entry in codec.ERROR_TABLE.values()}
_HTTP_STATUS["internal_error"] = 500


async def _no_close(code: int, reason: str) -> None:
    return None


def _json_error(exc: BaseException, status: int | None = None) -> Response:
    msg = codec.error_message(exc)
    return Response(codec.encode(msg), status_code=status or codec.wire_error(exc).status or 500,
                    media_type="application/json")


class _Connection:
    """One connection's session plus the running generation's task and stream."""

    def __init__(self, service: GenerateService, send: Callable[[m.ServerMessage], Awaitable[None]],
                 close: Callable[[int, str], Awaitable[None]], api_key: str | None, principal: str) -> None:
        self.service = service
        self.session = s.GenerateSession(service.limits(), token_text=service.token_text)
        self._send = send
        self._close = close
        self.api_key = api_key
        self.principal = principal
        self.stream: RequestStream | None = None
        self.task: asyncio.Task[None] | None = None
        # The generations remembered for feedback (prompts up to --max-prompt-chars each) are
        # charged to the server's session-memory budget; when it is short, the oldest are forgotten.
        memory = service.deps.memory
        self._lease = memory.lease(principal) if memory is not None else None

    async def handle_text(self, text: str | bytes) -> None:
        """One frame from the client (JSON text, or the same as UTF-8 bytes)."""
        try:
            msg = codec.decode(text)
        except InvalidRequest as exc:
            await self.perform(self.session.on_invalid(exc))
            return
        except Exception as exc:  # a decoder bug: the generic error frame, never a dead handler
            log.exception("a /generate frame could not be decoded")
            await self.perform(self.session.on_error(exc))
            return
        await self.handle_message(msg)

    async def handle_message(self, msg: m.ClientMessage) -> None:
        """One decoded client message."""
        try:
            actions = self.session.receive(msg, time.monotonic())
        except Exception as exc:  # a session bug: the generic error frame (and close), logged
            log.exception("a /generate message could not be handled")
            actions = self.session.on_error(exc)
        await self.perform(actions)

    async def perform(self, actions: list[s.Action]) -> None:
        """Carry out the session's actions in order."""
        self._charge_history()
        for action in actions:
            if isinstance(action, s.Send):
                await self._send(action.message)
            elif isinstance(action, s.Start):
                self.task = asyncio.create_task(self._run(action.request))
            elif isinstance(action, s.StoreFeedback):
                await self._store_feedback(action.record)
            elif isinstance(action, s.Close):
                await self._close(action.code if action.code is not None else 1011, action.reason)
            else:
                await self._control(action)

    def _charge_history(self) -> None:
        lease, wanted = self._lease, self.session.num_history_bytes
        if lease is None or lease.held == wanted:
            return
        held = lease.fit(wanted)
        if held < wanted:
            self.session.forget_history(held)
            lease.fit(self.session.num_history_bytes)

    async def _control(self, action: s.Action) -> None:
        stream = self.stream
        if isinstance(action, s.Abort):
            if stream is not None:
                stream.abort()
            elif self.task is not None:
                self.task.cancel()  # still waiting for the model or admission
            return
        if stream is None:
            return
        try:
            if isinstance(action, s.Pause):
                stream.pause()
            elif isinstance(action, s.Resume):
                stream.resume()
            elif isinstance(action, s.Modify):
                try:
                    # Awaited here: the connection's next messages wait for a compile, so
                    # they apply in the order they were sent.
                    self.session.on_modify_applied(await stream.modify(action.patch))
                except RillError as exc:
                    await self.perform(self.session.on_modify_refused(exc))
            elif isinstance(action, s.Regenerate):
                stream.regenerate()
        except RillError as exc:  # e.g. the request finished meanwhile, or the engine refused a value
            await self.perform(self.session.on_invalid(exc))

    async def _store_feedback(self, record: dict[str, Any]) -> None:
        hint = self.api_key[-4:] if self.api_key else None
        try:
            feedback_id = await asyncio.to_thread(self.service.feedback_store().add, record, s.PROTOCOL, hint,
                                                  self.principal)
        except RillError as exc:  # the store is full: its message says so
            await self.perform(self.session.on_invalid(exc))
            return
        except Exception:  # never leak storage internals
            log.exception("storing feedback failed")
            await self.perform(self.session.on_invalid(RillError("feedback could not be stored")))
            return
        await self.perform(self.session.on_feedback_stored(record["request_id"], feedback_id))

    async def _wait_ready(self) -> None:
        client = self.service.client
        while not client.is_ready():
            if client.load_error is not None:
                raise ModelLoadError("the model failed to load")
            if client.model_info is not None:  # it had loaded: the engine has stopped, for good
                raise EngineDead("the engine has stopped")
            progress, eta_s = client.load_progress()
            await self.perform(self.session.loading_status(progress, eta_s))
            try:
                await asyncio.wait_for(asyncio.shield(client.wait_ready()), LOADING_STATUS_PERIOD_S)
            except TimeoutError:
                continue
            except EngineDead as exc:
                raise ModelLoadError("the model failed to load") from exc
        self.session.limits = self.service.limits()

    async def _run(self, request: Any) -> None:
        request = msgspec.structs.replace(request, principal=self.principal)
        stream: RequestStream | None = None
        try:
            await self._wait_ready()
            timeout_s = self.service.http.request_timeout_s
            try:
                async with asyncio.timeout(timeout_s):
                    stream = await self.service.client.generate(request)
                    self.stream = stream
                    await self.perform(self.session.on_started(len(stream.prompt_token_ids), stream.sampling))
                    scheduled = asyncio.Event()
                    # Held in a local: the event loop keeps only a weak reference to a task.
                    _reporter = asyncio.create_task(self._report_queue(request.request_id, scheduled))
                    try:
                        async for output in stream:
                            scheduled.set()  # the engine took the request: its place no longer matters
                            await self.perform(self.session.on_output(output, time.monotonic()))
                    finally:
                        # Never cancelled mid-send (that could cut a frame): it stops at its next wait.
                        scheduled.set()
            except TimeoutError as exc:
                if stream is not None:
                    await stream.aclose()
                raise RequestTimeout(f"the generation ran past the server's time limit of {timeout_s:g} s") from exc
        except _Gone:
            return  # the peer left; the finally below aborts the request
        except Exception as exc:  # mapped by the codec's table; unknown ones leak nothing
            if not isinstance(exc, RillError):
                log.exception("generation %s failed", request.request_id)
            with contextlib.suppress(_Gone):
                await self.perform(self.session.on_error(exc))
        finally:
            self.stream = None
            if stream is not None:
                await stream.aclose()

    async def _report_queue(self, request_id: Any, scheduled: asyncio.Event) -> None:
        """Send ``status queued`` whenever the waiting request's place changes, until
        ``scheduled`` is set (``_run`` sets it at the first output).

        A request alone in the queue is not reported (it only waits for the next engine
        step), so an idle server's replies look exactly as before: ``init`` then tokens.
        """
        position_of = getattr(self.service.client, "queue_position", None)  # test fakes have no queue
        if position_of is None:
            return
        last: tuple[int, int] | None = None
        with contextlib.suppress(_Gone):
            while not scheduled.is_set() and (place := position_of(request_id)) is not None:
                if place != last and (last is not None or place[1] > 1):
                    last = place
                    await self.perform(self.session.queue_status(*place))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(scheduled.wait(), QUEUE_STATUS_PERIOD_S)

    async def wait(self) -> None:
        """Wait for the running generation (REST)."""
        if self.task is not None:
            with contextlib.suppress(_Gone, asyncio.CancelledError):
                await self.task

    async def shutdown(self) -> None:
        """The connection ends: abort and forget whatever runs, and give the memory back."""
        self.session.on_disconnect()
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._lease is not None:
            self._lease.close()


def routes(deps: Deps) -> list[BaseRoute]:
    """``/generate`` (WebSocket) and ``POST /v1/generate``."""
    service = GenerateService(deps)
    deps.extras["generate_ws"] = service
    return [WebSocketRoute("/generate", service.websocket), Route("/v1/generate", service.rest, methods=["POST"])]
