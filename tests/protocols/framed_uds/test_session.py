"""Tests of rill.protocols.framed_uds.session: the state machines, without sockets."""

from __future__ import annotations

import pytest

from rill.errors import ContextLengthExceeded, GenerationError, QueueFull
from rill.protocols._shared.session import Started
from rill.protocols.framed_uds import codec
from rill.protocols.framed_uds.framing import FrameTooLarge
from rill.protocols.framed_uds.messages import Cancel, Eos, Error, MetricsQuery, Request, Slo, Token
from rill.protocols.framed_uds.session import (
    Abort,
    Close,
    FramedSession,
    NewlineSession,
    Rejected,
    Send,
    SendMetrics,
    SessionLimits,
    Start,
    State,
)
from rill.types import RequestOutput


def out(
    text: str = "",
    ids: list[int] | None = None,
    texts: list[str] | None = None,
    finish: str | None = None,
    error: object = None,
) -> RequestOutput:
    ids = ids if ids is not None else ([len(text)] if text else [])
    return RequestOutput(
        request_id="e1",
        text=text,
        token_ids=ids,
        token_texts=texts if texts is not None else ([text] if text else []),
        finished=finish is not None,
        finish_reason=finish,
        error=error,
    )  # type: ignore[arg-type]


def feed(session: FramedSession | NewlineSession, output: RequestOutput) -> list:
    """The session's answer to one output of its request, as the driver hands it over."""
    return session.on_output(None, output, 0.0)


def started(session: FramedSession, is_accepted: bool = True, **fields: object) -> Start:
    """Send a request; with ``is_accepted`` the engine takes it (the driver's ``on_started``)."""
    actions = session.receive(Request(id=str(fields.pop("id", "r1")), prompt="Hello", **fields))  # type: ignore[arg-type]
    assert len(actions) == 1 and isinstance(actions[0], Start)
    if is_accepted:
        assert session.on_started(Started(None, [1, 2], actions[0].request.sampling)) == []
    return actions[0]


def test_streamed_request_then_eos_and_back_to_idle() -> None:
    session = FramedSession()
    start = started(session)
    assert start.request.protocol == "framed_uds" and session.state is State.ACTIVE
    assert feed(session, out("He", ids=[1])) == [Send(Token(id="r1", text="He", token_id=1))]
    assert feed(session, out("llo", ids=[2], finish="length")) == [
        Send(Token(id="r1", text="llo", token_id=2)),
        Send(Eos(id="r1", reason="length")),
    ]
    assert session.state is State.IDLE
    started(session, id="r2")  # the connection takes the next request
    assert session.num_requests == 2


def test_coalesced_delta_gives_one_token_event_per_token() -> None:
    session = FramedSession()
    started(session)
    actions = feed(session, out("abc", ids=[1, 2, 3], texts=["a", "b", "c"], finish="stop"))
    assert actions == [Send(Token(id="r1", text=t, token_id=i)) for t, i in (("a", 1), ("b", 2), ("c", 3))] + [
        Send(Eos(id="r1", reason="stop"))
    ]


def test_metadata_is_echoed_in_every_event() -> None:
    session = FramedSession()
    meta = {"trace": "t-1"}
    started(session, metadata=meta)
    actions = feed(session, out("a", ids=[1])) + feed(session, out("", finish="stop"))
    assert actions == [
        Send(Token(id="r1", text="a", token_id=1, metadata=meta)),
        Send(Eos(id="r1", reason="stop", metadata=meta)),
    ]


def test_stream_false_sends_one_eos_with_the_whole_text() -> None:
    session = FramedSession()
    started(session, stream=False)
    assert feed(session, out("Hel", ids=[1])) == []
    assert feed(session, out("lo", ids=[2], finish="length")) == [Send(Eos(id="r1", reason="length", text="Hello"))]


def test_cancel_aborts_and_exactly_one_cancelled_eos_follows() -> None:
    session = FramedSession()
    started(session)
    assert session.receive(Cancel(id="other")) == []
    assert session.receive(Cancel(id="r1")) == [Abort()]
    assert session.receive(Cancel(id="r1")) == [Abort()]  # repeated cancels are harmless aborts
    assert feed(session, out("x", ids=[5], finish="cancelled")) == [
        Send(Token(id="r1", text="x", token_id=5)),
        Send(Eos(id="r1", reason="cancelled")),
    ]
    assert session.receive(Cancel(id="r1")) == []  # crossed its eos on the wire: ignored
    assert session.state is State.IDLE


