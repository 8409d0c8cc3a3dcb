"""A replica's outputs over a Unix socket to a server process on its machine
(``rill.cluster.link``), without Ray running: a real ``EngineReplica.outputs`` and a real
``RayClient`` reader meet on a real abstract socket; the Ray stream between them is a stand-in
that runs the replica's generator in a task of its own, as Ray does. The batches come over the
socket while it is there; a replica that cannot connect sends them over Ray; a replica that
goes away ends its requests with ``ReplicaLost``; what the socket still carries after the Ray
stream ended is read; shutting down with a link open ends its requests and closes the socket; a
connection without the call's secret is closed unread, and a replica turned away sends over
Ray; the socket works under uvloop too."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from rill.cluster import link
from rill.cluster.client import RayClient
from rill.cluster.replica import Accepted, EngineReplica, Origin, _Outbox
from rill.errors import EngineDead, ReplicaLost
from rill.types import RequestOutput
from tests.cluster.test_client import _done, _Handle, _request, deployed
from tests.cluster.test_replica import _replica, _Stream

pytestmark = pytest.mark.skipif(Origin.here() is None, reason="this platform's /proc does not name processes")


class _RayStream:
    """What Ray makes of the replica's ``outputs``: the generator runs in a task of its own on
    the replica's side, its items queued for the server process; ``die`` ends it as a replica's
    death does (its side of the socket closes, the call fails); ``ended`` is set once the server
    process has read its end."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self.items = items
        self.sent: list[Any] = []  # every item that crossed over "Ray"
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for item in self.items:
                self.sent.append(item)
                self.queue.put_nowait(item)
        finally:
            self.queue.put_nowait(StopAsyncIteration())

    def __aiter__(self) -> _RayStream:
        return self

    async def __anext__(self) -> Any:
        item = await self.queue.get()
        if isinstance(item, StopAsyncIteration):
            self.ended.set()
        if isinstance(item, BaseException):
            raise item
        return item

    async def die(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.queue.put_nowait(ConnectionError("the actor died"))

    def cancel(self) -> None:
        self.task.cancel()


class _LinkHandle(_Handle):
    """A handle whose ``outputs`` calls run ``outputs`` (a replica's real generator, or a
    test's script of one) behind a ``_RayStream``."""

    def __init__(self, outputs: Callable[..., AsyncIterator[Any]]) -> None:
        super().__init__()
        self._outputs = outputs
        self.streams: list[_RayStream] = []

    def options(self, **_: Any) -> Any:
        def outputs(frontend: str, *, replica: str, origin: Any = None, secret: Any = None) -> _RayStream:
            stream = _RayStream(self._outputs(frontend, replica=replica, origin=origin, secret=secret))
            self.streams.append(stream)
            return stream

        return SimpleNamespace(outputs=SimpleNamespace(remote=outputs))


@contextlib.asynccontextmanager
async def _listening(handle: _LinkHandle) -> AsyncIterator[RayClient]:
    """``deployed(handle)`` with the client's listener started and named in its ``Origin``, as
    ``_connect`` does."""
    async with deployed(handle) as client:
        client._listener = await link.Listener.start()
        assert client._listener is not None and client._origin is not None
        client._origin = msgspec.structs.replace(client._origin, outputs_address=client._listener.address)
        yield client


@pytest.fixture
async def linked() -> AsyncIterator[tuple[RayClient, _LinkHandle, EngineReplica]]:
    """A ``RayClient`` with its listener and a handle to one real replica "r1" on this machine."""
    replica = _replica(None)
    handle = _LinkHandle(replica.outputs)
    async with _listening(handle) as client:
        yield client, handle, replica


def _running_on(replica: EngineReplica, client: RayClient, *streams: _Stream, ready: set[str]) -> None:
    """Requests the client started, running on ``replica`` (outputs waiting for those ``ready``)."""
    replica._outboxes[client._frontend] = _Outbox(streams={s.output.request_id: s for s in streams}, ready=ready)  # type: ignore[union-attr,misc]
    replica._outbox_of.update({s.output.request_id: client._frontend for s in streams})  # type: ignore[union-attr]


async def test_a_replica_on_this_machine_hands_its_outputs_over_the_socket(
    linked: tuple[RayClient, _LinkHandle, EngineReplica],
) -> None:
    client, handle, replica = linked
    _running_on(replica, client, _Stream("a", finished=True), _Stream("b"), ready={"a"})
    handle.answers = [_done(Accepted("r1")), _done(Accepted("r1"))]
    a = await client.generate(_request("a"))
    b = await client.generate(_request("b"))
    assert (await anext(a)).finished
    [ray_stream] = handle.streams
    assert ray_stream.sent == [link.Linked()]  # nothing else crossed over Ray
    assert client.linked_replicas() == {"r1"} and replica._linked == 1
    await ray_stream.die()  # its socket closes with it
    output = await anext(b)
    assert output.finished and isinstance(output.error, ReplicaLost)
    assert client.linked_replicas() == frozenset() and replica._linked == 0


async def test_a_replica_that_cannot_connect_sends_its_outputs_over_ray(
    linked: tuple[RayClient, _LinkHandle, EngineReplica],
) -> None:
    client, handle, replica = linked
    assert client._origin is not None
    client._origin = msgspec.structs.replace(client._origin, outputs_address="\0rill-outputs-nobody-listens-here")
    _running_on(replica, client, _Stream("a", finished=True), ready={"a"})
    handle.answers = [_done(Accepted("r1"))]
    a = await client.generate(_request("a"))
    assert (await anext(a)).finished
    [ray_stream] = handle.streams
    assert ray_stream.sent[0] == [] and [o.request_id for o in ray_stream.sent[1]] == ["a"]
    assert client.linked_replicas() == frozenset() and replica._linked == 0


class _ScriptedHandle(_LinkHandle):
    """A handle whose ``outputs`` call connects to the server process's socket as a replica on
    this machine does (``link.connect``), answers ``Linked`` and then leaves the rest to the
    test: ``socket`` is the replica's end, ``end_ray`` ends the Ray stream."""

    def __init__(self) -> None:
        super().__init__(self._script)
        self.socket: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()
        self._end = asyncio.Event()

    def end_ray(self) -> None:
        self._end.set()

    async def _script(self, frontend: str, *, replica: str, origin: Origin, secret: str) -> AsyncIterator[Any]:
        writer = await link.connect(origin.outputs_address, secret)  # type: ignore[arg-type]
        assert writer is not None
        self.socket.set_result(writer)
        yield link.Linked()
        await self._end.wait()


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[RayClient, _ScriptedHandle]]:
    """A ``RayClient`` with its listener and a scripted replica "r1" on this machine."""
    handle = _ScriptedHandle()
    async with _listening(handle) as client:
        yield client, handle


