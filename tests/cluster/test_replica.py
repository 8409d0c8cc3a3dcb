"""EngineReplica without Ray running: its outputs stream (an empty batch at once, then only the
requests that made output; a later call takes it over; requests nobody reads are cancelled),
and while a server process on the same machine has that stream open, the engine's thread
governor counts that process's CPU as its own."""

from __future__ import annotations

import logging
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from rill.cluster.replica import CONTROLS, EngineReplica, Origin, Refused, _Outbox, _unnice
from rill.engine.threads import ThreadGovernor
from rill.testing.fake_client import fake_client
from rill.testing.fake_runner import StepGate
from rill.types import GenerateRequest, RequestEvent, RequestOutput, SamplingParams


class _Stream:
    """A request's stream with one output waiting."""

    def __init__(self, request_id: str, finished: bool = False) -> None:
        self.output: RequestOutput | None = RequestOutput(request_id=request_id, finished=finished)
        self.reads = 0
        self.closed = False

    def get_nowait(self) -> RequestOutput | None:
        self.reads += 1
        output, self.output = self.output, None
        return output

    async def aclose(self) -> None:
        self.closed = True


def _governor() -> ThreadGovernor:
    return ThreadGovernor(2, {0}, lambda n: None, read_stat=lambda: "cpu0 0 0 0 0 0 0 0 0 0 0\n", own_cpu=lambda: 0.0)


def _replica(governor: ThreadGovernor | None) -> EngineReplica:
    replica = EngineReplica.__new__(EngineReplica)  # Ray Serve's constructor starts an engine: not needed here
    replica.replica = "r1"
    engine = SimpleNamespace(core=SimpleNamespace(thread_governor=governor))
    replica.client = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    replica._outboxes = {}
    replica._outbox_of = {}
    replica._linked = 0
    return replica


async def _first_batch(replica: EngineReplica, origin: Origin | None) -> Any:
    """Open ``outputs`` for front door "fd" (one request's output waiting) and read its first batch."""
    replica._outboxes["fd"] = _Outbox(streams={"a": _Stream("a")}, ready={"a"})  # type: ignore[dict-item]
    stream = replica.outputs("fd", replica="r1", origin=origin)
    assert await anext(stream) == []  # at once: the replica answers
    batch = await anext(stream)
    assert [output.request_id for output in batch] == ["a"]
    return stream


@pytest.fixture
def here() -> Origin:
    origin = Origin.here()
    if origin is None:
        pytest.skip("this platform's /proc does not name processes")
    return origin


async def test_a_server_process_on_this_machine_is_allied_while_its_stream_is_open(here: Origin) -> None:
    governor = _governor()
    replica = _replica(governor)
    stream = await _first_batch(replica, here)
    assert here.is_local() and governor.allies() == {os.getpid()}
    await stream.aclose()
    assert governor.allies() == frozenset()


@pytest.mark.parametrize(
    "elsewhere",
    [
        {"boot_id": "another machine"},
        {"started": -1},  # the same number in another pid namespace names another process
    ],
)
async def test_a_server_process_elsewhere_is_not_allied(here: Origin, elsewhere: dict[str, Any]) -> None:
    import msgspec

    origin = msgspec.structs.replace(here, **elsewhere)
    governor = _governor()
    replica = _replica(governor)
    stream = await _first_batch(replica, origin)
    assert not origin.is_local() and governor.allies() == frozenset()
    await stream.aclose()


async def test_no_origin_or_no_governor_allies_nothing(here: Origin) -> None:
    governor = _governor()
    await (await _first_batch(_replica(governor), None)).aclose()
    assert governor.allies() == frozenset()
    await (await _first_batch(_replica(None), here)).aclose()  # --num-threads given: no governor


async def test_only_requests_that_made_output_are_read_and_a_finished_one_is_let_go() -> None:
    replica = _replica(None)
    idle, done = _Stream("idle"), _Stream("done", finished=True)
    outbox = _Outbox(streams={"idle": idle, "done": done}, ready={"done"})  # type: ignore[dict-item]
    replica._outboxes["fd"] = outbox
    replica._outbox_of = {"idle": "fd", "done": "fd"}
    stream = replica.outputs("fd", replica="r1")
    assert await anext(stream) == []
    assert [o.request_id for o in await anext(stream)] == ["done"]
    assert idle.reads == 0 and done.closed and set(outbox.streams) == {"idle"}
    replica._wake([RequestOutput(request_id="idle")])  # the engine's next step made output for it
    assert [o.request_id for o in await anext(stream)] == ["idle"]
    await stream.aclose()
    assert idle.closed and replica._outboxes == {} and replica._outbox_of == {}


