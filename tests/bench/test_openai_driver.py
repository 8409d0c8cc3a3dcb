"""The OpenAI driver's SSE reading: line ends, pieces split anywhere, usage, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rill.bench.drivers import BenchError
from rill.bench.drivers.openai import Driver

EVENT = b'data: {"choices":[{"text":"a"}]}'
EMPTY = b'data: {"choices":[{"text":""}]}'
USAGE = b'data: {"choices":[],"usage":{"completion_tokens":7}}'


class _Timer:
    def __init__(self) -> None:
        self.count = 0

    def tokens(self) -> None:
        self.count += 1


class _Response:
    """What ``_read_events`` reads of an aiohttp response: ``content.iter_any()``."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.content = self
        self._pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece


def _read(pieces: list[bytes]) -> tuple[int, dict | None]:
    timer = _Timer()
    usage = asyncio.run(Driver._read_events(_Response(pieces), timer))  # type: ignore[arg-type]
    return timer.count, usage


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


@pytest.mark.parametrize(
    "pieces",
    [
        [EVENT + b"\n\n" + EMPTY + b"\n\n" + EVENT + b"\n\n" + USAGE + b"\n\ndata: [DONE]\n\n"],
        _bytewise(
            EVENT + b"\r\n\r\n" + EMPTY + b"\r\n\r\n" + EVENT + b"\r\n\r\n" + USAGE + b"\r\n\r\ndata: [DONE]\r\n\r\n"
        ),
        [EVENT + b"\r", b"\n\r\n" + EMPTY + b"\r\n\r\n" + EVENT + b"\r\n\r\n" + USAGE + b"\r", b"\n"],  # CRLF split
        [EVENT + b"\r\r: keep-alive\r" + EVENT + b"\r\r" + USAGE + b"\r"],  # bare CR, a comment line
        [EVENT + b"\n\n" + EVENT + b"\n\n" + USAGE],  # the stream ends without a last line end
    ],
)
def test_tokens_and_usage_whatever_the_line_ends_and_pieces(pieces: list[bytes]) -> None:
    assert _read(pieces) == (2, {"completion_tokens": 7})


def test_nothing_after_done_is_read() -> None:
    assert _read([EVENT + b"\n\ndata: [DONE]\n\n" + EVENT + b"\n\n"]) == (1, None)


def test_an_error_event_is_a_typed_failure() -> None:
    with pytest.raises(BenchError) as caught:
        _read([EVENT + b'\n\ndata: {"error":{"code":"engine_dead","message":"gone"}}\n\n'])
    assert (caught.value.kind, caught.value.message) == ("engine_dead", "gone")
