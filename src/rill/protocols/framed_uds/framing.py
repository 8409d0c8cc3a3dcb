"""Byte-level framing of the Unix-socket protocol (sans-I/O).

Framed mode: each frame is a ``uint32`` little-endian payload length followed by that many
bytes of UTF-8 JSON (``shared/specs/framed-uds.md`` § Transport & Framing). Newline mode
(``--uds-protocol newline``, a debugging aid): one prompt per line.

Both decoders take bytes in any chunking — a whole burst of frames or one byte at a time —
and return complete payloads. Limits are enforced *before* payload bytes are kept: the frame
decoder checks the 4-byte header against ``max_frame_bytes`` as soon as the header is
complete, so a client announcing a 4 GiB frame costs us four bytes of memory.

Pure: imports only the standard library and ``rill.errors``; no sockets, no ``await``.
"""

from __future__ import annotations

import struct

from rill.errors import RillError

HEADER = struct.Struct("<I")
"""The frame header: payload length, unsigned 32-bit little-endian."""


class FramingError(RillError):
    """The byte stream broke a framing rule; the connection cannot continue.

    Attributes:
        wire_code: the ``E_PROTO_*`` code the codec's error table sends for it.
    """

    code = "framing_error"
    wire_code = "E_PROTO_INVALID_LEN"


class FrameTooLarge(FramingError):
    """A frame header (or a newline-mode line) announced more bytes than ``max_frame_bytes``.

    Attributes:
        num_unread_bytes: payload bytes of the refused frame still to come after the bytes fed
            so far (0 in newline mode). A server that reads and drops them before closing lets
            a client still writing the frame finish and read the error instead of a reset.
    """

    code = "frame_too_large"
    wire_code = "E_PROTO_FRAME_TOO_LARGE"

    def __init__(self, num_bytes: int, max_frame_bytes: int, num_unread_bytes: int = 0) -> None:
        super().__init__(f"frame of {num_bytes} bytes exceeds the limit of {max_frame_bytes} bytes")
        self.num_bytes = num_bytes
        self.max_frame_bytes = max_frame_bytes
        self.num_unread_bytes = num_unread_bytes


class InvalidFrameLength(FramingError):
    """A frame header announced a zero-length payload."""

    code = "invalid_frame_length"
    wire_code = "E_PROTO_INVALID_LEN"


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length header (the server's frames are never empty)."""
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder of ``uint32-LE length | payload`` frames.

    Call ``feed`` with whatever bytes arrived; it returns the payloads completed by them, in
    order. After it raised, the decoder is *failed*: every further ``feed`` raises the same
    error (the connection must be closed; nothing after a framing error can be trusted).
    """

    def __init__(self, max_frame_bytes: int) -> None:
        if max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be >= 1")
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._need_bytes: int | None = None  # payload length once the header is known
        self._error: FramingError | None = None

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes held for the frame in progress (never more than 4 + ``max_frame_bytes``)."""
        return len(self._buffer)

    @property
    def is_idle(self) -> bool:
        """True when no partial frame is buffered (a clean point to end the stream)."""
        return not self._buffer and self._need_bytes is None

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; return every payload it completes.

        Raises:
            FrameTooLarge: a header announced more than ``max_frame_bytes``; checked as soon
                as the 4 header bytes are in, before any payload byte is kept.
            InvalidFrameLength: a header announced length 0.
        """
        if self._error is not None:
            raise self._error
        frames: list[bytes] = []
        view = memoryview(data)
        while view:
            if self._need_bytes is None:
                take = min(HEADER.size - len(self._buffer), len(view))
                self._buffer += view[:take]
                view = view[take:]
                if len(self._buffer) < HEADER.size:
                    break
                (length,) = HEADER.unpack(self._buffer)
                self._buffer.clear()
                self._check_length(length, num_bytes_after_header=len(view))
                self._need_bytes = length
            take = min(self._need_bytes - len(self._buffer), len(view))
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) == self._need_bytes:
                frames.append(bytes(self._buffer))
                self._buffer.clear()
                self._need_bytes = None
        return frames

    def _check_length(self, length: int, num_bytes_after_header: int) -> None:
        if length == 0:
            self._error = InvalidFrameLength("frame length is 0; a frame carries a non-empty JSON object")
        elif length > self.max_frame_bytes:
            self._error = FrameTooLarge(length, self.max_frame_bytes, max(0, length - num_bytes_after_header))
        if self._error is not None:
            raise self._error


class LineDecoder:
    """Incremental splitter of newline-mode input into lines (``\\n``; a trailing ``\\r`` is dropped).

    Lines longer than ``max_line_bytes`` raise ``FrameTooLarge`` as soon as the excess is
    seen, without buffering it. ``finish`` returns an unterminated last line at end of input.
    """

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; return the complete lines (without their terminator)."""
        lines: list[bytes] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                self._check(len(self._buffer) + len(data) - start)
                self._buffer += data[start:]
                return lines
            self._check(len(self._buffer) + end - start)
            line = bytes(self._buffer) + data[start:end]
            self._buffer.clear()
            lines.append(line[:-1] if line.endswith(b"\r") else line)
            start = end + 1

    def finish(self) -> list[bytes]:
        """End of input: the unterminated last line, if any."""
        line, self._buffer = bytes(self._buffer), bytearray()
        line = line[:-1] if line.endswith(b"\r") else line
        return [line] if line else []

    def _check(self, num_bytes: int) -> None:
        if num_bytes > self.max_line_bytes:
            raise FrameTooLarge(num_bytes, self.max_line_bytes)
