"""/generate's ``speculative`` parameter against a real server that speculates (prompt lookup).

Greedy output is the same token for token with speculation on (the default) and off; the
engine's counters show the drafts were verified and accepted only when it was on. ``modify``
carries the field too.
"""

from __future__ import annotations

from typing import Any

from websockets.asyncio.client import connect

from tests.helpers import SPEC_PROMPT, recv_json, same_output_with_and_without_speculation, speculative_field

from .test_adapter import is_status, is_type, send, until

GREEDY = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}


def token_ids(msgs: list[dict]) -> list[int]:
    return [m["token_id"] for m in msgs if m["type"] == "token"]


async def test_speculative_false_gives_the_same_tokens_without_drafts(spec_server: Any) -> None:
    async def run(speculative: bool | None) -> tuple[list[int], str]:
        async with connect(f"{spec_server.ws_url}/generate") as ws:
            await send(
                ws,
                type="config",
                prompt=SPEC_PROMPT,
                parameters={**GREEDY, **speculative_field(speculative)},
                options={"include_token_ids": True},
            )
            msgs = await until(ws, is_type("completion"))
        assert msgs[0]["type"] == "init" and msgs[0]["parameters"]["speculative"] is (speculative is None)
        assert len(token_ids(msgs)) == GREEDY["max_tokens"]
        return token_ids(msgs), msgs[-1]["generated_text"]

    await same_output_with_and_without_speculation(spec_server, run)


async def test_modify_speculative_false_stops_drafting_and_keeps_the_tokens(spec_server: Any) -> None:
    params = {**GREEDY, "max_tokens": 400}
    async with connect(f"{spec_server.ws_url}/generate") as ws:
        await send(
            ws,
            type="config",
            prompt=SPEC_PROMPT,
            parameters={**params, "speculative": False},
            options={"include_token_ids": True},
        )
        plain = token_ids(await until(ws, is_type("completion")))
        await send(ws, type="config", prompt=SPEC_PROMPT, parameters=params, options={"include_token_ids": True})
        head = await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"speculative": False})
        head += await until(ws, is_status("modified"))
        at_modify = spec_server.stats()
        tail = await until(ws, is_type("completion"))
    assert head[-1]["parameters"]["speculative"] is False
    assert len(token_ids(tail)) > 100  # plenty of tokens were generated after the modify ...
    assert spec_server.wait_idle().spec_draft_tokens_total == at_modify.spec_draft_tokens_total  # ... none drafted
    assert token_ids(head + tail) == plain


async def test_bad_speculative_is_an_invalid_request_naming_the_field(spec_server: Any) -> None:
    async with connect(f"{spec_server.ws_url}/generate") as ws:
        for value in ("yes", 99, -1):
            await send(ws, type="config", prompt=SPEC_PROMPT, parameters={**GREEDY, "speculative": value})
            err = await recv_json(ws)
            assert (err["type"], err["error"], err["field"], err["recoverable"]) == (
                "error",
                "invalid_request",
                "parameters.speculative",
                True,
            ), err
        await send(ws, type="config", prompt=SPEC_PROMPT, parameters={**GREEDY, "max_tokens": 400})
        await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"speculative": 17})
        err = await until(ws, is_type("error"))
        assert (err[-1]["error"], err[-1]["field"], err[-1]["recoverable"]) == (
            "invalid_request",
            "parameters.speculative",
            True,
        )
        await send(ws, type="control", action="stop")
        assert (await until(ws, is_type("completion")))[-1]["finish_reason"] == "cancelled"
    spec_server.wait_idle()


async def test_a_disconnect_mid_speculation_frees_the_kv(spec_server: Any) -> None:
    """The client goes away while drafts are being verified: the request ends and its KV rows
    (accepted and rejected positions alike) are freed."""
    before = spec_server.wait_idle()
    async with connect(f"{spec_server.ws_url}/generate") as ws:
        await send(
            ws,
            type="config",
            prompt=SPEC_PROMPT,
            parameters={**GREEDY, "max_tokens": 2000},
            options={"include_token_ids": True},
        )
        seen = []
        await until(ws, lambda m: m["type"] == "token" and (seen.append(m) or len(seen) >= 20))
        assert spec_server.stats().spec_draft_tokens_total > before.spec_draft_tokens_total
    stats = spec_server.wait_idle()
    assert stats.kv_used_tokens == 0 and stats.num_running == 0
    assert stats.requests_finished_total.get("cancelled", 0) > before.requests_finished_total.get("cancelled", 0)
