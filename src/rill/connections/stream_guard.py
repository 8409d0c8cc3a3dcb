"""Stream servers (``asyncio.start_server`` / ``start_unix_server``) under the gate."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from rill.connections.gate import ConnectionGate, Lease, peer_host
from rill.errors import TooManyConnections

StreamHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LeasedHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Lease | None"], Awaitable[None]]
Refuser = Callable[[asyncio.StreamReader, asyncio.StreamWriter, TooManyConnections], Awaitable[None]]


def stream_handler(gate: ConnectionGate, handler: LeasedHandler, refuse: Refuser) -> StreamHandler:
    """``handler`` for ``asyncio.start_server``/``start_unix_server`` under a lease of ``gate``.

    ``handler`` gets the connection's lease, to mark it idle while the peer has sent
    nothing (``Lease.set_idle``, with ``Lease.evict`` set). Past the limits ``refuse`` runs
    instead (it should answer in the protocol's own error format); the writer is closed
    after it either way.
    """

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            lease = gate.open(peer_host(writer.get_extra_info("peername")))
        except TooManyConnections as exc:
            try:
                await refuse(reader, writer, exc)
            finally:
                writer.close()
            return
        try:
            await handler(reader, writer, lease)
        finally:
            lease.release()

    return guarded
