"""Media parts: every validation error, and real decoding of audio, images and video."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from rill.errors import InvalidRequest
from rill.protocols._shared import b64pcm
from rill.protocols.chat_ws.media import MediaLimits, decode_media
from rill.protocols.chat_ws.messages import AudioPart, ImagePart, Message, TextPart, VideoPart

from .media_samples import pcm_b64, png_b64, tone, video_bytes


def decode(part, limits: MediaLimits | None = None):
    return decode_media([Message(role="user", content=[TextPart(text="x"), part])], limits or MediaLimits())


def test_pcm_round_trip() -> None:
    samples = np.array([0.0, 0.5, -1.0], np.float32)
    assert b64pcm.decode(b64pcm.encode(samples), "a", max_bytes=100, max_duration_s=1).tolist() == [0.0, 0.5, -1.0]


def test_valid_audio_decodes() -> None:
    (item,) = decode(AudioPart(data=pcm_b64(tone(0.5)), sample_rate=16000))
    assert item.kind == "audio" and item.where == "messages[0].content[1]"
    assert item.audio.dtype == np.float32 and item.duration_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("part", "limits", "error"),
    [
        (AudioPart(data=base64.b64encode(b"\0" * 6).decode()), None, "not a multiple of 4"),
        (AudioPart(data=pcm_b64([0.0, float("nan")])), None, "NaN or infinite"),
        (AudioPart(data=pcm_b64([0.0, float("inf")])), None, "NaN or infinite"),
        (AudioPart(data="@@not base64@@"), None, "not valid base64"),
        (AudioPart(data=""), None, "audio data is empty"),
        (AudioPart(data=pcm_b64(tone(0.1)), sample_rate=100), None, "sample_rate 100"),
        (AudioPart(data=pcm_b64(tone(1.0))), MediaLimits(max_audio_bytes=1000), "more than the limit of 1000 bytes"),
        (AudioPart(data=pcm_b64(tone(2.0))), MediaLimits(max_audio_s=1.0), "more than the limit of 1 s"),
    ],
    ids=["length", "nan", "inf", "base64", "empty", "rate", "bytes", "duration"],
)
def test_audio_errors(part: AudioPart, limits: MediaLimits | None, error: str) -> None:
    with pytest.raises(InvalidRequest, match="messages\\[0\\].content\\[1\\] \\(audio\\)") as info:
        decode(part, limits)
    assert error in str(info.value)


def test_valid_image_decodes() -> None:
    (item,) = decode(ImagePart(data=png_b64(8, 6)))
    assert item.kind == "image" and item.images[0].size == (8, 6) and item.images[0].mode == "RGB"


@pytest.mark.parametrize(
    ("part", "limits", "error"),
    [
        (ImagePart(data=base64.b64encode(b"not an image at all").decode()), None, "not a readable image"),
        (ImagePart(data=png_b64(100, 100)), MediaLimits(max_image_pixels=5000), "100x100 is more than 5000 pixels"),
        (ImagePart(data=png_b64(100, 100)), MediaLimits(max_image_bytes=10), "more than the limit of 10 bytes"),
        (ImagePart(data="%%%"), None, "not valid base64"),
    ],
    ids=["unreadable", "pixels", "bytes", "base64"],
)
def test_image_errors(part: ImagePart, limits: MediaLimits | None, error: str) -> None:
    with pytest.raises(InvalidRequest, match=r"\(image\)") as info:
        decode(part, limits)
    assert error in str(info.value)


@pytest.fixture(scope="module")
def video_b64(tmp_path_factory: pytest.TempPathFactory) -> str:
    return base64.b64encode(video_bytes(tmp_path_factory.mktemp("v") / "v.mp4")).decode()


def test_video_frames_and_audio_track(video_b64: str) -> None:
    (item,) = decode(VideoPart(data=video_b64))
    assert item.kind == "video" and len(item.images) == 3  # 3 s at one frame per second
    assert item.images[0].size == (32, 32)
    assert item.audio is not None and abs(len(item.audio) / 16000 - 3.0) < 0.2


def test_stack_frames_packs_frames_side_by_side(video_b64: str) -> None:
    (item,) = decode(VideoPart(data=video_b64, stack_frames=2))
    assert [im.size for im in item.images] == [(64, 32), (32, 32)]


def test_video_without_audio(tmp_path: Path) -> None:
    data = base64.b64encode(video_bytes(tmp_path / "n.mp4", seconds=1.0, with_audio=False)).decode()
    (item,) = decode(VideoPart(data=data))
    assert item.audio is None and len(item.images) == 1


@pytest.mark.parametrize(
    ("make", "limits", "error"),
    [
        (lambda v: VideoPart(data=base64.b64encode(b"\0" * 64).decode()), None, "not a readable video"),
        (lambda v: VideoPart(data=v), MediaLimits(max_video_s=1.0), "more than the limit of 1 s"),
        (lambda v: VideoPart(data=v), MediaLimits(max_video_bytes=100), "more than the limit of 100 bytes"),
        (lambda v: VideoPart(data=v, stack_frames=0), None, "stack_frames 0"),
        (lambda v: VideoPart(data=v), MediaLimits(max_video_frames=2), "more than 2 frames"),
        (lambda v: VideoPart(data=wav_b64()), None, "no video track"),
    ],
    ids=["garbage", "duration", "bytes", "stack", "frames", "audio-only"],
)
def test_video_errors(video_b64: str, make, limits: MediaLimits | None, error: str) -> None:
    with pytest.raises(InvalidRequest, match=r"\(video\)") as info:
        decode(make(video_b64), limits)
    assert error in str(info.value)


def wav_b64() -> str:
    import io

    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, tone(0.2), 16000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def test_too_many_parts() -> None:
    parts = [AudioPart(data=pcm_b64(tone(0.01))) for _ in range(3)]
    with pytest.raises(InvalidRequest, match="more than 2 media parts"):
        decode_media([Message(role="user", content=parts)], MediaLimits(max_parts=2))


def test_plain_text_has_no_media() -> None:
    assert decode_media([Message(role="user", content="hi")], MediaLimits()) == []
