"""A replica's outputs over a Unix socket, to a server process on the same machine.

Ray carries a replica's outputs stream through several threads on each side (the replica's
user-code loop, Serve's loop, Ray's gRPC threads, then the server process's), each a wake-up
per engine step on a machine whose cores the engine keeps busy, and each wake-up preempts an
engine thread. A server process on the replica's machine takes the batches from a socket
instead: one write, one read. Ray's outputs stream stays open beside it, carrying nothing: its
end still ends the requests, and Ray still places, checks and restarts the replica. Measured
on 2 cores at 32 streams: the front door's CPU 0.064 of a core against 0.075, its wake-ups
about 370 a second against 600 (``benchmarks/README.md``).

The exchange:

1. The server process listens on an abstract Unix socket (``Listener``; Linux only, no file
   left behind) and names it in the ``Origin`` it sends with each ``outputs`` call, together
   with a fresh secret for that call (``Listener.expect``).
2. A replica on the same machine (``Origin.is_local``) connects and sends the secret
   (``connect``). The server process hands a connection whose secret it gave out, from a peer
   of its own user, to that call's reader and answers one byte; any other it closes unread.
3. With that byte in, the replica says so as its stream's first item (``Linked``) and writes
   every batch to the socket (``write_batch``); without it (it could not connect, or was
   turned away), its first item is an empty batch and its batches go over Ray as before.
   Batches are framed (4-byte length, pickle): only a peer that received the secret over Ray,
   and runs as the same user, gets as far as being read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import secrets
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgspec

from rill.types import RequestOutput

log = logging.getLogger("rill.cluster")

SECRET_BYTES = 32
"""Length of a call's secret on the wire (hex of 16 random bytes)."""

HELLO_TIMEOUT_S = 10.0
"""Longest wait for a connecting replica's secret, and for its connection to open."""

MAX_FRAME_BYTES = 256 * 2**20
"""Largest batch frame a server process reads (a step's outputs are kilobytes)."""

_HEADER = struct.Struct(">I")

ACK = b"\x01"
"""The server process's answer to a connection it took."""


class Linked(msgspec.Struct, frozen=True):
    """A replica's first outputs item when its batches come over the socket it connected."""


class Listener:
    """The server process's end: an abstract Unix socket that replicas connect to.

    Each connection must first send a secret handed out by ``expect``; the connection is then
    the answer to that ``expect``. Any other connection is closed unread.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._expected: dict[str, asyncio.Future[Link]] = {}
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None

    @classmethod
    async def start(cls) -> Listener | None:
        """Listen on a fresh abstract address; None where the platform has none (not Linux)."""
        if not sys.platform.startswith("linux"):
            return None
        listener = cls("\0rill-outputs-" + secrets.token_hex(8))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Bound here, not by the loop: uvloop's own Unix paths stop at the address's NUL.
            sock.bind(listener.address)
            sock.setblocking(False)
            listener._server = await asyncio.start_unix_server(listener._accept, sock=sock)
        except OSError as exc:
            sock.close()
            log.info("no local outputs socket (%s): outputs come over Ray", exc)
            return None
        return listener

    def expect(self) -> tuple[str, asyncio.Future[Link]]:
        """A new secret, and the future of the connection that will present it."""
        secret = secrets.token_hex(SECRET_BYTES // 2)
        future: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        self._expected[secret] = future
        return secret, future

    def release(self, secret: str, future: asyncio.Future[Link]) -> None:
        """Let go of ``expect``'s secret and future: stop waiting, and close the connection it
        brought, if any."""
        if self._expected.pop(secret, None) is not None and not future.done():
            future.cancel()
        if future.done() and not future.cancelled():
            writer = future.result().writer
            self._open.discard(writer)
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            if not _same_user(writer):
                raise ConnectionError("a connection from another user")
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                secret = (await reader.readexactly(SECRET_BYTES)).decode("ascii", "replace")
            future = self._expected.pop(secret, None)
            if future is None or future.done():
                raise ConnectionError("a connection with no secret of this process")
            writer.write(ACK)  # the replica sends over this socket only once it has read this
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            self._open.discard(writer)
            writer.close()
            return
        future.set_result(Link(reader, writer))  # the reader's now, which ``release``s it

    async def close(self) -> None:
        """Stop listening and close every connection."""
        for future in self._expected.values():
            future.cancel()
        self._expected.clear()
        for writer in list(self._open):
            writer.close()
        self._open.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@dataclass(frozen=True)
class Link:
    """One replica's connection, as its server process reads it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


def _same_user(writer: asyncio.StreamWriter) -> bool:
    """Whether the connecting process runs as this process's user (``SO_PEERCRED``)."""
    sock = writer.get_extra_info("socket")
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    except (OSError, AttributeError):
        return False
    _, uid, _ = struct.unpack("iII", credentials)  # pid, uid, gid
    return bool(uid == os.getuid())


async def read_batch(reader: asyncio.StreamReader) -> list[RequestOutput]:
    """The next batch a replica wrote; raises ``asyncio.IncompleteReadError`` at the end."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"outputs frame of {size} bytes")
    batch: list[RequestOutput] = pickle.loads(await reader.readexactly(size))
    return batch


async def connect(address: str, secret: str) -> asyncio.StreamWriter | None:
    """The replica's end: connect to a server process's ``Listener``, present ``secret`` and
    wait for its answer; None when any of that fails (the batches then go over Ray)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    writer: asyncio.StreamWriter | None = None
    try:
        # Connected here, not by the loop (as ``Listener.start`` binds). A Unix socket's
        # connect completes at once or, the listener's backlog full, fails (BlockingIOError).
        sock.setblocking(False)
        sock.connect(address)
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            writer.write(secret.encode("ascii"))
            await writer.drain()
            if await reader.read(len(ACK)) != ACK:
                raise ConnectionError("the server process turned the connection away")
    except BaseException as exc:
        if writer is not None:
            writer.close()
        else:
            sock.close()
        if not isinstance(exc, OSError | TimeoutError | UnicodeEncodeError):
            raise
        log.info("no local outputs socket to the server process (%s): outputs go over Ray", exc)
        return None
    return writer


async def write_batch(writer: asyncio.StreamWriter, batch: Any) -> None:
    """Write one batch as a frame; raises ``ConnectionError`` once the server process is gone."""
    payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    writer.writelines((_HEADER.pack(len(payload)), payload))  # no copy of the payload
    await writer.drain()
