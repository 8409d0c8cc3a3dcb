"""The adapter over a real gRPC socket and a loopback WebSocket, against the in-process engine
client over a ``FakeRunner`` (the real engine code, no model): authentication, engine
failures, loading, cancellation, listener errors. Texts are checked against greedy decoding
of the fake model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from rill import config as config_mod
from rill.clients.evergreen import EvergreenClient, EvergreenError, prompt_message
from rill.deps import Deps
from rill.errors import ConfigError
from rill.frontend.inproc import InprocClient
from rill.protocols.evergreen import adapter, codec
from rill.protocols.evergreen.messages import GenerateConfig
from rill.testing.fake_client import FAKE_MODEL_NAME, fake_client, record_aborts, record_requests
from rill.testing.fake_runner import StepGate, fake_tokenizer
from rill.types import GenerateRequest
from tests.conftest import free_port
from tests.helpers import serving, wait_until

MAX_CONTEXT = 1024


@dataclass
class Fake:
    """The engine client under test and what the protocol submitted to it and aborted."""

    client: InprocClient
    requests: list[GenerateRequest]
    aborted: list[str]

    @property
    def runner(self) -> Any:
        """The client's ``FakeRunner``."""
        return self.client.engine.runner

    def greedy_text(self, request: GenerateRequest, num_tokens: int) -> str:
        """What greedy decoding of ``request``'s chat writes on the fake model."""
        tokenizer = self.client.engine.tokenizer
        ids = tokenizer.encode_chat(request.messages, chat_template_kwargs=request.chat_template_kwargs)
        out: list[int] = []
        for _ in range(num_tokens):
            out.append(int(np.argmax(self.runner.logits_after(ids + out))))
        return tokenizer.decode(out)

    def num_cancelled(self) -> int:
        """Requests the engine ended as cancelled (aborted)."""
        return self.client.stats().requests_finished_total.get("cancelled", 0)


@contextlib.asynccontextmanager
async def make_fake(**args: Any) -> AsyncIterator[Fake]:
    """A ``Fake`` over ``fake_client(**args)`` (a context longer than rill's default max_tokens)."""
    args.setdefault("max_len", MAX_CONTEXT)
    async with fake_client(**args) as client:
        yield Fake(client, record_requests(client), record_aborts(client))


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    """A ready ``Fake``."""
    async with make_fake() as fake:
        yield fake


def make_deps(client: Any, **overrides: Any) -> Deps:
    cfg = config_mod.load({"evergreen.grpc_port": free_port(), "uds.no_socket": True, **overrides}, env={})
    return Deps(config=cfg, client=client, api_keys=cfg.api_keys())


BIND_TRIES = 5
"""Ports tried before a listener's bind failure fails its test."""


async def started(deps: Deps):
    """Start the gRPC listener of ``deps``; a port taken by another process between
    ``free_port``'s check and the bind (it happened beside the cluster tests, under load) is
    replaced by a new one in ``deps``, so that ``address(deps)`` names the port bound."""
    for _ in range(BIND_TRIES - 1):
        try:
            return await _start(deps)
        except ConfigError as exc:
            if "cannot listen" not in str(exc):
                raise
            print(f"retrying on another port: {exc}")  # shown with the test's output if it fails
            evergreen = dataclasses.replace(deps.config.evergreen, grpc_port=free_port())
            deps.config = dataclasses.replace(deps.config, evergreen=evergreen)
    return await _start(deps)


async def _start(deps: Deps):
    stop = await adapter.start(deps)
    assert stop is not None
    return stop


@contextlib.asynccontextmanager
async def listening(deps: Deps) -> AsyncIterator[None]:
    """The gRPC listener of ``deps`` for the block's duration."""
    stop = await started(deps)
    try:
        yield
    finally:
        await stop()


def address(deps: Deps) -> str:
    return f"127.0.0.1:{deps.config.evergreen.grpc_port}"


async def open_held_session(egc: EvergreenClient, fake: Fake) -> tuple[Any, StepGate]:
    """A session whose generation has sent its first token, the engine held before its next
    step (the gate returned)."""
    gate = fake.runner.gate = StepGate()
    session = egc.open_session()
    message, _ = prompt_message("hold", config=GenerateConfig(max_tokens=100))
    await session.send(message)
    gate.allow()  # the prefill, which makes the first token
    await session.receive()
    return session, gate


