"""Check and decode the media parts of a chat: audio (raw PCM), images (Pillow), video (PyAV).

Every part is fully validated (base64, size, duration, decodability) before the model is
asked whether it takes that modality, so a bad file is reported as such whatever the model.
Decoding is CPU work: the adapter runs ``decode_media`` in a worker thread. No sockets, no
engine; imports numpy, Pillow, PyAV and ``rill.errors``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rill.errors import InvalidRequest
from rill.protocols._shared import b64pcm
from rill.protocols.chat_ws.messages import AudioPart, ImagePart, Message, VideoPart


@dataclass(frozen=True)
class MediaLimits:
    """Size and duration limits of media parts (per part, and per request in total)."""

    max_audio_bytes: int = 32 * 1024 * 1024
    max_audio_s: float = 600.0
    max_image_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_s: float = 120.0
    max_video_frames: int = 256
    video_fps: float = 1.0
    max_stack_frames: int = 16
    max_parts: int = 64


@dataclass
class DecodedMedia:
    """One media part after decoding (what a multimodal model would receive).

    ``kind`` is ``image``, ``audio`` or ``video``; ``where`` names the part in the request
    (``messages[1].content[2]``), ``message_index`` and ``content_index`` place it; images
    are RGB Pillow images; audio is float32 mono (a video's audio track at 16 kHz, None
    when it has none); ``language`` is the part's spoken-language hint.
    """

    kind: str
    where: str
    images: list[Any] = field(default_factory=list)
    audio: np.ndarray | None = None
    sample_rate_hz: int = b64pcm.INPUT_SAMPLE_RATE_HZ
    duration_s: float = 0.0
    message_index: int = 0
    content_index: int = 0
    language: str | None = None


def decode_media(messages: list[Message], limits: MediaLimits) -> list[DecodedMedia]:
    """Validate and decode every media part of ``messages``, in order.

    Raises:
        InvalidRequest: a part is malformed or over a limit (the message names the part).
    """
    decoded: list[DecodedMedia] = []
    for m, message in enumerate(messages):
        if isinstance(message.content, str):
            continue
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            if isinstance(part, AudioPart):
                item = _audio(part, where, limits)
                item.language = part.language
            elif isinstance(part, ImagePart):
                item = _image(part, where, limits)
            elif isinstance(part, VideoPart):
                item = _video(part, where, limits)
                item.language = part.language
            else:
                continue
            item.message_index, item.content_index = m, p
            decoded.append(item)
            if len(decoded) > limits.max_parts:
                raise InvalidRequest(
                    f"{where}: more than {limits.max_parts} media parts in one request", field="messages"
                )
    return decoded


def _audio(part: AudioPart, where: str, limits: MediaLimits) -> DecodedMedia:
    samples = b64pcm.decode(
        part.data,
        f"{where} (audio)",
        sample_rate_hz=part.sample_rate,
        max_bytes=limits.max_audio_bytes,
        max_duration_s=limits.max_audio_s,
    )
    return DecodedMedia(
        "audio", where, audio=samples, sample_rate_hz=part.sample_rate, duration_s=len(samples) / part.sample_rate
    )


def _image(part: ImagePart, where: str, limits: MediaLimits) -> DecodedMedia:
    from PIL import Image, UnidentifiedImageError

    raw = b64pcm.decode_b64(part.data, f"{where} (image)", limits.max_image_bytes)
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            width, height = probe.size
            # Check the pixel count from the header, before decoding allocates the bitmap.
            if width * height > limits.max_image_pixels:
                raise InvalidRequest(
                    f"{where} (image): {width}x{height} is more than {limits.max_image_pixels} pixels", field="messages"
                )
            image = probe.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{where} (image): not a readable image file", field="messages") from exc
    return DecodedMedia("image", where, images=[image])


def _video(part: VideoPart, where: str, limits: MediaLimits) -> DecodedMedia:
    import av

    label = f"{where} (video)"
    if not 1 <= part.stack_frames <= limits.max_stack_frames:
        raise InvalidRequest(
            f"{label}: stack_frames {part.stack_frames} is outside 1..{limits.max_stack_frames}", field="messages"
        )
    raw = b64pcm.decode_b64(part.data, label, limits.max_video_bytes)
    try:
        container = av.open(io.BytesIO(raw), mode="r")
    except Exception as exc:  # PyAV raises many FFmpeg error classes for a bad file
        raise InvalidRequest(f"{label}: not a readable video file", field="messages") from exc
    with container:
        if not container.streams.video:
            raise InvalidRequest(f"{label}: the file has no video track", field="messages")
        if container.duration is not None and container.duration / 1e6 > limits.max_video_s:
            raise InvalidRequest(
                f"{label}: video lasts {container.duration / 1e6:.1f} s, more than the limit of "
                f"{limits.max_video_s:g} s",
                field="messages",
            )
        try:
            frames, duration_s = _sample_frames(container, label, limits)
            audio = _audio_track(raw, label, limits)
        except InvalidRequest:
            raise
        except Exception as exc:
            raise InvalidRequest(f"{label}: the video could not be decoded", field="messages") from exc
    if not frames:
        raise InvalidRequest(f"{label}: the video has no frames", field="messages")
    images = [_stack(frames[i : i + part.stack_frames]) for i in range(0, len(frames), part.stack_frames)]
    return DecodedMedia("video", where, images=images, audio=audio, duration_s=duration_s)


def _sample_frames(container: Any, label: str, limits: MediaLimits) -> tuple[list[Any], float]:
    """One RGB frame per ``1 / video_fps`` seconds, checking the duration as frames decode."""
    frames: list[Any] = []
    next_s = 0.0
    last_s = 0.0
    for frame in container.decode(video=0):
        t = float(frame.time) if frame.time is not None else len(frames) / limits.video_fps
        last_s = max(last_s, t)
        if t > limits.max_video_s:
            raise InvalidRequest(
                f"{label}: video lasts more than the limit of {limits.max_video_s:g} s", field="messages"
            )
        if t + 1e-6 >= next_s:
            frames.append(frame.to_image())
            next_s += 1.0 / limits.video_fps
            if len(frames) > limits.max_video_frames:
                raise InvalidRequest(f"{label}: more than {limits.max_video_frames} frames", field="messages")
    return frames, last_s


def _audio_track(raw: bytes, label: str, limits: MediaLimits) -> np.ndarray | None:
    """The audio track as float32 mono at 16 kHz (None when the file has none)."""
    import av

    with av.open(io.BytesIO(raw), mode="r") as container:
        if not container.streams.audio:
            return None
        resampler = av.AudioResampler(format="flt", layout="mono", rate=b64pcm.INPUT_SAMPLE_RATE_HZ)
        pieces: list[np.ndarray] = []
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                pieces.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            pieces.append(out.to_ndarray().reshape(-1))
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    if len(samples) / b64pcm.INPUT_SAMPLE_RATE_HZ > limits.max_video_s:
        raise InvalidRequest(f"{label}: the audio track is longer than {limits.max_video_s:g} s", field="messages")
    return samples


def _stack(frames: list[Any]) -> Any:
    """Frames side by side in one image (``stack_frames`` > 1 packs several into one)."""
    if len(frames) == 1:
        return frames[0]
    from PIL import Image

    width = sum(f.width for f in frames)
    height = max(f.height for f in frames)
    canvas = Image.new("RGB", (width, height))
    x = 0
    for frame in frames:
        canvas.paste(frame, (x, 0))
        x += frame.width
    return canvas
