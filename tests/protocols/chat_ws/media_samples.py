"""Small generated media for the chat tests: PCM, images (Pillow), videos (PyAV)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np


def pcm_b64(samples: np.ndarray | list[float]) -> str:
    """Base64 of float32 little-endian PCM."""
    return base64.b64encode(np.asarray(samples, dtype="<f4").tobytes()).decode()


def tone(seconds: float, rate_hz: int = 16000) -> np.ndarray:
    """A quiet 220 Hz test tone (input audio only; never presented as speech)."""
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def png_b64(width: int = 8, height: int = 6) -> str:
    """A small PNG image."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def text_image(lines: list[str], font_size: int = 32) -> Any:
    """A white RGB image with ``lines`` written on it in black (Pillow's own scalable font),
    for OCR to read back."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=font_size)
    width = 40 + max(int(font.getlength(line)) for line in lines)
    image = Image.new("RGB", (width, 40 + 2 * font_size * len(lines)), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((20, 20 + 2 * font_size * i), line, fill="black", font=font)
    return image


def image_b64(image: Any) -> str:
    """Base64 of ``image`` as a PNG file."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def video_bytes(
    path: Path,
    seconds: float = 3.0,
    fps: int = 4,
    with_audio: bool = True,
    size: int = 32,
    sound: np.ndarray | None = None,
) -> bytes:
    """A tiny MPEG-4 video (moving gradient) with an optional AAC track, written by PyAV: a
    tone, or ``sound`` (16 kHz float32 mono) when given."""
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width = video.height = size
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=16000) if with_audio else None
        for i in range(int(seconds * fps)):
            img = np.full((size, size, 3), (i * 20) % 255, dtype=np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:
            samples = (tone(seconds) if sound is None else sound).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate = 16000
            for packet in audio.encode(frame):
                container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
    return path.read_bytes()
