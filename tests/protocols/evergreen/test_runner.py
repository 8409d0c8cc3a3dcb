"""The runner (one Evergreen session on the shared driver) without a wire, against the
in-process engine client over a ``FakeRunner``: what it queues for the transports, what it
counts as a rejection, and what it aborts when the session fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rill.errors import InvalidRequest
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import InvalidMessage, RefNotFound
from rill.protocols.evergreen.messages import GenerateConfig
from rill.protocols.evergreen.runner import DONE, SessionRunner
from rill.testing.fake_runner import StepGate
from tests.helpers import wait_until
from tests.protocols.evergreen.helpers import generate, leaf, msg
from tests.protocols.evergreen.test_adapter import Fake, make_deps, make_fake


class Counter:
    """Counts refusals as ``rill.frontend.metrics.Metrics`` does."""

    def __init__(self) -> None:
        self.codes: list[tuple[str, str]] = []

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        self.codes.append((protocol, code))


def new_runner(fake: Fake, **overrides: object) -> tuple[SessionRunner, Counter]:
    deps = make_deps(fake.client, **{"evergreen.grpc_port": 0, **overrides})
    counter = Counter()
    deps.metrics = counter  # type: ignore[assignment]
    return SessionRunner(deps, "someone"), counter


async def test_a_start_that_fails_aborts_the_session_and_its_running_actions_at_once(tmp_path: Path) -> None:
    async with make_fake() as fake:
        gate = fake.runner.gate = StepGate()  # action 0 stays in the engine
        runner, counter = new_runner(fake, **{"evergreen.evergreen_file_root": [str(tmp_path)]})
        await runner.feed(msg(leaf("a", "hello"), generate("a", "ra", config=GenerateConfig(max_tokens=500))))
        await wait_until(
            lambda: runner.driver is not None and runner.driver.stream("0") is not None, attempts=1000, interval_s=0.01
        )
        running = runner.driver.stream("0")
        await runner.feed(msg(leaf("b", ref=f"file://{tmp_path}/missing.txt"), generate("b", "rb")))
        await wait_until(lambda: not runner.outbox.empty(), attempts=1000, interval_s=0.01)
        error = runner.outbox.get_nowait()
        assert isinstance(error, RefNotFound) and codec.status_of(error)[0] == "NOT_FOUND"
        assert counter.codes == [("evergreen", "ref_not_found")]  # before the engine saw it: a refusal
        # The other action is aborted in the engine now, not when the wire tears the session down.
        await wait_until(lambda: fake.aborted, attempts=1000, interval_s=0.01)
        assert fake.aborted == [running.request_id] and runner.is_over
        gate.set()
        await runner.aclose()
        assert runner.outbox.empty() and runner.session is None


async def test_a_message_that_cannot_be_decoded_is_refused_and_ends_the_session() -> None:
    async with make_fake() as fake:
        runner, counter = new_runner(fake)
        await runner.feed("[]", codec.decode_json)
        error = runner.outbox.get_nowait()
        assert isinstance(error, InvalidMessage) and counter.codes == [("evergreen", "invalid_message")]
        await runner.feed(codec.encode_json(msg(leaf("p", "x"), generate("p", "r"))), codec.decode_json)
        assert runner.outbox.empty() and fake.requests == []  # nothing is taken after the end
        await runner.aclose()


async def test_a_failure_before_the_first_message_needs_no_session() -> None:
    async with make_fake() as fake:
        runner, counter = new_runner(fake)
        await runner.fail(InvalidRequest("no"), is_refused=True)
        assert isinstance(runner.outbox.get_nowait(), InvalidRequest) and runner.session is None
        assert counter.codes == [("evergreen", "invalid_request")]
        await runner.aclose()


async def test_the_session_ends_once_input_ended_and_every_action_finished() -> None:
    async with make_fake() as fake:
        runner, counter = new_runner(fake)
        await runner.feed(msg(leaf("p", "hi"), generate("p", "r", config=GenerateConfig(max_tokens=3))))
        await runner.input_ended()
        items: list = []
        async with asyncio.timeout(30):
            while not items or items[-1] is not DONE:
                items.append(await runner.outbox.get())
        fragments = [f for item in items[:-1] for f in item.node_fragments]
        assert [f.seq for f in fragments] == list(range(len(fragments))) and not fragments[-1].continued
        assert counter.codes == [] and len(fake.requests) == 1
        await runner.aclose()
