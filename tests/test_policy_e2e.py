"""One server policy on every protocol, applied at admission (issue 13, point 1): the token cap.

``--max-tokens-cap`` clamps ``max_tokens`` the same way on all six protocols (``/generate``
used to refuse instead): a request asking for more runs, with the cap in force. The engine
is held while the requests are submitted, so the parameters each one was admitted with can
be read before any of them runs (no timing).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import LiveServer, start_server
from tests.test_isolation_e2e import (
    STREAM_LIMIT_S,
    N,
    batch_ws_stream,
    chat_ws_stream,
    evergreen_stream,
    generate_ws_stream,
    openai_stream,
    uds_stream,
    wait_waiting,
)

CAP = 5
assert N > CAP  # every stream below asks for N tokens


@pytest.fixture(scope="module")
def capped(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """Every protocol on (the Unix socket in a temporary folder), ``--max-tokens-cap 5``."""
    sock = tmp_path_factory.mktemp("uds") / "rill.sock"
    server = start_server(
        tiny_model_dir, **{"uds.no_socket": False, "uds.socket": str(sock), "http.max_tokens_cap": CAP}
    )
    yield server
    server.stop()


async def test_the_token_cap_clamps_alike_on_every_protocol(capped: LiveServer) -> None:
    with capped.hold_engine():
        streams = {
            "openai_completion": asyncio.create_task(
                openai_stream(
                    capped,
                    "/v1/completions",
                    {"prompt": "The sun rose over the quiet village and", "max_tokens": N, "ignore_eos": True},
                )
            ),
            "openai_chat": asyncio.create_task(
                openai_stream(
                    capped,
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": N, "ignore_eos": True},
                )
            ),
            "generate_ws": asyncio.create_task(generate_ws_stream(capped, {"max_tokens": N, "ignore_eos": True})),
            "batch_ws": asyncio.create_task(batch_ws_stream(capped)),
            "chat_ws": asyncio.create_task(chat_ws_stream(capped)),
            "framed_uds": asyncio.create_task(uds_stream(capped)),
            "evergreen": asyncio.create_task(evergreen_stream(capped)),
        }
        await wait_waiting(capped, len(streams))
        admitted = capped.call(
            lambda: sorted(
                (t.protocol, s.sampling.max_tokens)
                for t, s in zip(capped.client._tracks.values(), capped.client._streams.values())
            )
        )
    results = await asyncio.wait_for(asyncio.gather(*streams.values()), STREAM_LIMIT_S)
    by_name = dict(zip(streams, results))

    # Every request was admitted, with the cap in force, whatever its protocol asked.
    assert [max_tokens for _, max_tokens in admitted] == [CAP] * len(streams), admitted
    assert {protocol for protocol, _ in admitted} >= {"generate_ws", "batch_ws", "chat_ws", "evergreen", "framed_uds"}
    # And it ran to the cap (or to eos, where the protocol cannot ignore it).
    assert by_name["openai_completion"]["finish"] == by_name["openai_chat"]["finish"] == "length"
    assert by_name["generate_ws"]["count"] == CAP and by_name["generate_ws"]["finish"] == "length"
    assert by_name["chat_ws"]["generated_tokens"] == CAP  # min_new_tokens N is clamped with it
    assert 1 <= by_name["batch_ws"]["new_tokens_count"] <= CAP
    assert 1 <= by_name["framed_uds"]["tokens"] <= CAP
    assert by_name["evergreen"]["text"]
    capped.wait_idle()
