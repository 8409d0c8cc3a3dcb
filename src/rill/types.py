"""Protocol-neutral vocabulary shared by the engine, the frontend and every protocol.

Protocols never see engine internals and the engine never sees wire messages: they meet here.
This module imports only the standard library, msgspec and ``rill.errors``.

The flow is ``GenerateRequest`` (built by a protocol session) → engine → a stream of
``RequestOutput`` deltas (one per engine step in which the request gained something).
Concatenating the ``text`` of every delta of a request gives its full completion text.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Literal

import msgspec

from rill.errors import InvalidRequest

RequestId = str

FinishReason = Literal["stop", "length", "cancelled", "error"]
"""Why a request ended: eos / stop string / stop token (``stop``), max tokens or context
full (``length``), client cancel or disconnect (``cancelled``), a failure (``error``)."""


class RequestEvent(str, enum.Enum):
    """Lifecycle events the engine reports; each protocol maps them to its own words."""

    QUEUED = "queued"  # accepted into the waiting queue
    SCHEDULED = "scheduled"  # first step that worked on it (prefill started)
    PREFILL_DONE = "prefill_done"  # the whole prompt is in the KV cache
    PAUSED = "paused"
    RESUMED = "resumed"
    MODIFIED = "modified"  # sampling parameters changed; in force from the next token
    REGENERATING = "regenerating"  # generation dropped; restarting from the prompt
    PREEMPTED = "preempted"  # KV evicted under memory pressure; will be recomputed


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling and stopping parameters (all optional, neutral defaults).

    ``temperature`` 0 means greedy. ``top_k`` 0 means off. ``logprobs`` None means no
    logprobs; 0 means the chosen token's logprob only; N > 0 adds the top N alternatives.
    ``num_beams`` > 1 selects beam search (deterministic; sampling fields are ignored).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False

    def validate(self, vocab_size: int | None = None, max_logprobs: int = 20) -> "SamplingParams":
        """Check every field; raise ``InvalidRequest`` naming the first bad one. Returns self."""
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be >= 0 (0 or -1 disables it)")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        _check(self.logprobs is None or 0 <= self.logprobs <= max_logprobs, "logprobs", f"must be in [0, {max_logprobs}]")
        _check(1 <= self.num_beams <= 16, "num_beams", "must be in [1, 16]")
        _check(math.isfinite(self.length_penalty), "length_penalty", "must be a finite number")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        for token_id, bias in self.logit_bias.items():
            _check(math.isfinite(bias) and -100 <= bias <= 100, "logit_bias", "values must be in [-100, 100]")
            if vocab_size is not None:
                _check(0 <= token_id < vocab_size, "logit_bias", f"token id {token_id} is outside the vocabulary")
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                _check(0 <= token_id < vocab_size, "stop_token_ids", f"token id {token_id} is outside the vocabulary")
        return self

    def updated(self, patch: dict[str, Any]) -> "SamplingParams":
        """Return a copy with ``patch`` applied, validated; raise ``InvalidRequest`` on a bad field.

        Unknown field names are rejected too, so a typo never passes silently.
        """
        known = set(self.__struct_fields__)
        for name in patch:
            if name not in known:
                raise InvalidRequest(f"unknown sampling parameter '{name}'", field=name)
        merged = msgspec.structs.asdict(self) | dict(patch)
        try:
            new = msgspec.convert(merged, SamplingParams, strict=False)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"invalid sampling parameter: {exc}", field=_path_field(str(exc))) from exc
        return new.validate()

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise InvalidRequest(f"'{field}' {why}", field=field)


def _path_field(text: str) -> str | None:
    # msgspec messages end with "- at `$.field`"; keep the field name for the error.
    marker = "`$."
    if marker in text:
        return text.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0]
    return None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat turn: ``content`` is text, or a list of parts as the chat template expects."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Protocol-neutral request built by a protocol session and consumed by the frontend.

    Exactly one of ``prompt``, ``prompt_token_ids`` or ``messages`` is set. Chat templates
    are applied by the frontend (``chat_template_kwargs`` passes e.g. ``enable_thinking``).
    ``priority``: lower runs first (0 is normal); ``protocol`` labels metrics.
    ``request_id`` is generated when None. ``deadline_s`` is a wall-clock time limit.
    """

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: RequestId | None = None
    priority: int = 0
    protocol: str = "other"
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = {}
    deadline_s: float | None = None
    require_cached_prefix_tokens: int | None = None
    """If set, the engine finishes it with ``rill.errors.CacheMiss`` unless at least
    this many leading prompt tokens are still in its prefix cache (batch /ws continuation)."""


class TopLogprob(msgspec.Struct, array_like=True):
    """One alternative token and its log-probability."""

    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True):
    """Logprob of a chosen token, with the top alternatives (chosen token not repeated)."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = []


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request so far."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one request gained since its previous output (one or more engine steps).

    ``token_ids`` / ``token_texts`` / ``logprobs`` are per new token, in order;
    ``text`` is the new completion text (stop strings removed, never a split UTF-8
    character). ``token_texts`` concatenate to ``text`` except where the detokenizer held
    text back or a stop string was cut. ``finished`` is set on the last output only.
    ``error`` is a ``RillError`` when ``finish_reason`` is ``error``.
    Times are ``time.monotonic()`` seconds.
    """

    request_id: RequestId
    text: str = ""
    token_ids: list[int] = []
    token_texts: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    events: list[RequestEvent] = []
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: Any = None
    usage: Usage = msgspec.field(default_factory=Usage)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """Fold a later delta of the same request into this one (coalescing for slow consumers)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(
            request_id=self.request_id,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            token_texts=self.token_texts + later.token_texts,
            logprobs=logprobs,
            events=self.events + later.events,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            error=later.error,
            usage=later.usage,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time if self.first_token_time is not None else later.first_token_time,
            last_token_time=later.last_token_time if later.last_token_time is not None else self.last_token_time,
        )


class ModelInfo(msgspec.Struct, kw_only=True):
    """What a protocol may tell clients about the loaded model."""

    name: str
    architecture: str
    max_context_tokens: int
    vocab_size: int
    dtype: str
    device: str
    quantization: str | None = None
    has_chat_template: bool = False
    modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])


class EngineStats(msgspec.Struct, kw_only=True):
    """A snapshot of engine state and counters, read by /metrics and admin frames."""

    num_running: int = 0
    num_waiting: int = 0
    num_paused: int = 0
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0  # held by live (running, paused, prefilling) requests
    kv_cached_bytes: int = 0  # reusable prefix-cache entries (evictable)
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0
    num_preemptions_total: int = 0
    last_batch_size: int = 0
    last_step_ms: float = 0.0
    step_ms_ewma: float = 0.0
    requests_finished_total: dict[str, int] = {}
