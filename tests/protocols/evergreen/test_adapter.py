"""The adapter over a real gRPC socket and an in-process WebSocket, with a scripted engine
client (no model): authentication, engine failures, loading, cancellation, listener errors."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from rill import config as config_mod
from rill.clients.evergreen import EvergreenClient, EvergreenError, prompt_message
from rill.errors import ConfigError, GenerationError, RequestTimeout
from rill.frontend.stream import RequestStream
from rill.protocols.evergreen import adapter, codec
from rill.protocols.evergreen.messages import GenerateConfig
from rill.deps import Deps
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestOutput

from tests.conftest import free_port
from tests.helpers import wait_until


class ScriptedClient:
    """Yields ``max_tokens`` tokens " t{i}", one per loop turn. The last user message picks a
    script: ``fail`` (GenerationError after 2 tokens), ``late`` (RequestTimeout), ``boom``
    (an unexpected exception from ``generate``), ``hold`` (a token only per ``gate.set()``)."""

    load_error: BaseException | None = None  # EngineClient: set when the model failed to load

    def __init__(self, is_ready: bool = True) -> None:
        self.model_info = ModelInfo(name="fake", architecture="Fake", max_context_tokens=64, vocab_size=100,
                                    dtype="float32", device="cpu", has_chat_template=True)
        self.ready = asyncio.Event()
        if is_ready:
            self.ready.set()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.gate = asyncio.Event()
        self._aborts: dict[str, asyncio.Event] = {}
        self.num_ready_waits = 0  # calls of wait_ready: a session waiting for the model

    def is_ready(self) -> bool:
        return self.ready.is_set()

    async def wait_ready(self) -> None:
        self.num_ready_waits += 1
        await self.ready.wait()

    async def generate(self, request: GenerateRequest) -> RequestStream:
        script = str(request.messages[-1].content)
        if script == "boom":
            raise RuntimeError("secret /etc/shadow")
        request_id = f"r{len(self.requests)}"
        self.requests.append(request)
        stream = RequestStream(self, request_id, [1], request.sampling)
        self._aborts[request_id] = asyncio.Event()
        asyncio.get_running_loop().create_task(self._drive(request_id, script, request, stream))
        return stream

    async def _drive(self, request_id: str, script: str, request: GenerateRequest, stream: RequestStream) -> None:
        for i in range(request.sampling.max_tokens):
            if script == "hold":
                waiter = asyncio.ensure_future(self.gate.wait())
                aborted = asyncio.ensure_future(self._aborts[request_id].wait())
                await asyncio.wait({waiter, aborted}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                aborted.cancel()
                self.gate.clear()
            else:
                await asyncio.sleep(0)
            if self._aborts[request_id].is_set():
                stream.put(RequestOutput(request_id=request_id, finished=True, finish_reason="cancelled"))
                return
            if script in ("fail", "late") and i == 2:
                error = GenerationError("the kernel failed") if script == "fail" else RequestTimeout("too slow")
                stream.put(RequestOutput(request_id=request_id, finished=True, finish_reason="error", error=error))
                return
            last = i == request.sampling.max_tokens - 1
            stream.put(RequestOutput(request_id=request_id, text=f" t{i}", finished=last,
                                     finish_reason="length" if last else None))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._aborts[request_id].set()

    def stats(self) -> EngineStats:
        return EngineStats()


def make_deps(client: Any, **overrides: Any) -> Deps:
    cfg = config_mod.load({"evergreen.grpc_port": free_port(), "uds.no_socket": True, **overrides}, env={})
    return Deps(config=cfg, client=client, api_keys=cfg.api_keys())


async def started(deps: Deps):
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


async def open_held_session(egc: EvergreenClient, client: ScriptedClient) -> Any:
    """A session whose generation has sent its first token and now waits on ``client.gate``."""
    session = egc.open_session()
    message, _ = prompt_message("hold", config=GenerateConfig(max_tokens=100))
    await session.send(message)
    client.gate.set()
    await session.receive()
    return session


async def collect(deps: Deps, prompt: str, max_tokens: int = 4, api_key: str | None = None) -> str:
    async with EvergreenClient(address(deps), api_key=api_key) as client:
        return "".join([t async for t in client.generate(prompt, config=GenerateConfig(max_tokens=max_tokens))])


async def test_grpc_port_0_disables_the_listener():
    assert await adapter.start(make_deps(ScriptedClient(), **{"evergreen.grpc_port": 0})) is None


async def test_a_port_in_use_is_a_config_error():
    deps = make_deps(ScriptedClient())
    async with listening(deps):
        with pytest.raises(ConfigError, match="--grpc-port"):
            await adapter.start(deps)


async def test_generate_streams_the_scripted_tokens_and_labels_the_protocol():
    client = ScriptedClient()
    deps = make_deps(client)
    async with listening(deps):
        assert await collect(deps, "hi", max_tokens=3) == " t0 t1 t2"
        assert client.requests[0].protocol == "evergreen"
        assert [(m.role, m.content) for m in client.requests[0].messages] == [("user", "hi")]


async def test_api_keys_are_required_over_grpc_when_configured():
    deps = make_deps(ScriptedClient(), **{"http.api_key": ["k1"]})
    async with listening(deps):
        with pytest.raises(EvergreenError) as info:
            await collect(deps, "hi")
        assert info.value.status == "UNAUTHENTICATED"
        with pytest.raises(EvergreenError):
            await collect(deps, "hi", api_key="wrong")
        assert await collect(deps, "hi", max_tokens=1, api_key="k1") == " t0"


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


@pytest.mark.parametrize("authorization, accepted", [
    ("Bearer k1", True), ("bearer k1", True), ("BEARER k1", True), ("  Bearer   k1  ", True),
    ("Bearer ", False), ("Bearer", False), ("k1", False), ("Basic k1", False), ("Bearer k", False), ("Bearer k1x", False),
])
async def test_grpc_parses_the_bearer_header_as_http_does(authorization: str, accepted: bool):
    # Regression (issue 12 item 10): gRPC took only "Bearer " with that exact case, and
    # compared with `in` (not constant-time); it now shares rill.auth with HTTP.
    deps = make_deps(ScriptedClient(), **{"http.api_key": ["k1"]})
    async with listening(deps), _RawAuthClient(address(deps), authorization) as client:
        if accepted:
            assert "".join([t async for t in client.generate("hi", config=GenerateConfig(max_tokens=1))]) == " t0"
        else:
            with pytest.raises(EvergreenError) as info:
                async for _ in client.generate("hi", config=GenerateConfig(max_tokens=1)):
                    pass
            assert info.value.status == "UNAUTHENTICATED"


@pytest.mark.parametrize("script, status, text", [
    ("fail", "INTERNAL", "the kernel failed"),
    ("late", "DEADLINE_EXCEEDED", "too slow"),
    ("boom", "INTERNAL", "internal server error"),
])
async def test_engine_failures_abort_the_session_with_their_status(script, status, text):
    deps = make_deps(ScriptedClient())
    async with listening(deps):
        with pytest.raises(EvergreenError) as info:
            await collect(deps, script, max_tokens=8)
        assert (info.value.status, info.value.message) == (status, text)
        assert "shadow" not in info.value.message


async def test_a_session_waits_for_the_model_to_load():
    client = ScriptedClient(is_ready=False)
    deps = make_deps(client)
    async with listening(deps):
        task = asyncio.create_task(collect(deps, "hi", max_tokens=2))
        # The call has reached the server and waits there; it must not fail while loading.
        await wait_until(lambda: client.num_ready_waits or task.done(), attempts=10_000, interval_s=0.001)
        assert not task.done()
        client.ready.set()
        assert await task == " t0 t1"


async def test_cancelling_the_call_aborts_the_request_in_the_engine():
    client = ScriptedClient()
    deps = make_deps(client)
    async with listening(deps):
        async with EvergreenClient(address(deps)) as egc:
            session = await open_held_session(egc, client)
            session.cancel()
            # the abort arrives within a few loop turns, not after a delay
            await wait_until(lambda: client.aborted, attempts=1000, interval_s=0.001)
        assert client.aborted == ["r0"]


def test_websocket_runs_a_session_and_a_disconnect_aborts(monkeypatch):
    client = ScriptedClient()
    deps = make_deps(client, **{"evergreen.grpc_port": 0})
    app = Starlette(routes=adapter.routes(deps))
    with TestClient(app) as http:
        with http.websocket_connect("/evergreen") as ws:
            message, output_id = prompt_message("hi", config=GenerateConfig(max_tokens=2))
            ws.send_text(codec.encode_json(message))
            replies = [codec.decode_json(ws.receive_text()) for _ in range(2)]
        assert [f.chunk_fragment.data for r in replies for f in r.node_fragments] == [b" t0", b" t1"]
        assert replies[-1].node_fragments[-1].continued is False
        with http.websocket_connect("/evergreen") as ws:
            ws.send_text("[]")
            with pytest.raises(WebSocketDisconnect) as info:
                ws.receive_text()
        assert info.value.code == 4003


def test_websocket_speaks_the_typescript_clients_json():
    # Exactly what actionengine-ts run.ts sends: camelCase, base64 data, metadata on every
    # fragment, a payload-less close fragment; the reply is read as plain JSON.
    import base64
    import json

    deps = make_deps(ScriptedClient(), **{"evergreen.grpc_port": 0})
    sent = [
        {"actions": [{"targetSpec": {"id": "fake"}, "name": "GENERATE", "inputs": [{"name": "prompt", "id": "in-1"}],
                      "outputs": [{"name": "response", "id": "out-1"}]}]},
        {"nodeFragments": [{"id": "in-1", "chunkFragment": {"metadata": {"mimetype": "text/plain", "role": "user"},
                                                              "data": base64.b64encode(b"Hi").decode()},
                            "seq": 0, "continued": True}]},
        {"nodeFragments": [{"id": "in-1", "seq": 1, "continued": False}]},
    ]
    with TestClient(Starlette(routes=adapter.routes(deps))) as http, http.websocket_connect("/evergreen") as ws:
        for message in sent:
            ws.send_text(json.dumps(message))
        replies = []
        while not replies or replies[-1]["nodeFragments"][0]["continued"]:
            replies.append(json.loads(ws.receive_text()))
    fragments = [r["nodeFragments"][0] for r in replies]
    assert fragments[0]["id"] == "out-1" and fragments[0]["seq"] == 0
    assert fragments[0]["chunkFragment"]["metadata"] == {"mimetype": "text/plain", "role": "model"}
    text = "".join(base64.b64decode(f["chunkFragment"]["data"]).decode() for f in fragments)
    assert text == "".join(f" t{i}" for i in range(256))  # no config: rill's default max_tokens


async def test_stopping_the_server_ends_open_sessions_and_aborts_their_requests():
    client = ScriptedClient()
    deps = make_deps(client)
    stop = await started(deps)
    async with EvergreenClient(address(deps)) as egc:
        session = await open_held_session(egc, client)
        await stop()
        with pytest.raises(EvergreenError):
            while await session.receive() is not None:
                pass
    # the cancelled handler closes its streams within a few loop turns
    await wait_until(lambda: client.aborted, attempts=1000, interval_s=0.001)
    assert client.aborted == ["r0"]


async def test_grpc_sessions_are_counted_by_the_gate():
    # Regression (issue 12 item 8): StartSession calls were not counted against any limit.
    # The idle session's first-message timeout is long, so it surely holds the only place.
    from rill.connections import ConnectionGate

    deps = make_deps(ScriptedClient(), **{"connections.first_message_timeout_s": 600})
    deps.gate = ConnectionGate(1, 1)
    async with listening(deps), EvergreenClient(address(deps)) as egc:
        idle = egc.open_session()
        await wait_until(lambda: deps.gate.total == 1, attempts=1000, interval_s=0.01)
        with pytest.raises(EvergreenError) as refused:
            await collect(deps, "hi")
        assert refused.value.status == "RESOURCE_EXHAUSTED" and "limit of 1 connections" in refused.value.message
        idle.cancel()
        await wait_until(lambda: deps.gate.total == 0, attempts=1000, interval_s=0.01)
        assert await collect(deps, "hi", max_tokens=1) == " t0"


async def test_an_idle_grpc_session_times_out_and_frees_its_place():
    # Regression (issue 12 item 8): a StartSession call that never sent a message was held forever.
    from rill.connections import ConnectionGate

    deps = make_deps(ScriptedClient(), **{"connections.first_message_timeout_s": 0.5})
    deps.gate = ConnectionGate(1, 1)
    async with listening(deps), EvergreenClient(address(deps)) as egc:
        idle = egc.open_session()
        with pytest.raises(EvergreenError) as timed_out:
            await idle.receive()
        assert timed_out.value.status == "DEADLINE_EXCEEDED" and "no message within" in timed_out.value.message
        await wait_until(lambda: deps.gate.total == 0, attempts=1000, interval_s=0.01)
        assert await collect(deps, "hi", max_tokens=1) == " t0"


def test_grpc_peer_host():
    assert adapter.grpc_peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert adapter.grpc_peer_host("ipv6:[2001:db8::1]:5000") == "2001:db8::/64"
    assert adapter.grpc_peer_host("ipv6:%5B2001:db8::1%5D:5000") == "2001:db8::/64"
    assert adapter.grpc_peer_host("unix:/tmp/x") is None


@pytest.mark.parametrize("text", [
    '{"nodeFragments":[{"\\ud800":1}]}',
    "[" * 5000 + "]" * 5000,
    '{"actions":[{"configs":[{"@type":"\\ud800"}]}]}',
    '{"nodeFragments":[{"seq":1' + "0" * 400 + "}]}",
])
def test_websocket_answers_hostile_json_with_invalid_argument_and_ends(text):
    # Issue 12 item 4: the reader died on these, with no reply, no close, and a handler that
    # never finished. Now: close 4003 (INVALID_ARGUMENT) with the reason, and the handler ends
    # (leaving the TestClient blocks would hang otherwise).
    client = ScriptedClient()
    deps = make_deps(client, **{"evergreen.grpc_port": 0})
    with TestClient(Starlette(routes=adapter.routes(deps))) as http:
        with http.websocket_connect("/evergreen") as ws:
            ws.send_text(text)
            with pytest.raises(WebSocketDisconnect) as info:
                ws.receive_text()
        assert info.value.code == 4003 and info.value.reason.startswith("INVALID_ARGUMENT: invalid")
        # the server still serves a normal session afterwards
        with http.websocket_connect("/evergreen") as ws:
            message, _ = prompt_message("hi", config=GenerateConfig(max_tokens=1))
            ws.send_text(codec.encode_json(message))
            assert codec.decode_json(ws.receive_text()).node_fragments[0].chunk_fragment.data == b" t0"
    assert client.requests and len(client.requests) == 1


def test_websocket_reader_bug_aborts_with_internal_instead_of_hanging(monkeypatch):
    def broken(text):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(codec, "decode_json", broken)
    deps = make_deps(ScriptedClient(), **{"evergreen.grpc_port": 0})
    with TestClient(Starlette(routes=adapter.routes(deps))) as http, http.websocket_connect("/evergreen") as ws:
        ws.send_text("{}")
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_text()
    assert (info.value.code, info.value.reason) == (4013, "INTERNAL: internal server error")


async def test_grpc_bytes_that_are_not_a_session_message_are_invalid_argument():
    # Was INTERNAL "internal server error": grpc's own parse failure reached the generic branch.
    import grpc

    deps = make_deps(ScriptedClient())
    async with listening(deps), grpc.aio.insecure_channel(address(deps)) as channel:
        call = channel.stream_stream("/evergreen.v2.EvergreenService/StartSession",
                                     request_serializer=lambda data: data, response_deserializer=lambda data: data)

        async def garbage():
            yield b"\xff\xff\xff\x0f"

        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call(garbage()):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("not a serialized evergreen.v2.SessionMessage")
