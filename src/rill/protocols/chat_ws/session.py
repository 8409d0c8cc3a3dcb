"""The sans-I/O state of one ``/ws/chat`` connection: request → engine request, outputs →
wire messages and speech segments.

Audio parts (and video audio tracks) arrive already transcribed: the service runs speech
recognition before the session exists and hands it each part's wire ``Transcript``; the session
sends them (``on_transcribed``) and the engine request carries their text in the parts' places.
Image parts, when the server reads text in images (OCR), arrive already read the same way
(each part's wire ``ImageText``): the text takes the part's place marked as read from an image
(``image_prompt_text``).

States and transitions (one request per connection)::

    QUEUED ──admitted──▶ GENERATING ──text finished──▶ SPEAKING ──speech ended──▶ DONE
       │                     │  └──────── text finished, no speech ──────────────▶ DONE
       └──── error ──────────┴──────────── error ──────────────────────────────▶ FAILED

A ``Session`` of the session driver (``protocols/_shared/driver.py``), which feeds it the
engine's answers; the adapter feeds it the queue's and the speech's. The returned actions
are performed in order: ``Send`` a message, ``Speak`` a text segment (to the reply's speech
stream), ``EndSpeech`` (no more segments), ``Record`` the finished chat, ``Close`` the
socket. The session never reads a clock, awaits or touches the engine. Pure: msgspec,
numpy (for PCM), ``rill.types``, ``rill.errors`` and this package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rill.errors import InvalidRequest, RillError
from rill.protocols._shared import b64pcm
from rill.protocols._shared import session as driver_session
from rill.protocols._shared.actions import Close, Send
from rill.protocols._shared.segmenter import Segmenter
from rill.protocols.chat_ws import codec
from rill.protocols.chat_ws.messages import (
    SAMPLING,
    ChatRequest,
    Chunk,
    Done,
    GenerationConfig,
    ImageText,
    Message,
    PrefillDone,
    Queued,
    QueueDone,
    QueueUpdate,
    ServerMessage,
    SpeechInfo,
    TextPart,
    Transcript,
)
from rill.protocols.chat_ws.queue import QueueStatus
from rill.types import ChatMessage, GenerateRequest, RequestEvent, RequestOutput, SamplingParams

PROTOCOL = "chat_ws"

QUEUED, GENERATING, SPEAKING, DONE, FAILED = "QUEUED", "GENERATING", "SPEAKING", "DONE", "FAILED"
TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({GENERATING, FAILED}),
    GENERATING: frozenset({SPEAKING, DONE, FAILED}),
    SPEAKING: frozenset({DONE, FAILED}),
    DONE: frozenset(),
    FAILED: frozenset(),
}


@dataclass(frozen=True)
class Speak:
    """Synthesize ``text`` (in order, after every earlier ``Speak``)."""

    text: str


@dataclass(frozen=True)
class EndSpeech:
    """No more segments for this reply."""


@dataclass(frozen=True)
class Record:
    """Keep the finished chat as recording ``done.recording_session_id``: its request, ``done``
    and the reply's whole audio (None when the reply was not spoken). Before ``done`` is sent."""

    done: Done
    audio: np.ndarray | None


def image_prompt_text(text: str) -> str:
    """The prompt's words for an image whose text OCR read as ``text``: marked as read from an
    image, so the model does not take it for the user's own words, and never passed off as
    a description of the picture."""
    if not text.strip():
        return "[An image with no readable text]"
    return f"[Text read from an image: {text.strip()}]"


Action = Send[ServerMessage] | Speak | EndSpeech | Record | Close
"""``Close`` carries the WebSocket close code (``codec.CLOSE_*``)."""

# Which engine modality a media part needs.
_MODALITY_OF_PART = {"image": "image", "audio": "audio", "video": "video"}


def build_generate_request(
    request: ChatRequest,
    *,
    heard: Sequence[Transcript] = (),
    read: Sequence[ImageText] = (),
    deadline_s: float | None = None,
) -> GenerateRequest:
    """The engine request for a chat whose media parts were already refused or handled.

    Text parts of a content list are joined with newlines; a media part that was ``heard``
    counts as a text part holding its transcript, an image that was ``read`` as one holding
    its ``prompt_text``; other media parts must not remain.

    Raises:
        InvalidRequest: a generation field is invalid (names it), or a media part remains.
    """
    texts = {(h.message_index, h.content_index): h.text for h in heard}
    texts.update({(r.message_index, r.content_index): r.prompt_text for r in read})
    messages = [ChatMessage(role=m.role, content=_text_of(m, i, texts)) for i, m in enumerate(request.messages)]
    sampling = sampling_params(request.generation)
    return GenerateRequest(
        messages=messages,
        sampling=sampling,
        protocol=PROTOCOL,
        chat_template_kwargs={"enable_thinking": request.enable_thinking},
        deadline_s=deadline_s,
    )


