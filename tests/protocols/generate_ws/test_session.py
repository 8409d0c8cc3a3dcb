"""Session of /generate: transitions, token/completion shaping, controls, errors (no sockets)."""

from __future__ import annotations

import msgspec
import pytest

from rill.errors import GenerationError, InvalidRequest, MemoryPressure, RequestTimeout
from rill.protocols._shared.session import Started
from rill.protocols.generate_ws import codec, generation
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws import session as s
from rill.types import (
    InvalidParameter,
    ModelInfo,
    RequestEvent,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)

INFO = ModelInfo(
    name="tiny", architecture="LlamaForCausalLM", max_context_tokens=128, vocab_size=1000, dtype="float32", device="cpu"
)


def new_session() -> s.GenerateSession:
    ids = iter(f"gen_{i}" for i in range(100))
    return s.GenerateSession(
        s.Limits(model_name="tiny", model_info=INFO), token_text=lambda i: f"<{i}>", new_request_id=lambda: next(ids)
    )


def config(**kw: object) -> m.Config:
    return codec.decode(msgspec.json.encode({"type": "config", "prompt": "Hi", **kw}))  # type: ignore[return-value]


def control(action: str, **kw: object) -> m.Control:
    return codec.decode(msgspec.json.encode({"type": "control", "action": action, **kw}))  # type: ignore[return-value]


def sent(actions: list[s.Action]) -> list[dict]:
    return [msgspec.json.decode(codec.encode(a.message)) for a in actions if isinstance(a, s.Send)]


def out(
    *texts: str,
    events: list[RequestEvent] = (),
    finished: bool = False,
    reason: str | None = None,
    n: int = 0,
    error: object = None,
    modified: list[SamplingParams] = (),
) -> RequestOutput:
    return RequestOutput(
        request_id="gen_0",
        text="".join(texts),
        token_ids=[7 + i for i in range(len(texts))],
        token_texts=list(texts),
        events=list(events),
        finished=finished,
        finish_reason=reason,
        usage=Usage(prompt_tokens=2, completion_tokens=n),
        error=error,
        modified=list(modified),
    )


def accepted(sess: s.GenerateSession, sampling: SamplingParams | None = None) -> Started:
    """What the driver tells the session when the engine took its request (2 prompt tokens)."""
    assert sess.gen is not None
    return Started(None, [1, 2], sampling if sampling is not None else sess.gen.sampling)


def started(sess: s.GenerateSession, **kw: object) -> list[dict]:
    actions = sess.receive(config(**kw), now=10.0)
    assert [type(a) for a in actions] == [s.Start]
    return sent(sess.on_started(accepted(sess)))


@pytest.mark.parametrize("first", [{"type": "control", "action": "stop"}, {"type": "feedback", "rating": 1}])
def test_anything_before_config_is_invalid_request(first: dict) -> None:
    sess = new_session()
    [err] = sent(sess.receive(codec.decode(msgspec.json.encode(first)), now=0.0))
    assert err["error"] == "invalid_request" and err["field"] == "type" and err["recoverable"] is True
    assert "first message must be a config" in err["message"]
    assert sess.state is s.State.AWAIT_CONFIG


def test_config_starts_a_generate_request() -> None:
    sess = new_session()
    [start] = sess.receive(config(parameters={"max_tokens": 5, "temperature": 0.0, "seed": 3}), now=0.0)
    assert isinstance(start, s.Start)
    req = start.request
    assert req.prompt == "Hi" and req.protocol == "generate_ws" and req.request_id == "gen_0"
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.seed) == (5, 0.0, 3)
    [init] = sent(sess.on_started(accepted(sess)))
    parameters = init.pop("parameters")
    assert init == {
        "type": "init",
        "request_id": "gen_0",
        "model": "tiny",
        "model_info": {
            "max_tokens": 128,
            "dtype": "float32",
            "quantization": None,
            "architecture": "LlamaForCausalLM",
            "vocab_size": 1000,
        },
    }
    assert (parameters["max_tokens"], parameters["temperature"], parameters["seed"]) == (5, 0.0, 3)


