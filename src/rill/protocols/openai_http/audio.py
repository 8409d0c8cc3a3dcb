"""OpenAI's audio routes on the wire: their requests, answers and SSE events (pure).

``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` take a multipart form:
``file`` (the sound file), ``model``, ``language`` (transcriptions), ``prompt`` and
``temperature`` (accepted; decoding is greedy and unprompted), ``response_format`` (``json``,
the default, ``text``, ``verbose_json`` with segments, ``srt`` or ``vtt``),
``timestamp_granularities[]`` (``segment``; ``word`` is refused: no word timings are made) and
``stream`` (``true``: ``transcript.text.delta`` events, one per segment once the audio is
transcribed, then ``transcript.text.done``).

``POST /v1/audio/speech`` takes JSON: ``input`` (at most 4,096 characters), ``model``,
``voice``, ``response_format`` (``mp3``, the default, ``wav``, ``pcm``: 16-bit little-endian at
24 kHz, ``flac``, ``opus``, ``aac``), ``speed`` (0.25..4.0), ``instructions`` (accepted,
unused) and ``stream_format`` (``audio``, the default, or ``sse``: ``speech.audio.delta``
events with base64 audio, then ``speech.audio.done``).

Model names: the recognizer's and synthesizer's own ids as ``/v1/models`` lists them, and
OpenAI's names as aliases (``whisper-1``, ``gpt-4o-transcribe``, ``gpt-4o-mini-transcribe``;
``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``). Voices: OpenAI's names all speak in the
server's one voice, as does that voice's own name; any other is refused.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Literal

import msgspec

from rill.errors import InvalidRequest
from rill.protocols._shared import sse as _sse
from rill.protocols.openai_http.codec import decode_body
from rill.types import Transcript

TRANSCRIPTION_ALIASES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
SPEECH_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "cedar",
    "coral",
    "echo",
    "fable",
    "marin",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
)
TRANSCRIPT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MAX_SPEECH_INPUT_CHARS = 4096
MIN_SPEED, MAX_SPEED = 0.25, 4.0

# ---------------------------------------------------------------------------- messages


class TranscriptionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a transcription or translation form (``file`` is read apart)."""

    task: Literal["transcribe", "translate"]
    model: str | None = None
    language: str | None = None
    response_format: str = "json"
    is_streaming: bool = False


class SpeechRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/audio/speech`` body."""

    input: str | None = None
    model: str | None = None
    voice: str | dict[str, str] | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] = "audio"


class Segment(msgspec.Struct, kw_only=True):
    """One ``verbose_json`` segment (the fields the ``openai`` client reads; scores are 0)."""

    id: int
    seek: int = 0
    start: float
    end: float
    text: str
    tokens: list[int] = []
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class DurationUsage(msgspec.Struct, kw_only=True):
    """``usage`` of a transcription: the audio's seconds, rounded up."""

    type: str = "duration"
    seconds: int


class TranscriptionJson(msgspec.Struct, kw_only=True):
    """The ``json`` answer."""

    text: str
    usage: DurationUsage


class TranscriptionVerbose(msgspec.Struct, kw_only=True):
    """The ``verbose_json`` answer."""

    task: str
    language: str
    duration: float
    text: str
    segments: list[Segment]
    usage: DurationUsage


class TextDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="transcript.text.delta"):
    """A streamed piece of the transcript."""

    delta: str


class TextDone(msgspec.Struct, kw_only=True, tag_field="type", tag="transcript.text.done"):
    """The whole transcript, last event of a streamed transcription."""

    text: str


class AudioDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="speech.audio.delta"):
    """A streamed piece of speech, base64 of the ``response_format``'s bytes."""

    audio: str


