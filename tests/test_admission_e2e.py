"""One admission step for every protocol (issue 13, point 1), on one real ``rill serve``.

The server runs with API keys, ``--max-tokens-cap 4`` and ``--rate-limit-requests 10`` per
hour (so no timing can matter). On each protocol: an empty and a wrong key are refused in the
protocol's own way; a request asking for more than the cap runs, clamped (``/generate``'s
``init`` reports the clamped ``max_tokens``); nine more run; the
11th in the window is refused with the protocol's rate-limit error. Every protocol has its own
key, hence its own principal and window. Tokens are counted by the engine's own
counter around each request (requests run one at a time), whatever the protocol reports.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from rill.clients.evergreen import EvergreenClient, EvergreenError, Session
from rill.clients.uds import UdsClient
from rill.protocols.evergreen import codec as evergreen_codec
from rill.protocols.evergreen.messages import GenerateConfig
from tests.conftest import LiveServer, free_port, start_server
from tests.helpers import recv_json
from tests.protocols.evergreen.helpers import customized_generate

CAP = 4
LIMIT = 10
ASK = 50  # max_tokens of the request over the cap
PROMPT = "The sun rose over the quiet village and"
WAIT_S = 120  # a hang fails the test; never a pass condition

PROTOCOLS = ("generate_ws", "batch_ws", "chat_ws", "evergreen_grpc", "evergreen_ws", "openai_http", "framed_uds")
KEYS = {protocol: f"key-{protocol}" for protocol in PROTOCOLS}


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """Every protocol on, one key per protocol, the token cap and the request rate limit."""
    sock = tmp_path_factory.mktemp("uds") / "rill.sock"
    server = start_server(
        tiny_model_dir,
        **{
            "uds.no_socket": False,
            "uds.socket": str(sock),
            "evergreen.grpc_port": free_port(),
            "http.api_key": list(KEYS.values()),
            "http.max_tokens_cap": CAP,
            "http.rate_limit_requests": LIMIT,
            "http.rate_limit_window": 3600.0,
        },
    )
    yield server
    server.stop()


class Refused(Exception):
    """A request the server refused: ``kind`` names the protocol's signal (status, code, close code)."""

    def __init__(self, kind: Any, detail: Any = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def bearer(key: str) -> dict[str, str]:
    """The header presenting ``key``; an empty key is the scheme alone (HTTP forbids a trailing space)."""
    return {"Authorization": f"Bearer {key}".rstrip()}


# -- one request per protocol: the reported completion-token count (None: not reported), or Refused -------


async def generate_ws(live: LiveServer, key: str, max_tokens: int) -> int | None:
    # Raw socket rather than rill.clients.generate: that client sends no header for an empty key.
    config = {"type": "config", "prompt": PROMPT, "parameters": {"max_tokens": max_tokens, "ignore_eos": True}}
    try:
        async with connect(f"{live.ws_url}/generate", additional_headers=bearer(key)) as ws:
            await ws.send(json.dumps(config))
            while True:
                msg = await recv_json(ws)
                if msg["type"] == "error":
                    raise Refused(msg["error"], msg)
                if msg["type"] == "init":  # reports the parameters in force: the clamped max_tokens
                    assert msg["parameters"]["max_tokens"] == min(max_tokens, CAP), msg
                if msg["type"] == "completion":
                    return msg["usage"]["completion_tokens"]
    except InvalidStatus as exc:
        raise Refused(exc.response.status_code) from exc


async def batch_ws(live: LiveServer, key: str, max_tokens: int) -> int | None:
    try:
        async with connect(f"{live.ws_url}/ws", additional_headers=bearer(key)) as ws:
            await ws.send(
                json.dumps(
                    {
                        "prompts": [{"request_id": uuid.uuid4().hex, "prompt": PROMPT}],
                        "generation_config": {"do_sample": False, "max_new_tokens": max_tokens},
                    }
                )
            )
            while True:
                for event in await recv_json(ws):
                    if event.get("type") == "ERROR" or "error" in event:
                        raise Refused("ERROR", event)
                    if event.get("type") == "COMPLETE":
                        return event["new_tokens_count"]
    except InvalidStatus as exc:
        raise Refused(exc.response.status_code) from exc


async def chat_ws(live: LiveServer, key: str, max_tokens: int) -> int | None:
    request = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "tts": {"enabled": False},
        "generation": {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens},
    }
    try:
        async with connect(f"{live.ws_url}/ws/chat", additional_headers=bearer(key)) as ws:
            await ws.send(json.dumps(request))
            while True:
                msg = await recv_json(ws)
                if msg["type"] == "done":
                    return msg["generated_tokens"]
                if msg["type"] == "error":
                    with pytest.raises(ConnectionClosed) as closed:
                        await ws.recv()
                    assert closed.value.rcvd is not None
                    raise Refused(closed.value.rcvd.code, msg)
    except InvalidStatus as exc:
        raise Refused(exc.response.status_code) from exc


async def evergreen_grpc(live: LiveServer, key: str, max_tokens: int) -> int | None:
    config = GenerateConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with EvergreenClient(f"127.0.0.1:{live.config.evergreen.grpc_port}", api_key=key) as client:
        if not key:  # the shared client sends no metadata for an empty key: send an empty bearer
            from rill.protocols.evergreen._pb import evergreen_service_pb2_grpc as service_grpc

            stub = service_grpc.EvergreenServiceStub(client._channel)
            client.open_session = lambda: Session(stub.StartSession(metadata=(("authorization", "Bearer"),)))
        try:
            text = "".join([piece async for piece in client.generate(PROMPT, config=config)])
        except EvergreenError as exc:
            raise Refused(exc.status, exc.message) from exc
    assert text
    return None  # Evergreen reports text, not token counts