@pytest.mark.parametrize(
    "params,field",
    [
        ({"temperature": -1}, "parameters.temperature"),
        ({"top_p": 0}, "parameters.top_p"),
        ({"max_tokens": 0}, "parameters.max_tokens"),
        ({"logit_bias": {"5000": 1}}, "parameters.logit_bias"),
    ],
)
def test_invalid_config_names_the_field(params: dict, field: str) -> None:
    sess = new_session()
    [err] = sent(sess.receive(config(parameters=params), now=0.0))
    assert err["error"] == "invalid_request" and err["field"] == field
    assert sess.state is s.State.AWAIT_CONFIG


def test_empty_prompt_is_refused() -> None:
    [err] = sent(new_session().receive(config(prompt=""), now=0.0))
    assert err["field"] == "prompt"


def test_tokens_and_completion_with_every_option() -> None:
    sess = new_session()
    started(
        sess, options={"echo_prompt": True, "include_token_ids": True, "include_timing": True, "include_logprobs": True}
    )
    lp = TokenLogprob(token_id=7, logprob=-0.25, top=[TopLogprob(7, -0.25), TopLogprob(9, -2.0)])
    delta = out(" a", " b", n=2)
    delta.logprobs = [lp, TokenLogprob(token_id=8, logprob=-1.0)]
    first, second = sent(sess.on_output(None, delta, now=10.5))
    assert first["token"] == " a" and first["generated_text"] == "Hi a" and first["token_id"] == 7
    assert first["logprobs"] == [
        {"token": " a", "logprob": -0.25, "token_id": 7},
        {"token": "<9>", "logprob": -2.0, "token_id": 9},
    ]
    assert first["timing"] == {"token_ms": 250.0, "total_ms": 500.0}
    assert second["generated_text"] == "Hi a b" and second["finished"] is False
    last, completion = sent(sess.on_output(None, out(" c", finished=True, reason="length", n=3), now=11.0))
    assert last["finished"] is True and last["finish_reason"] == "length"
    assert completion == {
        "type": "completion",
        "generated_text": "Hi a b c",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
        "request_id": "gen_0",
        "timing": {"first_token_ms": 500.0, "total_ms": 1000.0},
    }
    assert sess.state is s.State.IDLE


def test_plain_tokens_have_no_optional_fields() -> None:
    sess = new_session()
    started(sess)
    [tok] = sent(sess.on_output(None, out(" a", n=1), now=11.0))
    assert tok == {"type": "token", "token": " a", "generated_text": " a", "finished": False, "finish_reason": None}


def test_stream_false_sends_only_the_completion() -> None:
    sess = new_session()
    started(sess, options={"stream": False})
    assert sent(sess.on_output(None, out(" a", n=1), now=11.0)) == []
    [completion] = sent(sess.on_output(None, out(" b", finished=True, reason="stop", n=2), now=12.0))
    assert completion["generated_text"] == " a b" and completion["finish_reason"] == "stop"


def test_pause_resume_statuses_bracket_no_tokens() -> None:
    sess = new_session()
    started(sess)
    assert sess.receive(control("pause"), now=11.0) == [s.Pause()]
    [err] = sent(sess.receive(control("pause"), now=11.0))
    assert err["error"] == "invalid_request" and "already paused" in err["message"]
    # A token made before the pause took effect arrives with the PAUSED event: token first.
    msgs = sent(sess.on_output(None, out(" a", events=[RequestEvent.PAUSED], n=1), now=11.1))
    assert [x["type"] for x in msgs] == ["token", "status"] and msgs[1]["operation"] == "paused"
    assert sess.receive(control("resume"), now=12.0) == [s.Resume()]
    msgs = sent(sess.on_output(None, out(" b", events=[RequestEvent.RESUMED], n=2), now=12.1))
    assert [x.get("operation", x["type"]) for x in msgs] == ["resumed", "token"]


def test_resume_when_not_paused_is_refused() -> None:
    sess = new_session()
    started(sess)
    [err] = sent(sess.receive(control("resume"), now=11.0))
    assert err["error"] == "invalid_request" and "not paused" in err["message"]


