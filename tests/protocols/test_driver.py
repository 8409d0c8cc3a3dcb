"""The session driver (``rill.protocols._shared.driver``) against the real in-process client
on the fake engine: what every protocol's adapter relies on."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rill.errors import InvalidRequest, RequestTimeout
from rill.protocols._shared.actions import Abort, Close, Rejected, Send, Start
from rill.protocols._shared.driver import Driver, Gone
from rill.protocols._shared.session import Key, Session, Started, StepSession, split_by_token
from rill.testing.fake_client import LOADING_PERCENT, fake_client, record_aborts
from rill.testing.fake_runner import StepGate
from rill.types import GenerateRequest, RequestOutput, SamplingParams


class Recorder(Session):
    """A session that records every call and answers with what a test queued."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_started(self, started: Started) -> list[Any]:
        self.calls.append(("started", started))
        return [Send(("started", started.key))]

    def on_output(self, key: Key, output: RequestOutput, now: float) -> list[Any]:
        self.calls.append(("output", (key, output)))
        return [Send(("token", key, output.text))] + ([Close(1000, "done")] if output.finished else [])

    def on_start_failed(self, key: Key, exc: BaseException, now: float) -> list[Any]:
        self.calls.append(("failed", (key, exc)))
        return [Send(("error", key, type(exc).__name__))]

    def on_loading(self, progress: float, eta_s: float | None) -> list[Any]:
        self.calls.append(("loading", progress))
        return [Send(("loading", progress))]

    def outputs(self) -> list[RequestOutput]:
        return [value[1] for name, value in self.calls if name == "output"]


class StepRecorder(Recorder, StepSession):
    """A session taking one step's outputs at once."""

    def on_outputs(self, outputs: list[tuple[Key, RequestOutput]], now: float) -> list[Any]:
        self.calls.append(("step", [(key, o.text) for key, o in outputs]))
        return []


class Wire:
    """A transport that keeps what it was asked to send, and can go away."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed: list[tuple[int | None, str]] = []
        self.extra: list[Any] = []
        self.gone = False
        self.done = asyncio.Event()

    async def send(self, message: Any) -> None:
        if self.gone:
            raise Gone
        self.sent.append(message)

    async def close(self, code: int | None, reason: str) -> None:
        self.closed.append((code, reason))
        self.done.set()

    async def perform(self, action: Any) -> None:
        self.extra.append(action)


class Counter:
    def __init__(self) -> None:
        self.codes: list[tuple[str, str]] = []

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        self.codes.append((protocol, code))


async def until(condition: Any, timeout_s: float = 30.0) -> None:
    """Wait until ``condition()`` holds (polled: it is state of another thread or task)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def request(max_tokens: int = 4, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt="hello", sampling=SamplingParams(max_tokens=max_tokens, **sampling))


async def test_a_start_is_submitted_under_the_principal_and_pumped_to_its_end() -> None:
    async with fake_client() as client:
        seen: list[GenerateRequest] = []
        generate = client.generate

        async def recording(req: GenerateRequest) -> Any:
            seen.append(req)
            return await generate(req)

        client.generate = recording
        session, wire = Recorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="who")
        await driver.perform([Start(request(max_tokens=5), key="a"), Send("hi")])
        await asyncio.wait_for(wire.done.wait(), 30)
        assert seen[0].principal == "who"
        assert wire.sent[0] == "hi" and wire.sent[1] == ("started", "a")
        outputs = session.outputs()
        assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == 5
        assert wire.closed == [(1000, "done")]
        await driver.wait()
        assert driver.stream("a") is None and not driver.tasks
        assert client.stats().num_running == 0


async def test_a_refusal_reaches_the_session_and_the_rejection_metric() -> None:
    async with fake_client() as client:
        session, wire, metrics = Recorder(), Wire(), Counter()
        driver = Driver(session, wire, client, protocol="test", principal="p", metrics=metrics)
        await driver.perform([Start(request(max_tokens=4, temperature=-1.0))])
        await driver.wait()
        ((name, (key, exc)),) = session.calls
        assert name == "failed" and key is None and isinstance(exc, InvalidRequest)
        assert wire.sent == [("error", None, "InvalidParameter")]  # an InvalidRequest naming a sampling field
        assert metrics.codes == [("test", "invalid_request")]
        await driver.perform([Rejected("bad_frame")])
        assert metrics.codes[-1] == ("test", "bad_frame")


