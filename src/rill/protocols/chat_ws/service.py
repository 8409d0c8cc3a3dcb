"""What every ``/ws/chat`` connection of one server shares (``ChatService``), a chat's
``Turn`` in the server's fair queue and the ``ReplySpeech`` beside its engine request.

Not pure (``tests/protocols/test_purity.py`` lists it): it decodes media on a worker
thread, transcribes audio through the server's speech recognition (``rill.frontend.asr``),
reads the text in images through the server's OCR (``rill.frontend.ocr``),
asks the engine client whether the model is ready and how it renders a prompt, writes
recordings (to disk or the database) and reads them back, reads the reference audio file, waits on the
queue's mailboxes and reads the speech worker's audio. The socket itself is the adapter's.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
from msgspec import UNSET

from rill.config import parse_size
from rill.deps import Deps
from rill.errors import InvalidRequest
from rill.frontend.asr import AsrService
from rill.frontend.client import EngineClient
from rill.frontend.ocr import OcrService
from rill.frontend.speech import SAMPLE_RATE_HZ, SpeechService, SpeechStream
from rill.protocols._shared import b64pcm
from rill.protocols._shared.driver import Gone
from rill.protocols._shared.segmenter import THINK_TAGS, Segmenter
from rill.protocols.chat_ws import codec, media
from rill.protocols.chat_ws.messages import ChatRequest, Done, ImageText, SpeechInfo, Transcript
from rill.protocols.chat_ws.queue import FairQueue, Moved, Notice, QueueStatus, Started
from rill.protocols.chat_ws.session import (
    Action,
    ChatSession,
    EndSpeech,
    Speak,
    build_generate_request,
    image_prompt_text,
    refuse_modalities,
)
from rill.recordings import DatabaseRecordings, Recordings, RecordingStore
from rill.types import GenerateRequest, ModelInfo

log = logging.getLogger("rill.protocols.chat_ws")

Perform = Callable[[list[Action]], Awaitable[None]]
"""Carries out a session's actions (the connection's driver)."""


class ChatService:
    """What every ``/ws/chat`` connection of one server shares: the engine client, the fair
    queue, the speech worker, speech recognition, recordings and limits.

    Args:
        deps: the server's dependencies (``speech_synth``: the synthesizer; None: espeak-ng,
            created on first use; ``asr``: speech recognition; None: audio input is refused;
            ``ocr``: reading text in images; None: images are refused, the model seeing none).
    """

    def __init__(self, deps: Deps) -> None:
        cfg = deps.config
        self.client: EngineClient = deps.client
        self.asr: AsrService | None = deps.asr
        self.ocr: OcrService | None = deps.ocr
        self.metrics = deps.metrics
        self.queue = FairQueue(cfg.chat.chat_max_active, cfg.chat.chat_max_queue)
        self.speech = deps.speech_service()  # one worker thread for every synthesis of the process
        self.media_limits = media.MediaLimits()
        self.request_timeout_s = cfg.policy.request_timeout_s
        self.is_recording = cfg.chat.record
        days = cfg.chat.record_retention_days
        cap, retention_s = (
            parse_size(cfg.chat.record_max_bytes, "record_max_bytes"),
            None if days is None else days * 86400,
        )
        # Opened now, at start like the server's other stores' checks, so a folder or database
        # that cannot be used fails the start, not the first recorded chat. With --database
        # the recordings go where every server sharing it can serve them.
        self.recordings: Recordings | None = None
        if self.is_recording:
            self.recordings = (
                DatabaseRecordings(cfg.storage.database, cap, retention_s)
                if cfg.storage.database
                else RecordingStore(Path(cfg.http.data_dir) / "recordings", cap, retention_s)
            )
        self.ref_audio_path = cfg.chat.ref_audio
        self._ref_audio: dict[str, Any] | None = None
        self._mailboxes: dict[Hashable, asyncio.Queue[Notice]] = {}

    # -- a new chat --------------------------------------------------------------------
    async def prepare(self, request_text: str) -> tuple[ChatSession, GenerateRequest]:
        """The session and the engine request of a chat's request, once every check passed
        (decoded, model ready, speech settings honoured, media decoded and taken by the model).

        Raises:
            InvalidRequest, ModelNotReady, EngineDead, ...: what the client is told, then the socket closes.
        """
        request = codec.decode_request(request_text)
        info = self.client.require_model()
        speech_info = None
        if request.tts.enabled:
            synth = self.speech.synth
            note = synth.check(
                language=request.tts.language,
                mode=request.tts.mode,
                has_ref_audio=bool(request.tts.ref_audio_data or request.tts.ref_audio_path),
            )
            speech_info = SpeechInfo(synthesizer=synth.name, voice=synth.voice)
            if note is not None:
                speech_info.note = note
        decoded = await asyncio.to_thread(media.decode_media, request.messages, self.media_limits)
        audible = [d for d in decoded if self._can_hear(d)]
        readable = [d for d in decoded if self.ocr is not None and d.kind == "image"]
        handled = audible + readable
        unheard = [(d.kind, d.where) for d in decoded if not any(d is h for h in handled)]
        refuse_modalities(unheard, info.name, list(info.modalities))
        for part in readable:  # every image's size before any transcription or reading starts
            assert self.ocr is not None
            width, height = part.images[0].size
            self.ocr.check(width, height, f"{part.where} (image)")
        heard = await self._transcribe(audible, info)
        read = await self._read_images(readable)
        generate_request = build_generate_request(request, heard=heard, read=read, deadline_s=self.request_timeout_s)
        recording_id = f"chat_{uuid.uuid4().hex[:16]}" if self.is_recording else None
        session = ChatSession(
            request,
            is_speaking=request.tts.enabled,
            segmenter=Segmenter(starts_in_thinking=await self._starts_in_thinking(request)),
            recording_session_id=recording_id,
            keep_audio=recording_id is not None,
            heard=heard,
            read=read,
            speech_info=speech_info,
        )
        return session, generate_request

    # -- speech recognition ------------------------------------------------------------
    def _can_hear(self, part: media.DecodedMedia) -> bool:
        """An audio part, or a video part with an audio track, on a server that recognizes speech."""
        if self.asr is None:
            return False
        return part.kind == "audio" or (part.kind == "video" and part.audio is not None and len(part.audio) > 0)

    async def _transcribe(self, parts: list[media.DecodedMedia], info: ModelInfo) -> list[Transcript]:
        """Each part's transcript, in request order, once the request's audio passed every
        check (so that a bad last part costs no transcription of the first).

        Raises:
            InvalidRequest: a part's audio is bad, the request's audio is longer than speech
                recognition takes, or a part holds no speech (the message names the part).
            ResourceExhausted: speech recognition is busy.
        """
        if not parts:
            return []
        assert self.asr is not None
        total_s = 0.0
        for part in parts:
            assert part.audio is not None
            total_s += self.asr.check(len(part.audio), part.sample_rate_hz, f"{part.where} ({part.kind})")
        if total_s > self.asr.max_audio_s:
            raise InvalidRequest(
                f"messages: {total_s:.1f} s of audio in one request is more than speech recognition takes "
                f"({self.asr.max_audio_s:g} s, --asr-max-audio-s)",
                field="messages",
            )
        heard: list[Transcript] = []
        for part in parts:
            assert part.audio is not None
            where = f"{part.where} ({part.kind})"
            transcript = await self.asr.transcribe(
                part.audio, sample_rate_hz=part.sample_rate_hz, language=part.language, where=where
            )
            if not transcript.text:
                track = "its audio track" if part.kind == "video" else "it"
                raise InvalidRequest(
                    f"{where}: no speech was heard in {track} ({transcript.duration_s:.1f} s of audio), "
                    "so there is nothing to put in the prompt",
                    field="messages",
                )
            unseen = part.kind == "video" and "video" not in info.modalities
            heard.append(
                Transcript(
                    message_index=part.message_index,
                    content_index=part.content_index,
                    kind=part.kind,
                    text=transcript.text,
                    language=transcript.language,
                    duration_s=round(transcript.duration_s, 3),
                    speech_s=round(transcript.speech_s, 3),
                    note=f"only the audio track was heard: the model '{info.name}' cannot see the video's frames"
                    if unseen
                    else UNSET,
                )
            )
        return heard

    # -- text in images --------------------------------------------------------------------
    async def _read_images(self, parts: list[media.DecodedMedia]) -> list[ImageText]:
        """The text OCR reads in each image part, in request order (sizes already checked).

        Raises:
            ResourceExhausted: OCR is busy.
            RequestTimeout: an image took too long to read.
        """
        read: list[ImageText] = []
        for part in parts:
            assert self.ocr is not None
            found = await self.ocr.read(part.images[0], where=f"{part.where} (image)")
            read.append(
                ImageText(
                    message_index=part.message_index,
                    content_index=part.content_index,
                    text=found.text,
                    prompt_text=image_prompt_text(found.text),
                    width=found.width,
                    height=found.height,
                )
            )
        return read

    async def _starts_in_thinking(self, request: ChatRequest) -> bool:
        # Some templates open the reasoning block in the generation prompt itself (the reply
        # then starts inside it); only a rendered prompt tells.
        if not (request.enable_thinking and request.tts.enabled):
            return False
        try:
            rendered = await self.client.render_chat(
                [
                    {"role": m.role, "content": m.content if isinstance(m.content, str) else ""}
                    for m in request.messages
                ],
                add_generation_prompt=True,
                enable_thinking=True,
            )
        except Exception:  # noqa: BLE001 - a template that cannot render opens no thinking block
            return False
        return any(rendered.rstrip().endswith(opener) for opener, _ in THINK_TAGS)

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
    def save_recording(self, request_text: str, done: Done, audio: np.ndarray | None) -> None:
        """Store the chat's request, its reply and, for a spoken reply, its audio (WAV) as
        recording ``done.recording_session_id``; the store then applies its size cap and
        retention (blocking)."""
        import soundfile

        assert self.recordings is not None and isinstance(done.recording_session_id, str)
        recording_id = done.recording_session_id
        reply = {
            "recording_session_id": recording_id,
            "text": done.text,
            "generated_tokens": done.generated_tokens,
            "input_tokens": done.input_tokens,
            "created_at": time.time(),
            "audio": None
            if audio is None
            else {
                "sample_rate": SAMPLE_RATE_HZ,
                "duration_s": round(len(audio) / SAMPLE_RATE_HZ, 3),
                "url": f"/api/recordings/{recording_id}/reply.wav",
            },
        }
        wav = None
        if audio is not None:
            buffer = io.BytesIO()
            soundfile.write(buffer, audio, SAMPLE_RATE_HZ, format="WAV", subtype="FLOAT")
            wav = buffer.getvalue()
        self.recordings.save(recording_id, request_text, reply, wav)

    def recording(self, recording_id: str) -> dict[str, Any] | None:
        """A stored recording's reply with its request (``GET /api/recordings/{id}``), or None (blocking)."""
        return self.recordings.reply(recording_id) if self.recordings is not None else None

    def recording_audio(self, recording_id: str) -> Path | bytes | None:
        """The reply.wav of a stored recording (a file or its bytes), or None (blocking)."""
        return self.recordings.audio(recording_id) if self.recordings is not None else None

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
            self._ref_audio = {
                "name": Path(self.ref_audio_path).name,
                "duration": round(len(mono) / b64pcm.INPUT_SAMPLE_RATE_HZ, 1),
                "sample_rate": b64pcm.INPUT_SAMPLE_RATE_HZ,
                "samples": int(len(mono)),
                "base64": b64pcm.encode(mono),
            }
        return self._ref_audio