def test_a_cancel_before_the_engine_took_the_request_is_answered_at_once() -> None:
    session = FramedSession()
    started(session, is_accepted=False, stream=False)
    # The Abort cancels the submission, so no output will come: the session answers itself.
    assert session.receive(Cancel(id="r1")) == [Abort(), Send(Eos(id="r1", reason="cancelled", text=""))]
    assert session.state is State.IDLE
    assert session.on_start_failed(None, QueueFull(), 0.0) == []  # a refusal racing the cancel changes nothing
    started(session, id="r2")


def test_second_request_while_busy_is_rejected_and_closes() -> None:
    session = FramedSession()
    started(session)
    actions = session.receive(Request(id="r2", prompt="again", metadata={"m": 1}))
    assert actions[:2] == [Abort(), Rejected("E_PROTO_BUSY")]
    assert isinstance(actions[2], Send) and isinstance(actions[2].message, Error)
    assert actions[2].message.code == "E_PROTO_BUSY" and actions[2].message.id == "r2"
    assert actions[2].message.metadata == {"m": 1} and "r1" in actions[2].message.message
    assert actions[3:] == [Close()] and session.state is State.CLOSED
    assert feed(session, out("late", ids=[1])) == []  # outputs racing the close are dropped


def test_metrics_query_sends_the_snapshot_and_closes() -> None:
    session = FramedSession()
    assert session.receive(MetricsQuery()) == [SendMetrics(), Close()]
    assert session.state is State.CLOSED
    assert session.receive(Request(id="r", prompt="x")) == []
    busy = FramedSession()
    started(busy)
    assert busy.receive(MetricsQuery()) == [Abort(), SendMetrics(), Close()]


@pytest.mark.parametrize(
    "exc, code", [(FrameTooLarge(9, 8), "E_PROTO_FRAME_TOO_LARGE"), (codec.InvalidJson("bad"), "E_PROTO_INVALID_JSON")]
)
def test_protocol_errors_send_error_then_close(exc: Exception, code: str) -> None:
    session = FramedSession()
    actions = session.on_protocol_error(exc, "r7")
    assert actions == [Rejected(code), Send(Error(code=code, message=str(exc), id="r7")), Close()]
    assert session.on_protocol_error(exc) == []


def test_bad_sampling_field_is_a_bad_request_naming_it() -> None:
    session = FramedSession()
    actions = session.receive(Request(id="r1", prompt="x", top_p=3.0))
    assert actions[0] == Rejected("E_PROTO_BAD_REQUEST")
    assert isinstance(actions[1], Send) and isinstance(actions[1].message, Error)
    assert actions[1].message.code == "E_PROTO_BAD_REQUEST" and "top_p" in actions[1].message.message
    assert actions[2:] == [Close()]


@pytest.mark.parametrize(
    "exc, code",
    [
        (ContextLengthExceeded(900, 64), "E_LIMIT_PROMPT_TOO_LARGE"),
        (QueueFull(), "E_LIMIT_QUEUE_FULL"),
        (RuntimeError("boom /etc"), "E_RUNTIME_INTERNAL"),
    ],
)
def test_refused_start_sends_the_mapped_error(exc: Exception, code: str) -> None:
    session = FramedSession()
    started(session, is_accepted=False, metadata={"a": 1})
    actions = session.on_start_failed(None, exc, 0.0)
    assert session.refusal_code(exc) == code  # the driver counts the refusal under the wire's code
    assert isinstance(actions[0], Send) and isinstance(actions[0].message, Error)
    assert (actions[0].message.code, actions[0].message.id, actions[0].message.metadata) == (code, "r1", {"a": 1})
    assert "/etc" not in actions[0].message.message
    assert actions[1:] == [Close()]