class WireCodes(Recorder):
    """A session counting refusals under its wire's own codes."""

    def refusal_code(self, exc: BaseException) -> str:
        return "E_" + type(exc).__name__.upper()


async def test_a_session_may_count_refusals_under_its_wire_codes() -> None:
    async with fake_client() as client:
        metrics = Counter()
        driver = Driver(WireCodes(), Wire(), client, protocol="test", principal="p", metrics=metrics)
        await driver.perform([Start(request(max_tokens=4, temperature=-1.0))])
        await driver.wait()
        assert metrics.codes == [("test", "E_INVALIDPARAMETER")]  # the policy's InvalidRequest on a sampling field


async def test_abort_keeps_the_final_output_and_frees_the_request() -> None:
    gate = StepGate()
    async with fake_client() as client:
        client.engine.runner.gate = gate
        session, wire = Recorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p")
        await driver.perform([Start(request(max_tokens=200), key="k")])
        await until(lambda: driver.stream("k") is not None)
        await driver.perform([Abort("k")])
        gate.set()
        await asyncio.wait_for(driver.wait(), 30)
        last = session.outputs()[-1]
        assert last.finished and last.finish_reason == "cancelled"
        assert client.stats().num_running == 0 and client.stats().kv_used_tokens == 0


async def test_aclose_aborts_every_running_request_at_once() -> None:
    gate = StepGate()
    async with fake_client() as client:
        client.engine.runner.gate = gate
        aborted = record_aborts(client)
        session, wire = Recorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p")
        await driver.perform([Start(request(max_tokens=500), key="a"), Start(request(max_tokens=500), key="b")])
        await until(lambda: len(driver.streams) == 2)
        ids = {driver.streams[k].request_id for k in ("a", "b")}
        await driver.aclose()
        assert set(aborted) == ids and not driver.tasks
        gate.set()


async def test_a_start_waits_for_the_model_reporting_progress_and_can_be_aborted_meanwhile() -> None:
    loading = threading.Event()
    async with fake_client(loading=loading) as client:
        session, wire = Recorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p", waits_for_model=True)
        await driver.perform([Start(request(), key="early")])
        await until(lambda: bool(wire.sent))
        assert wire.sent[0] == ("loading", LOADING_PERCENT)
        await driver.perform([Abort("early")])
        await driver.wait()
        assert all(name == "loading" for name, _ in session.calls)
        await driver.perform([Start(request(max_tokens=3), key="later")])
        loading.set()
        await asyncio.wait_for(driver.wait(), 30)
        assert [name for name, _ in session.calls if name != "loading"][0] == "started"
        assert session.outputs()[-1].finished


async def test_without_waiting_a_start_while_loading_is_refused() -> None:
    loading = threading.Event()
    async with fake_client(loading=loading) as client:
        session = Recorder()
        driver = Driver(session, Wire(), client, protocol="test", principal="p")
        await driver.perform([Start(request())])
        await driver.wait()
        assert [type(exc).__name__ for name, (_, exc) in session.calls] == ["ModelNotReady"]


class TogetherRecorder(Recorder):
    """A session that reports the refusals of starts made together as one message."""

    def on_starts_failed(self, failures: list[tuple[Key, BaseException]], now: float) -> list[Any]:
        self.calls.append(("all failed", [key for key, _ in failures]))
        return [Send(("errors", [key for key, _ in failures]))]


async def test_starts_submitted_together_are_submitted_in_order_and_refused_together() -> None:
    async with fake_client() as client:
        session, wire = TogetherRecorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p", submits_together=True)
        bad = request(temperature=-1.0)
        await driver.perform(
            [
                Send("accepted"),
                Start(request(), key="a"),
                Start(bad, key="b"),
                Start(request(), key="c"),
                Start(bad, key="d"),
            ]
        )
        # Every submission was made, in order, before perform returned; the refusals come last.
        assert wire.sent == ["accepted", ("started", "a"), ("started", "c"), ("errors", ["b", "d"])]
        assert [name for name, _ in session.calls] == ["started", "started", "all failed"]
        await asyncio.wait_for(driver.wait(), 30)
        assert {key for key, _ in (value for name, value in session.calls if name == "output")} == {"a", "c"}

        session, wire = Recorder(), Wire()  # the default: each refusal on its own
        driver = Driver(session, wire, client, protocol="test", principal="p", submits_together=True)
        await driver.perform([Start(bad, key="x"), Start(bad, key="y")])
        assert wire.sent == [("error", "x", "InvalidParameter"), ("error", "y", "InvalidParameter")]