async def collect(deps: Deps, prompt: str, max_tokens: int = 4, api_key: str | None = None) -> str:
    """The text one greedy generation of ``prompt`` streams over gRPC."""
    config = GenerateConfig(max_tokens=max_tokens, temperature=0)
    async with EvergreenClient(address(deps), api_key=api_key) as client:
        return "".join([t async for t in client.generate(prompt, config=config)])


async def test_grpc_port_0_disables_the_listener(fake: Fake):
    assert await adapter.start(make_deps(fake.client, **{"evergreen.grpc_port": 0})) is None


async def test_a_port_in_use_is_a_config_error(fake: Fake):
    deps = make_deps(fake.client)
    async with listening(deps):
        with pytest.raises(ConfigError, match="--grpc-port"):
            await adapter.start(deps)


async def test_generate_streams_the_models_tokens_and_labels_the_protocol(fake: Fake):
    deps = make_deps(fake.client)
    async with listening(deps):
        text = await collect(deps, "hi", max_tokens=3)
    [request] = fake.requests
    assert request.protocol == "evergreen"
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]
    assert len(text) == 3 and text == fake.greedy_text(request, 3)  # one character per fake token


async def test_api_keys_are_required_over_grpc_when_configured(fake: Fake):
    deps = make_deps(fake.client, **{"http.api_key": ["k1"]})
    async with listening(deps):
        with pytest.raises(EvergreenError) as info:
            await collect(deps, "hi")
        assert info.value.status == "UNAUTHENTICATED"
        with pytest.raises(EvergreenError):
            await collect(deps, "hi", api_key="wrong")
        assert fake.requests == []
        text = await collect(deps, "hi", max_tokens=1, api_key="k1")
    assert text == fake.greedy_text(fake.requests[0], 1) and len(text) == 1


class _RawAuthClient(EvergreenClient):
    """Sends ``authorization`` exactly as given (the real client always writes ``Bearer KEY``)."""

    def __init__(self, address: str, authorization: str) -> None:
        super().__init__(address)
        self.authorization = authorization

    def open_session(self) -> Any:
        from rill.clients.evergreen import Session
        from rill.protocols.evergreen._pb import evergreen_service_pb2_grpc as service_grpc

        stub = service_grpc.EvergreenServiceStub(self._channel)
        return Session(stub.StartSession(metadata=(("authorization", self.authorization),)))


@pytest.mark.parametrize(
    "authorization, accepted",
    [
        ("Bearer k1", True),
        ("bearer k1", True),
        ("BEARER k1", True),
        ("  Bearer   k1  ", True),
        ("Bearer ", False),
        ("Bearer", False),
        ("k1", False),
        ("Basic k1", False),
        ("Bearer k", False),
        ("Bearer k1x", False),
    ],
)
async def test_grpc_parses_the_bearer_header_as_http_does(fake: Fake, authorization: str, accepted: bool):
    # Regression (issue 12 item 10): gRPC took only "Bearer " with that exact case, and
    # compared with `in` (not constant-time); it now shares rill.auth with HTTP.
    deps = make_deps(fake.client, **{"http.api_key": ["k1"]})
    async with listening(deps), _RawAuthClient(address(deps), authorization) as client:
        if accepted:
            text = "".join([t async for t in client.generate("hi", config=GenerateConfig(max_tokens=1))])
            assert len(text) == 1 and len(fake.requests) == 1
        else:
            with pytest.raises(EvergreenError) as info:
                async for _ in client.generate("hi", config=GenerateConfig(max_tokens=1)):
                    pass
            assert info.value.status == "UNAUTHENTICATED" and fake.requests == []


def fail_after(fake: Fake, num_tokens: int) -> None:
    """Make the engine step fail once a request has ``num_tokens`` generated tokens (a model error)."""

    def script(tokens: Any) -> None:
        if len(tokens) >= len(fake.client.engine.tokenizer.encode_chat(fake.requests[0].messages)) + num_tokens:
            raise RuntimeError("the kernel failed reading /etc/shadow")

    fake.runner.script = script


