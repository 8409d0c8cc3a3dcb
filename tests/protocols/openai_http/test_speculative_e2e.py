"""The OpenAI routes' ``speculative`` extension against a real server that speculates.

Greedy output is the same with speculation on (the default) and off, on ``/v1/completions``
and ``/v1/chat/completions``, streamed; the engine's counters show the drafts were verified
and accepted only when it was on.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import LiveServer
from tests.helpers import SPEC_PROMPT, same_output_with_and_without_speculation, speculative_field

MAX_TOKENS = 48


def _openai(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


async def _completion(client: openai.AsyncOpenAI, extra: dict[str, Any]) -> tuple[str, str | None, int]:
    model = (await client.models.list()).data[0].id
    stream = await client.completions.create(
        model=model,
        prompt=SPEC_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish, chunks[-1].usage.completion_tokens


async def _chat(client: openai.AsyncOpenAI, extra: dict[str, Any]) -> tuple[str, str | None, int]:
    model = (await client.models.list()).data[0].id
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": SPEC_PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("endpoint", [_completion, _chat], ids=["completions", "chat"])
async def test_speculative_false_gives_the_same_text_without_drafts(spec_server: LiveServer, endpoint: Any) -> None:
    client = _openai(spec_server)

    async def run(speculative: bool | None) -> tuple[str, str | None, int]:
        text, finish, num_tokens = await endpoint(client, {"ignore_eos": True, **speculative_field(speculative)})
        assert (finish, num_tokens) == ("length", MAX_TOKENS)
        return text, finish, num_tokens

    async with client:
        await same_output_with_and_without_speculation(spec_server, run)


@pytest.mark.parametrize("endpoint", [_completion, _chat], ids=["completions", "chat"])
@pytest.mark.parametrize("value", ["yes", 99, -1])
async def test_bad_speculative_is_a_400_naming_the_field(spec_server: LiveServer, endpoint: Any, value: Any) -> None:
    async with _openai(spec_server) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await endpoint(client, {"speculative": value})
    body = bad.value.body
    assert (bad.value.status_code, body["type"], body["code"], body["param"]) == (
        400,
        "invalid_request_error",
        "invalid_request",
        "speculative",
    )
    assert "speculative" in body["message"]
    spec_server.wait_idle()