def coalesced() -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text="abc",
        token_ids=[1, 2, 3],
        token_texts=["a", "b", "c"],
        prompt_logprobs=[None],
        finished=True,
        finish_reason="stop",
    )


def test_split_by_token_gives_one_output_per_token_with_the_end_on_the_last() -> None:
    pieces = split_by_token(coalesced())
    assert [p.text for p in pieces] == ["a", "b", "c"] and [p.token_ids for p in pieces] == [[1], [2], [3]]
    assert [p.finished for p in pieces] == [False, False, True]
    assert pieces[-1].finish_reason == "stop" and pieces[0].finish_reason is None
    assert pieces[0].prompt_logprobs == [None] and pieces[1].prompt_logprobs is None
    one = RequestOutput(request_id="r", text="x", token_ids=[7], token_texts=["x"])
    assert split_by_token(one) == [one]


async def test_one_event_per_token_splits_what_a_lagging_reader_got_folded() -> None:
    async with fake_client() as client:
        session = Recorder()
        driver = Driver(session, Wire(), client, protocol="test", principal="p", one_event_per_token=True)
        await driver._deliver("k", coalesced())
        assert [o.text for o in session.outputs()] == ["a", "b", "c"]


async def test_grouped_steps_keep_one_event_per_token_beside_the_other_requests() -> None:
    async with fake_client() as client:
        session = StepRecorder()
        driver = Driver(
            session, Wire(), client, protocol="test", principal="p", groups_steps=True, one_event_per_token=True
        )
        await driver._deliver("a", RequestOutput(request_id="a", text="x", token_ids=[1], token_texts=["x"]))
        await driver._deliver("a", RequestOutput(request_id="a", text="y", token_ids=[2], token_texts=["y"]))
        await driver._deliver("b", RequestOutput(request_id="b", text="u", token_ids=[3], token_texts=["u"]))
        await until(lambda: len(session.calls) == 2)
        assert session.calls == [("step", [("a", "x"), ("b", "u")]), ("step", [("a", "y")])]
        await driver.aclose()


class BrokenStepSession(StepRecorder):
    """A step session with a bug: handing it a step raises."""

    def on_outputs(self, outputs: list[tuple[Key, RequestOutput]], now: float) -> list[Any]:
        raise KeyError("bug")

    def on_error(self, exc: BaseException) -> list[Any]:
        self.calls.append(("error", exc))
        return [Send(("error", type(exc).__name__)), Close(1011, "")]


