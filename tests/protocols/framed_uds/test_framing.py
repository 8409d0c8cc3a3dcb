"""Tests of rill.protocols.framed_uds.framing: frames and lines in any chunking, limits first."""

from __future__ import annotations

import json
import struct

import pytest

from rill.protocols.framed_uds.framing import (
    FrameDecoder,
    FrameTooLarge,
    InvalidFrameLength,
    LineDecoder,
    encode_frame,
)

PAYLOADS = [
    b'{"id":"a","prompt":"x"}',
    json.dumps({"id": "b", "prompt": "\u00e9\u4e2d\U0001f600"}).encode(),
    b"{}" * 300,
]


def _stream() -> bytes:
    return b"".join(encode_frame(p) for p in PAYLOADS)


def test_header_is_uint32_little_endian() -> None:
    assert encode_frame(b"abc") == b"\x03\x00\x00\x00abc"
    assert encode_frame(b"x" * 258)[:4] == struct.pack("<I", 258)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 7, 64, 10_000])
def test_any_chunking_gives_the_same_frames(chunk: int) -> None:
    data = _stream()
    decoder = FrameDecoder(max_frame_bytes=1024)
    frames: list[bytes] = []
    for i in range(0, len(data), chunk):
        frames += decoder.feed(data[i : i + chunk])
    assert frames == PAYLOADS
    assert decoder.is_idle and decoder.num_buffered_bytes == 0


def test_one_byte_at_a_time_completes_exactly_on_the_last_byte() -> None:
    frame = encode_frame(b'{"id":"a","prompt":"x"}')
    decoder = FrameDecoder(max_frame_bytes=1024)
    for byte in frame[:-1]:
        assert decoder.feed(bytes([byte])) == []
    assert decoder.feed(frame[-1:]) == [b'{"id":"a","prompt":"x"}']


def test_oversize_header_is_rejected_before_any_payload_is_buffered() -> None:
    decoder = FrameDecoder(max_frame_bytes=16)
    assert decoder.feed(struct.pack("<I", 17)[:3]) == []
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(struct.pack("<I", 17)[3:] + b"x" * 5)
    assert info.value.wire_code == "E_PROTO_FRAME_TOO_LARGE"
    assert info.value.num_bytes == 17 and info.value.max_frame_bytes == 16
    assert decoder.num_buffered_bytes == 0
    with pytest.raises(FrameTooLarge):  # the decoder stays failed
        decoder.feed(b"more")


def test_a_4_gib_announcement_costs_nothing() -> None:
    decoder = FrameDecoder(max_frame_bytes=1024 * 1024)
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"\xff\xff\xff\xff")
    assert decoder.num_buffered_bytes == 0


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    assert FrameDecoder(max_frame_bytes=8).feed(encode_frame(b"12345678")) == [b"12345678"]


def test_zero_length_is_invalid_len() -> None:
    decoder = FrameDecoder(max_frame_bytes=16)
    assert decoder.feed(encode_frame(b"ok")) == [b"ok"]
    with pytest.raises(InvalidFrameLength) as info:
        decoder.feed(b"\x00\x00\x00\x00")
    assert info.value.wire_code == "E_PROTO_INVALID_LEN"


def test_frames_before_a_bad_header_in_the_same_chunk_are_lost_with_it() -> None:
    # The caller closes on the error; the spec sends the error and closes, so frames in the
    # same read are not delivered (they could not be answered anyway).
    decoder = FrameDecoder(max_frame_bytes=16)
    with pytest.raises(FrameTooLarge):
        decoder.feed(encode_frame(b"ok") + struct.pack("<I", 99))


def test_max_frame_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_bytes=0)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_lines_in_any_chunking(chunk: int) -> None:
    data = b"first prompt\nsecond\r\n\nthird"
    decoder = LineDecoder(max_line_bytes=64)
    lines: list[bytes] = []
    for i in range(0, len(data), chunk):
        lines += decoder.feed(data[i : i + chunk])
    assert lines == [b"first prompt", b"second", b""]
    assert decoder.finish() == [b"third"]
    assert decoder.finish() == []


def test_line_over_the_limit_is_rejected_without_buffering_it() -> None:
    decoder = LineDecoder(max_line_bytes=8)
    assert decoder.feed(b"12345678\n") == [b"12345678"]
    decoder.feed(b"1234")
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"56789")
    with pytest.raises(FrameTooLarge):
        LineDecoder(max_line_bytes=4).feed(b"123456\n")