async def evergreen_ws(live: LiveServer, key: str, max_tokens: int) -> int | None:
    config = GenerateConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        async with connect(f"{live.ws_url}/evergreen", additional_headers=bearer(key)) as ws:
            for message in customized_generate(config):
                await ws.send(evergreen_codec.encode_json(message))
            while True:
                try:
                    reply = evergreen_codec.decode_json(await ws.recv())
                except ConnectionClosed as exc:
                    assert exc.rcvd is not None
                    raise Refused(exc.rcvd.code, exc.rcvd.reason) from exc
                if any(f.id == "response_1" and not f.continued for f in reply.node_fragments):
                    return None
    except InvalidStatus as exc:
        raise Refused(exc.response.status_code) from exc


async def openai_http(live: LiveServer, key: str, max_tokens: int) -> int | None:
    async with httpx.AsyncClient(base_url=live.url, timeout=WAIT_S) as http:
        res = await http.post(
            "/v1/completions",
            headers=bearer(key),
            json={"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True},
        )
    if res.status_code != 200:
        raise Refused(res.status_code, res)
    return res.json()["usage"]["completion_tokens"]


async def framed_uds(live: LiveServer, key: str, max_tokens: int) -> int | None:
    def run() -> list[dict[str, Any]]:
        with UdsClient(live.config.uds.socket) as client:
            return list(
                client.generate({"id": uuid.uuid4().hex, "prompt": PROMPT, "max_tokens": max_tokens, "api_key": key})
            )

    events = await asyncio.to_thread(run)
    if events[-1]["event"] == "error":
        raise Refused(events[-1]["code"], events[-1])
    assert events[-1]["event"] == "eos", events
    return sum(1 for e in events if e["event"] == "token")


CLIENTS: dict[str, Callable[[LiveServer, str, int], Awaitable[int | None]]] = {
    "generate_ws": generate_ws,
    "batch_ws": batch_ws,
    "chat_ws": chat_ws,
    "evergreen_grpc": evergreen_grpc,
    "evergreen_ws": evergreen_ws,
    "openai_http": openai_http,
    "framed_uds": framed_uds,
}

RATE_LIMITED = {
    "generate_ws": "rate_limited",
    "batch_ws": "ERROR",
    "chat_ws": 1013,  # close: try again later
    "evergreen_grpc": "RESOURCE_EXHAUSTED",
    "evergreen_ws": 4008,  # close: 4000 + RESOURCE_EXHAUSTED
    "openai_http": 429,
    "framed_uds": "E_LIMIT_RATE_LIMITED",
}
"""How each protocol says "rate limited"."""

UNAUTHENTICATED = dict.fromkeys(PROTOCOLS, 401) | {
    "evergreen_grpc": "UNAUTHENTICATED",
    "framed_uds": "E_AUTH_UNAUTHORIZED",
}
"""How each protocol refuses a key: WebSocket handshakes and HTTP answer 401, gRPC and the Unix
socket their own codes."""

ENDS_AT_THE_CAP = {"generate_ws", "chat_ws", "evergreen_grpc", "evergreen_ws", "openai_http"}
"""Protocols that can ask to ignore eos (or set a minimum), so the clamped request runs to the cap."""


def generated(live: LiveServer) -> int:
    return live.stats().generation_tokens_total


async def request(live: LiveServer, protocol: str, max_tokens: int) -> tuple[int | None, int]:
    """One request with the protocol's key: what it reported and how many tokens the engine made."""
    before = generated(live)
    reported = await asyncio.wait_for(CLIENTS[protocol](live, KEYS[protocol], max_tokens), WAIT_S)
    live.wait_idle()
    return reported, generated(live) - before


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_empty_or_wrong_key_is_refused(live: LiveServer, protocol: str) -> None:
    before = generated(live)
    for key in ("", "not-a-key", KEYS[protocol] + "x"):
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(CLIENTS[protocol](live, key, 1), WAIT_S)
        assert refused.value.kind == UNAUTHENTICATED[protocol], refused.value
    assert generated(live) == before  # nothing ran


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_cap_clamps_and_the_eleventh_request_is_refused(live: LiveServer, protocol: str) -> None:
    reported, made = await request(live, protocol, ASK)  # over the cap: clamped, not refused
    assert 1 <= made <= CAP
    if protocol in ENDS_AT_THE_CAP:
        assert made == CAP
    assert reported in (None, made)
    for _ in range(LIMIT - 1):
        await request(live, protocol, 1)
    with pytest.raises(Refused) as refused:
        await request(live, protocol, 1)
    assert refused.value.kind == RATE_LIMITED[protocol], refused.value
    detail = refused.value.detail
    if protocol == "openai_http":
        assert detail.json()["error"]["type"] == "rate_limit_error" and int(detail.headers["Retry-After"]) > 3500
    elif protocol == "generate_ws":
        assert detail["recoverable"] is True and detail["retry_after_seconds"] > 3500
    elif protocol == "batch_ws":
        assert detail["error"].startswith(f"rate limit reached: {LIMIT} requests per 3600 s; retry in")
    else:  # the retry time is in the message (gRPC, a close reason, an error frame)
        text = str(detail if not isinstance(detail, dict) else detail.get("message") or detail.get("error"))
        assert "rate limit reached" in text and "retry in" in text, text
