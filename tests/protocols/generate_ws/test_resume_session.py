"""Resume in the pure half of /generate: the session's actions for a resumable generation, the
``resume`` message, and the transcript's compact tokens (no sockets, no registry)."""

from __future__ import annotations

import msgspec
import pytest

from rill.errors import EngineDead, MemoryPressure, ResumeExpired
from rill.protocols.generate_ws import codec, transcript
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws import session as s
from rill.types import RequestEvent

from .test_session import accepted, config, control, new_session, out, sent


def resume(**kw: object) -> m.Resume:
    return codec.decode(msgspec.json.encode({"type": "resume", **kw}))  # type: ignore[return-value]


def recording(sess: s.GenerateSession) -> list[s.Action]:
    """Start a resumable generation as the adapter would: Record, opened, Start, started."""
    assert [type(a) for a in sess.receive(config(resumable=True), now=1.0)] == [s.Record]
    assert [type(a) for a in sess.on_record_opened()] == [s.Start]
    return sess.on_started(accepted(sess))


def test_a_resumable_config_opens_the_transcript_before_starting() -> None:
    sess = new_session()
    actions = sess.receive(config(resumable=True), now=1.0)
    assert actions == [s.Record("gen_0")] and sess.state is s.State.STARTING
    (start,) = sess.on_record_opened()
    assert isinstance(start, s.Start) and start.request.request_id == "gen_0"
    assert not sess.outlives_disconnect  # no init yet: the client cannot know the id
    assert sent(sess.on_started(accepted(sess)))[0]["type"] == "init"
    assert sess.outlives_disconnect


def test_a_spec_config_neither_records_nor_outlives_its_connection() -> None:
    sess = new_session()
    assert [type(a) for a in sess.receive(config(), now=1.0)] == [s.Start]
    sess.on_started(accepted(sess))
    assert not sess.outlives_disconnect
    assert not any(isinstance(a, s.StopRecording) for a in sess.on_output(None, out("a", finished=True), 2.0))


def test_the_transcript_ends_right_after_the_completion() -> None:
    sess = new_session()
    recording(sess)
    actions = sess.on_output(None, out("a", "b", finished=True, reason="length", n=2), now=2.0)
    assert [type(a) for a in actions] == [s.Send, s.Send, s.Send, s.StopRecording]
    assert isinstance(actions[2], s.Send) and isinstance(actions[2].message, m.Completion)
    assert not sess.outlives_disconnect
    later = sess.on_error(EngineDead("later"))  # the transcript ended once: nothing more to stop
    assert [type(a) for a in later] == [s.Send, s.Close]


def test_a_fatal_error_ends_the_transcript_before_the_socket_closes() -> None:
    sess = new_session()
    recording(sess)
    actions = sess.on_output(None, out("a", finished=True, reason="error", error=EngineDead("x")), now=2.0)
    assert [type(a) for a in actions] == [s.Send, s.Send, s.StopRecording, s.Close]


def test_a_refused_start_ends_the_transcript_with_its_error() -> None:
    sess = new_session()
    sess.receive(config(resumable=True), now=1.0)
    sess.on_record_opened()
    actions = sess.on_start_failed(None, MemoryPressure("full"), now=2.0)
    assert [type(a) for a in actions] == [s.Send, s.StopRecording]


def test_a_transcript_that_could_not_be_opened_is_a_refusal() -> None:
    sess = new_session()
    sess.receive(config(resumable=True), now=1.0)
    (err,) = sent(sess.on_start_failed(None, MemoryPressure("the server keeps 256 streams"), now=2.0))
    assert (err["error"], err["recoverable"]) == ("memory_pressure", True)
    assert sess.state is s.State.IDLE and sess.on_record_opened() == []


def test_stop_before_the_start_ends_the_transcript() -> None:
    sess = new_session()
    sess.receive(config(resumable=True), now=1.0)
    sess.on_record_opened()
    actions = sess.receive(control("stop"), now=2.0)
    assert [type(a) for a in actions] == [s.Abort, s.Send, s.StopRecording]


def test_a_paused_resumable_generation_outlives_its_connection() -> None:
    sess = new_session()
    recording(sess)
    sess.receive(control("pause"), now=2.0)
    sess.on_output(None, out(events=[RequestEvent.PAUSED]), now=3.0)
    assert sess.outlives_disconnect and sess.state is s.State.PAUSED


