"""rill.clients.generate: the Python client and `rill client generate` (Ctrl-C → stop)."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import pytest

from rill.clients.generate import GenerateClient, GenerateError
from rill.testing.fake_runner import ALPHABET
from tests.helpers import wait_until


async def test_client_generate_control_and_feedback(make_server: Any) -> None:
    live = await make_server()
    async with GenerateClient(live.ws) as client:
        msgs = [m async for m in client.generate("Hi", max_tokens=3)]
        assert [m["type"] for m in msgs] == ["init", "token", "token", "token", "completion"]
        assert client.request_id == msgs[0]["request_id"]
        ack = await client.feedback(0.5, text="ok")
        assert ack["operation"] == "feedback_received"
        seen = []
        async for msg in client.generate("Hi", max_tokens=100000):
            seen.append(msg)
            if msg["type"] == "token" and len(seen) == 3:
                await client.stop()
        assert seen[-1]["finish_reason"] == "cancelled"
        with pytest.raises(GenerateError) as info:
            async for _ in client.generate("Hi", temperature=-1):
                pass
        assert info.value.message["field"] == "parameters.temperature"


async def test_cli_streams_and_ctrl_c_sends_stop(make_server: Any) -> None:
    live = await make_server()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rill",
        "client",
        "generate",
        "--prompt",
        "Hi",
        "--url",
        live.ws,
        "--max-tokens",
        "1000000",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    first = await proc.stdout.read(1)  # the first token's text is on the terminal
    assert first.decode() in ALPHABET  # what the fake model writes
    proc.send_signal(signal.SIGINT)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert b"[cancelled:" in err
    await wait_until(live.is_idle, attempts=500, interval_s=0.005)
    assert live.num_cancelled() == 1 and len(live.requests) == 1
