"""Starlette routes of OpenAI's audio API: ``POST /v1/audio/transcriptions``,
``/v1/audio/translations`` and ``/v1/audio/speech`` (the wire is ``audio.py``'s).

Transcription, one request:

1. read the multipart form (one file; the body is bounded by ``--max-body-bytes`` like every
   route's), check its fields and the model name, and that the recognition pool has room;
2. decode the file off the event loop (``rill.frontend.audio_files``: WAV, or anything FFmpeg
   reads), refusing it past the recognizer's duration cap (``--asr-max-audio-s``) as soon as
   decoding passes it; count the request and its seconds in its principal's window
   (``--rate-limit-requests``, ``--rate-limit-audio-s``);
3. transcribe in the server's bounded recognition pool (``AsrService``), then answer in the
   asked format, or as SSE events when ``stream`` is true.

Speech: the text is cut into sentences (``protocols/_shared/segmenter.split``, as ``/ws/chat``
cuts its replies: a long one at a word, so none is longer than the segmenter's cap) that the
synthesizer (``--tts``) speaks one after another on its worker thread while the answer
streams: ``pcm`` and ``wav`` as each sentence is ready, compressed formats once the whole text
is spoken and encoded (off the event loop). The first sentence is spoken before the status is
sent, so a synthesizer error gets its status. ``speed`` resamples the speech on the same
worker thread (faster speech is also higher). A client that goes away stops the synthesis at
its next audio block. The request counts in its principal's window when it starts, the
seconds spoken when it ends.

Errors go through the API's one table (``codec.error_for``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal

import numpy as np
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from rill import auth
from rill.deps import Deps
from rill.errors import InvalidRequest
from rill.frontend.asr import AsrService
from rill.frontend.audio_files import STREAMABLE_FORMATS, decode_audio, encode_compressed, pcm16, wav_header
from rill.frontend.policy import SubmissionPolicy
from rill.frontend.speech import SAMPLE_RATE_HZ
from rill.protocols._shared import segmenter, sse
from rill.protocols.openai_http import audio, codec
from rill.protocols.openai_http.messages import ModelCard
from rill.protocols.openai_http.responder import count_rejection, error_response

log = logging.getLogger("rill.openai_http.audio")

MAX_FORM_FIELDS = 32
"""Text fields a transcription form may have (OpenAI's have under a dozen)."""


class AudioApi:
    """The audio routes, bound to one server's ``Deps`` (speech runs on the process's one speech
    worker thread, ``Deps.speech_service()``)."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.speech = deps.speech_service()  # /ws/chat's thread: synthesizers keep global state

    def routes(self) -> list[BaseRoute]:
        """The three routes."""
        return [
            Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"]),
            Route("/v1/audio/translations", self.translations, methods=["POST"]),
            Route("/v1/audio/speech", self.create_speech, methods=["POST"]),
        ]

    async def aclose(self) -> None:
        """Stop the speech worker thread."""
        self.speech.shutdown()

    # -- models ----------------------------------------------------------------------------
    @property
    def speech_model(self) -> str:
        """The synthesizer's model id: ``piper-<voice>`` or ``espeak-ng``."""
        synth = self.speech.synth
        return f"piper-{synth.voice}" if synth.name == "piper" else synth.name

    def cards(self, created: int) -> list[ModelCard]:
        """``/v1/models`` entries: the recognizer and the synthesizer the server was given (an
        app made without one still speaks with espeak-ng, unlisted)."""
        ids = [self.deps.asr.recognizer.name] if self.deps.asr is not None else []
        if self.deps.speech_synth is not None:
            ids.append(self.speech_model)
        return [ModelCard(id=name, created=created) for name in ids]

    # -- transcription ---------------------------------------------------------------------
    async def transcriptions(self, request: Request) -> Response:
        """``POST /v1/audio/transcriptions``."""
        return await self._hear(request, "transcribe")

    async def translations(self, request: Request) -> Response:
        """``POST /v1/audio/translations``: the speech's words in English."""
        return await self._hear(request, "translate")

    async def _hear(self, request: Request, task: Literal["transcribe", "translate"]) -> Response:
        try:
            asr = self.deps.asr
            if asr is None:
                raise codec.model_off("speech recognition model", "--asr whisper")
            req, data = await self._read_form(request, task, asr)
            asr.check_room()  # a full pool refuses before the file is decoded: no samples held
            samples, rate_hz = await asyncio.to_thread(decode_audio, data, asr.max_audio_s)
            del data
            await self._count_audio(request, len(samples) / rate_hz)
            transcript = await asr.transcribe(
                samples, sample_rate_hz=rate_hz, language=req.language, where="file", task=req.task
            )
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            return self._refused(exc)
        if req.is_streaming:
            return Response(
                b"".join(audio.transcript_events(transcript)), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS
            )
        body, media_type = audio.encode_transcript(transcript, req)
        return Response(body, media_type=media_type)

    async def _read_form(
        self, request: Request, task: Literal["transcribe", "translate"], asr: AsrService
    ) -> tuple[audio.TranscriptionRequest, bytes]:
        try:
            async with request.form(max_files=1, max_fields=MAX_FORM_FIELDS) as form:
                fields: dict[str, str] = {}
                for name, value in form.multi_items():
                    if isinstance(value, str):  # list fields repeat: keep every value
                        fields[name] = f"{fields[name]},{value}" if name in fields else value
                upload = form.get("file")
                req = audio.transcription_request(fields, task)
                codec.check_model(req.model, asr.recognizer.name, audio.TRANSCRIPTION_ALIASES, request.url.path)
                if not isinstance(upload, UploadFile):
                    raise InvalidRequest("'file' is required: the sound file, as multipart/form-data", field="file")
                return req, await upload.read()
        except HTTPException as exc:  # Starlette's refusal of a malformed form
            raise InvalidRequest(f"the multipart form could not be read: {exc.detail}", field="file") from exc

    # -- speech ----------------------------------------------------------------------------
    async def create_speech(self, request: Request) -> Response:
        """``POST /v1/audio/speech``."""
        try:
            body = await request.body()
            voices = (*audio.OPENAI_VOICES, self.speech.synth.voice.lower())
            req = audio.decode_speech(body, voices)
            codec.check_model(req.model, self.speech_model, audio.SPEECH_ALIASES, "/v1/audio/speech")
            await self._count_audio(request, 0.0)  # its seconds are charged once spoken
            chunks = self._encoded(req, auth.scope_principal(request.scope))
            first = await anext(chunks)  # the first sentence: its errors still get a status
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            return self._refused(exc)
        is_sse = req.stream_format == "sse"
        if is_sse:
            return StreamingResponse(_framed(first, chunks, is_sse), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        return StreamingResponse(
            _framed(first, chunks, is_sse), media_type=audio.SPEECH_MEDIA_TYPES[req.response_format]
        )

    async def _encoded(self, req: audio.SpeechRequest, principal: str) -> AsyncGenerator[bytes]:
        """The answer's audio bytes: a piece per sentence (pcm, wav), or the whole file."""
        pieces = self._spoken(req, principal)
        try:
            if req.response_format in STREAMABLE_FORMATS:
                header = wav_header(None, SAMPLE_RATE_HZ) if req.response_format == "wav" else b""
                async for pcm in pieces:
                    yield header + pcm16(pcm)
                    header = b""
            else:
                whole = np.concatenate([pcm async for pcm in pieces])
                yield await asyncio.to_thread(encode_compressed, whole, SAMPLE_RATE_HZ, req.response_format)
        finally:
            await pieces.aclose()

    async def _spoken(self, req: audio.SpeechRequest, principal: str) -> AsyncGenerator[np.ndarray]:
        """Float32 speech at 24 kHz, a sentence at a time, at ``req.speed``; the seconds made
        are charged to ``principal``'s audio limit when it ends."""
        assert req.input is not None  # decode_speech checked it
        num_samples = 0
        try:
            async with self.speech.open(language=None, speed=req.speed) as stream:
                for sentence in segmenter.split(req.input):
                    stream.say(sentence)
                stream.end()
                async for pcm in stream:
                    num_samples += len(pcm)
                    yield pcm
        finally:
            policy = self._policy()
            if policy is not None:
                policy.charge_audio(principal, num_samples / SAMPLE_RATE_HZ)

    # -- shared ----------------------------------------------------------------------------
    def _policy(self) -> SubmissionPolicy | None:
        """The server's submission policy (the in-process client's), for its rate limits."""
        policy = getattr(self.deps.client, "policy", None)
        return policy if isinstance(policy, SubmissionPolicy) else None

    async def _count_audio(self, request: Request, audio_s: float) -> None:
        policy = self._policy()
        if policy is not None:
            await policy.count_audio(auth.scope_principal(request.scope), audio_s)

    def _refused(self, exc: Exception) -> Response:
        """The OpenAI error response for ``exc``, counted (unexpected errors are logged, not shown)."""
        count_rejection(self.deps.metrics, exc)
        return error_response(exc)


async def _framed(first: bytes, rest: AsyncGenerator[bytes], is_sse: bool) -> AsyncIterator[bytes]:
    """The response body: the chunks as they are, or each as a ``speech.audio.delta`` event and
    ``speech.audio.done`` last (an error after the status is logged and ends the body)."""
    try:
        yield audio.audio_event(first) if is_sse else first
        async for chunk in rest:
            yield audio.audio_event(chunk) if is_sse else chunk
        if is_sse:
            yield audio.audio_done()
    except Exception as exc:  # the status is sent: an error event is all that is left
        log.error("speech failed after its first sentence", exc_info=exc)
        if is_sse:
            yield b"data: " + codec.error_event_data(exc) + b"\n\n"
    finally:
        await rest.aclose()