def broken_tokenizer() -> Any:
    """The fake tokenizer, but its encoding raises an unexpected error (a bug)."""
    tokenizer = fake_tokenizer.__wrapped__()  # an instance of its own, not the cached one

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("secret /etc/shadow")

    tokenizer.encode = broken
    return tokenizer


@pytest.mark.parametrize(
    "case, status, text",
    [
        ("model error", "INTERNAL", "the engine step failed while generating"),
        ("time limit", "DEADLINE_EXCEEDED", "the request reached its time limit"),
        ("bug", "INTERNAL", "internal server error"),
    ],
)
async def test_engine_failures_abort_the_session_with_their_status(case, status, text):
    async with make_fake(tokenizer=broken_tokenizer() if case == "bug" else None) as fake:
        deps = make_deps(fake.client, **{"http.request_timeout_s": 30.0})
        if case == "model error":
            fail_after(fake, 2)
        elif case == "time limit":
            # The engine's clock is an hour ahead: every time limit has passed at its first step.
            fake.client.engine.core.clock = lambda: time.monotonic() + 3600
        async with listening(deps):
            with pytest.raises(EvergreenError) as info:
                await collect(deps, "hi", max_tokens=8)
    assert (info.value.status, info.value.message) == (status, text)
    assert "shadow" not in info.value.message and len(fake.requests) == 1


async def test_a_session_waits_for_the_model_to_load():
    loading = threading.Event()
    async with make_fake(loading=loading) as fake:
        waits: list[None] = []
        wait_ready = fake.client.wait_ready

        async def counted_wait_ready() -> None:
            waits.append(None)
            await wait_ready()

        fake.client.wait_ready = counted_wait_ready
        deps = make_deps(fake.client)
        async with listening(deps):
            task = asyncio.create_task(collect(deps, "hi", max_tokens=2))
            # The call has reached the server and waits there; it must not fail while loading.
            await wait_until(lambda: waits or task.done(), attempts=10_000, interval_s=0.001)
            assert not task.done()
            loading.set()
            text = await task
        assert text == fake.greedy_text(fake.requests[0], 2) and len(text) == 2


async def test_cancelling_the_call_aborts_the_request_in_the_engine(fake: Fake):
    deps = make_deps(fake.client)
    async with listening(deps):
        async with EvergreenClient(address(deps)) as egc:
            session, gate = await open_held_session(egc, fake)
            session.cancel()
            # the abort arrives within a few loop turns, not after a delay
            await wait_until(lambda: fake.aborted, attempts=1000, interval_s=0.001)
        assert len(fake.aborted) == 1
        gate.set()
        await wait_until(lambda: fake.num_cancelled() == 1, attempts=1000, interval_s=0.01)


@contextlib.asynccontextmanager
async def websocket_url(deps: Deps) -> AsyncIterator[str]:
    """The adapter's routes on a loopback port; the ``/evergreen`` WebSocket URL."""
    async with serving(Starlette(routes=adapter.routes(deps))) as port:
        yield f"ws://127.0.0.1:{port}/evergreen"


async def closed_with(ws: Any) -> tuple[int | None, str]:
    """Read until the server closes; its close code and reason."""
    with pytest.raises(ConnectionClosed) as info:
        while True:
            await ws.recv()
    rcvd = info.value.rcvd
    return (rcvd.code, rcvd.reason) if rcvd is not None else (None, "")


async def test_websocket_runs_a_session_and_a_bad_message_ends_it(fake: Fake):
    deps = make_deps(fake.client, **{"evergreen.grpc_port": 0})
    async with websocket_url(deps) as url:
        async with connect(url) as ws:
            message, output_id = prompt_message("hi", config=GenerateConfig(max_tokens=2, temperature=0))
            await ws.send(codec.encode_json(message))
            fragments: list[Any] = []
            while not fragments or fragments[-1].continued:  # outputs may come merged
                fragments += codec.decode_json(await ws.recv()).node_fragments
        text = b"".join(f.chunk_fragment.data for f in fragments if f.chunk_fragment is not None).decode()
        assert text == fake.greedy_text(fake.requests[0], 2) and len(text) == 2
        assert fragments[-1].continued is False
        async with connect(url) as ws:
            await ws.send("[]")
            code, _ = await closed_with(ws)
        assert code == 4003


