"""Wire messages of ``/ws/chat`` (shared/specs/chat-websocket.md), names exactly as on the wire.

Message sequence on one connection::

    client: ChatRequest                      (exactly one, right after connecting)
    server: Transcript*                      (one per audio part and video audio track heard)
    server: ImageText*                       (one per image part read, when OCR is on)
    server: Queued, QueueUpdate*             (only while the chat waits for a free slot)
    server: QueueDone                        (always, before prefill)
    server: PrefillDone → Chunk* → Done      (Chunk only when ``streaming`` is true)
    server closes the connection.
    Any error: Error, then close.

rill's extensions, which spec clients skip (the spec's examples act on the types they know
and ignore the rest): the ``transcript`` and ``image_text`` messages; ``language`` on audio and video parts (the
spoken language, to skip detection); ``tts`` on ``done`` (who spoke the reply, and a note when
a speech setting was honoured differently than asked).

Fields the server leaves out are ``UNSET`` (never written); ``None`` is written as ``null``.
Pure: msgspec and ``rill.protocols._shared`` only.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from rill.protocols._shared.sampling import Field, SamplingMap, same


class TextPart(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    """Content part: text."""

    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    """Content part: an image file (PNG, JPEG, ...), base64."""

    data: str


class AudioPart(msgspec.Struct, tag_field="type", tag="audio", kw_only=True):
    """Content part: raw PCM float32 little-endian mono, base64, at ``sample_rate`` Hz.

    ``language`` (rill extension): the spoken language's code (``en``, ``fr``, ...) for speech
    recognition; left out, it is detected.
    """

    data: str
    sample_rate: int = 16000
    language: str | None = None


class VideoPart(msgspec.Struct, tag_field="type", tag="video", kw_only=True):
    """Content part: a video file (MP4, WebM, ...), base64; frames and the audio track are
    extracted; ``stack_frames`` frames are stacked into one image. ``language`` (rill
    extension): the audio track's spoken language, as on ``AudioPart``."""

    data: str
    stack_frames: int = 1
    language: str | None = None


ContentPart = TextPart | ImagePart | AudioPart | VideoPart


class Message(msgspec.Struct, kw_only=True):
    """One conversation turn; ``content`` is plain text or a list of parts."""

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class GenerationConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling fields (spec defaults), plus the other sampling fields of the engine.

    Unknown fields are refused so that a misspelt parameter never passes silently.
    """

    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.8
    length_penalty: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_new_tokens: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    num_beams: int | None = None
    do_sample: bool | None = None
    speculative: bool | int | None = None
    """Speculative decoding when the server runs it: false or 0 off, N at most N draft tokens
    (the server's length when unset); the output is the same, only the speed differs."""


SAMPLING = SamplingMap(
    GenerationConfig,
    Field("max_new_tokens", "max_tokens"),
    Field("min_new_tokens", "min_tokens"),
    same(
        "temperature",
        "top_p",
        "length_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "allowed_token_ids",
        "num_beams",
        "speculative",
    ),
)
"""``generation`` → ``SamplingParams`` (``do_sample: false`` forces greedy: the session's rule)."""


class TTSConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Speech output settings."""

    enabled: bool = True
    mode: str = "default"
    ref_audio_path: str | None = None
    ref_audio_data: str | None = None
    language: str | None = None


class ImageConfig(msgspec.Struct, kw_only=True):
    """Image processing settings (accepted; only meaningful for a vision model)."""

    max_slice_nums: int | None = None
    use_image_id: bool = True


class ChatRequest(msgspec.Struct, kw_only=True):
    """Client → server: the one request of a connection.

    Unknown top-level fields are ignored, as the source project's clients send extras.
    """

    messages: list[Message]
    streaming: bool = True
    generation: GenerationConfig = msgspec.field(default_factory=GenerationConfig)
    tts: TTSConfig = msgspec.field(default_factory=TTSConfig)
    image: ImageConfig = msgspec.field(default_factory=ImageConfig)
    omni_mode: bool = False
    enable_thinking: bool = False
    use_tts_template: bool = False


class Queued(msgspec.Struct, tag_field="type", tag="queued", kw_only=True):
    """Server → client: the chat waits; ``position`` is 1-based."""

    position: int
    estimated_wait_s: float
    queue_length: int


class QueueUpdate(msgspec.Struct, tag_field="type", tag="queue_update", kw_only=True):
    """Server → client: the waiting chat's position changed."""

    position: int
    estimated_wait_s: float
    queue_length: int


class QueueDone(msgspec.Struct, tag_field="type", tag="queue_done"):
    """Server → client: the chat left the queue and starts now."""


class PrefillDone(msgspec.Struct, tag_field="type", tag="prefill_done", kw_only=True):
    """Server → client: the whole conversation is in the KV cache."""

    input_tokens: int


class Chunk(msgspec.Struct, tag_field="type", tag="chunk", kw_only=True):
    """Server → client: new text and/or speech (empty fields left out; never both empty)."""

    text_delta: str | UnsetType = UNSET
    audio_data: str | UnsetType = UNSET


class Transcript(msgspec.Struct, tag_field="type", tag="transcript", kw_only=True):
    """Server → client (rill extension): what speech recognition heard in one audio part, or
    in a video part's audio track, of the request. Sent before ``queue_done``, so before
    ``prefill_done`` and the first token; ``text`` is what entered the prompt in the part's place.

    ``message_index`` and ``content_index`` place the part (``messages[i].content[j]``);
    ``kind`` is ``audio`` or ``video``; ``language`` the code given or detected;
    ``duration_s`` the audio's length and ``speech_s`` the speech voice-activity trimming
    kept; ``note`` says what of the part the model did not get (a video's frames).
    """

    message_index: int
    content_index: int
    kind: str
    text: str
    language: str
    duration_s: float
    speech_s: float
    note: str | UnsetType = UNSET


class ImageText(msgspec.Struct, tag_field="type", tag="image_text", kw_only=True):
    """Server → client (rill extension): the text OCR read in one image part of the request
    (OCR, not vision: what the image shows is not described). Sent after the transcripts and
    before ``queue_done``, so before the first token.

    ``message_index`` and ``content_index`` place the part (``messages[i].content[j]``);
    ``text`` is what was read (empty when the image holds no readable text); ``prompt_text``
    what entered the prompt in the part's place; ``width`` and ``height`` the image's size.
    """

    message_index: int
    content_index: int
    text: str
    prompt_text: str
    width: int
    height: int


class SpeechInfo(msgspec.Struct, kw_only=True):
    """``done.tts`` (rill extension) of a spoken reply: the synthesizer and voice that spoke
    it; ``note`` when a speech setting was honoured differently than asked (a reference voice
    that could not be imitated)."""

    synthesizer: str
    voice: str
    note: str | UnsetType = UNSET


class Done(msgspec.Struct, tag_field="type", tag="done", kw_only=True):
    """Server → client: the reply is complete.

    ``audio_data``: the whole reply's speech when not streaming; ``null`` when streaming
    (every audio segment already went out in a ``chunk``) or when speech is off.
    ``tts`` (rill extension): who spoke a spoken reply; left out when speech is off.
    """

    text: str
    generated_tokens: int
    input_tokens: int
    audio_data: str | None = None
    recording_session_id: str | UnsetType = UNSET
    tts: SpeechInfo | UnsetType = UNSET


class Error(msgspec.Struct, tag_field="type", tag="error", kw_only=True):
    """Server → client: the chat failed; the server closes the connection next."""

    error: str


ServerMessage = Transcript | ImageText | Queued | QueueUpdate | QueueDone | PrefillDone | Chunk | Done | Error
