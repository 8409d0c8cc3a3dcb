"""``ResponseSession`` (pure) driven by golden vectors: engine outputs in, SSE bytes or JSON out.

``vectors/session.json`` holds each case's outputs (``[choice index, RequestOutput]``) and the
exact events (streamed) or body (not streamed) expected; it doubles as documentation of the
wire shapes. Token strings come from ``token_text`` = ``"<id>"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rill.errors import EngineDead
from rill.protocols.openai_http.session import EchoPrompt, Kind, ResponseSession
from rill.types import RequestOutput, TokenLogprob, TopLogprob, Usage

CASES = json.loads((Path(__file__).parent / "vectors" / "session.json").read_text())


def _session(case: dict[str, Any]) -> ResponseSession:
    return ResponseSession(
        kind=Kind.CHAT if case["kind"] == "chat" else Kind.COMPLETION,
        response_id="id-1",
        created=1,
        model="m",
        num_choices=case["num_choices"],
        n=case["n"],
        include_usage=case["include_usage"],
        logprobs=case["logprobs"],
        token_text=lambda token_id: f"<{token_id}>",
    )


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_session_vectors(case: dict[str, Any]) -> None:
    session = _session(case)
    events: list[bytes] = session.start() if case["stream"] else []
    for index, output in case["outputs"]:
        produced = session.on_output(index, msgspec.convert(output, RequestOutput))
        if case["stream"]:
            events += produced
        if session.failed is not None:
            break
    if case["stream"]:
        events += session.end()
        assert [e.decode() for e in events] == case["expected"]
    elif session.failed is not None:
        assert case["expected"] == {"failed": type(session.failed).__name__}
    else:
        assert session.is_done
        assert json.loads(session.body()) == case["expected"]


def test_outputs_with_nothing_to_show_produce_no_event() -> None:
    session = _session({"kind": "completion", "num_choices": 1, "n": 1, "include_usage": False, "logprobs": None})
    assert session.on_output(0, RequestOutput(request_id="r", events=[])) == []
    assert not session.is_done


def test_outside_failure_is_reported_once() -> None:
    session = _session({"kind": "chat", "num_choices": 2, "n": 2, "include_usage": True, "logprobs": None})
    (event,) = session.fail(EngineDead("the engine stopped"))
    assert json.loads(event.decode()[len("data: ") :])["error"]["code"] == "engine_dead"
    assert session.fail(EngineDead()) == []
    assert session.on_output(0, RequestOutput(request_id="r", text="late")) == []
    assert session.end() == [b"data: [DONE]\n\n"]  # no usage chunk after a failure


def test_unexpected_failure_text_is_not_shown() -> None:
    session = _session({"kind": "completion", "num_choices": 1, "n": 1, "include_usage": False, "logprobs": None})
    (event,) = session.fail(RuntimeError("secret detail /etc/passwd"))
    error = json.loads(event.decode()[len("data: ") :])["error"]
    assert "secret" not in error["message"] and error["code"] == "internal_error"


CALL_TEXT = [
    "Checking.\n<tool_",
    'call>\n{"name": "get_weather", "argu',
    'ments": {"city": "Pa',
    'ris"}}\n</tool_call>',
]


def _tool_session() -> ResponseSession:
    return ResponseSession(
        kind=Kind.CHAT, response_id="id-1", created=1, model="m", num_choices=1, tool_format="hermes"
    )


def test_tool_calls_stream_as_openai_does() -> None:
    session = _tool_session()
    session.start()
    chunks = []
    for i, text in enumerate(CALL_TEXT):
        last = i == len(CALL_TEXT) - 1
        out = RequestOutput(request_id="r", text=text, finished=last, finish_reason="stop" if last else None)
        chunks += [json.loads(e.decode().removeprefix("data: ")) for e in session.on_output(0, out)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking.\n"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:])
    assert len(calls) > 2, "arguments arrive in several fragments"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_in_a_body() -> None:
    session = _tool_session()
    for i, text in enumerate(CALL_TEXT):
        last = i == len(CALL_TEXT) - 1
        session.on_output(
            0, RequestOutput(request_id="r", text=text, finished=last, finish_reason="stop" if last else None)
        )
    choice = json.loads(session.body())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("is_streaming", [False, True])
def test_a_call_cut_by_max_tokens_comes_back_as_far_as_it_was_written(is_streaming: bool) -> None:
    # OpenAI's answer to a forced call cut short: the call with its arguments so far, and
    # finish_reason length; the body shows what a stream of the same output showed.
    session = _tool_session()
    pieces = ["<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Par']
    events: list[bytes] = session.start() if is_streaming else []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput(request_id="r", text=text, finished=last, finish_reason="length" if last else None)
        events += session.on_output(0, out)
    if is_streaming:
        chunks = [json.loads(e.decode().removeprefix("data: ")) for e in events if e.startswith(b"data: {")]
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        name, arguments = calls[0]["function"]["name"], "".join(tc["function"].get("arguments", "") for tc in calls)
        finish = chunks[-1]["choices"][0]["finish_reason"]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    else:
        choice = json.loads(session.body())["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None and call["id"].startswith("call_")
        name, arguments, finish = call["function"]["name"], call["function"]["arguments"], choice["finish_reason"]
    assert (name, arguments, finish) == ("get_weather", '{"city": "Par', "length")


def test_text_without_a_call_keeps_stop() -> None:
    session = _tool_session()
    session.on_output(0, RequestOutput(request_id="r", text="no call <tool", finished=True, finish_reason="stop"))
    choice = json.loads(session.body())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "no call <tool"
    assert "tool_calls" not in choice["message"]


FENCED_CALL = ['```json\n{"name": "get_weather", "argu', 'ments": {"city": "Paris"}}\n``', "`\n"]


def _text_call_session() -> ResponseSession:
    def is_declared(name: str, arguments: dict) -> bool:
        return name == "get_weather" and isinstance(arguments.get("city"), str)

    return ResponseSession(
        kind=Kind.CHAT,
        response_id="id-1",
        created=1,
        model="m",
        num_choices=1,
        tool_format="hermes",
        text_calls=is_declared,
    )


def test_a_reply_that_is_only_a_fenced_call_streams_as_a_call() -> None:
    session = _text_call_session()
    session.start()
    chunks = []
    for i, text in enumerate(FENCED_CALL):
        last = i == len(FENCED_CALL) - 1
        out = RequestOutput(request_id="r", text=text, finished=last, finish_reason="stop" if last else None)
        chunks += [json.loads(e.decode().removeprefix("data: ")) for e in session.on_output(0, out)]
    (chunk,) = chunks  # held until the end: more text could still follow the block
    assert chunk["choices"][0]["finish_reason"] == "tool_calls"
    delta = chunk["choices"][0]["delta"]
    assert delta.get("content") is None
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_reply_that_is_only_a_fenced_call_in_a_body() -> None:
    session = _text_call_session()
    for i, text in enumerate(FENCED_CALL):
        last = i == len(FENCED_CALL) - 1
        out = RequestOutput(request_id="r", text=text, finished=last, finish_reason="stop" if last else None)
        session.on_output(0, out)
    choice = json.loads(session.body())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_fenced_call_with_prose_stays_the_answer() -> None:
    session = _text_call_session()
    text = "".join(FENCED_CALL) + "I would call that."
    session.on_output(0, RequestOutput(request_id="r", text=text, finished=True, finish_reason="stop"))
    choice = json.loads(session.body())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text
    assert "tool_calls" not in choice["message"]


# -- echo, prompt logprobs and best_of ----------------------------------------------------------


def _prompt_logprobs() -> list[TokenLogprob | None]:
    # Prompt [7, 8, 9]: token 8 was the 2nd most likely (after 4), token 9 the most likely.
    return [
        None,
        TokenLogprob(token_id=8, logprob=-1.5, rank=2, top=[TopLogprob(4, -0.5), TopLogprob(5, -2.0)]),
        TokenLogprob(token_id=9, logprob=-0.1, rank=1, top=[TopLogprob(6, -3.0), TopLogprob(4, -4.0)]),
    ]


def _echo_session(stream_logprobs: int | None, prompt_logprobs: int | None = None) -> ResponseSession:
    return ResponseSession(
        kind=Kind.COMPLETION,
        response_id="id-1",
        created=1,
        model="m",
        num_choices=1,
        logprobs=stream_logprobs,
        token_text=lambda token_id: f"<{token_id}>",
        echo=[EchoPrompt(text="<7><8><9>", token_ids=[7, 8, 9])],
        prompt_logprobs=prompt_logprobs,
    )


def _data(event: bytes) -> dict[str, Any]:
    return json.loads(event.decode()[len("data: ") :])


def test_streamed_echo_waits_for_the_prompt_logprobs_then_leads_the_first_chunk() -> None:
    session = _echo_session(1)
    assert session.on_output(0, RequestOutput(request_id="r", events=[])) == []  # queued: nothing to show yet
    first = RequestOutput(
        request_id="r",
        text="<3>",
        token_ids=[3],
        prompt_logprobs=_prompt_logprobs(),
        logprobs=[TokenLogprob(token_id=3, logprob=-0.7, top=[TopLogprob(2, -0.2)])],
    )
    [event] = session.on_output(0, first)
    choice = _data(event)["choices"][0]
    assert choice["text"] == "<7><8><9><3>"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<7>", "<8>", "<9>", "<3>"]
    assert lp["token_logprobs"] == [None, -1.5, -0.1, -0.7]
    assert lp["top_logprobs"] == [
        None,
        {"<4>": -0.5, "<8>": -1.5},
        {"<9>": -0.1, "<6>": -3.0},
        {"<2>": -0.2, "<3>": -0.7},
    ]
    assert lp["text_offset"] == [0, 3, 6, 9]
    [event] = session.on_output(
        0,
        RequestOutput(
            request_id="r",
            text="<5>",
            token_ids=[5],
            finished=True,
            finish_reason="length",
            logprobs=[TokenLogprob(token_id=5, logprob=-1.0)],
        ),
    )
    assert _data(event)["choices"][0]["logprobs"]["text_offset"] == [12]


def test_a_choice_is_held_until_its_prompts_logprobs_arrive_with_the_first_candidate() -> None:
    session = ResponseSession(
        kind=Kind.COMPLETION,
        response_id="id-1",
        created=1,
        model="m",
        num_choices=2,
        n=2,
        logprobs=0,
        token_text=lambda token_id: f"<{token_id}>",
        echo=[EchoPrompt(text="<7><8><9>", token_ids=[7, 8, 9])],
    )
    # The second candidate asks no prompt logprobs: its tokens (even its end) wait for the first's.
    assert (
        session.on_output(
            1,
            RequestOutput(request_id="b", text="<3>", token_ids=[3], logprobs=[TokenLogprob(token_id=3, logprob=-0.7)]),
        )
        == []
    )
    assert (
        session.on_output(
            1,
            RequestOutput(
                request_id="b",
                text="<4>",
                token_ids=[4],
                finished=True,
                finish_reason="length",
                logprobs=[TokenLogprob(token_id=4, logprob=-0.9)],
            ),
        )
        == []
    )
    events = session.on_output(
        0,
        RequestOutput(
            request_id="a",
            text="<5>",
            token_ids=[5],
            prompt_logprobs=_prompt_logprobs(),
            logprobs=[TokenLogprob(token_id=5, logprob=-0.2)],
        ),
    )
    first, second = (_data(e)["choices"][0] for e in events)
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "<7><8><9><5>", None)
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "<7><8><9><3><4>", "length")
    assert second["logprobs"]["token_logprobs"] == [None, -1.5, -0.1, -0.7, -0.9]
    assert second["logprobs"]["text_offset"] == [0, 3, 6, 9, 12]
    [event] = session.on_output(
        0,
        RequestOutput(
            request_id="a",
            text="<6>",
            token_ids=[6],
            finished=True,
            finish_reason="length",
            logprobs=[TokenLogprob(token_id=6, logprob=-0.3)],
        ),
    )
    assert _data(event)["choices"][0]["text"] == "<6>" and _data(event)["choices"][0]["logprobs"]["text_offset"] == [12]
    assert session.is_done


def test_vllm_prompt_logprobs_rank_alternatives_around_the_prompt_token() -> None:
    session = _echo_session(None, prompt_logprobs=2)
    session.on_output(
        0, RequestOutput(request_id="r", prompt_logprobs=_prompt_logprobs(), finished=True, finish_reason="length")
    )
    [choice] = json.loads(session.body())["choices"]
    assert choice["text"] == "<7><8><9>" and choice["logprobs"] is None
    first, second, third = choice["prompt_logprobs"]
    assert first is None
    assert second == {
        "8": {"logprob": -1.5, "rank": 2, "decoded_token": "<8>"},
        "4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
        "5": {"logprob": -2.0, "rank": 3, "decoded_token": "<5>"},
    }
    assert {k: v["rank"] for k, v in third.items()} == {"9": 1, "6": 2, "4": 3}


def test_best_of_shows_the_candidates_with_the_highest_mean_logprob() -> None:
    session = ResponseSession(
        kind=Kind.COMPLETION,
        response_id="id-1",
        created=1,
        model="m",
        num_choices=6,
        n=2,
        candidates=3,
        token_text=lambda token_id: f"<{token_id}>",
    )
    # Prompt 0: means -1.0, -0.5, -2.0; prompt 1: -3.0, -0.25 (eos only, one token), -1.0.
    for index, (text, total, count) in enumerate(
        [("a", -2.0, 2), ("b", -1.5, 3), ("c", -2.0, 1), ("d", -3.0, 1), ("", -0.25, 1), ("f", -2.0, 2)]
    ):
        session.on_output(
            index,
            RequestOutput(
                request_id=str(index),
                text=text,
                finished=True,
                finish_reason="stop",
                cumulative_logprob=total,
                usage=Usage(prompt_tokens=4, completion_tokens=count),
            ),
        )
    body = json.loads(session.body())
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "b"), (1, "a"), (2, ""), (3, "f")]
    assert body["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 10,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
