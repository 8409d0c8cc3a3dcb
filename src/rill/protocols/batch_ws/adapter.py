"""Starlette WebSocket routes ``/ws`` and ``/api/ws`` for the batch protocol: the only I/O.

Per connection: one receive loop (decode → ``BatchSession.receive`` → actions), one reader
task per prompt (``async for`` over its ``RequestStream``, merging into a per-prompt slot),
and one pump task that, on each wake-up, drains every slot at once and hands the group to
``BatchSession.on_outputs``, so one PROGRESS array carries every prompt that produced a
token in that engine step. The slots make the per-socket buffer bounded (one merged output
per prompt) however slow the client reads. On disconnect every open prompt is aborted at
once, which frees its KV memory in the engine. The continuation store is shared by every
connection of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import cast

import msgspec
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from rill import auth
from rill import config as rill_config
from rill.deps import Deps
from rill.errors import ConfigError, InvalidRequest, RillError
from rill.frontend.client import EngineClient
from rill.frontend.stream import RequestStream
from rill.protocols.batch_ws import codec
from rill.protocols.batch_ws.messages import GenerationConfig
from rill.protocols.batch_ws.session import (
    Abort,
    Action,
    BatchSession,
    ContinuationStore,
    Limits,
    PromptKey,
    Send,
    SendError,
    Start,
)
from rill.types import RequestOutput

log = logging.getLogger("rill.protocols.batch_ws")

PATHS = ("/ws", "/api/ws")


class _Shared:
    """What every connection of one server shares: engine client, defaults, limits, store."""

    def __init__(self, deps: Deps) -> None:
        self.client: EngineClient = deps.client
        defaults = deps.sampling_defaults or rill_config.sampling_defaults()
        self.defaults = GenerationConfig(**{name: getattr(defaults, name, None) for name in GenerationConfig.__struct_fields__})
        cfg = deps.config.batch_ws
        self.limits = Limits(max_inflight_prompts=cfg.batch_max_inflight_prompts,
                             request_timeout_s=deps.config.policy.request_timeout_s)
        # Kept generations are charged to the server's session-memory budget.
        self.store = ContinuationStore(cfg.batch_cache_max_entries, cfg.batch_cache_max_tokens, cfg.batch_cache_ttl_s,
                                       memory=deps.memory)
        try:  # a bad MODEL_DEFAULT_* value must stop startup, not fail every message later
            BatchSession(self.store, self.defaults, self.limits, "check").default_sampling()
        except InvalidRequest as exc:
            raise ConfigError(f"batch /ws generation defaults (MODEL_DEFAULT_* / RILL_DEFAULT_*): {exc}") from exc


def routes(deps: Deps) -> list[BaseRoute]:
    """The batch WebSocket routes, sharing one continuation store."""
    shared = _Shared(deps)

    async def endpoint(ws: WebSocket) -> None:
        await _Connection(shared, ws).run()

    return [WebSocketRoute(path, endpoint, name=f"batch_ws{path.replace('/', '_')}") for path in PATHS]


class _Connection:
    """One accepted ``/ws`` socket."""

    def __init__(self, shared: _Shared, ws: WebSocket) -> None:
        self.ws = ws
        self.client = shared.client
        # NOTE: continuations are scoped by the credentials presented, so one API key can
        # never continue (and read) another key's generation by guessing its request_id.
        scope = _credential(ws)
        self.principal = auth.scope_principal(ws.scope)
        self.session = BatchSession(shared.store, shared.defaults, shared.limits, f"bws-{uuid.uuid4().hex[:12]}", scope,
                                    principal=self.principal)
        self.slots: dict[PromptKey, RequestOutput] = {}
        self.wake = asyncio.Event()
        self.readers: dict[PromptKey, asyncio.Task[None]] = {}
        self.send_lock = asyncio.Lock()

    async def run(self) -> None:
        """Serve the socket until the client goes away; then abort whatever still runs."""
        await self.ws.accept()
        pump = asyncio.create_task(self._pump())
        try:
            await self._receive_loop()
        except (WebSocketDisconnect, OSError):
            pass
        finally:
            for action in self.session.on_disconnect():
                if isinstance(action, Abort):
                    self.client.abort(cast(PromptKey, action.key))  # batch /ws names every stream
            # Expired generations would otherwise stay charged to the budget until the next
            # prompt anyone sends.
            self.session.store.expire(time.monotonic())
            pump.cancel()
            readers = list(self.readers.values())
            for task in readers:
                task.cancel()
            await asyncio.gather(pump, *readers, return_exceptions=True)

    async def _receive_loop(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                await self._send(codec.encode_socket_error(codec.BINARY_FRAME))
                continue
            try:
                actions = self.session.receive(codec.decode(text), time.monotonic())
            except InvalidRequest as exc:
                await self._send(codec.encode_socket_error(str(exc)))
                continue
            except Exception:  # a bug: the generic error frame; the other prompts go on
                log.exception("batch /ws message could not be handled")
                await self._send(codec.encode_socket_error(codec.GENERIC_ERROR))
                continue
            await self._perform(actions)

    async def _perform(self, actions: list[Action]) -> None:
        failures: list[tuple[PromptKey, BaseException]] = []
        for action in actions:
            if isinstance(action, Send):
                await self._send(codec.encode_events(action.message))
            elif isinstance(action, SendError):
                await self._send(codec.encode_socket_error(action.text))
            elif isinstance(action, Start):
                key = cast(PromptKey, action.key)  # batch /ws names every stream
                try:
                    stream = await self.client.generate(msgspec.structs.replace(action.request,
                                                                                principal=self.principal))
                except Exception as exc:  # reported per prompt via the error table
                    if not isinstance(exc, RillError):  # a bug: keep the traceback, tell the client nothing of it
                        log.error("batch /ws request %s failed at submission", key, exc_info=exc)
                    failures.append((key, exc))
                    continue
                self.session.on_submitted(key, stream.prompt_token_ids)
                self._watch(key, stream)
            elif isinstance(action, Abort):
                self.client.abort(cast(PromptKey, action.key))  # batch /ws names every stream
        if failures:
            await self._perform(self.session.on_start_failed(failures, time.monotonic()))

    def _watch(self, key: PromptKey, stream: RequestStream) -> None:
        task = asyncio.create_task(self._read(key, stream))
        self.readers[key] = task
        task.add_done_callback(lambda _: self.readers.pop(key, None))

    async def _read(self, key: PromptKey, stream: RequestStream) -> None:
        # Leaving this block early (disconnect → cancel) closes the stream, which aborts the
        # request in the engine.
        async with stream:
            async for output in stream:
                pending = self.slots.get(key)
                self.slots[key] = output if pending is None else pending.merge(output)
                self.wake.set()

    async def _pump(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                # Every stream of one engine step was filled in one loop callback, and their
                # readers ran before this task woke, so this drain groups that step's outputs.
                drained, self.slots = self.slots, {}
                await self._perform(self.session.on_outputs(list(drained.items()), time.monotonic()))
        except asyncio.CancelledError:
            raise
        except (WebSocketDisconnect, OSError, RuntimeError):
            return  # the socket went away under a send; run()'s receive sees the disconnect
        except Exception:
            log.exception("batch /ws pump failed; closing the socket")
            with contextlib.suppress(Exception):
                await self._send(codec.encode_socket_error(codec.GENERIC_ERROR))
                await self.ws.close(code=1011)

    async def _send(self, text: str) -> None:
        async with self.send_lock:
            if self.ws.application_state is WebSocketState.CONNECTED:
                await self.ws.send_text(text)


def _credential(ws: WebSocket) -> str:
    """Whose continuations this socket may use: the principal of the key the middleware
    accepted (however it was sent: header, key subprotocol or query), else without keys what
    the client presented (``Authorization: Bearer`` or ``?api_key=``), or ''."""
    checked = ws.scope.get(auth.PRINCIPAL_SCOPE_KEY)
    if isinstance(checked, str):
        return checked
    header = ws.headers.get("authorization", "")
    return auth.bearer_token(header) or ws.query_params.get("api_key", "") or header