def test_modify_valid_and_invalid() -> None:
    # The session maps the wire's patch; the server's policy validates it once, with the
    # vocabulary, and a refusal is reported with the field named as on this wire.
    sess = new_session()
    started(sess, parameters={"temperature": 0.8})
    assert sess.receive(control("modify", parameters={"temperature": -2}), now=11.0) == [s.Modify({"temperature": -2})]
    with pytest.raises(InvalidParameter) as refused:
        SamplingParams().patched({"temperature": -2}).validate()
    [err] = sent(sess.on_modify_refused(refused.value))
    assert err["error"] == "invalid_request" and err["field"] == "parameters.temperature"
    assert err["message"] == "'temperature' must be >= 0" and err["recoverable"] is True
    assert sess.gen is not None and sess.gen.sampling.temperature == 0.8  # nothing changed
    # A refusal that is not about a value keeps its own field (a grammar that does not compile).
    [compile_err] = sent(
        sess.on_modify_refused(InvalidRequest("response_format cannot be enforced: x", field="response_format"))
    )
    assert compile_err["field"] == "response_format"
    assert sess.receive(control("modify", parameters={"temperature": 0.0}), now=11.0) == [
        s.Modify({"temperature": 0.0})
    ]
    msgs = sent(
        sess.on_output(
            None, out(" a", events=[RequestEvent.MODIFIED], n=1, modified=[SamplingParams(temperature=0.0)]), now=11.1
        )
    )
    assert msgs[0]["type"] == "token"
    assert msgs[1]["operation"] == "modified" and msgs[1]["parameters"]["temperature"] == 0.0


def test_the_servers_clamped_parameters_are_the_ones_reported() -> None:
    # --max-tokens-cap is applied at admission (the frontend), as on every protocol: `init`
    # reports what the server took, the next modify patches it, and `modified` reports what
    # the engine's MODIFIED event carries.
    sess = new_session()
    sess.receive(config(parameters={"max_tokens": 500, "temperature": 0.8}), now=10.0)
    assert sess.gen is not None and sess.gen.sampling.max_tokens == 500  # no refusal here
    [init] = sent(sess.on_started(accepted(sess, SamplingParams(max_tokens=5, temperature=0.8))))
    assert init["parameters"]["max_tokens"] == 5 and init["parameters"]["temperature"] == 0.8
    assert sess.receive(control("modify", parameters={"temperature": 0.1}), now=11.0) == [
        s.Modify({"temperature": 0.1})
    ]
    sess.on_modify_applied(SamplingParams(max_tokens=5, temperature=0.1))
    assert sess.gen.sampling == SamplingParams(max_tokens=5, temperature=0.1)
    first, second = SamplingParams(max_tokens=5, temperature=0.1), SamplingParams(max_tokens=5, temperature=0.3)
    msgs = sent(
        sess.on_output(
            None,
            out(" a", events=[RequestEvent.MODIFIED, RequestEvent.MODIFIED], n=1, modified=[first, second]),
            now=11.1,
        )
    )
    assert [m["parameters"]["temperature"] for m in msgs[1:]] == [0.1, 0.3]  # each event its own data
    assert msgs[1]["operation"] == "modified" and msgs[1]["parameters"]["max_tokens"] == 5


def test_modify_needs_parameters_and_parameters_need_modify() -> None:
    sess = new_session()
    started(sess)
    assert sent(sess.receive(control("modify"), now=11.0))[0]["field"] == "parameters"
    assert sent(sess.receive(control("stop", parameters={"top_k": 1}), now=11.0))[0]["field"] == "parameters"


def test_regenerate_sends_status_and_fresh_init_and_resets_text() -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", " b", n=2), now=11.0)
    assert sess.receive(control("regenerate"), now=11.0) == [s.Regenerate()]
    msgs = sent(sess.on_output(None, out(" x", events=[RequestEvent.REGENERATING], n=1), now=11.5))
    assert [x.get("operation", x["type"]) for x in msgs] == ["regenerating", "init", "token"]
    assert msgs[1]["request_id"] == "gen_0" and msgs[2]["generated_text"] == " x"


def test_stop_is_answered_by_the_cancelled_completion() -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", n=1), now=11.0)
    assert sess.receive(control("stop"), now=11.0) == [s.Abort()]
    [completion] = sent(sess.on_output(None, out(finished=True, reason="cancelled", n=1), now=11.2))
    assert completion["finish_reason"] == "cancelled" and completion["generated_text"] == " a"


