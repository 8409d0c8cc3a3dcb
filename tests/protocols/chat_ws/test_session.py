"""ChatSession and the request builders, without sockets or engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from rill.errors import InvalidRequest, QueueFull, RillError
from rill.protocols._shared.session import Started
from rill.protocols.chat_ws import codec
from rill.protocols.chat_ws.messages import (
    ChatRequest,
    Chunk,
    Done,
    Error,
    GenerationConfig,
    Message,
    PrefillDone,
    Queued,
    QueueDone,
    QueueUpdate,
    TextPart,
)
from rill.protocols.chat_ws.queue import QueueStatus
from rill.protocols.chat_ws.session import (
    DONE,
    FAILED,
    ChatSession,
    Close,
    EndSpeech,
    Record,
    Send,
    Speak,
    build_generate_request,
    refuse_modalities,
    sampling_params,
)
from rill.types import RequestEvent, RequestOutput, SamplingParams, Usage


def request(**kwargs) -> ChatRequest:
    return ChatRequest(messages=[Message(role="user", content="Hello!")], **kwargs)


def out(
    text: str = "", n: int = 1, finished: bool = False, reason: str | None = None, events=(), error=None
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text=text,
        token_ids=list(range(n)),
        events=list(events),
        finished=finished,
        finish_reason=reason,
        error=error,
        usage=Usage(completion_tokens=0),
    )


def sent(actions) -> list:
    return [a.message for a in actions if isinstance(a, Send)]


def started(session: ChatSession, prompt_tokens: int = 7) -> ChatSession:
    session.on_admitted()
    session.on_started(Started(None, list(range(prompt_tokens)), SamplingParams()))
    return session


def output_of(session: ChatSession, output: RequestOutput) -> list:
    """The session's answer to one engine output (as the driver hands it over)."""
    return session.on_output(None, output, 0.0)


def test_streaming_without_speech() -> None:
    s = started(ChatSession(request(), is_speaking=False))
    first = output_of(s, out("Hi", events=[RequestEvent.PREFILL_DONE]))
    assert sent(first) == [PrefillDone(input_tokens=7), Chunk(text_delta="Hi")]
    end = output_of(s, out(" there.", finished=True, reason="stop"))
    assert sent(end) == [
        Chunk(text_delta=" there."),
        Done(text="Hi there.", generated_tokens=2, input_tokens=7, audio_data=None),
    ]
    assert isinstance(end[-1], Close) and s.state == DONE


def test_prefill_done_is_sent_once_even_without_the_event() -> None:
    s = started(ChatSession(request(), is_speaking=False))
    assert isinstance(sent(output_of(s, out("a")))[0], PrefillDone)
    assert not any(isinstance(m, PrefillDone) for m in sent(output_of(s, out("b"))))


def test_empty_delta_sends_no_chunk() -> None:
    s = started(ChatSession(request(), is_speaking=False))
    output_of(s, out("a"))
    assert sent(output_of(s, out("", n=1))) == []


def test_speech_segments_then_done_after_the_last_audio() -> None:
    s = started(ChatSession(request(), is_speaking=True))
    actions = output_of(s, out("One. Two"))
    assert [a for a in actions if isinstance(a, Speak)] == [Speak("One.")]
    end = output_of(s, out(" three.", finished=True, reason="length"))
    assert [a for a in end if isinstance(a, (Speak, EndSpeech))] == [Speak("Two three."), EndSpeech()]
    assert not any(isinstance(m, Done) for m in sent(end))
    audio = s.on_audio(np.ones(10, np.float32))
    assert sent(audio) == [Chunk(audio_data=base64.b64encode(np.ones(10, "<f4").tobytes()).decode())]
    done = sent(s.on_speech_end())
    assert done == [Done(text="One. Two three.", generated_tokens=2, input_tokens=7, audio_data=None)]