async def test_a_later_call_takes_the_outbox_over_and_the_first_lets_go_without_cancelling() -> None:
    replica = _replica(None)
    kept = _Stream("kept")
    outbox = _Outbox(streams={"kept": kept})  # type: ignore[dict-item]
    replica._outboxes["fd"] = outbox
    replica._outbox_of = {"kept": "fd"}
    old = replica.outputs("fd", replica="r1")
    assert await anext(old) == []
    new = replica.outputs("fd", replica="r1")
    assert await anext(new) == []
    replica._wake([RequestOutput(request_id="kept")])
    with pytest.raises(StopAsyncIteration):
        await anext(old)  # the old reader's server process is gone: it stops
    assert not kept.closed and replica._outboxes["fd"] is outbox
    assert [o.request_id for o in await anext(new)] == ["kept"]
    await new.aclose()
    assert kept.closed


async def _started(replica: EngineReplica) -> _Stream:
    """Start request "s" for front door "fd" on ``replica`` (its engine stands in: a stream)."""
    started = _Stream("s")

    async def start_choice(choice: Any) -> _Stream:
        return started

    replica.client.start_choice = start_choice  # type: ignore[attr-defined]
    answer = await replica.start(SimpleNamespace(request_id="s"), prefix_keys=[], frontend="fd")  # type: ignore[arg-type]
    assert answer.replica == "r1"  # type: ignore[union-attr]
    return started


async def test_requests_no_server_process_reads_are_cancelled() -> None:
    replica = _replica(None)
    started = await _started(replica)
    outbox = replica._outboxes["fd"]
    assert outbox.reaper is not None  # nobody reads it yet: a timer is set
    outbox.reaper.cancel()
    await replica._reap("fd", outbox)  # the timer ran out
    assert started.closed and replica._outboxes == {} and replica._outbox_of == {}


async def test_an_outbox_read_in_time_is_not_reaped() -> None:
    replica = _replica(None)
    started = await _started(replica)
    outbox = replica._outboxes["fd"]
    reaper = outbox.reaper
    stream = replica.outputs("fd", replica="r1")
    assert await anext(stream) == []
    assert outbox.reaper is None and reaper is not None and reaper.cancelled()
    await replica._reap("fd", outbox)  # a timer that fired anyway changes nothing
    assert not started.closed and replica._outboxes["fd"] is outbox
    await stream.aclose()


_SETPRIORITY = os.setpriority
"""The real ``os.setpriority``, for making a thread nicer while a test refuses the replica's call."""


def _in_a_thread_at_niceness_5(work: Any) -> int:
    """Run ``work`` in a new thread made nicer (5), as Ray starts its workers; return that
    thread's niceness after it (on Linux niceness is per thread)."""
    result: list[int] = []

    def run() -> None:
        _SETPRIORITY(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 5)
        work()
        result.append(os.getpriority(os.PRIO_PROCESS, 0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="only a privileged process may lower its niceness")
async def test_every_control_reaches_the_engine() -> None:
    """Each of ``CONTROLS`` applied on a request the replica's engine runs, in order: pause,
    resume, regenerate (the engine restarts it), abort (it ends cancelled)."""
    async with fake_client() as client:
        replica = _replica(None)
        replica.client = client
        gate = client.engine.runner.gate = StepGate()
        stream = await client.generate(
            GenerateRequest(prompt="hello", sampling=SamplingParams(max_tokens=64, ignore_eos=True))
        )
        gate.allow(2)
        events: list[RequestEvent] = []
        async for output in stream:
            if output.usage.completion_tokens == 2:
                break
        for op in ("pause", "resume", "regenerate", "abort"):
            assert op in CONTROLS
            assert await replica.control(op, stream.request_id, replica="r1") is None, op
        gate.set()
        last = None
        async with stream:
            async for output in stream:
                events += output.events
                last = output
        assert last is not None and last.finish_reason == "cancelled", last
        assert RequestEvent.REGENERATING in events, events
        refused = await replica.control("regenerate", stream.request_id, replica="r1")
        assert isinstance(refused, Refused)  # it ended: RequestNotFound, as a value


def test_a_replica_started_nicer_brings_its_thread_back_to_0() -> None:
    assert _in_a_thread_at_niceness_5(_unnice) == 0


def test_a_replica_that_may_not_lower_its_niceness_says_how_to_start_the_cluster(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    start = os.getpriority(os.PRIO_PROCESS, 0)
    with caplog.at_level(logging.WARNING, logger="rill.cluster"):
        assert _in_a_thread_at_niceness_5(_unnice) == start + 5
    assert "RAY_worker_niceness=0" in caplog.text
