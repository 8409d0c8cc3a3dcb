"""``/ws/chat`` and its HTTP helpers: the only I/O of the chat protocol.

Per connection: receive the one request → decode → check speech settings → validate and
decode media (worker thread) → refuse modalities the model lacks → wait for a turn in the
server-wide ``FairQueue`` (``queued`` / ``queue_update`` / ``queue_done``) → generate. Three
tasks then run until the session says ``Close``: the engine reader (deltas → chunks and
speech segments), the speech reader (PCM → audio chunks, then ``done``) and a watcher that
notices the client leaving. Leaving at any point leaves the queue, closes the engine stream
(the engine aborts the request and frees its KV cache at once) and cancels the speech.

HTTP: ``GET /api/recordings/{id}`` (JSON), ``GET /api/recordings/{id}/reply.wav`` and
``GET /api/default_ref_audio`` (the source project's shape, or 404).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from rill import auth
from rill.config import parse_size
from rill.deps import Deps
from rill.errors import InvalidRequest, ModelNotReady
from rill.frontend.client import EngineClient
from rill.frontend.speech import SAMPLE_RATE_HZ, SpeechService, SpeechStream
from rill.frontend.stream import RequestStream
from rill.protocols._shared import b64pcm
from rill.protocols.chat_ws import codec, media
from rill.protocols.chat_ws.messages import ChatRequest, Done
from rill.protocols.chat_ws.queue import FairQueue, Moved, Notice, QueueStatus, Started
from rill.protocols.chat_ws.segmenter import THINK_TAGS, Segmenter
from rill.protocols.chat_ws.session import (
    Action,
    ChatSession,
    Close,
    EndSpeech,
    Send,
    Speak,
    build_generate_request,
    refuse_modalities,
)
from rill.recordings import RecordingStore

log = logging.getLogger("rill.protocols.chat_ws")


class ChatService:
    """What every ``/ws/chat`` connection of one server shares: the engine client, the fair
    queue, the speech worker, recordings and limits."""

    def __init__(self, deps: Deps) -> None:
        cfg = deps.config
        self.client: EngineClient = deps.client
        self.queue = FairQueue(cfg.chat.chat_max_active, cfg.chat.chat_max_queue)
        self.speech = SpeechService(deps.speech_synth)
        self.media_limits = media.MediaLimits()
        self.request_timeout_s = cfg.policy.request_timeout_s
        self.recordings_dir = Path(cfg.http.data_dir) / "recordings" if cfg.chat.record else None
        days = cfg.chat.record_retention_days
        self.recordings = RecordingStore(Path(cfg.http.data_dir) / "recordings",
                                         parse_size(cfg.chat.record_max_bytes, "record_max_bytes"),
                                         None if days is None else days * 86400)
        self.ref_audio_path = cfg.chat.ref_audio
        self._ref_audio: dict[str, Any] | None = None
        self._mailboxes: dict[Hashable, asyncio.Queue[Notice]] = {}

    # -- queue (event loop only) -------------------------------------------------------
    def join(self, ticket: str) -> tuple[Started | QueueStatus, asyncio.Queue[Notice]]:
        """Enter the queue; the mailbox receives this ticket's later notices."""
        mailbox: asyncio.Queue[Notice] = asyncio.Queue()
        first = self.queue.join(ticket)  # QueueFull propagates
        self._mailboxes[ticket] = mailbox
        return first, mailbox

    def leave(self, ticket: str, duration_s: float | None = None) -> None:
        """Leave the queue or free the slot; deliver the notices to the chats concerned."""
        self._mailboxes.pop(ticket, None)
        notices = self.queue.leave(ticket) if duration_s is None else self.queue.finish(ticket, duration_s)
        for notice in notices:
            mailbox = self._mailboxes.get(notice.ticket)
            if mailbox is not None:
                mailbox.put_nowait(notice)

    # -- recordings --------------------------------------------------------------------
    def save_recording(self, recording_id: str, request_text: str, done: Done, session: ChatSession) -> None:
        """Write request.json, reply.json and reply.wav under the recording's folder, then apply
        the recordings' size cap and retention (blocking)."""
        import soundfile

        assert self.recordings_dir is not None
        folder = self.recordings_dir / recording_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "request.json").write_text(request_text)
        audio = session.whole_audio()
        reply = {"recording_session_id": recording_id, "text": done.text, "generated_tokens": done.generated_tokens,
                 "input_tokens": done.input_tokens, "created_at": time.time(),
                 "audio": {"sample_rate": SAMPLE_RATE_HZ, "duration_s": round(len(audio) / SAMPLE_RATE_HZ, 3),
                           "url": f"/api/recordings/{recording_id}/reply.wav"} if session.is_speaking else None}
        if session.is_speaking:
            soundfile.write(folder / "reply.wav", audio, SAMPLE_RATE_HZ, subtype="FLOAT")
        (folder / "reply.json").write_text(json.dumps(reply))
        self.recordings.commit(recording_id)

    def default_ref_audio(self) -> dict[str, Any] | None:
        """``{name, duration, sample_rate, samples, base64}`` of ``--ref-audio`` at 16 kHz (cached)."""
        if self.ref_audio_path is None:
            return None
        if self._ref_audio is None:
            import soundfile
            import soxr

            audio, rate = soundfile.read(self.ref_audio_path, dtype="float32", always_2d=True)
            mono = audio.mean(axis=1)
            if rate != b64pcm.INPUT_SAMPLE_RATE_HZ:
                mono = soxr.resample(mono, rate, b64pcm.INPUT_SAMPLE_RATE_HZ)
            self._ref_audio = {"name": Path(self.ref_audio_path).name,
                               "duration": round(len(mono) / b64pcm.INPUT_SAMPLE_RATE_HZ, 1),
                               "sample_rate": b64pcm.INPUT_SAMPLE_RATE_HZ, "samples": int(len(mono)),
                               "base64": b64pcm.encode(mono)}
        return self._ref_audio


