"""One fuzz target per protocol: generate an input, decode it, drive a fresh session with it.

The property, for every target and every input: the codec returns a message or raises one
of its documented errors, and the session (fed the decoded message, then a few engine
outputs) returns actions or raises one of its documented errors. Nothing else may escape.
Valid inputs (``gen.wire_input`` kind ``"valid"``) must be accepted by codec and session,
so a decoder that refused everything fails too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rill.config import SamplingDefaults
from rill.errors import InvalidRequest, RillError
from rill.protocols._shared.session import Started
from rill.protocols.batch_ws import codec as batch_codec
from rill.protocols.batch_ws import session as batch_session
from rill.protocols.batch_ws.messages import GenerationConfig as BatchDefaults
from rill.protocols.batch_ws.store import ContinuationStore
from rill.protocols.chat_ws import codec as chat_codec
from rill.protocols.chat_ws import session as chat_session
from rill.protocols.evergreen import codec as evergreen_codec
from rill.protocols.evergreen.errors import InvalidMessage as EvergreenInvalid
from rill.protocols.evergreen.messages import GenerateConfig
from rill.protocols.evergreen.prompt import ModelFacts
from rill.protocols.evergreen.session import EvergreenSession, Generate, SessionLimits
from rill.protocols.framed_uds import codec as uds_codec
from rill.protocols.framed_uds import session as uds_session
from rill.protocols.framed_uds.framing import FrameDecoder, FramingError, encode_frame
from rill.protocols.generate_ws import codec as generate_codec
from rill.protocols.generate_ws import messages as generate_messages
from rill.protocols.generate_ws import session as generate_session
from rill.protocols.openai_http import codec as openai_codec
from rill.protocols.openai_http import responses_codec
from rill.protocols.openai_http import tools as openai_tools
from rill.protocols.openai_http.responses_session import ResponsesSession
from rill.protocols.openai_http.session import Kind as OpenAIKind
from rill.protocols.openai_http.session import ResponseSession
from rill.types import ModelInfo, RequestOutput, Usage
from tests.fuzz import gen
from tests.protocols.evergreen.helpers import eot, generate, leaf, msg, parent

MODEL_INFO = ModelInfo(
    name="fake",
    architecture="Fake",
    max_context_tokens=256,
    vocab_size=1000,
    dtype="float32",
    device="cpu",
    has_chat_template=True,
)


class Undocumented(AssertionError):
    """An exception escaped that the codec or session does not document."""


@dataclass
class Stats:
    """Counts of one target's run."""

    num_inputs: int = 0
    num_accepted: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [inputs, accepted]

    def add(self, kind: str, is_accepted: bool) -> None:
        self.num_inputs += 1
        self.num_accepted += is_accepted
        counts = self.by_kind.setdefault(kind, [0, 0])
        counts[0] += 1
        counts[1] += is_accepted


def outputs(rng: random.Random, request_id: str, n: int = 3) -> list[RequestOutput]:
    """A short stream of engine outputs for one request (texts, ids, a finish)."""
    texts = [rng.choice(["a", " b", "é", ""]) for _ in range(n - 1)]
    out = [
        RequestOutput(
            request_id=request_id,
            text=text,
            token_ids=[rng.randrange(1000)],
            token_texts=[text],
            usage=Usage(prompt_tokens=3, completion_tokens=i + 1),
        )
        for i, text in enumerate(texts)
    ]
    out.append(
        RequestOutput(
            request_id=request_id,
            text=".",
            token_ids=[7],
            token_texts=["."],
            finished=True,
            finish_reason="length",
            usage=Usage(prompt_tokens=3, completion_tokens=n),
        )
    )
    return out


CALL_TEXTS = [
    '```json\n{"name": "f", "arguments": {}}\n```',
    '{"name": "f", "parameters": {"x": [1, "\\u00e9"]}}',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    '```\n{"name": "g", "arguments": 1}```',
]
"""Replies that are (or nearly are) tool calls of the generated requests' function ``f``."""


def call_outputs(rng: random.Random, request_id: str) -> list[RequestOutput]:
    """One of ``CALL_TEXTS`` cut in random pieces, as engine outputs ending with ``stop``."""
    text = rng.choice(CALL_TEXTS)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 3)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [
        RequestOutput(
            request_id=request_id,
            text=piece,
            finished=i == len(pieces) - 1,
            finish_reason="stop" if i == len(pieces) - 1 else None,
            usage=Usage(prompt_tokens=3, completion_tokens=i + 1),
        )
        for i, piece in enumerate(pieces)
    ]


