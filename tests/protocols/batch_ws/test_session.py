"""Session of batch /ws (sans-I/O): golden vectors, errors, continuation store bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rill import errors
from rill.config import SamplingDefaults
from rill.protocols._shared.session import Started
from rill.protocols.batch_ws.messages import BatchRequest, GenerationConfig
from rill.protocols.batch_ws.session import (
    Abort,
    Action,
    BatchSession,
    ContinuationStore,
    Limits,
    Send,
    SendError,
    Start,
)
from rill.types import RequestOutput, SamplingParams

VECTORS = json.loads((Path(__file__).parent / "vectors" / "session.json").read_text())
DEFAULTS = GenerationConfig(**msgspec.structs.asdict(msgspec.convert(vars(SamplingDefaults()), GenerationConfig)))


def make_session(store: ContinuationStore | None = None, limits: Limits = Limits(), scope: str = "") -> BatchSession:
    return BatchSession(
        store if store is not None else ContinuationStore(16, 10_000, 60.0), DEFAULTS, limits, "k", scope
    )


def render(actions: list[Action], expected: list[list[Any]] | None = None) -> list[list[Any]]:
    """Actions as JSON-able lists; Start shows only the request fields the vector names."""
    out: list[list[Any]] = []
    for i, action in enumerate(actions):
        if isinstance(action, Send):
            out.append(["send", msgspec.to_builtins(action.message)])
        elif isinstance(action, SendError):
            out.append(["error", action.text])
        elif isinstance(action, Start):
            request = msgspec.to_builtins(action.request)
            want = expected[i][2] if expected and i < len(expected) and expected[i][0] == "start" else {}
            out.append(["start", action.key, _subset(request, want)])
        elif isinstance(action, Abort):
            out.append(["abort", action.key])
    return out


def _subset(actual: dict, want: dict) -> dict:
    picked = {}
    for key, value in want.items():
        got = actual.get(key)
        picked[key] = _subset(got, value) if isinstance(value, dict) and isinstance(got, dict) else got
    return picked


def receive(session: BatchSession, payload: dict, now: float = 0.0) -> list[Action]:
    return session.receive(msgspec.convert(payload, BatchRequest), now)


def submitted(session: BatchSession, key: str, prompt_token_ids: list[int]) -> None:
    """The engine took the request of ``key`` (as the driver tells the session)."""
    assert session.on_started(Started(key, prompt_token_ids, SamplingParams())) == []


def output(key: str, **fields: Any) -> tuple[str, RequestOutput]:
    return key, RequestOutput(request_id=key, **fields)


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["name"])
def test_session_vectors(case: dict) -> None:
    session = make_session()
    for step in case["steps"]:
        if "receive" in step:
            if "error" in step:
                with pytest.raises(errors.InvalidRequest) as info:
                    receive(session, step["receive"], step["now"])
                assert str(info.value) == step["error"]
                continue
            actions = receive(session, step["receive"], step["now"])
        elif "submitted" in step:
            submitted(session, step["submitted"], step["prompt_token_ids"])
            continue
        else:
            outputs = [
                (key, msgspec.convert({"request_id": key, **fields}, RequestOutput)) for key, fields in step["outputs"]
            ]
            actions = session.on_outputs(outputs, step["now"])
        assert render(actions, step["expect"]) == step["expect"]


def test_engine_refusal_at_submit_is_an_error_for_that_prompt_only() -> None:
    session = make_session()
    receive(session, {"prompts": [{"request_id": "ok", "prompt": "a"}, {"request_id": "long", "prompt": "b" * 999}]})
    actions = session.on_starts_failed([("k-2", errors.ContextLengthExceeded(999, 256))], 0.1)
    assert render(actions) == [
        [
            "send",
            [
                {
                    "type": "ERROR",
                    "request_id": "long",
                    "error": "prompt has 999 tokens but the model's context holds at most 256",
                }
            ],
        ]
    ]
    assert session.num_open_prompts == 1
    actions = session.on_outputs([output("k-1", token_ids=[1], text="x", finished=True, finish_reason="stop")], 0.2)
    assert [type(a.message[0]).__struct_config__.tag for a in actions if isinstance(a, Send)] == [
        "STARTED",
        "INITIALIZED",
        "PROGRESS",
        "COMPLETE",
    ]


def test_engine_failure_mid_generation_never_leaks_internals() -> None:
    session = make_session()
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "b", "prompt": "y"}]})
    actions = session.on_outputs(
        [
            output(
                "k-1",
                events=["scheduled"],
                finished=True,
                finish_reason="error",
                error=errors.GenerationError("CUDA oops at 0x1"),
            ),
            output("k-2", events=["scheduled", "prefill_done"], token_ids=[3], text="z"),
        ],
        1.0,
    )
    assert render(actions) == [
        ["send", [{"type": "STARTED", "request_id": "a"}, {"type": "STARTED", "request_id": "b"}]],
        ["send", [{"type": "INITIALIZED", "request_id": "b", "text": ""}]],
        ["send", [{"type": "PROGRESS", "request_id": "b", "text": "z"}]],
        ["send", [{"type": "ERROR", "request_id": "a", "error": "generation failed"}]],
    ]


def test_failure_before_start_sends_only_error() -> None:
    session = make_session()
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    actions = session.on_outputs([output("k-1", finished=True, finish_reason="cancelled")], 1.0)
    assert render(actions) == [
        ["send", [{"type": "ERROR", "request_id": "a", "error": "the generation was cancelled"}]]
    ]


def test_request_id_still_generating_gets_an_error_and_the_other_prompts_run() -> None:
    store = ContinuationStore(16, 10_000, 60.0)
    first, second = make_session(store), make_session(store)
    receive(first, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    actions = receive(second, {"prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "b", "prompt": "y"}]})
    assert render(actions)[:2] == [
        ["send", [{"type": "ACCEPTED", "request_id": "a"}, {"type": "ACCEPTED", "request_id": "b"}]],
        [
            "send",
            [
                {
                    "type": "ERROR",
                    "request_id": "a",
                    "error": "request_id 'a' is still generating; wait for its COMPLETE or use another id",
                }
            ],
        ],
    ]
    assert [type(a) for a in actions[2:]] == [Start]
    # Once the first finishes, the id is free again.
    first.on_outputs([output("k-1", token_ids=[1], text="q", finished=True, finish_reason="stop")], 1.0)
    assert isinstance(receive(second, {"prompts": [{"request_id": "a", "prompt": "x"}]})[1], Start)


def test_missing_prompt_without_kept_generation_is_an_error() -> None:
    actions = receive(make_session(), {"prompts": [{"request_id": "a"}]})
    assert render(actions)[1] == [
        "send",
        [
            {
                "type": "ERROR",
                "request_id": "a",
                "error": "'prompt' is required: there is no kept generation to continue for request_id 'a'",
            }
        ],
    ]


def finish_with_length(session: BatchSession, key: str, prompt_ids: list[int], new_ids: list[int], now: float) -> None:
    submitted(session, key, prompt_ids)
    session.on_outputs(
        [output(key, token_ids=new_ids, text="t" * len(new_ids), finished=True, finish_reason="length")], now
    )


def test_evicted_entry_is_reported_once_then_the_id_starts_afresh() -> None:
    store = ContinuationStore(max_entries=1, max_tokens=10_000, ttl_s=60.0)
    session = make_session(store)
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "b", "prompt": "y"}]})
    finish_with_length(session, "k-1", [1], [2], 1.0)
    finish_with_length(session, "k-2", [3], [4], 1.0)  # evicts "a" (max_entries=1)
    actions = receive(
        session, {"prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "b", "prompt": "y"}]}, 2.0
    )
    assert render(actions)[1] == [
        "send",
        [
            {
                "type": "ERROR",
                "request_id": "a",
                "error": "the kept generation of request_id 'a' was evicted to make room; "
                "send it again with its prompt to start over",
            }
        ],
    ]
    assert isinstance(actions[2], Start) and actions[2].request.prompt_token_ids == [3, 4]
    again = receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]}, 3.0)
    assert isinstance(again[1], Start) and again[1].request.prompt == "x"


def test_expired_entry_is_reported_with_the_ttl() -> None:
    session = make_session(ContinuationStore(16, 10_000, ttl_s=5.0))
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    finish_with_length(session, "k-1", [1], [2], 1.0)
    actions = receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]}, 100.0)
    assert render(actions)[1][1][0]["error"] == (
        "the kept generation of request_id 'a' expired after 5 s; send it again with its prompt to start over"
    )


def test_engine_cache_miss_is_reported_for_that_request_id() -> None:
    session = make_session()
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    finish_with_length(session, "k-1", [1], [2], 1.0)
    receive(session, {"prompts": [{"request_id": "a"}]}, 2.0)
    actions = session.on_outputs(
        [output("k-2", finished=True, finish_reason="error", error=errors.CacheMiss("engine text"))], 2.1
    )
    assert render(actions) == [
        [
            "send",
            [
                {
                    "type": "ERROR",
                    "request_id": "a",
                    "error": "the kept generation of request_id 'a' was evicted to make room; "
                    "send it again with its prompt to start over",
                }
            ],
        ]
    ]


def test_eos_ends_continuation() -> None:
    session = make_session()
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    submitted(session, "k-1", [1])
    session.on_outputs([output("k-1", token_ids=[2], text="y", finished=True, finish_reason="stop")], 1.0)
    actions = receive(session, {"prompts": [{"request_id": "a", "prompt": "fresh"}]}, 2.0)
    assert actions[1].request.prompt == "fresh"


def test_continuations_are_scoped_by_credentials() -> None:
    store = ContinuationStore(16, 10_000, 60.0)
    alice, mallory = make_session(store, scope="Bearer alice"), make_session(store, scope="Bearer mallory")
    receive(alice, {"prompts": [{"request_id": "a", "prompt": "secret"}]})
    finish_with_length(alice, "k-1", [1], [2], 1.0)
    assert receive(mallory, {"prompts": [{"request_id": "a", "prompt": "x"}]})[1].request.prompt == "x"
    assert receive(alice, {"prompts": [{"request_id": "a", "prompt": "x"}]})[1].request.prompt_token_ids == [1, 2]


def test_disconnect_aborts_every_open_prompt_and_frees_ids() -> None:
    store = ContinuationStore(16, 10_000, 60.0)
    session = make_session(store)
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "b", "prompt": "y"}]})
    receive(session, {"prompts": [{"request_id": "c", "prompt": "z"}]})
    assert render(session.on_disconnect()) == [["abort", "k-1"], ["abort", "k-2"], ["abort", "k-3"]]
    assert session.num_open_prompts == 0
    assert not any(store.is_busy(("", rid)) for rid in "abc")
    assert session.on_outputs([output("k-1", token_ids=[1], text="late")], 1.0) == []


def test_inflight_limit_refuses_the_whole_message() -> None:
    session = make_session(limits=Limits(max_inflight_prompts=2))
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    with pytest.raises(
        errors.InvalidRequest, match="too many prompts in flight on this socket: 1 running \\+ 2 new > 2"
    ):
        receive(session, {"prompts": [{"request_id": "b", "prompt": "x"}, {"request_id": "c", "prompt": "x"}]})


def test_timeout_applies_and_max_new_tokens_passes_through() -> None:
    # --max-tokens-cap is applied at admission for every protocol (tests/test_policy_e2e.py).
    actions = receive(
        make_session(limits=Limits(request_timeout_s=30.0)),
        {"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"max_new_tokens": 100}},
    )
    assert actions[1].request.sampling.max_tokens == 100 and actions[1].request.deadline_s == 30.0


def test_defaults_fill_missing_fields() -> None:
    defaults = GenerationConfig(
        num_beams=1,
        do_sample=True,
        temperature=0.3,
        top_p=0.9,
        top_k=7,
        max_new_tokens=11,
        repetition_penalty=1.1,
        length_penalty=1.0,
    )
    session = BatchSession(ContinuationStore(4, 100, 1.0), defaults, Limits(), "k")
    sampling = session.receive(
        msgspec.convert(
            {"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"temperature": 0.5}}, BatchRequest
        ),
        0.0,
    )[1].request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens, sampling.repetition_penalty) == (
        0.5,
        0.9,
        7,
        11,
        1.1,
    )
    bad = BatchSession(
        ContinuationStore(4, 100, 1.0),
        GenerationConfig(**{**msgspec.structs.asdict(defaults), "top_p": 5.0}),
        Limits(),
        "k",
    )
    with pytest.raises(errors.InvalidRequest, match="top_p"):
        bad.default_sampling()


def test_continuation_that_fills_the_context_says_so() -> None:
    session = make_session()
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}]})
    finish_with_length(session, "k-1", [1, 2], [3, 4], 1.0)
    receive(session, {"prompts": [{"request_id": "a"}]}, 2.0)
    actions = session.on_start_failed("k-2", errors.ContextLengthExceeded(4, 4), 2.0)
    assert render(actions)[0][1][0]["error"] == (
        "request_id 'a' cannot continue: its text so far (4 tokens) already fills the model's context of 4 tokens"
    )


def test_beam_continuation_recomputes_instead_of_requiring_cached_kv() -> None:
    # The engine keeps no row of a finished beam request, so requiring cached KV would
    # always fail; the kept ids are exact, so recomputing them continues correctly.
    session = make_session()
    receive(session, {"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"num_beams": 2}})
    finish_with_length(session, "k-1", [1, 2], [3], 1.0)
    start = receive(session, {"prompts": [{"request_id": "a"}]}, 2.0)[1]
    assert start.request.prompt_token_ids == [1, 2, 3] and start.request.require_cached_prefix_tokens is None
    assert start.request.sampling.num_beams == 2  # the kept config applies when none is sent
