"""Raw PCM float32 mono audio as base64 (pure): the audio encoding of the chat protocols.

The wire carries the little-endian bytes of a float32 array, base64-encoded, with no header
(not WAV, not Opus): 16 kHz from the client, 24 kHz from the server. This module converts
both ways and checks what a client sends (length a multiple of 4 bytes, finite samples,
size and duration limits). Imports: stdlib, numpy, ``rill.errors``.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from rill.errors import InvalidRequest

INPUT_SAMPLE_RATE_HZ = 16000
"""Sample rate of client audio when the part does not say otherwise."""

OUTPUT_SAMPLE_RATE_HZ = 24000
"""Sample rate of every audio payload the server sends."""

_FLOAT32_LE = np.dtype("<f4")


def encode(samples: np.ndarray) -> str:
    """Base64 of ``samples`` as little-endian float32 bytes (an empty array gives '')."""
    return base64.b64encode(np.ascontiguousarray(samples, dtype=_FLOAT32_LE).tobytes()).decode("ascii")


def decode_b64(data: str, field: str, max_bytes: int) -> bytes:
    """The bytes of a base64 string, refusing one that decodes to more than ``max_bytes``.

    The size is checked on the encoded length first, so an oversized payload is never decoded.

    Raises:
        InvalidRequest: not valid base64, or too large (``field`` names the part).
    """
    if len(data) // 4 * 3 > max_bytes + 3:
        raise InvalidRequest(
            f"{field}: {len(data) // 4 * 3} bytes is more than the limit of {max_bytes} bytes", field=field
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{field}: data is not valid base64", field=field) from exc
    if len(raw) > max_bytes:
        raise InvalidRequest(f"{field}: {len(raw)} bytes is more than the limit of {max_bytes} bytes", field=field)
    return raw


def decode(
    data: str, field: str, *, sample_rate_hz: int = INPUT_SAMPLE_RATE_HZ, max_bytes: int, max_duration_s: float
) -> np.ndarray:
    """Check and decode client audio into float32 samples.

    Args:
        data: base64 of raw float32 little-endian mono PCM.
        field: where the data came from (``messages[0].content[1]``), for error messages.
        sample_rate_hz: the part's sample rate (8000..192000).
        max_bytes: largest decoded size accepted.
        max_duration_s: longest audio accepted at ``sample_rate_hz``.

    Raises:
        InvalidRequest: bad base64, empty, a length that is not a multiple of 4 bytes,
            a NaN or infinite sample, or over a limit.
    """
    if not 8000 <= sample_rate_hz <= 192000:
        raise InvalidRequest(f"{field}: sample_rate {sample_rate_hz} is outside 8000..192000 Hz", field=field)
    raw = decode_b64(data, field, max_bytes)
    if not raw:
        raise InvalidRequest(f"{field}: audio data is empty", field=field)
    if len(raw) % 4:
        raise InvalidRequest(
            f"{field}: audio is {len(raw)} bytes, not a multiple of 4 (raw float32 PCM expected)", field=field
        )
    samples = np.frombuffer(raw, dtype=_FLOAT32_LE)
    duration_s = len(samples) / sample_rate_hz
    if duration_s > max_duration_s:
        raise InvalidRequest(
            f"{field}: audio lasts {duration_s:.1f} s, more than the limit of {max_duration_s:g} s", field=field
        )
    if not np.isfinite(samples).all():
        raise InvalidRequest(f"{field}: audio has NaN or infinite samples", field=field)
    return samples.astype(np.float32)