Target = Callable[[random.Random, "bytes | None"], tuple[str, bool]]
"""One run: ``(rng, given)`` → the input's kind and whether codec and session accepted it;
``given`` replaces the generated wire bytes (kind ``"raw"``)."""


def _input(rng: random.Random, given: bytes | None, valid: Callable[[random.Random], Any]) -> tuple[str, bytes]:
    return ("raw", given) if given is not None else gen.wire_input(rng, valid)


def fake_tokens(text: str) -> list[int]:
    """Stand-in tokenization: one id per character (bounded by the context in the codec)."""
    return [ord(c) % 1000 for c in text[:64]] or [1]


# -- openai_http ---------------------------------------------------------------------------------

SERVED = openai_codec.ServedModel(name="fake", max_context_tokens=256, vocab_size=1000)


def openai_session(req: Any, kind: OpenAIKind, rng: random.Random) -> None:
    openai_codec.check_model(req.model, SERVED.name)
    if kind is OpenAIKind.CHAT:
        messages = openai_codec.template_messages(openai_codec.chat_messages(req, SERVED))
        openai_codec.template_kwargs(req)
        prompts = [fake_tokens(json.dumps(messages))]
    else:
        prompts = [p if isinstance(p, list) else fake_tokens(p) for p in openai_codec.completion_prompts(req)]
    num_choices = openai_codec.check_choices(req, len(prompts), SERVED)
    sampling = openai_codec.sampling_params(req, SERVED)
    try:  # as the submission policy validates a request's parameters
        sampling.validate(vocab_size=SERVED.vocab_size, allow_prefill_only=kind is OpenAIKind.COMPLETION)
    except InvalidRequest as exc:
        raise openai_codec.renamed(exc, req) from exc
    request_ids = [f"cmpl-x-{k}" for k in range(num_choices)]
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if kind is OpenAIKind.CHAT else req.logprobs
    tool_format = "hermes" if kind is OpenAIKind.CHAT and openai_tools.parses_tool_calls(req) else None
    text_calls = openai_tools.text_call_check(req) if tool_format is not None else None
    session = ResponseSession(
        kind=kind,
        response_id="cmpl-x",
        created=0,
        model="fake",
        num_choices=num_choices,
        n=req.n or 1,
        logprobs=logprobs,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        tool_format=tool_format,
        text_calls=text_calls,
    )
    session.start()
    for index, request_id in enumerate(request_ids):
        is_call = tool_format is not None and rng.random() < 0.5
        for output in call_outputs(rng, request_id) if is_call else outputs(rng, request_id):
            session.on_output(index, output)
    session.end() if req.stream else session.body()