def test_generation_error_sends_error_then_eos_error_then_closes() -> None:
    session = FramedSession()
    started(session)
    actions = feed(session, out("", finish="error", error=GenerationError("decode failed")))
    assert actions == [
        Send(Error(code="E_RUNTIME_DECODE", message="decode failed", id="r1")),
        Send(Eos(id="r1", reason="error")),
        Close(),
    ]


def test_one_request_option_closes_after_eos() -> None:
    session = FramedSession(SessionLimits(one_request=True))
    started(session)
    assert feed(session, out("a", ids=[1], finish="stop"))[-2:] == [Send(Eos(id="r1", reason="stop")), Close()]
    assert session.state is State.CLOSED


def test_disconnect_aborts_only_a_running_request() -> None:
    idle = FramedSession()
    assert idle.on_disconnect() == []
    busy = FramedSession()
    started(busy)
    assert busy.on_disconnect() == [Abort()]
    assert busy.receive(Cancel(id="r1")) == []


def test_slo_becomes_priority_and_max_tokens_passes_through() -> None:
    # --max-tokens-cap is applied at admission for every protocol (tests/test_policy_e2e.py).
    session = FramedSession(SessionLimits())
    start = started(session, slo=Slo(target_ttft_ms=100), max_tokens=50)
    assert start.request.priority < 0 and start.request.sampling.max_tokens == 50


# -- newline mode ---------------------------------------------------------------------------


def test_newline_lines_run_one_after_another_with_a_blank_line_after_each() -> None:
    session = NewlineSession()
    first = session.receive_line(b"first prompt")
    assert len(first) == 1 and isinstance(first[0], Start) and first[0].request.prompt == "first prompt"
    assert session.receive_line(b"second") == []  # queued behind the first
    assert session.receive_line(b"   ") == []  # blank lines are skipped
    assert feed(session, out("ab", ids=[1])) == [Send(b"ab")]
    actions = feed(session, out("c", ids=[2], finish="length"))
    assert actions[:2] == [Send(b"c"), Send(b"\n\n")] and isinstance(actions[2], Start)
    assert actions[2].request.prompt == "second"
    assert session.on_end_of_input() == []  # still answering
    assert feed(session, out("z", finish="stop"))[-2:] == [Send(b"\n\n"), Close()]


def test_newline_end_of_input_when_idle_closes() -> None:
    assert NewlineSession().on_end_of_input() == [Close()]


def test_newline_errors_are_one_line_then_close() -> None:
    session = NewlineSession()
    session.receive_line(b"x")
    actions = feed(session, out("", finish="error", error=GenerationError("decode failed")))
    assert actions == [Send(b"error: E_RUNTIME_DECODE: decode failed\n"), Close()]
    bad = NewlineSession()
    assert bad.receive_line(b"\xff\xfe") == [
        Rejected("E_PROTO_INVALID_JSON"),
        Send(b"error: E_PROTO_INVALID_JSON: input line is not valid UTF-8\n"),
        Close(),
    ]
    refused = NewlineSession()
    refused.receive_line(b"x")
    assert refused.on_start_failed(None, QueueFull(), 0.0)[-1] == Close()


def test_newline_one_request_and_disconnect() -> None:
    session = NewlineSession(SessionLimits(one_request=True))
    session.receive_line(b"a")
    session.receive_line(b"b")
    assert feed(session, out("x", finish="stop"))[-1] == Close()
    busy = NewlineSession()
    busy.receive_line(b"a")
    assert busy.on_disconnect() == [Abort()]
    assert busy.receive_line(b"b") == []


def test_newline_line_too_long_while_running_aborts_and_closes() -> None:
    session = NewlineSession()
    session.receive_line(b"a")
    actions = session.on_protocol_error(FrameTooLarge(99, 8))
    assert actions == [
        Abort(),
        Rejected("E_PROTO_FRAME_TOO_LARGE"),
        Send(b"error: E_PROTO_FRAME_TOO_LARGE: frame of 99 bytes exceeds the limit of 8 bytes\n"),
        Close(),
    ]
    assert session.on_protocol_error(FrameTooLarge(99, 8)) == []


def test_request_timeout_becomes_the_deadline() -> None:
    session = FramedSession(SessionLimits(request_timeout_s=2.5))
    assert started(session).request.deadline_s == 2.5
    assert started(FramedSession()).request.deadline_s is None
