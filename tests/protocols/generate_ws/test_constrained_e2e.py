"""/generate with constrained decoding on a real server: ``parameters.response_format`` from the
start, and switched on mid-stream by ``modify`` (it constrains the text generated from then on)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
from websockets.asyncio.client import connect

from .test_adapter import is_status, is_type, recv, send, until

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 50},
        "picks": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["word", "n", "picks", "inner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}


async def _switched_on_mid_stream(server: Any, seed: int) -> tuple[int, int, list[int], str]:
    """(tokens seen when the modify was sent, tokens seen when its status came, all ids, finish)."""
    async with connect(f"{server.ws_url}/generate") as ws:
        # ignore_eos keeps the free part going until the modify arrives; the grammar ends it.
        await send(
            ws,
            type="config",
            prompt="Once upon a time",
            parameters={"max_tokens": 400, "seed": seed, "ignore_eos": True},
            options={"include_token_ids": True},
        )
        head = await until(ws, lambda m: m["type"] == "token")
        num_sent = len([m for m in head if m["type"] == "token"])
        await send(ws, type="control", action="modify", parameters={"response_format": FORMAT})
        head += await until(ws, is_status("modified"))
        tail = await until(ws, is_type("completion"))
    ids = [m["token_id"] for m in head + tail if m["type"] == "token"]
    num_status = len([m for m in head if m["type"] == "token"])
    return num_sent, num_status, ids, tail[-1]["finish_reason"]


def _valid_from(server: Any, ids: list[int], k: int) -> bool:
    try:
        jsonschema.validate(json.loads(server.call(server.client.decode, ids[k:])), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def test_modify_switches_a_json_schema_on_mid_stream_50_of_50(server: Any) -> None:
    runs = []
    for start in range(0, 50, 10):
        runs += await asyncio.gather(*[_switched_on_mid_stream(server, seed) for seed in range(start, start + 10)])
    for num_sent, num_status, ids, finish in runs:
        assert num_sent >= 1, "some free text came before the modify"
        assert finish == "stop"  # the grammar completed well before max_tokens
        # The constraint took effect after the tokens seen when the modify was sent and no
        # later than the status (a slow reader gets tokens and the status coalesced, and the
        # status then follows the tokens): from that token on, the text is valid JSON.
        assert any(_valid_from(server, ids, k) for k in range(num_sent, num_status + 1)), ids
    server.wait_idle()


async def test_response_format_from_the_start_and_bad_ones_are_errors(server: Any) -> None:
    async with connect(f"{server.ws_url}/generate") as ws:
        await send(
            ws, type="config", prompt="Once", parameters={"max_tokens": 300, "seed": 5, "response_format": FORMAT}
        )
        done = await until(ws, is_type("completion"))
        jsonschema.validate(json.loads(done[-1]["generated_text"]), SCHEMA)
        await send(
            ws,
            type="config",
            prompt="Once",
            parameters={"max_tokens": 8, "response_format": {"type": "regex", "regex": "(("}},
        )
        error = await recv(ws)
        assert error["type"] == "error" and error["error"] == "invalid_request"
        assert error.get("field", "").endswith("response_format")
    server.wait_idle()