def openai_target(kind: OpenAIKind) -> Target:
    decode = openai_codec.decode_chat if kind is OpenAIKind.CHAT else openai_codec.decode_completion
    valid = gen.openai_chat if kind is OpenAIKind.CHAT else gen.openai_completion

    def run(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
        kind_, data = _input(rng, given, valid)
        try:
            openai_session(decode(data), kind, rng)
        except InvalidRequest:
            return kind_, False
        return kind_, True

    return run


def responses_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    """``/v1/responses``: the request translated to its chat request, checked as the adapter
    does, then a ``ResponsesSession`` fed engine outputs (text or a tool call)."""
    kind, data = _input(rng, given, gen.openai_responses)
    try:
        req = responses_codec.decode(data)
        items = responses_codec.input_items(req.input)
        chat = responses_codec.chat_request(req, [], items)
        openai_codec.check_chat(chat)
        openai_codec.check_model(req.model, SERVED.name)
        openai_codec.chat_messages(chat, SERVED)
        sampling = openai_codec.sampling_params(chat, SERVED)
        try:
            sampling.validate(vocab_size=SERVED.vocab_size)
        except InvalidRequest as exc:
            raise responses_codec.renamed(openai_codec.renamed(exc, chat)) from exc
    except InvalidRequest:
        return kind, False
    tool_format = "hermes" if openai_tools.parses_tool_calls(chat) else None
    session = ResponsesSession(
        response_id="resp_x",
        created_at=0,
        model="fake",
        echo={"background": bool(req.background)},
        tool_format=tool_format,
        text_calls=openai_tools.text_call_check(chat) if tool_format is not None else None,
        logprobs=(chat.top_logprobs or 0) if chat.logprobs else None,
    )
    session.start()
    is_call = tool_format is not None and rng.random() < 0.5
    for output in call_outputs(rng, "r") if is_call else outputs(rng, "r"):
        session.on_output(output)
    if rng.random() < 0.2:
        session.cancel()
    session.snapshot()
    return kind, True


# -- generate_ws -----------------------------------------------------------------------------


def generate_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    session = generate_session.GenerateSession(generate_session.Limits(model_name="fake", model_info=MODEL_INFO))
    is_rest = rng.random() < 0.2
    kind, data = _input(rng, given, gen.generate_rest if is_rest else _generate_sequence_head)
    try:
        message = generate_codec.decode_rest(data).to_config() if is_rest else generate_codec.decode(data)
    except generate_codec.InvalidMessage:
        return kind, False
    actions = session.receive(message, now=0.0)
    if any(isinstance(a, generate_session.Record) for a in actions):  # a resumable one: its transcript opened
        actions = session.on_record_opened()
    is_started = any(isinstance(a, generate_session.Start) for a in actions)
    if is_started:
        assert session.gen is not None
        session.on_started(Started(None, [1, 2, 3], session.gen.sampling))
        for output in outputs(rng, "r"):
            session.on_output(None, output, now=1.0)
    for _ in range(rng.randrange(3)):  # later messages on the same socket
        try:
            later = generate_codec.decode(gen.dumps(rng, gen.mutate(rng, gen.generate_ws(rng))))
        except generate_codec.InvalidMessage:
            continue
        session.receive(later, now=2.0)
    return kind, is_started or not isinstance(message, generate_messages.Config)


def _generate_sequence_head(rng: random.Random) -> dict[str, Any]:
    # The first message of a socket: a valid config starts a generation.
    config = gen.generate_ws(rng)
    return config if config["type"] == "config" else {"type": "config", "prompt": gen.text(rng)}


# -- batch_ws ----------------------------------------------------------------------------------

BATCH_DEFAULTS = BatchDefaults(**vars(SamplingDefaults()))


def batch_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    kind, data = _input(rng, given, gen.batch_ws)
    session = batch_session.BatchSession(ContinuationStore(4, 1000, 10.0), BATCH_DEFAULTS, batch_session.Limits(), "k")
    try:
        actions = session.receive(batch_codec.decode(data), 0.0)
    except InvalidRequest:
        return kind, False
    starts = [a for a in actions if isinstance(a, batch_session.Start)]
    for start in starts:
        session.on_started(Started(start.key, [1, 2, 3], start.request.sampling))
    for output in outputs(rng, "x"):
        session.on_outputs([(s.key, output) for s in starts], 1.0)
    return kind, bool(starts)


# -- chat_ws ----------------------------------------------------------------------------------


def chat_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    kind, data = _input(rng, given, gen.chat_ws)
    try:
        request = chat_codec.decode_request(data)
        kinds = [
            (getattr(part, "type", "text"), f"messages[{i}]")
            for i, m in enumerate(request.messages)
            if isinstance(m.content, list)
            for part in m.content
        ]
        chat_session.refuse_modalities([k for k in kinds if k[0] != "text"], "fake", ["text"])
        engine_request = chat_session.build_generate_request(request)
    except InvalidRequest:
        return kind, False
    session = chat_session.ChatSession(request, is_speaking=False)
    session.on_admitted()
    session.on_started(Started(None, [1, 2, 3], engine_request.sampling))
    for output in outputs(rng, "c"):
        session.on_output(None, output, 1.0)
    return kind, True


# -- framed_uds --------------------------------------------------------------------------------


def uds_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    kind, payload = _input(rng, given, gen.framed_uds)
    data = encode_frame(payload)
    if rng.random() < 0.1:  # a header that lies about the length
        kind, data = "hostile", rng.randbytes(4) + payload
    decoder = FrameDecoder(max_frame_bytes=4096)
    session = uds_session.FramedSession(uds_session.SessionLimits())
    is_accepted = False
    try:
        frames = []
        for start in range(0, len(data), step := rng.choice([1, 3, 7, len(data) or 1])):
            frames += decoder.feed(data[start : start + step])
    except FramingError as exc:
        session.on_protocol_error(exc)
        return kind, False
    for frame in frames:
        try:
            message = uds_codec.decode(frame)
        except (uds_codec.InvalidJson, InvalidRequest) as exc:
            session.on_protocol_error(exc, uds_codec.wire_id(frame))
            continue
        actions = session.receive(message)
        is_accepted = is_accepted or not any(_is_error(a) for a in actions)
        if starts := [a for a in actions if isinstance(a, uds_session.Start)]:
            session.on_started(Started(None, [1, 2, 3], starts[0].request.sampling))
            for output in outputs(rng, "u"):
                session.on_output(None, output, 1.0)
    return kind, is_accepted


def _is_error(action: Any) -> bool:
    return (
        isinstance(action, uds_session.Rejected) or getattr(getattr(action, "message", None), "event", None) == "error"
    )


def newline_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    session = uds_session.NewlineSession(uds_session.SessionLimits())
    if given is not None:
        kind, line = "raw", given
    elif rng.random() < 0.3:  # a prompt line: it must start a generation
        kind, line = "valid", gen.text(rng).encode()
    else:
        kind, line = "raw", rng.randbytes(rng.randrange(32))
    actions = session.receive_line(line)
    for output in outputs(rng, "n"):
        session.on_output(None, output, 1.0)
    session.on_end_of_input()
    return kind, any(isinstance(a, uds_session.Start) for a in actions)


# -- evergreen ----------------------------------------------------------------------------------


def evergreen_valid(rng: random.Random) -> dict[str, Any]:
    config = GenerateConfig(max_tokens=rng.randint(1, 8), temperature=rng.choice([None, 0.0, 0.7]))
    ids = [f"n{rng.randrange(10**6)}-{i}" for i in range(4)]
    message = msg(
        generate(ids[0], ids[3], config=config),
        parent(ids[0], ids[1], ids[2]),
        leaf(ids[1], gen.text(rng), role=rng.choice(["", "user"])),
        eot(ids[2]),
    )
    return json.loads(evergreen_codec.encode_json(message))


def evergreen_config(rng: random.Random) -> GenerateConfig:
    """A config with values anywhere in the protobuf types' ranges (int32, double, uint64)."""

    def pick(values: list[Any]) -> Any:
        return rng.choice(values + [None, None])

    return GenerateConfig(
        temperature=pick([0.0, 0.7, -1.0, 1e308, float("inf"), float("nan"), 5e-324]),
        top_k=pick([0, 5, -5, 2**31 - 1, -(2**31)]),
        top_p=pick([0.5, 1.0, 0.0, -0.1, 2.0, float("nan")]),
        min_p=pick([0.0, 0.1, 1.5]),
        max_tokens=pick([1, 4, 0, -1, 2**31 - 1]),
        min_tokens=pick([0, 3, -2, 2**31 - 1]),
        repetition_penalty=pick([1.0, 0.0, 1e308]),
        presence_penalty=pick([0.0, -3.0, 1e300]),
        frequency_penalty=pick([0.0, 2.5, float("-inf")]),
        seed=pick([0, 2**63, 2**64 - 1]),
        stop=tuple(rng.sample(["\n", "", "é", "x" * 100], rng.randrange(3))),
        ignore_eos=pick([True, False]),
    )


def evergreen_semantic(rng: random.Random) -> list[Any]:
    """Well-typed messages with hostile content: cycles, repeated ids, odd seqs and roles,
    unknown mimetypes, configs with extreme values, outputs that are inputs."""
    ids = [f"n{i}" for i in range(6)]
    messages = []
    for _ in range(rng.randint(1, 6)):
        items: list[Any] = []
        for _ in range(rng.randint(1, 4)):
            node_id, seq, continued = rng.choice(ids), rng.choice([0, 0, 0, 1, 2, -1, 2**31 - 1]), rng.random() < 0.2
            roll = rng.random()
            if roll < 0.3:
                items.append(parent(node_id, *rng.sample(ids, rng.randint(1, 3)), seq=seq, continued=continued))
            elif roll < 0.65:
                items.append(
                    leaf(
                        node_id,
                        rng.choice(["a", "", "é", "x" * 500]),
                        seq=seq,
                        continued=continued,
                        mimetype=rng.choice(["text/plain", "text/plain", None, "image/png", "", "text/x;charset=y"]),
                        role=rng.choice(["", "user", "model", "SYSTEM", "robot", "tool"]),
                    )
                )
            elif roll < 0.75:
                items.append(eot(node_id))
            else:
                items.append(
                    generate(
                        rng.choice(ids),
                        rng.choice(ids + [None, "out"]),
                        input_name=rng.choice(["prompt", "prompt", "text", "x"]),
                        name=rng.choice(["GENERATE"] * 6 + ["OTHER", ""]),
                        config=evergreen_config(rng) if rng.random() < 0.7 else None,
                        target=rng.choice([None, None, "fake", "other"]),
                    )
                )
        messages.append(msg(*items))
    return messages


def evergreen_semantic_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    """Several well-typed messages on one session, each through the JSON or protobuf codec."""
    if given is not None:
        return evergreen_target(rng, given)
    session = EvergreenSession(SessionLimits(max_depth=4, max_nodes=12, max_actions=3), ModelFacts(name="fake"))
    num_started = 0
    try:
        for message in evergreen_semantic(rng):
            if rng.random() < 0.5:
                decoded = evergreen_codec.decode_json(evergreen_codec.encode_json(message))
            else:
                decoded = evergreen_codec.decode_pb(evergreen_codec.to_pb(message).SerializeToString())
            for command in session.receive(decoded):
                if isinstance(command, Generate):
                    session.request_for(command, {})
                    num_started += 1
                    for output in outputs(rng, "e"):
                        session.on_output(command.action_id, output, 0.0)
        session.on_input_end()
    except (RillError, EvergreenInvalid):
        return "hostile", num_started > 0
    return "hostile", True


def evergreen_target(rng: random.Random, given: bytes | None = None) -> tuple[str, bool]:
    use_pb = rng.random() < 0.2
    if given is not None:
        kind, payload = "raw", given
    elif use_pb:
        kind = "valid" if rng.random() < 0.3 else "hostile"
        payload = evergreen_codec.to_pb(
            evergreen_codec.decode_json(json.dumps(evergreen_valid(rng)))
        ).SerializeToString()
        if kind == "hostile":
            payload = gen.edit_bytes(rng, payload)
    else:
        kind, payload = _input(rng, given, evergreen_valid)
    session = EvergreenSession(SessionLimits(max_depth=6, max_nodes=50, max_actions=4), ModelFacts(name="fake"))
    try:
        message = evergreen_codec.decode_pb(payload) if use_pb else evergreen_codec.decode_json(payload)
    except EvergreenInvalid:
        return kind, False
    try:
        commands = session.receive(message)
        started = [c for c in commands if isinstance(c, Generate)]
        for command in started:
            session.request_for(command, {})
            for output in outputs(rng, "e"):
                session.on_output(command.action_id, output, 0.0)
        session.on_input_end()
    except RillError:
        return kind, False
    return kind, bool(started)


TARGETS: dict[str, Target] = {
    "openai_http.completions": openai_target(OpenAIKind.COMPLETION),
    "openai_http.chat": openai_target(OpenAIKind.CHAT),
    "openai_http.responses": responses_target,
    "generate_ws": generate_target,
    "batch_ws": batch_target,
    "chat_ws": chat_target,
    "framed_uds": uds_target,
    "framed_uds.newline": newline_target,
    "evergreen": evergreen_target,
    "evergreen.session": evergreen_semantic_target,
}
"""Target name → one run (returns the input's kind and whether codec and session accepted it)."""


def run_one(name: str, seed: int, stats: Stats, given: bytes | None = None) -> None:
    """One input of target ``name`` from ``seed`` (or the bytes ``given``); raises
    ``Undocumented`` when something undocumented escapes, AssertionError when a valid input
    is refused."""
    rng = random.Random(seed)
    try:
        kind, is_accepted = TARGETS[name](rng, given)
    except (AssertionError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # the property under test
        raise Undocumented(f"{name}: seed {seed}: {type(exc).__name__}: {exc!r}"[:2000]) from exc
    if kind == "valid" and not is_accepted:
        raise AssertionError(f"{name}: seed {seed}: a valid input was refused")
    stats.add(kind, is_accepted)
