"""EngineReplica without Ray running: while a server process on the same machine has its
outputs stream open, the engine's thread governor counts that process's CPU as its own."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from rill.cluster.replica import EngineReplica, Origin, _Outbox
from rill.engine.threads import ThreadGovernor
from rill.types import RequestOutput


class _Stream:
    """A request's stream with one output waiting."""

    def __init__(self, request_id: str) -> None:
        self.output: RequestOutput | None = RequestOutput(request_id=request_id)

    def get_nowait(self) -> RequestOutput | None:
        output, self.output = self.output, None
        return output

    async def aclose(self) -> None:
        pass


def _governor() -> ThreadGovernor:
    return ThreadGovernor(2, {0}, lambda n: None, read_stat=lambda: "cpu0 0 0 0 0 0 0 0 0 0 0\n", own_cpu=lambda: 0.0)


def _replica(governor: ThreadGovernor | None) -> EngineReplica:
    replica = EngineReplica.__new__(EngineReplica)  # Ray Serve's constructor starts an engine: not needed here
    replica.replica = "r1"
    engine = SimpleNamespace(core=SimpleNamespace(thread_governor=governor))
    replica.client = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    replica._outboxes = {}
    replica._outbox_of = {}
    return replica


async def _first_batch(replica: EngineReplica, origin: Origin | None) -> Any:
    """Open ``outputs`` for front door "fd" (one request's output waiting) and read its first batch."""
    replica._outboxes["fd"] = _Outbox(streams={"a": _Stream("a")})  # type: ignore[dict-item]
    stream = replica.outputs("fd", replica="r1", origin=origin)
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