@pytest.mark.parametrize("state", ["first", "idle"])
def test_resume_is_taken_as_the_first_message_or_when_idle(state: str) -> None:
    sess = new_session()
    if state == "idle":
        sess.receive(config(), now=1.0)
        sess.on_started(accepted(sess))
        sess.on_output(None, out("a", finished=True, reason="stop", n=1), now=2.0)
    assert sess.receive(resume(request_id="gen_9", last_index=4), now=3.0) == [s.Attach("gen_9", 4)]
    assert sess.receive(resume(request_id="gen_9"), now=3.0) == [s.Attach("gen_9", -1)]


def test_resume_while_a_generation_runs_is_refused() -> None:
    sess = new_session()
    recording(sess)
    (err,) = sent(sess.receive(resume(request_id="gen_9", last_index=0), now=2.0))
    assert (err["error"], err["field"]) == ("invalid_request", "type")
    assert "before sending resume" in err["message"]


def test_resume_failures_name_the_generation_asked_for() -> None:
    sess = new_session()
    for exc, code in [
        (ResumeExpired("gone"), "resume_expired"),
        (codec.UnknownGeneration("no such"), "request_not_found"),
    ]:
        (err,) = sent(sess.on_resume_failed("gen_9", exc))
        assert (err["error"], err["request_id"], err["recoverable"], err["recovery_action"]) == (
            code,
            "gen_9",
            True,
            "send_config",
        )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"last_index": 0}, "request_id"),
        ({"request_id": "", "last_index": 0}, "request_id"),
        ({"request_id": "g", "last_index": -2}, "last_index"),
        ({"request_id": "g", "last_index": "3"}, "last_index"),
        ({"request_id": "g", "extra": 1}, "extra"),
    ],
)
def test_a_bad_resume_message_names_its_field(body: dict, field: str) -> None:
    with pytest.raises(codec.InvalidMessage) as caught:
        resume(**body)
    assert caught.value.field == field


def test_the_transcript_rebuilds_tokens_from_one_text_per_run() -> None:
    log = transcript.Transcript()
    sess = new_session()
    sent_messages: list[m.ServerMessage] = []
    for action in [*recording(sess), *sess.on_output(None, out("ab", "c", n=2), now=2.0)]:
        assert isinstance(action, s.Send)
        sent_messages.append(action.message)
    sess.receive(control("regenerate"), now=3.0)
    restart = out("x", events=[RequestEvent.REGENERATING], n=1)
    sent_messages += [a.message for a in sess.on_output(None, restart, now=4.0) if isinstance(a, s.Send)]
    entries = [log.entry(msg, i) for i, msg in enumerate(sent_messages)]
    rebuilt = [transcript.message(entry) for entry, _ in entries]
    assert [msgspec.structs.replace(msg, index=i) for i, msg in enumerate(sent_messages)] == rebuilt
    assert [msg.index for msg in rebuilt] == list(range(len(sent_messages)))
    assert [msg.generated_text for msg in rebuilt if isinstance(msg, m.Token)] == ["ab", "abc", "x"]


def test_kept_tokens_cost_their_piece_not_the_whole_text() -> None:
    log = transcript.Transcript()
    text, sizes = "", []
    for i in range(2000):
        text += "word "
        _, size = log.entry(m.Token(token="word ", generated_text=text), i)
        sizes.append(size)
    assert max(sizes) < 200  # as sent, the last token alone would be over 10,000 bytes


@pytest.mark.parametrize(
    "token",
    [
        m.Token(token="word ", generated_text="", index=7),
        m.Token(token=" the", generated_text="", finished=True, finish_reason="length", index=10**6),
        m.Token(
            token="x",
            generated_text="",
            token_id=2**31,
            logprobs=[m.TokenLogprobWire(token=t, logprob=-1.2345678901234567e-300, token_id=2**40) for t in "xyz"],
            timing=m.TokenTiming(token_ms=12.345678901234567, total_ms=-1.2345678901234567e300),
            request_id="gen_0123456789abcdef",
            index=2**62,
        ),
    ],
)
def test_a_tokens_counted_size_bounds_its_json_without_encoding_it(token: m.Token) -> None:
    """``token_size`` is at least the JSON's length for plain ASCII, and not far above it."""
    encoded = len(codec.encode(token))
    assert encoded <= transcript.token_size(token) <= 2 * encoded + 64


def test_a_tokens_counted_size_is_a_sixth_of_its_json_at_least() -> None:
    """Characters that JSON escapes (6 bytes each) or UTF-8 spends 4 bytes on."""
    for text in ("\x00" * 500, "\U0001f600" * 500, "é" * 500):
        token = m.Token(token=text, generated_text="", index=1)
        assert len(codec.encode(token)) <= 6 * transcript.token_size(token)
