"""Wire messages of the ``/generate`` WebSocket (``shared/specs/generate-websocket.md``).

One msgspec struct per message; field names are exactly the spec's (the codec renames
nothing). Client messages form a tagged union on ``"type"``. Optional server fields default
to ``msgspec.UNSET`` so they are left out of the JSON unless the client asked for them.

Pure: imports msgspec, the standard library and ``rill.protocols._shared``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from rill.protocols._shared.sampling import SamplingMap, same
from rill.types import ResponseFormat

# --------------------------------------------------------------------------- client → server


class Parameters(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Generation parameters of ``config`` and ``control``/``modify``; every field optional.

    A field left out keeps its current value (the server default for ``config``). Unknown
    names are refused so a typo never passes silently. Values are range-checked by the
    session (``rill.types.SamplingParams.validate``), which names the bad field.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    response_format: ResponseFormat | None = None
    """Constrained decoding (``rill.types.ResponseFormat``: json_object, json_schema, regex,
    grammar); set by ``modify`` it constrains the text generated from then on, and
    ``{"type": "text"}`` lifts it."""
    speculative: bool | int | None = None
    """Speculative decoding when the server runs it (``--speculative``): true takes the
    server's draft length, false or 0 turns it off, N in [1, 16] drafts at most N tokens.
    The output is the same either way; only the speed differs."""


SAMPLING = SamplingMap(Parameters, same(*Parameters.__struct_fields__))
"""Every ``Parameters`` field is the ``SamplingParams`` field of the same name: a new sampling
parameter on this wire is one field above. ``config`` and ``modify`` both go through it."""


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the server should put in its replies (``config.options``)."""

    stream: bool = True
    echo_prompt: bool = False
    include_token_ids: bool = False
    include_logprobs: bool = False
    include_timing: bool = False


class Config(msgspec.Struct, tag_field="type", tag="config", kw_only=True):
    """Client → server: start a generation. Must be the first message (or follow a
    ``resume``), and again after a ``completion`` or a recoverable ``error`` to start the next
    one (spec §1).

    ``resumable`` (a rill extension; spec clients never send it) makes the generation outlive
    its connection: every server message of it carries its ``index``, and a dropped client
    re-attaches with ``resume`` within the server's grace period."""

    prompt: str
    model: str | None = None
    parameters: Parameters | None = None
    options: Options | None = None
    resumable: bool | UnsetType = UNSET


class Control(msgspec.Struct, tag_field="type", tag="control", kw_only=True, forbid_unknown_fields=True):
    """Client → server: steer the running generation (spec §2–3). ``parameters`` only with
    ``modify``."""

    action: Literal["stop", "pause", "resume", "regenerate", "modify"]
    parameters: Parameters | None = None


class Feedback(msgspec.Struct, tag_field="type", tag="feedback", kw_only=True, forbid_unknown_fields=True):
    """Client → server: a rating of a generation (spec §4). It concerns the current or last
    generation of the socket unless ``request_id`` names an earlier one."""

    rating: Annotated[float, Meta(ge=-1, le=1)]
    text: Annotated[str, Meta(max_length=65536)] | None = None
    position: Annotated[int, Meta(ge=0)] | None = None
    request_id: str | None = None


class Resume(msgspec.Struct, tag_field="type", tag="resume", kw_only=True, forbid_unknown_fields=True):
    """Client → server (a rill extension): re-attach this connection to the resumable
    generation ``request_id`` (its ``init``'s id). The server sends every message of it after
    the one whose ``index`` is ``last_index`` (-1: from its first), then follows it live; the
    controls and feedback of this connection then steer it. Valid as the first message and
    whenever no generation runs on the connection."""

    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    last_index: Annotated[int, Meta(ge=-1)] = -1


ClientMessage = Config | Control | Feedback | Resume


class RestRequest(Parameters, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/generate`` body: the spec's flat REST shape (``prompt`` plus parameters at
    the top level), with the ``config.options`` flags accepted at the top level too."""

    prompt: str
    model: str | None = None
    stream: bool = False
    echo_prompt: bool = False
    include_token_ids: bool = False
    include_logprobs: bool = False
    include_timing: bool = False

    def to_config(self) -> Config:
        """The equivalent WebSocket ``config`` message."""
        params = Parameters(**{name: getattr(self, name) for name in Parameters.__struct_fields__})
        options = Options(
            stream=self.stream,
            echo_prompt=self.echo_prompt,
            include_token_ids=self.include_token_ids,
            include_logprobs=self.include_logprobs,
            include_timing=self.include_timing,
        )
        return Config(prompt=self.prompt, model=self.model, parameters=params, options=options)


# --------------------------------------------------------------------------- server → client


class ModelInfoWire(msgspec.Struct, kw_only=True):
    """``init.model_info``: ``max_tokens`` is the context length, as in the spec's example."""

    max_tokens: int
    dtype: str
    quantization: str | None = None
    architecture: str | None = None
    vocab_size: int | None = None
    version: str | UnsetType = UNSET