async def test_what_the_socket_still_carries_after_the_ray_stream_ended_is_read(
    scripted: tuple[RayClient, _ScriptedHandle],
) -> None:
    # A replica letting go of a server process ends its Ray call and closes its socket; the
    # call's end can come first, with the last batches still in the socket.
    client, handle = scripted
    handle.answers = [_done(Accepted("r1")), _done(Accepted("r1"))]
    a = await client.generate(_request("a"))
    b = await client.generate(_request("b"))
    async with asyncio.timeout(10):
        writer = await handle.socket
        [ray_stream] = handle.streams
        handle.end_ray()
        await ray_stream.ended.wait()
    await link.write_batch(
        writer, [RequestOutput(request_id="a", token_ids=[7], finished=True, finish_reason="length")]
    )
    writer.close()
    output = await anext(a)
    assert output.finished and output.error is None and output.token_ids == [7]
    output = await anext(b)  # nothing came for it: its replica is gone for it
    assert output.finished and isinstance(output.error, ReplicaLost)
    assert client.linked_replicas() == frozenset()


async def test_shutting_down_with_a_link_open_ends_its_requests_and_closes_the_socket(
    scripted: tuple[RayClient, _ScriptedHandle],
) -> None:
    client, handle = scripted
    handle.answers = [_done(Accepted("r1"))]
    a = await client.generate(_request("a"))
    async with asyncio.timeout(10):
        writer = await handle.socket
        while client.linked_replicas() != {"r1"}:  # the reader takes the link after the opening item
            await asyncio.sleep(0)
        await client.shutdown()
    output = await anext(a)
    assert output.finished and isinstance(output.error, EngineDead)
    [ray_stream] = handle.streams
    async with asyncio.timeout(10):
        await asyncio.gather(ray_stream.task, return_exceptions=True)
    assert ray_stream.task.cancelled()  # the Ray call was let go
    with pytest.raises(ConnectionError):  # and the server process's end of the socket closed
        await link.write_batch(writer, [])
    writer.close()


def test_the_socket_works_under_uvloop() -> None:
    # Ray Serve runs a replica's code on uvloop where it is installed (as uvicorn runs the
    # server's), whose own Unix paths stop at an abstract address's NUL.
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(test_a_connection_without_the_calls_secret_is_closed_unread())
    finally:
        loop.close()


async def test_a_connection_without_the_calls_secret_is_closed_unread() -> None:
    listener = await link.Listener.start()
    assert listener is not None
    try:
        secret, expected = listener.expect()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(listener.address)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        writer.write(b"0" * link.SECRET_BYTES)
        await writer.drain()
        assert await reader.read() == b""  # closed, unanswered
        writer.close()
        # A replica turned away sends over Ray: it is not left waiting for a reader.
        assert await link.connect(listener.address, "f" * link.SECRET_BYTES) is None
        assert not expected.done()
        replica_side = await link.connect(listener.address, secret)
        assert replica_side is not None
        async with asyncio.timeout(10):
            connection = await expected
        await link.write_batch(replica_side, ["one batch"])
        assert await link.read_batch(connection.reader) == ["one batch"]
        replica_side.close()
        listener.release(secret, expected)
    finally:
        await listener.close()
