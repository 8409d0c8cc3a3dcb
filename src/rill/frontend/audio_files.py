"""Sound files in and out: decode an uploaded file to float32 mono PCM, and encode synthesized
speech as a file format (blocking: call both from a worker thread, ``asyncio.to_thread``).

Decoding takes WAV (integer PCM) with the standard library's ``wave`` and every other container
and codec FFmpeg knows (mp3, flac, ogg/opus, webm, m4a, float WAV, ...) with PyAV, which rill
already installs for video input; PyAV's output is resampled to 16 kHz mono as it decodes. Both
stop once the audio is longer than the caller's cap, so the samples held are bounded by the cap
(and the file by the HTTP body limit). A file that is empty, not audio, or longer than the cap
raises ``InvalidRequest`` naming ``field``.

Encoding takes float32 mono PCM at 24 kHz (the speech synthesizers' rate): ``pcm`` is raw
16-bit little-endian samples, ``wav`` the same behind a WAV header (``wav_header(None)`` writes
the open-ended header a stream starts with), and ``flac``, ``mp3``, ``opus`` and ``aac`` go
through PyAV's encoders (ogg for opus, ADTS for aac).
"""

from __future__ import annotations

import io
import struct
import wave
from typing import Any

import numpy as np

from rill.errors import InvalidRequest

DECODE_RATE_HZ = 16000
"""Rate of what PyAV decodes (WAV keeps its own rate; the speech recognizer resamples it)."""

STREAMABLE_FORMATS = ("pcm", "wav")
"""Formats written piece by piece as speech is synthesized."""

COMPRESSED_FORMATS = {
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "mp3"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
}
"""Formats PyAV encodes whole: name → (container, codec)."""


def decode_audio(data: bytes, max_audio_s: float, field: str = "file") -> tuple[np.ndarray, int]:
    """Float32 mono samples of the sound file ``data`` and their sample rate.

    Raises:
        InvalidRequest: the file is empty, is not audio FFmpeg can decode, has no audio, or holds
            more than ``max_audio_s`` seconds (decoding stops there).
    """
    if not data:
        raise InvalidRequest(f"{field}: the file is empty", field=field)
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        try:
            return _decode_wav(data, max_audio_s, field)
        except (wave.Error, EOFError, struct.error):
            pass  # float or extensible WAV: FFmpeg reads those
    return _decode_av(data, max_audio_s, field)


def _too_long(field: str, max_audio_s: float) -> InvalidRequest:
    return InvalidRequest(
        f"{field}: the audio is longer than speech recognition takes ({max_audio_s:g} s, --asr-max-audio-s)",
        field=field,
    )


def _decode_wav(data: bytes, max_audio_s: float, field: str) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as wav:
        rate, width, channels = wav.getframerate(), wav.getsampwidth(), wav.getnchannels()
        if rate <= 0 or channels <= 0 or width not in (1, 2, 3, 4):
            raise wave.Error("unsupported WAV layout")
        max_frames = int(max_audio_s * rate)
        # A streamed WAV's header may claim more frames than it holds: count what is there.
        frames = wav.readframes(max_frames + 1)
    num_frames = len(frames) // (width * channels)
    if num_frames > max_frames:
        raise _too_long(field, max_audio_s)
    raw = np.frombuffer(frames[: num_frames * width * channels], dtype=np.uint8)
    if width == 1:
        samples = (raw.astype(np.float32) - 128.0) / 128.0
    elif width == 3:
        triples = raw.reshape(-1, 3).astype(np.int32)
        ints = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        samples = (np.where(ints >= 1 << 23, ints - (1 << 24), ints) / float(1 << 23)).astype(np.float32)
    else:
        dtype = "<i2" if width == 2 else "<i4"
        samples = raw.view(dtype).astype(np.float32) / float(1 << (8 * width - 1))
    mono = samples.reshape(-1, channels).mean(axis=1) if channels > 1 else samples
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def _decode_av(data: bytes, max_audio_s: float, field: str) -> tuple[np.ndarray, int]:
    import av

    max_samples = int(max_audio_s * DECODE_RATE_HZ)
    pieces: list[np.ndarray] = []
    num_samples = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise InvalidRequest(f"{field}: the file has no audio stream", field=field)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=DECODE_RATE_HZ)
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    piece = out.to_ndarray().reshape(-1)
                    num_samples += len(piece)
                    if num_samples > max_samples:
                        raise _too_long(field, max_audio_s)
                    pieces.append(piece)
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1))
    except av.FFmpegError as exc:
        raise InvalidRequest(
            f"{field}: not a sound file this server can decode (wav, mp3, flac, ogg, webm, m4a, ...)", field=field
        ) from exc
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    if len(samples) > max_samples:
        raise _too_long(field, max_audio_s)
    if not len(samples):
        raise InvalidRequest(f"{field}: the file holds no audio samples", field=field)
    return samples, DECODE_RATE_HZ


def pcm16(samples: np.ndarray) -> bytes:
    """16-bit little-endian PCM bytes of float samples in [-1, 1] (clipped)."""
    return bytes((np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes())


def wav_header(num_samples: int | None, rate_hz: int) -> bytes:
    """The 44-byte header of a 16-bit mono WAV; ``None`` samples: unknown length (a stream),
    written as the largest sizes, as streaming servers do."""
    data_bytes = 0xFFFFFFFF - 36 if num_samples is None else num_samples * 2
    return b"RIFF" + struct.pack(
        "<I4s4sIHHIIHH4sI",
        36 + data_bytes,
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        rate_hz,
        rate_hz * 2,
        2,
        16,
        b"data",
        data_bytes,
    )


def encode_compressed(samples: np.ndarray, rate_hz: int, audio_format: str) -> bytes:
    """``samples`` (float32 mono) as a whole ``flac``, ``mp3``, ``opus`` or ``aac`` file."""
    import av

    container_format, codec = COMPRESSED_FORMATS[audio_format]
    # Opus encodes at 48 kHz only; the others keep the synthesizer's rate.
    out_rate = 48000 if audio_format == "opus" else rate_hz
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream: Any = container.add_stream(codec, rate=out_rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(
            np.clip(samples, -1.0, 1.0).astype(np.float32).reshape(1, -1), format="flt", layout="mono"
        )
        frame.sample_rate = rate_hz
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=out_rate)
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(piece):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return bytes(buffer.getvalue())