def test_stop_before_start_answers_at_once() -> None:
    sess = new_session()
    sess.receive(config(), now=0.0)
    actions = sess.receive(control("stop"), now=0.1)
    assert actions[0] == s.Abort()
    assert sent(actions)[0]["finish_reason"] == "cancelled"
    assert sess.state is s.State.IDLE


@pytest.mark.parametrize("action", ["stop", "pause", "resume", "modify", "regenerate"])
def test_control_when_nothing_runs_is_a_clear_error(action: str) -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", finished=True, reason="stop", n=1), now=11.0)
    [err] = sent(sess.receive(control(action), now=12.0))
    assert err["error"] == "invalid_request" and "none is running" in err["message"]


def test_config_while_generating_is_refused_and_keeps_the_generation() -> None:
    sess = new_session()
    started(sess)
    [err] = sent(sess.receive(config(), now=11.0))
    assert err["error"] == "invalid_request" and sess.state is s.State.GENERATING


def test_engine_error_mid_stream_carries_partial_text_then_recovery() -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", n=1), now=11.0)
    [err] = sent(
        sess.on_output(None, out(finished=True, reason="error", n=1, error=GenerationError("0xdead")), now=11.1)
    )
    assert err["error"] == "internal_error" and err["generated_text"] == " a" and err["recoverable"] is True
    assert "0xdead" not in err["message"]
    assert isinstance(sess.receive(config(), now=12.0)[0], s.Start)  # the recovery flow


def test_timeout_error_carries_partial_text() -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", n=1), now=11.0)
    [err] = sent(sess.on_error(RequestTimeout("late")))
    assert err["error"] == "timeout" and err["generated_text"] == " a" and err["request_id"] == "gen_0"


def test_admission_error_has_no_partial_text_and_is_recoverable() -> None:
    sess = new_session()
    sess.receive(config(), now=0.0)
    [err] = sent(sess.on_error(MemoryPressure("big")))
    assert err["error"] == "memory_pressure" and "generated_text" not in err
    assert sess.state is s.State.IDLE


def test_fatal_error_closes() -> None:
    sess = new_session()
    sess.receive(config(), now=0.0)
    actions = sess.on_error(RuntimeError("x"))
    assert isinstance(actions[-1], s.Close) and actions[-1].code == 1011


def test_feedback_for_current_and_earlier_generations() -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", finished=True, reason="stop", n=1), now=11.0)
    fb = codec.decode(b'{"type":"feedback","rating":-0.5,"text":"meh","position":1}')
    [store] = sess.receive(fb, now=12.0)
    assert isinstance(store, s.StoreFeedback)
    assert store.record | {} == {
        "request_id": "gen_0",
        "rating": -0.5,
        "text": "meh",
        "position": 1,
        "model": "tiny",
        "prompt": "Hi",
        "generated_text": " a",
        "is_generation_finished": True,
    }
    [ack] = sent(sess.on_feedback_stored("gen_0", 7))
    assert ack["operation"] == "feedback_received" and ack["feedback_id"] == 7
    sess.receive(config(), now=13.0)
    named = codec.decode(b'{"type":"feedback","rating":1,"request_id":"gen_0"}')
    assert sess.receive(named, now=14.0)[0].record["generated_text"] == " a"  # type: ignore[union-attr]
    unknown = codec.decode(b'{"type":"feedback","rating":1,"request_id":"gen_x"}')
    assert sent(sess.receive(unknown, now=14.0))[0]["field"] == "request_id"


def test_loading_status() -> None:
    [st] = sent(new_session().on_loading(67.04, 3.46))
    assert st["operation"] == "model_loading" and st["progress"] == 67.0 and st["eta_seconds"] == 3.5


def test_disconnect_aborts_a_running_generation() -> None:
    sess = new_session()
    assert sess.on_disconnect() == []
    started(sess)
    assert sess.on_disconnect() == [s.Abort()]


def test_regenerate_delta_merged_with_older_tokens_keeps_them_before_the_restart() -> None:
    sess = new_session()
    started(sess)
    sess.on_output(None, out(" a", n=1), now=11.0)
    sess.receive(control("regenerate"), now=11.0)
    # The stream merged the old run's " b" with the restart and the new run's " x".
    msgs = sent(sess.on_output(None, out(" b", " x", events=[RequestEvent.REGENERATING], n=1), now=11.5))
    assert [m.get("operation", m["type"]) for m in msgs] == ["token", "regenerating", "init", "token"]
    assert msgs[0]["generated_text"] == " a b" and msgs[3]["generated_text"] == " x"


