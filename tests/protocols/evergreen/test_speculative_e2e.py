"""Evergreen's ``GenerateConfig.speculative`` against a real server that speculates, over gRPC.

Greedy output is the same with speculation on (the field unset: the server's) and off (0);
the engine's counters show the drafts were verified and accepted only when it was on.
"""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from rill.clients.evergreen import EvergreenClient, EvergreenError, prompt_message
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import InvalidMessage
from rill.protocols.evergreen.messages import GENERATE_CONFIG_TYPE_URL, GenerateConfig
from tests.conftest import LiveServer
from tests.helpers import SPEC_PROMPT, same_output_with_and_without_speculation

MAX_TOKENS = 48


def grpc_address(server: LiveServer) -> str:
    return f"127.0.0.1:{server.config.evergreen.grpc_port}"


async def generate(server: LiveServer, config: GenerateConfig) -> str:
    async with EvergreenClient(grpc_address(server)) as client:
        return "".join([piece async for piece in client.generate(SPEC_PROMPT, config=config)])


async def test_speculative_0_gives_the_same_text_without_drafts(spec_server: LiveServer) -> None:
    async def run(speculative: bool | None) -> tuple[str, int]:
        before = spec_server.stats().generation_tokens_total
        config = GenerateConfig(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            speculative=None if speculative is None else int(speculative),
        )
        text = await generate(spec_server, config)
        num_tokens = spec_server.wait_idle().generation_tokens_total - before
        assert text and num_tokens == MAX_TOKENS
        return text, num_tokens

    await same_output_with_and_without_speculation(spec_server, run)


@pytest.mark.parametrize("value", [99, -1])
async def test_out_of_range_speculative_is_invalid_argument_naming_it(spec_server: LiveServer, value: int) -> None:
    with pytest.raises(EvergreenError) as info:
        await generate(spec_server, GenerateConfig(max_tokens=4, speculative=value))
    assert info.value.status == "INVALID_ARGUMENT" and "'speculative'" in info.value.message
    spec_server.wait_idle()


async def test_a_speculative_of_the_wrong_type_is_refused_over_the_websocket(spec_server: LiveServer) -> None:
    # Over gRPC the field is an int32; proto3 JSON (the /evergreen WebSocket) can carry a string.
    message, _ = prompt_message(SPEC_PROMPT, config=GenerateConfig(max_tokens=4))
    body = json.loads(codec.encode_json(message))
    body["actions"][0]["configs"] = [{"@type": GENERATE_CONFIG_TYPE_URL, "speculative": "yes"}]
    with pytest.raises(InvalidMessage, match="Failed to parse speculative field"):
        codec.decode_json(json.dumps(body))
    async with ws_connect(f"{spec_server.ws_url}/evergreen") as ws:
        await ws.send(json.dumps(body))
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
    # NOTE: a close reason holds at most 123 bytes, too few for the parser's path to the field.
    close = info.value.rcvd
    assert close.code == 4003 and close.reason.startswith("INVALID_ARGUMENT: invalid SessionMessage")
    spec_server.wait_idle()