def routes(deps: Deps) -> list[BaseRoute]:
    """``/ws/chat`` and the recordings / reference-audio HTTP routes."""
    service = ChatService(deps)

    async def stop_speech() -> None:
        service.speech.shutdown()

    deps.stoppers.append(stop_speech)  # the speech worker thread ends with the server

    async def chat_endpoint(ws: WebSocket) -> None:
        await _Chat(service, ws).run()

    async def recording(request: Request) -> Response:
        folder = _recording_folder(service, request.path_params["recording_id"])
        if folder is None or not (folder / "reply.json").is_file():
            return JSONResponse({"error": "recording not found"}, status_code=404)
        reply = json.loads((folder / "reply.json").read_text())
        reply["request"] = json.loads((folder / "request.json").read_text())
        return JSONResponse(reply)

    async def recording_wav(request: Request) -> Response:
        folder = _recording_folder(service, request.path_params["recording_id"])
        if folder is None or not (folder / "reply.wav").is_file():
            return JSONResponse({"error": "recording audio not found"}, status_code=404)
        return FileResponse(folder / "reply.wav", media_type="audio/wav")

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


def _recording_folder(service: ChatService, recording_id: str) -> Path | None:
    if service.recordings_dir is None:
        return None
    return service.recordings.path_of(recording_id)