def test_modify_refused_by_the_engine_is_undone() -> None:
    from rill.errors import RequestNotFound

    sess = new_session()
    started(sess, parameters={"temperature": 0.8})
    sess.receive(control("modify", parameters={"temperature": 0.1}), now=11.0)
    [err] = sent(sess.on_modify_refused(RequestNotFound("request gen_0 already finished")))
    assert err["error"] == "invalid_request"
    assert sess.gen is not None and sess.gen.sampling.temperature == 0.8


def test_a_refused_or_unstarted_generation_takes_no_feedback() -> None:
    # Issue 12 item 2: feedback on a refused request stored its (3.9 MB) prompt each time.
    sess = new_session()
    sess.receive(config(), now=0.0)
    fb = codec.decode(b'{"type":"feedback","rating":1}')
    [waiting] = sent(sess.receive(fb, now=0.5))  # not started yet
    assert waiting["error"] == "invalid_request" and "never started" in waiting["message"]
    sess.on_error(MemoryPressure("too big"))
    [refused] = sent(sess.receive(fb, now=1.0))
    assert refused["error"] == "invalid_request" and refused["field"] == "request_id"


def test_feedback_is_capped_per_generation_and_per_connection() -> None:
    ids = iter(f"gen_{i}" for i in range(10))
    sess = s.GenerateSession(
        s.Limits(model_name="tiny", model_info=INFO, max_feedback_per_generation=2, max_feedback_per_connection=3),
        new_request_id=lambda: next(ids),
    )
    fb = codec.decode(b'{"type":"feedback","rating":1}')
    started(sess)
    kinds = [type(a).__name__ for _ in range(3) for a in sess.receive(fb, now=11.0)]
    assert kinds == ["StoreFeedback", "StoreFeedback", "Send"]
    [err] = sent(sess.receive(fb, now=11.0))
    assert (err["error"], err["recoverable"]) == ("rate_limited", True) and "generation 'gen_0'" in err["message"]
    sess.on_output(None, out(" a", finished=True, reason="stop", n=1), now=12.0)
    started(sess)
    assert isinstance(sess.receive(fb, now=13.0)[0], s.StoreFeedback)
    [err] = sent(sess.receive(fb, now=13.0))
    assert err["error"] == "rate_limited" and "this connection" in err["message"]


def test_queue_status_while_waiting_for_the_engine() -> None:
    sess = new_session()
    assert sent(sess.on_queued(None, 1, 1)) == []  # nothing started: nothing to report
    started(sess)
    [status] = sent(sess.on_queued(None, 2, 3))
    assert status == {
        "type": "status",
        "operation": "queued",
        "request_id": "gen_0",
        "position": 2,
        "queue_length": 3,
        "message": "waiting for the engine: 2 of 3",
    }
    sess.on_output(None, out("a", finished=True, reason="length", n=1), now=11.0)
    assert sent(sess.on_queued(None, 1, 1)) == []  # finished: a late notice is dropped


def test_remembered_generations_are_counted_and_the_oldest_forgotten_on_request() -> None:
    sess = new_session()
    for _ in range(3):
        started(sess)
        sess.on_output(None, out("ab", finished=True, reason="length", n=2), now=11.0)
    one = generation.remembered_bytes(sess.gen)  # "Hi" and "ab"
    assert sess.num_history_bytes == 3 * one
    sess.forget_history(2 * one)
    assert sess.num_history_bytes == 2 * one
    [err] = sent(
        sess.receive(
            codec.decode(msgspec.json.encode({"type": "feedback", "rating": 1, "request_id": "gen_0"})), now=12.0
        )
    )
    assert err["field"] == "request_id"  # forgotten
    assert not any(
        a
        for a in sent(
            sess.receive(
                codec.decode(msgspec.json.encode({"type": "feedback", "rating": 1, "request_id": "gen_2"})), now=12.0
            )
        )
        if a.get("type") == "error"
    )
    sess.forget_history(0)
    assert sess.num_history_bytes == 0