def _text_of(message: Message, index: int, heard: Mapping[tuple[int, int], str]) -> str:
    if isinstance(message.content, str):
        return message.content
    texts: list[str] = []
    for p, part in enumerate(message.content):
        if (index, p) in heard:
            texts.append(heard[(index, p)])
            continue
        if not isinstance(part, TextPart):
            raise InvalidRequest(
                f"messages[{index}].content[{p}]: media parts cannot be sent to this model", field="messages"
            )
        texts.append(part.text)
    return "\n".join(texts)


def sampling_params(generation: GenerationConfig) -> SamplingParams:
    """Engine sampling parameters from the wire ``generation`` object (validated; the
    server's ``--max-tokens-cap`` is applied at admission, as on every protocol).

    Raises:
        InvalidRequest: a value is out of range (the message uses the wire name).
    """
    patch = SAMPLING.patch(generation)
    if generation.do_sample is False:
        patch["temperature"] = 0.0
    try:
        return SAMPLING.params(patch)
    except InvalidRequest as exc:
        raise InvalidRequest(f"generation: {exc}", field=f"generation.{exc.field}") from exc


def refuse_modalities(kinds_and_places: list[tuple[str, str]], model_name: str, model_modalities: list[str]) -> None:
    """Raise for the first media part the model cannot take (never drop it silently).

    Args:
        kinds_and_places: ``(kind, where)`` of each decoded media part, e.g. ``("image", "messages[1].content[0]")``.
        model_name: the served model name, for the message.
        model_modalities: what the model takes (``ModelInfo.modalities``).
    """
    for kind, where in kinds_and_places:
        modality = _MODALITY_OF_PART[kind]
        if modality not in model_modalities:
            raise InvalidRequest(
                f"{where}: the model '{model_name}' cannot take {modality} input "
                f"(it takes: {', '.join(model_modalities)})",
                field="messages",
            )