class Init(msgspec.Struct, tag_field="type", tag="init", kw_only=True):
    """Server → client: a generation starts (again, after ``regenerate``).

    ``parameters`` (an addition to the spec's example; clients ignore unknown fields) are the
    sampling parameters in force, as the server took them: a ``max_tokens`` over the server's
    cap shows the clamped value. Same fields as the ``modified`` status's ``parameters``.
    """

    request_id: str
    model: str
    model_info: ModelInfoWire | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET
    index: int | UnsetType = UNSET
    """Position of the message in a resumable generation's transcript (absent otherwise)."""


class TokenLogprobWire(msgspec.Struct, kw_only=True):
    """One entry of ``token.logprobs``: the chosen token first, then the alternatives."""

    token: str
    logprob: float
    token_id: int


class TokenTiming(msgspec.Struct, kw_only=True):
    """``token.timing``: milliseconds for this token and since the ``config`` arrived."""

    token_ms: float
    total_ms: float


class Token(msgspec.Struct, tag_field="type", tag="token", kw_only=True):
    """Server → client: one generated token with the cumulative ``generated_text``."""

    token: str
    generated_text: str
    finished: bool = False
    finish_reason: str | None = None
    token_id: int | UnsetType = UNSET
    logprobs: list[TokenLogprobWire] | UnsetType = UNSET
    timing: TokenTiming | UnsetType = UNSET
    request_id: str | UnsetType = UNSET
    index: int | UnsetType = UNSET
    """Position of the message in a resumable generation's transcript (absent otherwise)."""


class UsageWire(msgspec.Struct, kw_only=True):
    """Token counts of a generation."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionTiming(msgspec.Struct, kw_only=True):
    """``completion.timing`` in milliseconds since the ``config`` arrived."""

    first_token_ms: float | None
    total_ms: float


class Completion(msgspec.Struct, tag_field="type", tag="completion", kw_only=True):
    """Server → client: the generation ended (``stop``, ``length`` or ``cancelled``)."""

    generated_text: str
    finish_reason: str
    usage: UsageWire
    request_id: str | UnsetType = UNSET
    timing: CompletionTiming | UnsetType = UNSET
    index: int | UnsetType = UNSET
    """Position of the message in a resumable generation's transcript (absent otherwise)."""


class Error(msgspec.Struct, tag_field="type", tag="error", kw_only=True):
    """Server → client: something failed (spec §4). Extra fields say what exactly:
    ``field`` (invalid_request), both lengths (context_length_exceeded),
    ``retry_after_seconds`` (rate_limited), ``generated_text`` (the partial text, mid-stream)."""

    error: str
    message: str
    recoverable: bool
    recovery_action: str | None = None
    request_id: str | None = None
    field: str | UnsetType = UNSET
    prompt_tokens: int | UnsetType = UNSET
    max_context_tokens: int | UnsetType = UNSET
    retry_after_seconds: float | UnsetType = UNSET
    generated_text: str | UnsetType = UNSET
    index: int | UnsetType = UNSET
    """Position of the message in a resumable generation's transcript (absent otherwise)."""


class Status(msgspec.Struct, tag_field="type", tag="status", kw_only=True):
    """Server → client: progress of a long operation, or the answer to a control or
    feedback message (``operation`` names it: ``model_loading``, ``queued`` (with
    ``position``, 1-based, and ``queue_length``), ``paused``, ``resumed``, ``modified``,
    ``regenerating``, ``feedback_received``)."""

    operation: str
    message: str | UnsetType = UNSET
    request_id: str | UnsetType = UNSET
    progress: float | UnsetType = UNSET
    eta_seconds: float | None | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET
    feedback_id: int | UnsetType = UNSET
    position: int | UnsetType = UNSET
    queue_length: int | UnsetType = UNSET
    index: int | UnsetType = UNSET
    """Position of the message in a resumable generation's transcript (absent otherwise)."""


ServerMessage = Init | Token | Completion | Error | Status


class RestResponse(msgspec.Struct, kw_only=True):
    """``POST /v1/generate`` answer when ``stream`` is false (the spec's REST shape)."""

    id: str
    model: str
    generated_text: str
    finish_reason: str
    usage: UsageWire
    timing: CompletionTiming | UnsetType = UNSET
