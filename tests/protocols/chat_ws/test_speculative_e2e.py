"""/ws/chat's ``generation.speculative`` against a real server that speculates.

Greedy output is the same with speculation on (the default) and off; the engine's counters
show the drafts were verified and accepted only when it was on. Speech is off (text only).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import LiveServer
from tests.helpers import SPEC_PROMPT, recv_json, same_output_with_and_without_speculation, speculative_field

GREEDY = {"max_new_tokens": 48, "do_sample": False}


async def chat(server: LiveServer, generation: dict[str, Any]) -> tuple[list[dict], int | None]:
    """Every message of one text-only chat, and the close code."""
    body = {"messages": [{"role": "user", "content": SPEC_PROMPT}], "generation": generation, "tts": {"enabled": False}}
    messages = []
    async with connect(f"{server.ws_url}/ws/chat") as ws:
        await ws.send(json.dumps(body))
        try:
            while True:
                messages.append(await recv_json(ws))
        except ConnectionClosed:
            pass
    return messages, ws.close_code


async def test_speculative_false_gives_the_same_text_without_drafts(spec_server: LiveServer) -> None:
    async def run(speculative: bool | None) -> tuple[str, str]:
        messages, _ = await chat(spec_server, {**GREEDY, **speculative_field(speculative)})
        done = messages[-1]
        assert done["type"] == "done" and done["generated_tokens"] == GREEDY["max_new_tokens"], done
        return done["text"], "".join(m.get("text_delta", "") for m in messages if m["type"] == "chunk")

    await same_output_with_and_without_speculation(spec_server, run)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("yes", "$.generation.speculative"),
        (99, "generation: 'speculative' must be"),
        (-1, "generation: 'speculative' must be"),
    ],
)
async def test_bad_speculative_is_an_error_naming_the_field(spec_server: LiveServer, value: Any, words: str) -> None:
    messages, close_code = await chat(spec_server, {**GREEDY, "speculative": value})
    assert len(messages) == 1 and messages[0]["type"] == "error" and words in messages[0]["error"], messages
    assert close_code == 1000
    spec_server.wait_idle()
