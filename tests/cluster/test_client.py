"""RayClient's bookkeeping against a fake deployment handle (no Ray running): a request that
ends before its start is answered leaves nothing behind, controls made before that answer
follow it in order (or fail with a refused start), a replica that died after answering
ends its request at once, an outputs stream that never opens ends its requests with
``ReplicaLost``, and a replica that leaves keeps its share of the summed counters."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rill.cluster import client as client_mod
from rill.cluster import launch, registry
from rill.cluster.client import RayClient
from rill.cluster.replica import Accepted, Refused
from rill.config import ClusterConfig, EngineConfig
from rill.errors import QueueFull, ReplicaLost, RequestNotFound
from rill.frontend.policy import SubmissionPolicy
from rill.testing.fake_client import fake_engine
from rill.types import EngineStats, GenerateRequest, RequestOutput, SamplingParams
from tests.helpers import wait_until


class _Call:
    """What a handle's ``.remote`` returns: awaitable, cancellable."""

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def __await__(self) -> Iterator[Any]:
        return self.future.__await__()

    def cancel(self) -> None:
        self.future.cancel()


class _Outputs:
    """A replica's outputs stream: the batches the test puts, ended by None."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[RequestOutput] | None] = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[list[RequestOutput]]:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        batch = await self.queue.get()
        if batch is None:
            raise StopAsyncIteration
        return batch

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """The deployment handle: each ``start`` answers with the next future of ``answers``."""

    def __init__(self) -> None:
        self.answers: list[asyncio.Future[Any]] = []
        self.outputs_of: dict[str, _Outputs] = {}
        self.stats_of: dict[str, EngineStats] = {}
        self.controls: list[tuple[str, str, str]] = []  # (op, request id, replica) as sent
        self.start = SimpleNamespace(remote=lambda choice, **kw: _Call(self.answers.pop(0)))
        self.control = SimpleNamespace(remote=self._control)
        self.stats = SimpleNamespace(remote=lambda *, replica: _Call(_done(self.stats_of[replica])))

    def _control(self, op: str, request_id: str, *, replica: str) -> _Call:
        self.controls.append((op, request_id, replica))
        return _Call(_done(None))

    def options(self, **_: Any) -> Any:
        def outputs(frontend: str, *, replica: str, origin: Any = None, secret: Any = None) -> _Outputs:
            return self.outputs_of.setdefault(replica, _Outputs())

        return SimpleNamespace(outputs=SimpleNamespace(remote=outputs))


def _done(value: Any) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


@contextlib.asynccontextmanager
async def deployed(handle: _Handle) -> AsyncIterator[RayClient]:
    """A ``RayClient`` whose deployment is ``handle``, with one live replica "r1"."""
    config = EngineConfig(model="fake-model")
    client = RayClient(config, ClusterConfig(replicas=2), asyncio.get_running_loop(), SubmissionPolicy(engine=config))
    client.engine = fake_engine(config)
    client._deployed = SimpleNamespace(handle=handle, close=lambda: None)  # type: ignore[assignment]
    client._ready.set()
    registry.publish(launch.DEPLOYMENT, frozenset({"r1"}))
    try:
        yield client
    finally:
        await client.shutdown()
        registry.publish(launch.DEPLOYMENT, frozenset())


@pytest.fixture
async def ray_client() -> AsyncIterator[tuple[RayClient, _Handle]]:
    handle = _Handle()
    async with deployed(handle) as client:
        yield client, handle


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt="hello", sampling=SamplingParams(max_tokens=4))


async def test_a_request_that_ends_before_its_start_is_answered_leaves_nothing_behind(
    ray_client: tuple[RayClient, _Handle],
) -> None:
    client, handle = ray_client
    b_answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    handle.answers = [_done(Accepted("r1")), b_answer]
    outputs = handle.outputs_of["r1"] = _Outputs()
    outputs.queue.put_nowait([])  # the replica's opening batch
    first = await client.generate(_request("a"))
    second = asyncio.ensure_future(client.generate(_request("b")))
    await _until(lambda: not handle.answers)  # b's start is sent
    # b's final output comes in on the outputs stream before its start's answer does.
    outputs.queue.put_nowait([RequestOutput(request_id="b", finished=True, finish_reason="length")])
    await _until(lambda: "b" not in client._streams)
    b_answer.set_result(Accepted("r1"))
    stream = await second
    assert (await anext(stream)).finish_reason == "length"
    assert set(client._lanes) == {"a"} and client._on_replica["r1"] == {"a"}
    assert registry.in_flight(launch.DEPLOYMENT) == {"r1": 1}
    await first.aclose()


async def test_controls_made_before_the_start_is_answered_follow_it_in_order(
    ray_client: tuple[RayClient, _Handle],
) -> None:
    # Outputs and answers travel apart: a session may act on a request whose replica has not
    # answered yet (a cancel on the Unix socket, a disconnect). Those controls once found no
    # replica to go to and were dropped.
    client, handle = ray_client
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    handle.answers = [answer]
    handle.outputs_of["r1"] = _Outputs()
    handle.outputs_of["r1"].queue.put_nowait([])  # the replica's opening batch
    starting = asyncio.ensure_future(client.generate(_request("a")))
    await _until(lambda: not handle.answers)  # a's start is sent, its stream open here
    client.pause("a")
    client.resume("a")
    client.abort("a")
    for _ in range(5):
        await asyncio.sleep(0)
    assert handle.controls == []  # no replica known yet: nothing goes anywhere
    answer.set_result(Accepted("r1"))
    stream = await starting
    await wait_until(lambda: len(handle.controls) == 3, attempts=1000, interval_s=0.005)
    assert handle.controls == [("pause", "a", "r1"), ("resume", "a", "r1"), ("abort", "a", "r1")]
    await stream.aclose()


async def test_controls_waiting_for_a_refused_start_fail_with_it(ray_client: tuple[RayClient, _Handle]) -> None:
    client, handle = ray_client
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    handle.answers = [answer]
    starting = asyncio.ensure_future(client.generate(_request("a")))
    await _until(lambda: not handle.answers)
    waiting = client._send("a", lambda replica: handle.control.remote("pause", "a", replica=replica))
    answer.set_result(Refused(QueueFull("the replica's queue is full")))
    with pytest.raises(QueueFull):
        await starting
    with pytest.raises(RequestNotFound):
        await waiting
    assert handle.controls == [] and client._lanes == {}


async def _until(condition: Any) -> None:
    """Let the loop run until ``condition()`` holds (a thread may tokenize meanwhile)."""
    while not condition():
        await asyncio.sleep(0.001)


async def test_a_replica_that_died_after_answering_ends_its_request_at_once(
    ray_client: tuple[RayClient, _Handle],
) -> None:
    client, handle = ray_client
    handle.answers = [_done(Accepted("r2"))]  # r2 is not among the live replicas
    stream = await client.generate(_request("a"))
    output = await anext(stream)
    assert output.finished and isinstance(output.error, ReplicaLost)
    assert "r2" not in handle.outputs_of and client._lanes == {} and registry.in_flight(launch.DEPLOYMENT) == {}


async def test_an_outputs_stream_that_never_opens_ends_its_requests(
    ray_client: tuple[RayClient, _Handle], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, handle = ray_client
    monkeypatch.setattr(client_mod, "CONTROL_TIMEOUT_S", 0.05)
    handle.answers = [_done(Accepted("r1"))]
    stream = await client.generate(_request("a"))  # r1's stream never yields its opening batch
    output = await anext(stream)
    assert output.finished and isinstance(output.error, ReplicaLost)
    assert handle.outputs_of["r1"].cancelled and client._lanes == {}


async def test_a_replica_that_leaves_keeps_its_share_of_the_counters(ray_client: tuple[RayClient, _Handle]) -> None:
    client, handle = ray_client
    registry.publish(launch.DEPLOYMENT, frozenset({"r1", "r2"}))
    handle.stats_of = {
        "r1": EngineStats(generation_tokens_total=10, num_running=1, requests_finished_total={"stop": 2}),
        "r2": EngineStats(generation_tokens_total=5, num_running=3, requests_finished_total={"stop": 1}),
    }
    await client._read_stats()
    assert client.stats().generation_tokens_total == 15 and client.stats().num_running == 4
    registry.publish(launch.DEPLOYMENT, frozenset({"r1"}))  # r2 died
    handle.stats_of["r1"] = EngineStats(generation_tokens_total=12, num_running=1, requests_finished_total={"stop": 3})
    await client._read_stats()
    total = client.stats()
    assert total.generation_tokens_total == 17 and total.requests_finished_total == {"stop": 4}
    assert total.num_running == 1  # a gauge: only the live replica's