class Turn:
    """One chat's place in the server's fair queue: wait for it, then give it back (``leave``)."""

    def __init__(self, service: ChatService) -> None:
        self.service = service
        self.ticket = f"chat-{uuid.uuid4().hex}"
        self._is_in_queue = False
        self._started_at: float | None = None

    async def wait(self, session: ChatSession, perform: Perform, gone: asyncio.Event) -> bool:
        """Queue until admitted (True) or the client left (False); ``perform`` tells the client
        where it stands. ``QueueFull`` when no place is left in line."""
        first, mailbox = self.service.join(self.ticket)
        self._is_in_queue = True
        if isinstance(first, QueueStatus):
            await perform(session.on_queue_joined(first))
            while True:
                getter = asyncio.create_task(mailbox.get())
                leaving = asyncio.create_task(gone.wait())
                await asyncio.wait([getter, leaving], return_when=asyncio.FIRST_COMPLETED)
                leaving.cancel()
                if not getter.done():
                    getter.cancel()
                    return False
                notice = getter.result()
                if isinstance(notice, Started):
                    break
                assert isinstance(notice, Moved)
                await perform(session.on_queue_moved(notice.status))
        await perform(session.on_admitted())
        if gone.is_set():
            return False
        self._started_at = time.monotonic()
        return True

    def leave(self) -> None:
        """Leave the line or free the slot (how long the chat ran feeds the wait estimate)."""
        if self._is_in_queue:
            self._is_in_queue = False
            duration = None if self._started_at is None else time.monotonic() - self._started_at
            self.service.leave(self.ticket, duration)


class ReplySpeech:
    """The speech of one reply, beside its engine request: segments go in (``take``), each
    one's audio goes to the session (``on_audio``, then ``on_speech_end``), whose answers
    ``perform`` carries out; a synthesizer that fails fails the chat (``on_error``)."""

    def __init__(self, service: SpeechService, session: ChatSession, perform: Perform) -> None:
        self.session = session
        self.perform = perform
        self.speech: SpeechStream = service.open(session.request.tts.language)
        self._reader = asyncio.create_task(self._read())

    def take(self, action: Speak | EndSpeech) -> None:
        """Speak a segment after the earlier ones, or end the reply's speech."""
        if isinstance(action, Speak):
            self.speech.say(action.text)
        else:
            self.speech.end()

    async def aclose(self) -> None:
        """Cancel what is left to say, and the reading."""
        await self.speech.aclose()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async for samples in self.speech:
                await self.perform(self.session.on_audio(samples))
            await self.perform(self.session.on_speech_end())
        except Gone:
            return
        except Exception as exc:  # the synthesizer failed: the session tells the client
            if codec.error_for(exc)[0].error == codec.GENERIC_ERROR:
                log.exception("chat speech failed")
            with contextlib.suppress(Gone):
                await self.perform(self.session.on_error(exc))