def test_long_audio_is_split_into_one_second_chunks() -> None:
    s = started(ChatSession(request(), is_speaking=True))
    chunks = sent(s.on_audio(np.zeros(24000 * 2 + 5, np.float32)))
    sizes = [len(base64.b64decode(c.audio_data)) // 4 for c in chunks]
    assert sizes == [24000, 24000, 5]


def test_non_streaming_sends_only_done_with_whole_text_and_audio() -> None:
    s = started(ChatSession(request(streaming=False), is_speaking=True))
    assert sent(output_of(s, out("Hi. ", events=[RequestEvent.PREFILL_DONE]))) == [PrefillDone(input_tokens=7)]
    assert sent(s.on_audio(np.full(3, 0.5, np.float32))) == []
    output_of(s, out("Bye.", finished=True, reason="stop"))
    assert sent(s.on_audio(np.full(2, 0.25, np.float32))) == []
    (done,) = sent(s.on_speech_end())
    pcm = np.frombuffer(base64.b64decode(done.audio_data), "<f4")
    assert done.text == "Hi. Bye." and pcm.tolist() == [0.5, 0.5, 0.5, 0.25, 0.25]


def test_recording_id_goes_on_done() -> None:
    s = started(ChatSession(request(), is_speaking=False, recording_session_id="chat_0000000000000000"))
    (done,) = [m for m in sent(output_of(s, out("x", finished=True, reason="stop"))) if isinstance(m, Done)]
    assert done.recording_session_id == "chat_0000000000000000"


def test_a_recorded_chat_is_stored_before_done_goes_out() -> None:
    s = started(ChatSession(request(), is_speaking=True, recording_session_id="chat_0000000000000001", keep_audio=True))
    output_of(s, out("Hi.", finished=True, reason="stop"))
    s.on_audio(np.full(4, 0.5, np.float32))
    record, send, close = s.on_speech_end()
    assert isinstance(record, Record) and isinstance(send, Send) and isinstance(close, Close)
    assert record.done is send.message and record.done.recording_session_id == "chat_0000000000000001"
    assert record.audio is not None and record.audio.tolist() == [0.5] * 4
    unspoken = started(ChatSession(request(), is_speaking=False, recording_session_id="chat_0000000000000002"))
    (record,) = [a for a in output_of(unspoken, out("x", finished=True, reason="stop")) if isinstance(a, Record)]
    assert record.audio is None
    assert not any(
        isinstance(a, Record)
        for a in output_of(started(ChatSession(request(), is_speaking=False)), out("x", finished=True, reason="stop"))
    )


def test_queue_messages() -> None:
    s = ChatSession(request(), is_speaking=False)
    assert sent(s.on_queue_joined(QueueStatus(2, 20.0, 3))) == [
        Queued(position=2, estimated_wait_s=20.0, queue_length=3)
    ]
    assert sent(s.on_queue_moved(QueueStatus(1, 10.0, 2))) == [
        QueueUpdate(position=1, estimated_wait_s=10.0, queue_length=2)
    ]
    assert sent(s.on_admitted()) == [QueueDone()]


@pytest.mark.parametrize(
    ("output", "text"),
    [
        (out(finished=True, reason="cancelled"), "Cancelled"),
        (out(finished=True, reason="error", error=RillError("deadline passed")), "deadline passed"),
    ],
)
def test_engine_end_with_error_sends_error_and_close(output: RequestOutput, text: str) -> None:
    s = started(ChatSession(request(), is_speaking=True))
    actions = output_of(s, output)
    assert sent(actions) == [Error(error=text)] and isinstance(actions[-1], Close)
    assert s.state == FAILED and s.on_error(RillError("again")) == [] and s.on_audio(np.ones(3, np.float32)) == []


def test_queue_full_error_closes_with_try_again_later() -> None:
    actions = ChatSession(request(), is_speaking=False).on_error(QueueFull())
    assert sent(actions) == [Error(error="Queue full")] and actions[-1] == Close(codec.CLOSE_TRY_AGAIN_LATER)


def test_illegal_transition_is_a_bug() -> None:
    s = ChatSession(request(), is_speaking=False)
    with pytest.raises(RuntimeError):
        s._go(DONE)  # QUEUED cannot jump to DONE


def test_build_generate_request() -> None:
    req = ChatRequest(
        messages=[
            Message(role="system", content="Be brief."),
            Message(role="user", content=[TextPart(text="a"), TextPart(text="b")]),
        ],
        generation=GenerationConfig(max_new_tokens=64, temperature=0.2, top_k=5, seed=3, min_new_tokens=2, stop=["\n"]),
        enable_thinking=True,
    )
    g = build_generate_request(req, deadline_s=9.0)  # --max-tokens-cap is the frontend's
    assert [(m.role, m.content) for m in g.messages] == [("system", "Be brief."), ("user", "a\nb")]
    p = g.sampling
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.min_tokens, p.stop) == (
        64,
        0.2,
        0.8,
        5,
        3,
        2,
        ["\n"],
    )
    assert g.protocol == "chat_ws" and g.chat_template_kwargs == {"enable_thinking": True} and g.deadline_s == 9.0


def test_do_sample_false_is_greedy() -> None:
    assert sampling_params(GenerationConfig(do_sample=False)).temperature == 0.0


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_new_tokens": 0}, "generation.max_new_tokens"),
        ({"top_p": 0.0}, "generation.top_p"),
        ({"temperature": -1.0}, "generation.temperature"),
        ({"min_new_tokens": 900, "max_new_tokens": 10}, "generation.min_new_tokens"),
    ],
)
def test_bad_generation_field_is_named(fields: dict, name: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        sampling_params(GenerationConfig(**fields))
    assert info.value.field == name and "generation" in str(info.value)


def test_refuse_modalities_names_model_and_modality() -> None:
    refuse_modalities([], "tiny", ["text"])
    refuse_modalities([("image", "messages[0].content[1]")], "vlm", ["text", "image"])
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[1\]: the model 'tiny' cannot take audio input"):
        refuse_modalities([("audio", "messages[0].content[1]")], "tiny", ["text"])
