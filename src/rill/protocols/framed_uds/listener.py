"""The Unix-socket listener of the framed protocol: binding, accepting, stopping.

``UdsListener.open`` binds ``--socket`` with mode ``--socket-mode``, replacing a stale socket
file left by a dead server and refusing to start when a live server holds the path; each
accepted connection (counted by the connection gate, when there is one) is handed to a
connection object made by the adapter, which runs it. ``close`` stops accepting, closes the
live connections and removes the socket file. ``peer_principal`` names the process at the
other end.

Not pure (``NOT_PURE`` in ``tests/protocols/test_purity.py``): sockets and the file system.
What flows over a connection is ``adapter.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable
from typing import Protocol

from rill import auth
from rill.config import UdsConfig
from rill.connections import ConnectionGate, Lease, stream_handler
from rill.errors import ConfigError, RillError

log = logging.getLogger("rill.protocols.framed_uds")

READ_BYTES = 64 * 1024
"""Bytes asked of the socket per read (frames larger than this arrive in several reads)."""

LISTEN_BACKLOG = 128
"""Connections the kernel holds before they are accepted."""


class Peer(Protocol):
    """One accepted connection, as the listener drives it."""

    async def run(self) -> None:
        """Serve the connection until it ends."""
        ...

    async def refuse(self, exc: RillError) -> None:
        """Answer ``exc`` (the connection limit) in the protocol's format, then close."""
        ...

    async def close(self) -> None:
        """End the connection now (idempotent)."""
        ...


PeerFactory = Callable[["UdsListener", asyncio.StreamReader, asyncio.StreamWriter, "Lease | None"], Peer]
"""Makes the object serving one connection (``adapter.Connection``)."""


class UdsListener:
    """The listening socket and its live connections."""

    def __init__(self, config: UdsConfig, gate: ConnectionGate | None, connect: PeerFactory) -> None:
        self.config = config
        self.gate = gate
        self.connect = connect
        self.connections: set[Peer] = set()
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None

    async def open(self) -> None:
        """Bind and start accepting (see ``bind_unix_socket``)."""
        path = self.config.socket
        sock = bind_unix_socket(path, int(self.config.socket_mode, 8))
        self._inode = os.stat(path).st_ino
        gate = self.gate
        handler = self._on_connection if gate is None else stream_handler(gate, self._on_connection, self._refuse)
        self._server = await asyncio.start_unix_server(handler, sock=sock, limit=READ_BYTES)
        log.info("framed-uds (%s) listening on %s (mode %s)", self.config.uds_protocol, path, self.config.socket_mode)

    async def close(self) -> None:
        """Stop accepting, end every connection (and its request), remove the socket file."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            await connection.close()
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(OSError):
            if os.stat(self.config.socket).st_ino == self._inode:  # never remove a successor's socket
                os.unlink(self.config.socket)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, exc: RillError) -> None:
        await self.connect(self, reader, writer, None).refuse(exc)

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lease: Lease | None = None
    ) -> None:
        connection = self.connect(self, reader, writer, lease)
        self.connections.add(connection)
        try:
            await connection.run()
        except Exception:  # a bug here must not take the listener down
            log.exception("framed-uds connection failed")
        finally:
            self.connections.discard(connection)
            await connection.close()


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """A listening Unix stream socket at ``path`` whose file has permissions ``mode``.

    A socket file nobody listens on (a dead server's) is replaced; a live one, or a path
    that is not a socket, makes this raise ``ConfigError`` with a message saying what to do.
    The mode is set between ``bind`` and ``listen``: connecting is refused until ``listen``,
    so no client ever connects through a wider mode.
    """
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on Unix socket {path}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


def _remove_stale_socket(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(f"--socket {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        # Nobody listens: a server died without removing its socket file.
        log.info("replacing stale Unix socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot check Unix socket {path}: {exc.strerror or exc}") from exc
    finally:
        probe.close()
    raise ConfigError(
        f"another server is already listening on Unix socket {path}; stop it, "
        "or use --socket PATH (or --no-socket) for this one"
    )


def peer_principal(writer: asyncio.StreamWriter) -> str:
    """The principal of a Unix-socket peer when the server has no API keys: ``uds:uid=N``, the
    user id of the process at the other end (``SO_PEERCRED``, which the peer cannot forge), or
    ``uds:unknown`` where the OS does not say. (With keys, a request's ``api_key`` names it.)"""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)  # Linux; other systems have other calls
    if sock is None or option is None:
        return auth.principal(None, "uds:unknown")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return auth.principal(None, "uds:unknown")
    _pid, uid, _gid = struct.unpack("3i", raw)
    return auth.principal(None, f"uds:uid={uid}")