async def test_a_step_session_that_fails_fails_the_connection_and_a_peer_gone_stops_the_steps() -> None:
    async with fake_client() as client:
        session, wire = BrokenStepSession(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p", groups_steps=True)
        await driver._deliver("a", RequestOutput(request_id="a", text="x", token_ids=[1], token_texts=["x"]))
        await asyncio.wait_for(wire.done.wait(), 30)
        assert wire.sent == [("error", "KeyError")] and wire.closed == [(1011, "")]
        assert driver._flusher is not None and driver._flusher.exception() is None

        session, wire = StepRecorder(), Wire()
        wire.gone = True
        session.on_outputs = lambda outputs, now: [Send("progress")]  # type: ignore[method-assign]
        driver = Driver(session, wire, client, protocol="test", principal="p", groups_steps=True)
        await driver._deliver("a", RequestOutput(request_id="a", text="x", token_ids=[1], token_texts=["x"]))
        flusher = driver._flusher
        assert flusher is not None
        await asyncio.wait_for(asyncio.shield(flusher), 30)  # ends by itself, quietly
        assert flusher.exception() is None and wire.sent == []


async def test_actions_only_the_wire_has_go_to_the_transport() -> None:
    async with fake_client() as client:
        wire = Wire()
        driver = Driver(Recorder(), wire, client, protocol="test", principal="p")
        await driver.perform(["pause"])
        assert wire.extra == ["pause"]


async def test_a_peer_that_left_ends_the_request() -> None:
    async with fake_client() as client:
        aborted = record_aborts(client)
        wire = Wire()
        wire.gone = True
        driver = Driver(Recorder(), wire, client, protocol="test", principal="p")
        await driver.perform([Start(request(max_tokens=500))])
        await asyncio.wait_for(driver.wait(), 30)
        assert len(aborted) == 1 and client.stats().num_running == 0


async def test_a_prepared_start_is_built_in_its_task_and_a_failed_build_is_a_refusal() -> None:
    async with fake_client() as client:
        session, wire, metrics = Recorder(), Wire(), Counter()
        driver = Driver(session, wire, client, protocol="test", principal="p", metrics=metrics)
        built = asyncio.Event()

        async def prepare() -> GenerateRequest:
            await built.wait()  # the request is built while the caller goes on
            return request(max_tokens=3)

        driver.start(prepare, key="a")
        await asyncio.sleep(0)
        assert driver.stream("a") is None and session.calls == []
        built.set()
        await asyncio.wait_for(driver.wait(), 30)
        assert session.calls[0][0] == "started" and session.outputs()[-1].finished

        async def broken() -> GenerateRequest:
            raise InvalidRequest("the file is gone")

        driver.start(broken, key="b")
        await driver.wait()
        ((name, (key, exc)),) = session.calls[-1:]
        assert (name, key, str(exc)) == ("failed", "b", "the file is gone")
        assert metrics.codes == [("test", "invalid_request")]


async def test_aborting_a_start_still_being_prepared_cancels_it() -> None:
    async with fake_client() as client:
        session = Recorder()
        driver = Driver(session, Wire(), client, protocol="test", principal="p")
        never = asyncio.Event()

        async def prepare() -> GenerateRequest:
            await never.wait()
            return request()

        driver.start(prepare, key="k")
        await asyncio.sleep(0)
        driver.abort("k")
        await asyncio.wait_for(driver.wait(), 30)
        assert session.calls == [] and not driver.tasks


async def test_the_session_lock_holds_every_hook_while_the_adapter_has_the_session() -> None:
    async with fake_client() as client:
        session, lock = Recorder(), asyncio.Lock()
        driver = Driver(session, Wire(), client, protocol="test", principal="p", session_lock=lock)
        async with lock:  # the adapter's own call into the session (Evergreen: in a worker thread)
            await driver.perform([Start(request(max_tokens=3))])
            await until(lambda: client.stats().requests_finished_total.get("length", 0) == 1)
            assert session.calls == []  # accepted and finished, yet the session was not called
        await asyncio.wait_for(driver.wait(), 30)
        assert session.calls[0][0] == "started" and session.outputs()[-1].finished


async def test_a_request_past_the_time_limit_is_ended_and_told_so() -> None:
    gate = StepGate()
    async with fake_client() as client:
        client.engine.runner.gate = gate  # no step runs: only the limit can end the request
        aborted = record_aborts(client)
        session, wire = Recorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p", time_limit_s=0.2)
        await driver.perform([Start(request(max_tokens=500), key="k")])
        await asyncio.wait_for(driver.wait(), 30)
        last = session.outputs()[-1]
        assert last.finished and last.finish_reason == "error" and isinstance(last.error, RequestTimeout)
        assert "0.2 s" in str(last.error)
        assert len(aborted) == 1 and driver.stream("k") is None
        gate.set()
        await until(lambda: client.stats().num_running == 0 and client.stats().num_waiting == 0)


async def test_a_start_submitted_together_is_still_ended_by_the_time_limit() -> None:
    gate = StepGate()
    async with fake_client() as client:
        client.engine.runner.gate = gate  # no step runs: only the limit can end the request
        session, wire = TogetherRecorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p", submits_together=True, time_limit_s=0.2)
        await driver.perform([Start(request(max_tokens=500), key="k")])
        assert wire.sent == [("started", "k")]  # submitted before perform returned
        await asyncio.wait_for(driver.wait(), 30)
        last = session.outputs()[-1]
        assert last.finished and isinstance(last.error, RequestTimeout) and driver.stream("k") is None
        gate.set()
        await until(lambda: client.stats().num_running == 0 and client.stats().num_waiting == 0)


async def test_the_time_limit_counts_from_when_the_model_is_ready() -> None:
    loading = threading.Event()
    async with fake_client(loading=loading) as client:
        session, wire = Recorder(), Wire()
        driver = Driver(session, wire, client, protocol="test", principal="p", waits_for_model=True, time_limit_s=1.0)
        await driver.perform([Start(request(max_tokens=1))])
        await until(lambda: len(wire.sent) >= 4, timeout_s=60)  # four loading reports: over 1.5 s of waiting
        loading.set()
        await asyncio.wait_for(driver.wait(), 30)
        last = session.outputs()[-1]
        assert last.finished and last.finish_reason != "error"