async def test_a_websocket_disconnect_aborts_the_request(fake: Fake):
    deps = make_deps(fake.client, **{"evergreen.grpc_port": 0})
    gate = fake.runner.gate = StepGate()
    async with websocket_url(deps) as url:
        async with connect(url) as ws:
            message, _ = prompt_message("hi", config=GenerateConfig(max_tokens=100))
            await ws.send(codec.encode_json(message))
            gate.allow()  # the prefill, which makes the first token
            await ws.recv()
        await wait_until(lambda: fake.aborted, attempts=1000, interval_s=0.01)
    gate.set()
    await wait_until(lambda: fake.num_cancelled() == 1, attempts=1000, interval_s=0.01)


async def test_websocket_speaks_the_typescript_clients_json(fake: Fake):
    # Exactly what actionengine-ts run.ts sends: camelCase, base64 data, metadata on every
    # fragment, a payload-less close fragment; the reply is read as plain JSON.
    import base64
    import json

    deps = make_deps(fake.client, **{"evergreen.grpc_port": 0})
    sent = [
        {
            "actions": [
                {
                    "targetSpec": {"id": FAKE_MODEL_NAME},
                    "name": "GENERATE",
                    "inputs": [{"name": "prompt", "id": "in-1"}],
                    "outputs": [{"name": "response", "id": "out-1"}],
                }
            ]
        },
        {
            "nodeFragments": [
                {
                    "id": "in-1",
                    "chunkFragment": {
                        "metadata": {"mimetype": "text/plain", "role": "user"},
                        "data": base64.b64encode(b"Hi").decode(),
                    },
                    "seq": 0,
                    "continued": True,
                }
            ]
        },
        {"nodeFragments": [{"id": "in-1", "seq": 1, "continued": False}]},
    ]
    async with websocket_url(deps) as url, connect(url) as ws:
        for message in sent:
            await ws.send(json.dumps(message))
        replies = []
        while not replies or replies[-1]["nodeFragments"][0]["continued"]:
            replies.append(json.loads(await ws.recv()))
    fragments = [r["nodeFragments"][0] for r in replies]
    assert fragments[0]["id"] == "out-1" and fragments[0]["seq"] == 0
    assert fragments[0]["chunkFragment"]["metadata"] == {"mimetype": "text/plain", "role": "model"}
    text = "".join(base64.b64decode(f["chunkFragment"]["data"]).decode() for f in fragments)
    [request] = fake.requests
    assert [(m.role, m.content) for m in request.messages] == [("user", "Hi")]
    assert len(text) == 256  # no config: rill's default max_tokens, one character per fake token


async def test_stopping_the_server_ends_open_sessions_and_aborts_their_requests(fake: Fake):
    deps = make_deps(fake.client)
    stop = await started(deps)
    async with EvergreenClient(address(deps)) as egc:
        session, gate = await open_held_session(egc, fake)
        await stop()
        with pytest.raises(EvergreenError):
            while await session.receive() is not None:
                pass
    # the cancelled handler closes its streams within a few loop turns
    await wait_until(lambda: fake.aborted, attempts=1000, interval_s=0.001)
    assert len(fake.aborted) == 1
    gate.set()
    await wait_until(lambda: fake.num_cancelled() == 1, attempts=1000, interval_s=0.01)


async def test_grpc_sessions_are_counted_by_the_gate(fake: Fake):
    # Regression (issue 12 item 8): StartSession calls were not counted against any limit.
    # The idle session's first-message timeout is long, so it surely holds the only place.
    from rill.connections import ConnectionGate

    deps = make_deps(fake.client, **{"connections.first_message_timeout_s": 600})
    deps.gate = ConnectionGate(1, 1)
    async with listening(deps), EvergreenClient(address(deps)) as egc:
        idle = egc.open_session()
        await wait_until(lambda: deps.gate.total == 1, attempts=1000, interval_s=0.01)
        with pytest.raises(EvergreenError) as refused:
            await collect(deps, "hi")
        assert refused.value.status == "RESOURCE_EXHAUSTED" and "limit of 1 connections" in refused.value.message
        idle.cancel()
        await wait_until(lambda: deps.gate.total == 0, attempts=1000, interval_s=0.01)
        assert len(await collect(deps, "hi", max_tokens=1)) == 1