class ChatSession(driver_session.Session):
    """One chat's presentation state: accumulated text and audio, what was sent, its state.

    Args:
        request: the decoded client request.
        is_speaking: speech is on (``tts.enabled`` and a synthesizer is available).
        segmenter: cuts reply text into speakable segments (reasoning excluded).
        recording_session_id: put on ``done`` when the chat is recorded.
        heard: what speech recognition heard in the request's audio (each part's
            ``transcript`` message, sent as it is), in request order.
        read: what OCR read in the request's images (each image's ``image_text`` message, sent as
            it is), in request order.
        speech_info: put on ``done`` (as ``tts``) when the reply is spoken.
    """

    def __init__(
        self,
        request: ChatRequest,
        *,
        is_speaking: bool,
        segmenter: Segmenter | None = None,
        recording_session_id: str | None = None,
        keep_audio: bool = False,
        heard: Sequence[Transcript] = (),
        read: Sequence[ImageText] = (),
        speech_info: SpeechInfo | None = None,
    ) -> None:
        self.request = request
        self.heard = tuple(heard)
        self.read = tuple(read)
        self.speech_info = speech_info
        self.is_streaming = request.streaming
        self.is_speaking = is_speaking
        self.state = QUEUED
        self.text = ""
        self.input_tokens = 0
        self.generated_tokens = 0
        self.recording_session_id = recording_session_id
        self.audio: list[np.ndarray] = []  # whole reply audio (non-streaming or recorded)
        self._keep_audio = keep_audio or not request.streaming
        self._segmenter = segmenter or Segmenter()
        self._prefill_sent = False
        self.max_chunk_samples = b64pcm.OUTPUT_SAMPLE_RATE_HZ  # one second of audio per chunk

    # -- speech recognition ------------------------------------------------------------
    def on_transcribed(self) -> list[Action]:
        """One ``transcript`` per part heard, then one ``image_text`` per image read, before
        anything else is sent."""
        messages: list[ServerMessage] = [*self.heard, *self.read]
        return [Send(message) for message in messages]

    # -- queue (the server's fair queue of chats, not the engine's) ---------------------
    def on_queue_joined(self, status: QueueStatus) -> list[Action]:
        """The chat had to wait for a turn: tell the client where it stands."""
        return [
            Send(
                Queued(
                    position=status.position, estimated_wait_s=status.estimated_wait_s, queue_length=status.queue_length
                )
            )
        ]

    def on_queue_moved(self, status: QueueStatus) -> list[Action]:
        """The waiting chat's position changed."""
        return [
            Send(
                QueueUpdate(
                    position=status.position, estimated_wait_s=status.estimated_wait_s, queue_length=status.queue_length
                )
            )
        ]

    def on_admitted(self) -> list[Action]:
        """The chat may generate now (sent even when it never waited)."""
        self._go(GENERATING)
        return [Send(QueueDone())]

    # -- engine ------------------------------------------------------------------------
    def on_started(self, started: driver_session.Started) -> list[Action]:
        """The engine accepted the request (its prompt tokens are ``input_tokens``)."""
        self.input_tokens = len(started.prompt_token_ids)
        return []

    def on_start_failed(self, key: driver_session.Key, exc: BaseException, now: float) -> list[Action]:
        """The engine refused the request: the error, then close."""
        return self.on_error(exc)

    def on_output(self, key: driver_session.Key, output: RequestOutput, now: float) -> list[Action]:
        """One engine delta → ``prefill_done`` (first time), chunks, speech segments, the end."""
        actions: list[Action] = []
        if output.finished and output.finish_reason in ("error", "cancelled"):
            return self.on_error(output.error if isinstance(output.error, BaseException) else RillError("Cancelled"))
        if not self._prefill_sent and (
            RequestEvent.PREFILL_DONE in output.events or output.token_ids or output.finished
        ):
            self._prefill_sent = True
            actions.append(Send(PrefillDone(input_tokens=self.input_tokens)))
        # usage counts every generated token, also one delivered later (its text held back)
        self.generated_tokens = output.usage.completion_tokens or self.generated_tokens + len(output.token_ids)
        if output.text:
            self.text += output.text
            if self.is_streaming:
                actions.append(Send(Chunk(text_delta=output.text)))
            if self.is_speaking:
                actions += [Speak(s) for s in self._segmenter.feed(output.text)]
        if output.finished:
            actions += self._text_finished()
        return actions

    def _text_finished(self) -> list[Action]:
        if not self.is_speaking:
            return self._done()
        self._go(SPEAKING)
        return [*(Speak(s) for s in self._segmenter.flush()), EndSpeech()]

    # -- speech ------------------------------------------------------------------------
    def on_audio(self, samples: np.ndarray) -> list[Action]:
        """One spoken segment's PCM (24 kHz float32) is ready."""
        if not len(samples) or self.state in (DONE, FAILED):
            return []
        if self._keep_audio:
            self.audio.append(samples)
        if self.is_streaming:
            # NOTE: at most one second per message: a long sentence would otherwise make a
            # frame over 1 MiB, the default limit of the websockets client.
            step = self.max_chunk_samples
            return [Send(Chunk(audio_data=b64pcm.encode(samples[i : i + step]))) for i in range(0, len(samples), step)]
        return []

    def on_speech_end(self) -> list[Action]:
        """Every segment was spoken."""
        return self._done() if self.state == SPEAKING else []

    # -- endings -----------------------------------------------------------------------
    def _done(self) -> list[Action]:
        self._go(DONE)
        audio = None
        if self.is_speaking and not self.is_streaming:
            audio = b64pcm.encode(np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32))
        done = Done(
            text=self.text, generated_tokens=self.generated_tokens, input_tokens=self.input_tokens, audio_data=audio
        )
        if self.is_speaking and self.speech_info is not None:
            done.tts = self.speech_info
        if self.recording_session_id is None:
            return [Send(done), Close(codec.CLOSE_NORMAL)]
        done.recording_session_id = self.recording_session_id
        return [Record(done, self.whole_audio() if self.is_speaking else None), Send(done), Close(codec.CLOSE_NORMAL)]

    def on_error(self, exc: BaseException) -> list[Action]:
        """Anything failed: one ``error`` message (from the error table), then close."""
        if self.state in (DONE, FAILED):
            return []
        self.state = FAILED
        message, code = codec.error_for(exc)
        return [Send(message), Close(code)]

    def whole_audio(self) -> np.ndarray:
        """Every audio sample of the reply so far (kept when recording or not streaming)."""
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)

    def _go(self, state: str) -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"chat session: illegal transition {self.state} → {state}")
        self.state = state
