"""The framed Unix socket's ``speculative`` request field against a real server that speculates.

Greedy output is the same token for token with speculation on (the default) and off; the
engine's counters show the drafts were verified and accepted only when it was on.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import LiveServer
from tests.helpers import SPEC_PROMPT, same_output_with_and_without_speculation, speculative_field

from .conftest import FramedClient

MAX_TOKENS = 48


async def test_speculative_false_gives_the_same_tokens_without_drafts(spec_server: LiveServer) -> None:
    async def run(speculative: bool | None) -> tuple[list[int], str]:
        conn = await FramedClient.connect(spec_server.config.uds.socket)
        await conn.send(
            {
                "id": "s",
                "prompt": SPEC_PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                **speculative_field(speculative),
            }
        )
        events = await conn.until_end()
        await conn.close()
        tokens = [e for e in events if e["event"] == "token"]
        assert events[-1] == {"event": "eos", "id": "s", "reason": "length"} and len(tokens) == MAX_TOKENS
        return [t["token_id"] for t in tokens], "".join(t["text"] for t in tokens)

    await same_output_with_and_without_speculation(spec_server, run)


@pytest.mark.parametrize("value", ["yes", 99, -1])
async def test_bad_speculative_is_a_bad_request_naming_the_field(spec_server: LiveServer, value: Any) -> None:
    conn = await FramedClient.connect(spec_server.config.uds.socket)
    await conn.send({"id": "bad", "prompt": SPEC_PROMPT, "speculative": value})
    event = await conn.recv()
    assert (event["event"], event["code"], event["id"]) == ("error", "E_PROTO_BAD_REQUEST", "bad")
    assert "speculative" in event["message"]
    assert await conn.is_closed()
    await conn.close()
    spec_server.wait_idle()
