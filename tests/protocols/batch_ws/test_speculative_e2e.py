"""Batch /ws's ``generation_config.speculative`` against a real server that speculates.

Greedy output is the same with speculation on (the default) and off; the engine's counters
show the drafts were verified and accepted only when it was on.
"""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.client import connect

from tests.helpers import SPEC_PROMPT, same_output_with_and_without_speculation, speculative_field

from .test_adapter import by_type, events_of, recv_array, run_batch

GREEDY = {"do_sample": False, "num_beams": 1, "max_new_tokens": 48}


async def test_speculative_false_gives_the_same_text_without_drafts(spec_server: Any) -> None:
    async def run(speculative: bool | None) -> tuple[str, str]:
        rid = f"spec-{speculative}"  # a request_id of its own: reusing one would continue that generation
        payload = {
            "prompts": [{"request_id": rid, "prompt": SPEC_PROMPT}],
            "generation_config": {**GREEDY, **speculative_field(speculative)},
        }
        async with connect(spec_server.ws_url + "/ws") as ws:
            frames = await run_batch(ws, payload)
        complete = by_type(frames, "COMPLETE")[rid]
        assert complete["new_tokens_count"] == GREEDY["max_new_tokens"] and not complete["is_eos"]
        return complete["text"], "".join(e["text"] for e in events_of(frames, rid) if e["type"] == "PROGRESS")

    await same_output_with_and_without_speculation(spec_server, run)


async def test_bad_speculative_is_a_socket_error_naming_the_field(spec_server: Any) -> None:
    async with connect(spec_server.ws_url + "/ws") as ws:
        for value, words in (("yes", "$.generation_config.speculative"), (99, "'speculative'"), (-1, "'speculative'")):
            await ws.send(
                json.dumps(
                    {
                        "prompts": [{"request_id": "bad", "prompt": SPEC_PROMPT}],
                        "generation_config": {**GREEDY, "speculative": value},
                    }
                )
            )
            error = (await recv_array(ws))[0]
            assert set(error) == {"error"} and words in error["error"], error
    spec_server.wait_idle()
