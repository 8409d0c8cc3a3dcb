"""Starlette routes of OpenAI's Responses API and their I/O.

Routes: ``POST /v1/responses``, ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``
resumes the event stream), ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
``GET /v1/responses/{id}/input_items``.

Every response runs in a *producer* task of its own, not in the request's handler: the task
reads the engine's outputs, turns them into events (``responses_session``) and appends them
to the response's resumable stream (``rill.frontend.resumable``, the server's
``deps.resumable``). A streamed request is one follower of that stream; when its client goes
away the response runs on for ``--resume-grace-s`` and any connection of the same principal
can read on from a sequence number; after the grace period with no reader, a response still
running is cancelled (its KV freed in the next engine step). A background response
(``background: true``) runs with no follower by design and is kept until it ends. A
non-streamed foreground request waits for the end; its client going away cancels it.

With ``store`` (the default) the response object, its input items and its conversation are
written to the response store (``rill.response_store``) when the response is created and
again when it ends; ``previous_response_id`` continues a stored conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from rill import auth
from rill.config import parse_size
from rill.errors import InvalidRequest, PositionOutOfRange, RequestNotFound, ResumeExpired, RillError
from rill.frontend.client import Submission
from rill.frontend.resumable import ResumableStream, StreamRegistry
from rill.frontend.stream import RequestStream
from rill.protocols._shared import sse
from rill.protocols.openai_http import codec, responses_codec, tools
from rill.protocols.openai_http.responder import JSON_MEDIA_TYPE, error_response, wait_for_disconnect
from rill.protocols.openai_http.responses_codec import ResponsesRequest, new_id
from rill.protocols.openai_http.responses_session import ResponsesSession
from rill.response_store import ResponseStore, StoredResponse
from rill.types import GenerateRequest

log = logging.getLogger("rill.openai_http")

_json = msgspec.json.Encoder()

ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "temperature", "top_p", "user")
"""Request fields a response object repeats as sent (``_echo`` adds those with defaults)."""


@dataclass
class _Run:
    """A response being produced: its session, stream and engine request."""

    session: ResponsesSession
    stream: ResumableStream[bytes]
    principal: str
    stores: bool
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    engine: RequestStream | None = None
    task: asyncio.Task[None] | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class ResponsesApi:
    """The Responses API's handlers, bound to one OpenAI API (its model, client and deps)."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.client = api.client
        config = api.deps.config
        self.streams: StreamRegistry[Any] = api.deps.resumable
        r = config.resume
        self._store_args = {
            "where": config.storage.database or config.http.data_dir,
            "max_count": r.responses_max_stored,
            "max_bytes": parse_size(r.responses_max_store_bytes, "responses_max_store_bytes"),
            "max_history_bytes": parse_size(r.responses_max_history_bytes, "responses_max_history_bytes"),
            "retention_s": r.responses_retention_days * 86400,
            "max_bytes_per_client": (
                parse_size(r.responses_max_store_bytes_per_principal, "responses_max_store_bytes_per_principal")
                if r.responses_max_store_bytes_per_principal is not None
                else None
            ),
        }
        self._store: ResponseStore | None = None
        self._store_lock = asyncio.Lock()
        self.keepalive_s = config.http.sse_keepalive_s or None
        self.runs: dict[str, _Run] = {}

    def routes(self) -> list[BaseRoute]:
        """The routes, for the shared HTTP port."""
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
        ]

    async def store(self) -> ResponseStore:
        """The response store, opened (off the event loop) on first use."""
        async with self._store_lock:
            if self._store is None:
                self._store = await asyncio.to_thread(lambda: ResponseStore(**self._store_args))
            return self._store

    # -- create ------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """``POST /v1/responses``."""
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        owner = auth.scope_owner(request.scope)
        run: _Run | None = None
        try:
            served = self.api._served()
            req = responses_codec.decode(body)
            codec.check_model(req.model, served.name)
            run = await self._start(req, owner, auth.scope_principal(request.scope), served)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            if run is not None:
                self.streams.forget(run.session.id)
            self.api._count_rejection(exc)
            return error_response(responses_codec.renamed(exc))
        if req.background:
            return _json_response(run.session.snapshot())
        if req.stream:
            return _Follower(run.stream, -1, self.keepalive_s)
        return _Waiter(self, run)

    async def _start(self, req: ResponsesRequest, principal: str, asker: str, served: Any) -> _Run:
        """Start one response owned by ``principal`` (``auth.scope_owner``); ``asker`` is whom
        the submission policy's rate limits and shares charge (``auth.scope_principal``)."""
        items = responses_codec.input_items(req.input)
        history: list[dict[str, Any]] = []
        store = await self.store()
        if req.previous_response_id:
            history = await self._history(req.previous_response_id, principal, store)
        store.check_history([*history, *items])
        chat = responses_codec.chat_request(req, history, items)
        codec.check_chat(chat)
        sampling = codec.sampling_params(chat, served)
        text_calls = tools.text_call_check(chat)
        response_id = new_id("resp")
        prompt = GenerateRequest(
            messages=codec.chat_messages(chat, served),
            add_generation_prompt=True,
            chat_template_kwargs={},
            tools=codec.template_tools(chat),
        )
        session = ResponsesSession(
            response_id=response_id,
            created_at=int(time.time()),
            model=served.name,
            echo=_echo(req),
            tool_format=self.api._tool_format() if tools.parses_tool_calls(chat) else None,
            text_calls=text_calls,
            logprobs=(chat.top_logprobs or 0) if chat.logprobs else None,
            token_text=self.api.token_text,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )
        stream: ResumableStream[bytes] = self.streams.open(
            response_id, principal, keeps_running=bool(req.background), charged_to=asker
        )
        run = _Run(session, stream, principal, req.stores, items, history)
        try:
            if req.stores:
                await asyncio.to_thread(store.put, principal, self._stored(run), is_new=True, charged_to=asker)
            submission = Submission(
                prompts=[prompt],
                sampling=sampling,
                request_id=response_id,
                protocol=codec.PROTOCOL,
                principal=asker,
                prepare=text_calls.prepare if text_calls is not None else None,
            )
            try:
                run.engine = (await self.client.submit(submission))[0]
            except RillError as exc:
                raise codec.renamed(exc, chat) from exc
        except BaseException:
            self.streams.forget(response_id)
            if req.stores:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(store.delete, response_id, principal)
            raise
        for event in session.start():
            _append(stream, event)
        self.runs[response_id] = run
        task = asyncio.create_task(self._produce(run), name=f"response {response_id}")
        run.task = task
        stream.cancel = _canceller(task)
        return run

    async def _history(self, previous_id: str, principal: str, store: ResponseStore) -> list[dict[str, Any]]:
        live = self._live(previous_id, principal)
        if live is not None and not live.session.is_done:
            raise InvalidRequest(
                f"previous response {previous_id!r} is still running; continue it once it has ended",
                field="previous_response_id",
            )
        try:
            stored = await asyncio.to_thread(store.get, previous_id, principal)
        except RequestNotFound as exc:
            raise InvalidRequest(
                f"previous response {previous_id!r} was not found (unknown, deleted, or not stored)",
                field="previous_response_id",
            ) from exc
        return stored.history

    def _stored(self, run: _Run) -> StoredResponse:
        output = [item for item in run.session.output if item["status"] == "completed"]
        return StoredResponse(run.session.snapshot(), run.input_items, [*run.history, *run.input_items, *output])

    async def _produce(self, run: _Run) -> None:
        session, stream, engine = run.session, run.stream, run.engine
        assert engine is not None
        ending: list[Any] = []  # the events that end the response, sent once its row is written
        try:
            try:
                async for out in engine:
                    events = session.on_output(out)
                    if session.is_done:
                        ending = events
                        break
                    for event in events:
                        _append(stream, event)
                if not session.is_done:
                    ending = session.fail(codec.RequestCancelled("the request ended without a result"))
            except asyncio.CancelledError:
                ending = session.cancel()
            except Exception as exc:
                log.error("error while producing response %s", session.id, exc_info=exc)
                ending = session.fail(exc)
        finally:
            try:
                with contextlib.suppress(Exception):
                    await engine.aclose()  # aborts the engine request if it still runs
                if run.stores:
                    # Before any reader learns the end: a client that reads or continues the
                    # response through another server sharing the database (--database) finds
                    # it ended there too. Until then this server reads it from the run.
                    try:
                        store = await self.store()
                        await asyncio.to_thread(store.put, run.principal, self._stored(run), is_new=False)
                    except Exception as exc:
                        log.error("could not store response %s", session.id, exc_info=exc)
            finally:
                # Readers learn the end whatever happened above (a second cancellation at
                # shutdown included).
                for event in ending:
                    _append(stream, event)
                stream.finish()
                run.ended.set()
                self.runs.pop(session.id, None)

    # -- read, resume, cancel, delete ----------------------------------------------------------
    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``; with ``stream=true``, the events after ``starting_after``."""
        response_id = request.path_params["response_id"]
        principal = auth.scope_owner(request.scope)
        try:
            query = request.query_params
            if query.get("stream", "false").lower() in ("true", "1"):
                after = _int_param(query.get("starting_after"), "starting_after", default=-1)
                try:
                    stream = self.streams.get(response_id, principal)
                except RequestNotFound as exc:
                    if isinstance(exc, ResumeExpired):
                        raise
                    await self._stored_or_raise(response_id, principal)
                    raise ResumeExpired(
                        f"response {response_id!r} ended more than {self.streams.grace_s:g} s ago; its events are "
                        "no longer kept (GET it without stream for the result)"
                    ) from exc
                try:
                    stream.check_position(after)
                except PositionOutOfRange as exc:
                    raise InvalidRequest(
                        f"'starting_after' must be from -1 to {exc.last_position} (the sequence_number of the "
                        f"last event so far), not {after}",
                        field="starting_after",
                    ) from exc
                return _Follower(stream, after, self.keepalive_s)
            run = self._live(response_id, principal)
            if run is not None:
                return _json_response(run.session.snapshot())
            stored = await self._stored_or_raise(response_id, principal)
            return _json_response(stored.response)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            return error_response(exc)

    def _live(self, response_id: str, principal: str) -> _Run | None:
        """The running response ``response_id`` of ``principal``, if there is one."""
        run = self.runs.get(response_id)
        return run if run is not None and run.principal == principal else None

    async def _stored_or_raise(self, response_id: str, principal: str) -> StoredResponse:
        store = await self.store()
        return await asyncio.to_thread(store.get, response_id, principal)

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: stop a running response (its object as it ends)."""
        response_id = request.path_params["response_id"]
        principal = auth.scope_owner(request.scope)
        try:
            run = self._live(response_id, principal)
            if run is not None:
                if run.task is not None and not run.session.is_done:
                    run.task.cancel()
                await run.ended.wait()
                return _json_response(run.session.snapshot())
            stored = await self._stored_or_raise(response_id, principal)
            return _json_response(stored.response)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    async def delete(self, request: Request) -> Response:
        """``DELETE /v1/responses/{id}``: a running one is cancelled; the stored row deleted."""
        response_id = request.path_params["response_id"]
        principal = auth.scope_owner(request.scope)
        try:
            run = self._live(response_id, principal)
            found = False
            if run is not None:
                found = True
                run.stores = False
                if run.task is not None:
                    run.task.cancel()
                await run.ended.wait()
            if self.streams.peek(response_id, principal) is not None:
                found = True
                self.streams.forget(response_id)
            store = await self.store()
            try:
                await asyncio.to_thread(store.delete, response_id, principal)
            except RequestNotFound:
                if not found:
                    raise
            return _json_response({"id": response_id, "object": "response.deleted", "deleted": True})
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    async def input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items`` (``limit``, ``order``, ``after``)."""
        response_id = request.path_params["response_id"]
        principal = auth.scope_owner(request.scope)
        try:
            query = request.query_params
            limit = _int_param(query.get("limit"), "limit", default=20)
            if not 1 <= limit <= 100:
                raise InvalidRequest("'limit' must be in [1, 100]", field="limit")
            order = query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise InvalidRequest("'order' must be asc or desc", field="order")
            run = self._live(response_id, principal)
            if run is not None:
                items = run.input_items
            else:
                items = (await self._stored_or_raise(response_id, principal)).input_items
            items = list(reversed(items)) if order == "desc" else list(items)
            after = query.get("after")
            if after is not None:
                ids = [item["id"] for item in items]
                if after not in ids:
                    raise InvalidRequest(f"'after' names no item of this response: {after!r}", field="after")
                items = items[ids.index(after) + 1 :]
            page = items[:limit]
            return _json_response(
                {
                    "object": "list",
                    "data": page,
                    "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None,
                    "has_more": len(items) > limit,
                }
            )
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    async def aclose(self) -> None:
        """Server shutdown: cancel the responses still running, let each record how it
        ended, then close the store."""
        tasks = [run.task for run in self.runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._store is not None:
            await asyncio.to_thread(self._store.close)


def _canceller(task: asyncio.Task[None]) -> Callable[[], None]:
    def cancel() -> None:
        task.cancel()

    return cancel


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    echo = {name: getattr(req, name) for name in ECHOED}
    echo["tools"] = req.tools or []
    echo["tool_choice"] = req.tool_choice or "auto"
    echo["text"] = req.text or {"format": {"type": "text"}}
    echo["store"] = req.stores
    echo["background"] = bool(req.background)
    echo["parallel_tool_calls"] = req.parallel_tool_calls is not False
    echo["metadata"] = req.metadata or {}
    echo["truncation"] = "disabled"
    return echo


def _append(stream: ResumableStream[bytes], event: dict[str, Any]) -> None:
    data = sse.encode_event(_json.encode(event), event=event["type"])
    stream.append(data, len(data))


def _int_param(value: str | None, name: str, *, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise InvalidRequest(f"'{name}' must be an integer, not {value!r}", field=name) from exc


def _json_response(value: Any, status: int = 200) -> Response:
    return Response(_json.encode(value), status_code=status, media_type=JSON_MEDIA_TYPE)


class _Follower(Response):
    """Writes a response's events after a position as SSE, then live ones until it ends.

    The client going away only ends this follower: the response runs on (the stream's grace
    timer decides how long when nobody else reads it).
    """

    def __init__(self, stream: ResumableStream[bytes], after: int, keepalive_s: float | None) -> None:
        super().__init__(status_code=200)
        self.stream = stream
        self.after = after
        self.keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._write(send))
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watcher):
                task.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)

    async def _write(self, send: Send) -> None:
        headers = [(b"content-type", sse.MEDIA_TYPE.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in sse.HEADERS.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = self.stream.follow(self.after)
        pending: asyncio.Future[tuple[int, bytes]] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=self.keepalive_s)
                if not done:
                    await send({"type": "http.response.body", "body": sse.KEEP_ALIVE, "more_body": True})
                    continue
                try:
                    _, data = pending.result()
                except StopAsyncIteration:
                    break
                except RillError as exc:  # fell behind the stream's memory bound
                    data = sse.encode_event(_json.encode({"type": "error", **_error_fields(exc)}), event="error")
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    break
                finally:
                    if pending.done():
                        pending = None
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if pending is not None:
                # Let the cancelled read finish first: closing a generator while a read of it
                # is still running fails.
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await events.aclose()


class _Waiter(Response):
    """A non-streamed foreground response: waits for the end and writes the response object
    (or the error); the client going away cancels the response."""

    def __init__(self, api: ResponsesApi, run: _Run) -> None:
        super().__init__(status_code=200)
        self.api = api
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        ended = asyncio.create_task(self.run.ended.wait())
        try:
            done, _ = await asyncio.wait({watcher, ended}, return_when=asyncio.FIRST_COMPLETED)
            if ended not in done:
                if self.run.task is not None:
                    self.run.task.cancel()  # nobody waits for it any more
                return
        finally:
            for task in (watcher, ended):
                task.cancel()
            await asyncio.gather(watcher, ended, return_exceptions=True)
        self.api.streams.forget(self.run.session.id)  # nobody resumes a non-streamed response
        session = self.run.session
        response = _json_response(session.snapshot())
        await response(scope, receive, send)


def _error_fields(exc: BaseException) -> dict[str, Any]:
    _, detail = codec.error_detail(exc)
    return {"code": detail.code, "message": detail.message, "param": detail.param}