async def test_an_idle_grpc_session_times_out_and_frees_its_place(fake: Fake):
    # Regression (issue 12 item 8): a StartSession call that never sent a message was held forever.
    from rill.connections import ConnectionGate

    deps = make_deps(fake.client, **{"connections.first_message_timeout_s": 0.5})
    deps.gate = ConnectionGate(1, 1)
    async with listening(deps), EvergreenClient(address(deps)) as egc:
        idle = egc.open_session()
        with pytest.raises(EvergreenError) as timed_out:
            await idle.receive()
        assert timed_out.value.status == "DEADLINE_EXCEEDED" and "no message within" in timed_out.value.message
        await wait_until(lambda: deps.gate.total == 0, attempts=1000, interval_s=0.01)
        assert len(await collect(deps, "hi", max_tokens=1)) == 1


def test_grpc_peer_host():
    assert adapter.grpc_peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert adapter.grpc_peer_host("ipv6:[2001:db8::1]:5000") == "2001:db8::/64"
    assert adapter.grpc_peer_host("ipv6:%5B2001:db8::1%5D:5000") == "2001:db8::/64"
    assert adapter.grpc_peer_host("unix:/tmp/x") is None


@pytest.mark.parametrize(
    "text",
    [
        '{"nodeFragments":[{"\\ud800":1}]}',
        "[" * 5000 + "]" * 5000,
        '{"actions":[{"configs":[{"@type":"\\ud800"}]}]}',
        '{"nodeFragments":[{"seq":1' + "0" * 400 + "}]}",
    ],
)
async def test_websocket_answers_hostile_json_with_invalid_argument_and_ends(fake: Fake, text):
    # Issue 12 item 4: the reader died on these, with no reply, no close, and a handler that
    # never finished. Now: close 4003 (INVALID_ARGUMENT) with the reason, and the handler ends
    # (stopping the server would hang otherwise).
    deps = make_deps(fake.client, **{"evergreen.grpc_port": 0})
    async with websocket_url(deps) as url:
        async with connect(url) as ws:
            await ws.send(text)
            code, reason = await closed_with(ws)
        assert code == 4003 and reason.startswith("INVALID_ARGUMENT: invalid")
        assert fake.requests == []
        # the server still serves a normal session afterwards
        async with connect(url) as ws:
            message, _ = prompt_message("hi", config=GenerateConfig(max_tokens=1, temperature=0))
            await ws.send(codec.encode_json(message))
            data = codec.decode_json(await ws.recv()).node_fragments[0].chunk_fragment.data
    assert len(fake.requests) == 1 and data.decode() == fake.greedy_text(fake.requests[0], 1)


async def test_websocket_reader_bug_aborts_with_internal_instead_of_hanging(fake: Fake, monkeypatch):
    def broken(text):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(codec, "decode_json", broken)
    deps = make_deps(fake.client, **{"evergreen.grpc_port": 0})
    async with websocket_url(deps) as url, connect(url) as ws:
        await ws.send("{}")
        assert await closed_with(ws) == (4013, "INTERNAL: internal server error")


async def test_grpc_bytes_that_are_not_a_session_message_are_invalid_argument(fake: Fake):
    # Was INTERNAL "internal server error": grpc's own parse failure reached the generic branch.
    import grpc

    deps = make_deps(fake.client)
    async with listening(deps), grpc.aio.insecure_channel(address(deps)) as channel:
        call = channel.stream_stream(
            "/evergreen.v2.EvergreenService/StartSession",
            request_serializer=lambda data: data,
            response_deserializer=lambda data: data,
        )

        async def garbage():
            yield b"\xff\xff\xff\x0f"

        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call(garbage()):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("not a serialized evergreen.v2.SessionMessage")
