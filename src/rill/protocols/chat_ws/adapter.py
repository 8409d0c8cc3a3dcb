"""``/ws/chat`` and its HTTP helpers: the chat protocol's transport.

Per connection: receive the one request; the service (``service.ChatService``) checks it,
transcribes its audio, reads the text in its images and makes the session; send what was
heard (``transcript``) and read (``image_text``); wait
for a turn in the server's fair queue (``queued`` /
``queue_update`` / ``queue_done``); then the session driver (``protocols/_shared/driver.py``)
runs the engine request (deltas → chunks, one per token, and speech segments) while a
speech reader turns the reply's speech into audio chunks, until the session says ``Close``.
A watcher notices the client leaving; leaving at any point cancels its transcription,
leaves the queue, ends the engine request (the engine frees its KV cache at once) and
cancels the speech.

HTTP: ``GET /api/recordings/{id}`` (JSON), ``GET /api/recordings/{id}/reply.wav`` and
``GET /api/default_ref_audio`` (the source project's shape, or 404).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from rill import auth
from rill.deps import Deps
from rill.protocols._shared.actions import Start
from rill.protocols._shared.driver import Driver, Gone
from rill.protocols.chat_ws import codec
from rill.protocols.chat_ws.service import ChatService, ReplySpeech, Turn
from rill.protocols.chat_ws.session import PROTOCOL, ChatSession, EndSpeech, Record, Speak

log = logging.getLogger("rill.protocols.chat_ws")

T = TypeVar("T")


def routes(deps: Deps) -> list[BaseRoute]:
    """``/ws/chat`` and the recordings / reference-audio HTTP routes."""
    service = ChatService(deps)

    async def stop_speech() -> None:
        service.speech.shutdown()
        if service.recordings is not None:
            service.recordings.close()

    deps.stoppers.append(stop_speech)  # the speech worker thread and the recordings end with the server

    async def chat_endpoint(ws: WebSocket) -> None:
        await _Chat(service, ws).run()

    async def recording(request: Request) -> Response:
        reply = await asyncio.to_thread(service.recording, request.path_params["recording_id"])
        return JSONResponse({"error": "recording not found"}, status_code=404) if reply is None else JSONResponse(reply)

    async def recording_wav(request: Request) -> Response:
        found = await asyncio.to_thread(service.recording_audio, request.path_params["recording_id"])
        if found is None:
            return JSONResponse({"error": "recording audio not found"}, status_code=404)
        if isinstance(found, bytes):  # from the database (--database)
            return Response(found, media_type="audio/wav")
        return FileResponse(found, media_type="audio/wav")

    async def default_ref_audio(request: Request) -> Response:
        try:
            info = await asyncio.to_thread(service.default_ref_audio)
        except Exception:
            log.exception("cannot read --ref-audio %s", service.ref_audio_path)
            return JSONResponse({"error": "the configured reference audio cannot be read"}, status_code=500)
        if info is None:
            return JSONResponse({"error": "no default reference audio configured"}, status_code=404)
        return JSONResponse(info)

    return [
        WebSocketRoute("/ws/chat", chat_endpoint, name="chat_ws"),
        Route("/api/recordings/{recording_id}", recording, methods=["GET"]),
        Route("/api/recordings/{recording_id}/reply.wav", recording_wav, methods=["GET"]),
        Route("/api/default_ref_audio", default_ref_audio, methods=["GET"]),
    ]


class _Chat:
    """One accepted ``/ws/chat`` socket, from its request to its close: the driver's transport."""

    def __init__(self, service: ChatService, ws: WebSocket) -> None:
        self.service = service
        self.ws = ws
        self.turn = Turn(service)
        self.session: ChatSession | None = None
        self.driver: Driver | None = None
        self.speech: ReplySpeech | None = None
        self.request_text = ""
        self.gone = asyncio.Event()  # the client left
        self.closed = asyncio.Event()  # the session asked to close
        self.close_code = codec.CLOSE_NORMAL
        self._watcher: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Serve the connection; every exit path leaves the queue and frees engine and speech."""
        await self.ws.accept()
        first = await self.ws.receive()
        if first["type"] == "websocket.disconnect":
            return  # left before asking anything
        # The request is JSON; accept it in a binary frame too (UTF-8), as some clients send that.
        raw = first.get("text")
        self.request_text = raw if raw is not None else (first.get("bytes") or b"").decode("utf-8", errors="replace")
        self._watcher = asyncio.create_task(self._watch_disconnect())
        try:
            await self._serve()
        except Gone:
            pass
        except Exception as exc:
            error, close_code = codec.error_for(exc)
            if error.error == codec.GENERIC_ERROR:
                log.exception("chat failed")
            with contextlib.suppress(Gone):
                if self.driver is None or self.session is None:
                    await self.send(error)
                    await self.close(close_code, "")
                else:
                    await self.driver.perform(self.session.on_error(exc))
        finally:
            await self._release()
            if self.ws.client_state == WebSocketState.CONNECTED and not self.gone.is_set():
                with contextlib.suppress(Exception):
                    await self.ws.close(self.close_code)

    async def _serve(self) -> None:
        session, request = await self._unless_gone(self.service.prepare(self.request_text))
        self.session = session
        self.driver = Driver(
            session,
            self,
            self.service.client,
            protocol=PROTOCOL,
            principal=auth.scope_principal(self.ws.scope),
            metrics=self.service.metrics,
            one_event_per_token=True,
        )
        await self.driver.perform(session.on_transcribed())
        if not await self.turn.wait(session, self.driver.perform, self.gone):
            return
        await self.driver.perform([Start(request)])
        stops = [asyncio.create_task(self.closed.wait()), asyncio.create_task(self.gone.wait())]
        try:
            await asyncio.wait(stops, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in stops:
                task.cancel()

    async def _unless_gone(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result, or ``Gone`` (``work`` cancelled) if the client leaves first:
        a transcription queued for a client that left never runs."""
        task = asyncio.create_task(work)
        leaving = asyncio.create_task(self.gone.wait())
        try:
            await asyncio.wait([task, leaving], return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise Gone
        return task.result()

    async def send(self, message: Any) -> None:
        """Write one server message."""
        if self.gone.is_set():
            raise Gone
        try:
            await self.ws.send_text(codec.encode(message))
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise Gone from exc

    async def close(self, code: int | None, reason: str) -> None:
        """The session is done: ``run`` closes the socket with ``code``."""
        self.close_code = code if code is not None else codec.CLOSE_NORMAL
        self.closed.set()

    async def perform(self, action: Speak | EndSpeech | Record) -> None:
        """Store the finished chat, or hand a segment (or the end) to the reply's speech,
        opened at the first one."""
        if isinstance(action, Record):
            await asyncio.to_thread(self.service.save_recording, self.request_text, action.done, action.audio)
            return
        if self.speech is None:
            assert self.session is not None and self.driver is not None
            self.speech = ReplySpeech(self.service.speech, self.session, self.driver.perform)
        self.speech.take(action)

    async def _watch_disconnect(self) -> None:
        # The client sends nothing after its request; the next event is normally its leaving.
        with contextlib.suppress(Exception):
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
        self.gone.set()

    async def _release(self) -> None:
        # Engine first: ending the request frees its KV at once.
        if self.driver is not None:
            await self.driver.aclose()
        if self.speech is not None:
            await self.speech.aclose()
        if self._watcher is not None:
            self._watcher.cancel()
        self.turn.leave()
