"""A protocol a newcomer adds: ``tests/fixtures/lines`` (four files written against the session
driver) served beside the six real ones by one registration line, and answering like them.

What ``docs/ARCHITECTURE.md`` ("Adding a protocol") promises, checked: the new protocol needs
only its own files and one ``rill.server.Protocol`` entry; its session and codec are pure; a
client gets one line per token, the same text ``/v1/completions`` gives, a refusal in the
protocol's own format, and a dropped connection frees the request's KV memory.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from rill import config as config_mod
from rill.server import Protocol, protocols, serve
from rill.testing.fake_client import fake_client
from tests.conftest import free_port
from tests.fixtures.lines import adapter as lines
from tests.protocols.test_purity import FORBIDDEN, forbidden_in, imported_modules

FIXTURE = Path(lines.__file__).parent


async def serving_lines(client: Any, body: Any) -> None:
    """Run ``serve`` with the six protocols plus ``lines`` (the one registration line), call
    ``body(http_port, lines_port)``, then stop."""
    http_port, lines_port = free_port(), free_port()
    cfg = config_mod.load(
        {
            "engine.model": "fake-model",
            "http.port": http_port,
            "http.log_level": "warning",
            "uds.no_socket": True,
            "evergreen.grpc_port": 0,
        },
        env={},
    )
    ready, stop = asyncio.Event(), asyncio.Event()
    registered = (*protocols(), Protocol("lines", start=lines.listener(lines_port)))
    task = asyncio.create_task(serve(cfg, client=client, ready=ready, stop=stop, served=registered))
    await asyncio.wait({task, asyncio.create_task(ready.wait())}, return_when=asyncio.FIRST_COMPLETED)
    try:
        await body(http_port, lines_port)
    finally:
        stop.set()
        await task


async def ask(port: int, *lines_out: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for line in lines_out:
        writer.write(line)
    await writer.drain()
    return reader, writer


async def read_until_end(reader: asyncio.StreamReader) -> list[dict[str, Any]]:
    got = []
    while True:
        got.append(json.loads(await asyncio.wait_for(reader.readline(), 30)))
        if "finish_reason" in got[-1] or "error" in got[-1]:
            return got


def test_the_new_protocol_is_only_its_own_files_and_its_session_and_codec_are_pure() -> None:
    assert sorted(p.name for p in FIXTURE.glob("*.py")) == [
        "__init__.py",
        "adapter.py",
        "codec.py",
        "messages.py",
        "session.py",
    ]
    for name in ("messages.py", "codec.py", "session.py"):
        path = FIXTURE / name
        source = path.read_text()
        assert not forbidden_in(imported_modules(path, "tests.fixtures.lines"), FORBIDDEN), name
        assert "await " not in source and "async def" not in source, name


async def test_a_prompt_gets_a_line_per_token_with_the_text_of_v1_completions() -> None:
    async with fake_client() as client:

        async def body(http_port: int, lines_port: int) -> None:
            reader, writer = await ask(lines_port, b'{"prompt": "once upon", "max_tokens": 12}\n')
            got = await read_until_end(reader)
            tokens, done = got[:-1], got[-1]
            assert done == {"finish_reason": "length", "tokens": 12} and len(tokens) == 12
            async with httpx.AsyncClient(timeout=30) as http:
                reply = await http.post(
                    f"http://127.0.0.1:{http_port}/v1/completions",
                    json={"model": "fake-model", "prompt": "once upon", "max_tokens": 12, "temperature": 0},
                )
            assert "".join(t["token"] for t in tokens) == reply.json()["choices"][0]["text"]
            # A bad line is refused in the protocol's own format; the connection goes on.
            writer.write(b'{"prompt": 7}\n{"prompt": "again", "max_tokens": 2}\n')
            refused = json.loads(await asyncio.wait_for(reader.readline(), 30))
            assert refused["error"]["code"] == "invalid_request" and "prompt" in refused["error"]["message"]
            assert (await read_until_end(reader))[-1] == {"finish_reason": "length", "tokens": 2}
            writer.close()

        await serving_lines(client, body)


async def test_a_dropped_connection_frees_the_request() -> None:
    async with fake_client() as client:
        client.engine.runner.delay_s = 0.01  # a slow model: the request is still running when the client leaves

        async def body(http_port: int, lines_port: int) -> None:
            reader, writer = await ask(lines_port, b'{"prompt": "long", "max_tokens": 400}\n')
            json.loads(await asyncio.wait_for(reader.readline(), 30))  # the first token: it runs
            assert client.stats().num_running == 1
            writer.close()
            async with asyncio.timeout(30):
                while (stats := client.stats()).num_running or stats.kv_used_bytes:
                    await asyncio.sleep(0.01)  # polls engine state: the abort crosses a thread

        await serving_lines(client, body)