class _Chat:
    """One accepted ``/ws/chat`` socket, from its request to its close."""

    def __init__(self, service: ChatService, ws: WebSocket) -> None:
        self.service = service
        self.ws = ws
        self.ticket = f"chat-{uuid.uuid4().hex}"
        self.session: ChatSession | None = None
        self.stream: RequestStream | None = None
        self.speech: SpeechStream | None = None
        self.request_text = ""
        self.gone = asyncio.Event()  # the client left
        self.closed = asyncio.Event()  # the session asked to close
        self.close_code = codec.CLOSE_NORMAL
        self._send_lock = asyncio.Lock()
        self._in_queue = False
        self._started_at: float | None = None

    async def run(self) -> None:
        """Serve the connection; every exit path leaves the queue and frees engine and speech."""
        await self.ws.accept()
        first = await self.ws.receive()
        if first["type"] == "websocket.disconnect":
            return  # left before asking anything
        # The request is JSON; accept it in a binary frame too (UTF-8), as some clients send that.
        raw = first.get("text")
        if raw is None:
            raw = (first.get("bytes") or b"").decode("utf-8", errors="replace")
        self.request_text = raw
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error, close_code = codec.error_for(exc)
            if not isinstance(exc, (InvalidRequest, ModelNotReady)) and error.error == codec.GENERIC_ERROR:
                log.exception("chat failed")
            actions: list[Action] = self.session.on_error(exc) if self.session is not None else [Send(error), Close(close_code)]
            await self._perform(actions)
        finally:
            watcher.cancel()
            await self._release()
            if self.ws.client_state == WebSocketState.CONNECTED and not self.gone.is_set():
                with contextlib.suppress(Exception):
                    await self.ws.close(self.close_code)

    async def _serve(self) -> None:
        request = codec.decode_request(self.request_text)
        client = self.service.client
        info = client.require_model()
        if request.tts.enabled:
            self.service.speech.synth.check(language=request.tts.language, mode=request.tts.mode,
                                            has_ref_audio=bool(request.tts.ref_audio_data or request.tts.ref_audio_path))
        decoded = await asyncio.to_thread(media.decode_media, request.messages, self.service.media_limits)
        refuse_modalities([(d.kind, d.where) for d in decoded], info.name, list(info.modalities))
        generate_request = msgspec.structs.replace(
            build_generate_request(request, deadline_s=self.service.request_timeout_s),
            principal=auth.scope_principal(self.ws.scope))
        recording_id = f"chat_{uuid.uuid4().hex[:16]}" if self.service.recordings_dir is not None else None
        self.session = ChatSession(request, is_speaking=request.tts.enabled,
                                   segmenter=Segmenter(starts_in_thinking=await self._starts_in_thinking(request)),
                                   recording_session_id=recording_id, keep_audio=recording_id is not None)
        if not await self._wait_turn():
            return
        self._started_at = time.monotonic()
        self.stream = await client.generate(generate_request)
        await self._perform(self.session.on_started(len(self.stream.prompt_token_ids)))
        if self.session.is_speaking:
            self.speech = self.service.speech.open(request.tts.language)
        tasks = [asyncio.create_task(self._read_engine())]
        if self.speech is not None:
            tasks.append(asyncio.create_task(self._read_speech()))
        stop = [asyncio.create_task(self.closed.wait()), asyncio.create_task(self.gone.wait())]
        try:
            await asyncio.wait([*tasks, *stop], return_when=asyncio.FIRST_COMPLETED)
            while not (self.closed.is_set() or self.gone.is_set()):
                failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
                if failed is not None:
                    raise failed.exception()  # type: ignore[misc]
                pending = [t for t in [*tasks, *stop] if not t.done()]
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [*tasks, *stop]:
                task.cancel()
            await asyncio.gather(*tasks, *stop, return_exceptions=True)

    async def _starts_in_thinking(self, request: ChatRequest) -> bool:
        # Some templates open the reasoning block in the generation prompt itself (the reply
        # then starts inside it); only a rendered prompt tells.
        if not (request.enable_thinking and request.tts.enabled):
            return False
        try:
            rendered = await self.service.client.render_chat(
                [{"role": m.role, "content": m.content if isinstance(m.content, str) else ""} for m in request.messages],
                add_generation_prompt=True, enable_thinking=True)
        except Exception:  # noqa: BLE001 - a template that cannot render opens no thinking block
            return False
        return any(rendered.rstrip().endswith(opener) for opener, _ in THINK_TAGS)

    async def _wait_turn(self) -> bool:
        """Queue until admitted (True) or the client left (False)."""
        assert self.session is not None
        first, mailbox = self.service.join(self.ticket)
        self._in_queue = True
        if isinstance(first, QueueStatus):
            await self._perform(self.session.on_queued(first))
            while True:
                getter = asyncio.create_task(mailbox.get())
                leaving = asyncio.create_task(self.gone.wait())
                await asyncio.wait([getter, leaving], return_when=asyncio.FIRST_COMPLETED)
                leaving.cancel()
                if not getter.done():
                    getter.cancel()
                    return False
                notice = getter.result()
                if isinstance(notice, Started):
                    break
                assert isinstance(notice, Moved)
                await self._perform(self.session.on_queue_moved(notice.status))
        await self._perform(self.session.on_admitted())
        return not self.gone.is_set()

    async def _read_engine(self) -> None:
        assert self.stream is not None and self.session is not None
        async for output in self.stream:
            await self._perform(self.session.on_output(output))

    async def _read_speech(self) -> None:
        assert self.speech is not None and self.session is not None
        async for samples in self.speech:
            await self._perform(self.session.on_audio(samples))
        await self._perform(self.session.on_speech_end())

    async def _watch_disconnect(self) -> None:
        # The client sends nothing after its request; the next event is normally its leaving.
        with contextlib.suppress(Exception):
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
        self.gone.set()

    async def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                await self._send(action)
            elif isinstance(action, Speak):
                if self.speech is not None:
                    self.speech.say(action.text)
            elif isinstance(action, EndSpeech):
                if self.speech is not None:
                    self.speech.end()
            elif isinstance(action, Close):
                self.close_code = action.code if action.code is not None else codec.CLOSE_NORMAL
                self.closed.set()

    async def _send(self, action: Send[Any]) -> None:
        message = action.message
        if isinstance(message, Done) and self.session is not None and self.session.recording_session_id is not None:
            await asyncio.to_thread(self.service.save_recording, self.session.recording_session_id,
                                    self.request_text, message, self.session)
        if self.gone.is_set():
            return
        async with self._send_lock:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self.ws.send_text(codec.encode(message))

    async def _release(self) -> None:
        # Engine first: closing the stream aborts the request and frees its KV at once.
        if self.stream is not None:
            await self.stream.aclose()
        if self.speech is not None:
            await self.speech.aclose()
        if self._in_queue:
            self._in_queue = False
            duration = None if self._started_at is None else time.monotonic() - self._started_at
            self.service.leave(self.ticket, duration)