class SpeechUsage(msgspec.Struct, kw_only=True):
    """``usage`` of ``speech.audio.done`` (no tokens: the synthesizer reads characters)."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


class AudioDone(msgspec.Struct, kw_only=True, tag_field="type", tag="speech.audio.done"):
    """Last event of streamed speech."""

    usage: SpeechUsage


# ---------------------------------------------------------------------------- codec


def transcription_request(form: Mapping[str, str], task: Literal["transcribe", "translate"]) -> TranscriptionRequest:
    """The checked fields of a transcription (``translate``: translation) form.

    ``form`` maps each text field to its value; list fields come as ``name[]`` (as the
    ``openai`` client sends them) or ``name``, their values joined by commas.

    Raises:
        InvalidRequest: a bad ``response_format``, ``temperature``, ``timestamp_granularities``
            or ``stream`` (the field is named).
    """
    response_format = form.get("response_format") or "json"
    if response_format not in TRANSCRIPT_FORMATS:
        raise InvalidRequest(
            f"'response_format' must be one of {', '.join(TRANSCRIPT_FORMATS)}, not '{response_format}'",
            field="response_format",
        )
    temperature = form.get("temperature")
    if temperature:
        try:
            value = float(temperature)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise InvalidRequest(f"'temperature' must be a number in 0..1, not '{temperature}'", field="temperature")
    granularities = form.get("timestamp_granularities[]") or form.get("timestamp_granularities") or ""
    for name in filter(None, (g.strip() for g in granularities.split(","))):
        if name != "segment":
            raise InvalidRequest(
                f"'timestamp_granularities': '{name}' is not available; this server times segments only",
                field="timestamp_granularities",
            )
    stream = (form.get("stream") or "false").lower()
    if stream not in ("true", "false"):
        raise InvalidRequest(f"'stream' must be true or false, not '{stream}'", field="stream")
    language = (form.get("language") or "").strip().lower() or None
    return TranscriptionRequest(
        task=task,
        model=form.get("model"),
        language=language if task == "transcribe" else None,
        response_format=response_format,
        is_streaming=stream == "true",
    )


def encode_transcript(transcript: Transcript, req: TranscriptionRequest) -> tuple[bytes, str]:
    """The answer's body and media type for ``req.response_format``."""
    usage = DurationUsage(seconds=math.ceil(transcript.duration_s))
    fmt = req.response_format
    if fmt == "text":
        return (transcript.text + "\n").encode(), "text/plain; charset=utf-8"
    if fmt == "srt":
        return _cues(transcript, ",", numbered=True).encode(), "text/plain; charset=utf-8"
    if fmt == "vtt":
        return ("WEBVTT\n\n" + _cues(transcript, ".", numbered=False)).encode(), "text/vtt; charset=utf-8"
    if fmt == "verbose_json":
        segments = [
            Segment(id=i, start=s.start_s, end=_ended(s.end_s, transcript), text=" " + s.text)
            for i, s in enumerate(transcript.segments)
        ]
        verbose = TranscriptionVerbose(
            task="transcribe" if req.task == "transcribe" else "translate",
            language=transcript.language,
            duration=round(transcript.duration_s, 3),
            text=transcript.text,
            segments=segments,
            usage=usage,
        )
        return _encoder.encode(verbose), "application/json"
    return _encoder.encode(TranscriptionJson(text=transcript.text, usage=usage)), "application/json"


def _cues(transcript: Transcript, decimal: str, numbered: bool) -> str:
    cues = []
    for i, s in enumerate(transcript.segments, start=1):
        head = f"{i}\n" if numbered else ""
        cues.append(
            f"{head}{_clock(s.start_s, decimal)} --> {_clock(_ended(s.end_s, transcript), decimal)}\n{s.text}\n"
        )
    return "\n".join(cues)


def _ended(end_s: float, transcript: Transcript) -> float:
    # Whisper times in 20 ms steps up to its window's end: a last segment may end past the audio.
    return min(end_s, round(transcript.duration_s, 3))


def _clock(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{decimal}{ms % 1000:03d}"


def transcript_events(transcript: Transcript) -> list[bytes]:
    """The SSE events of a streamed transcription: a delta per segment, then done."""
    deltas = [TextDelta(delta=(" " if i else "") + s.text) for i, s in enumerate(transcript.segments)]
    return [sse(event) for event in [*deltas, TextDone(text=transcript.text)]]


_speech_decoder = msgspec.json.Decoder(SpeechRequest)
_encoder = msgspec.json.Encoder()


def decode_speech(body: bytes, voices: tuple[str, ...]) -> SpeechRequest:
    """Parse and check a ``/v1/audio/speech`` body; ``voices`` are the accepted voice names.

    Raises:
        InvalidRequest: bad JSON, or a bad ``input``, ``voice``, ``response_format`` or ``speed``.
    """
    req = decode_body(_speech_decoder, body)
    if not req.input or not req.input.strip():
        raise InvalidRequest("'input' is required: the text to speak", field="input")
    if len(req.input) > MAX_SPEECH_INPUT_CHARS:
        raise InvalidRequest(
            f"'input' has {len(req.input)} characters; at most {MAX_SPEECH_INPUT_CHARS} are spoken", field="input"
        )
    voice = req.voice.get("id") if isinstance(req.voice, dict) else req.voice
    if voice is not None and voice.lower() not in voices:
        raise InvalidRequest(
            f"'voice' '{voice}' is not available; this server speaks in one voice, named by any of: "
            f"{', '.join(voices)}",
            field="voice",
        )
    if req.response_format not in SPEECH_FORMATS:
        raise InvalidRequest(
            f"'response_format' must be one of {', '.join(SPEECH_FORMATS)}, not '{req.response_format}'",
            field="response_format",
        )
    if not MIN_SPEED <= req.speed <= MAX_SPEED:
        raise InvalidRequest(f"'speed' must be in {MIN_SPEED}..{MAX_SPEED}, not {req.speed}", field="speed")
    return req


SPEECH_MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


def audio_event(chunk: bytes) -> bytes:
    """One ``speech.audio.delta`` SSE event carrying ``chunk``."""
    return sse(AudioDelta(audio=base64.b64encode(chunk).decode("ascii")))


def audio_done() -> bytes:
    """The ``speech.audio.done`` SSE event."""
    return sse(AudioDone(usage=SpeechUsage()))


def sse(event: msgspec.Struct) -> bytes:
    """One server-sent event whose data is ``event``'s JSON."""
    return _sse.encode_event(_encoder.encode(event))
