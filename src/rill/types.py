"""Protocol-neutral vocabulary shared by the engine, the frontend and every protocol.

Protocols never see engine internals and the engine never sees wire messages: they meet here.
This module imports only the standard library, msgspec and ``rill.errors``.

The flow is ``GenerateRequest`` (built by a protocol session) → engine → a stream of
``RequestOutput`` deltas (one per engine step in which the request gained something).
Concatenating the ``text`` of every delta of a request gives its full completion text.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
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


# Bounds of every numeric sampling field: the one place they are set. Every protocol's
# request reaches the engine only through SamplingParams.validate (the frontend calls it on
# every request and modify), so a value is accepted or refused alike on every wire.
MAX_TEMPERATURE = 100.0  # above this the distribution is uniform to float32 precision anyway
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: top_k above the vocabulary means off
MIN_REPETITION_PENALTY = 0.01  # logits are scaled by at most 100 either way: no overflow to inf
MAX_REPETITION_PENALTY = 100.0
MAX_ABS_PENALTY = 2.0  # presence / frequency penalty (OpenAI's range)
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 2048
MAX_TOKENS_LIMIT = 2**31 - 1  # the context bounds generation much sooner; this keeps ints small
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_ALLOWED_TOKEN_IDS = 2**18  # more than any vocabulary holds
MAX_NUM_BEAMS = 16
MAX_ABS_LENGTH_PENALTY = 10.0  # beam scores stay finite for any length (see engine.beam)
MAX_SEED = 2**63
MAX_SPECULATIVE_TOKENS = 16  # draft tokens one request may ask to have verified per step
MAX_CONSTRAINT_CHARS = 65536  # a JSON schema, regex or grammar; compiling is linear in it


class ResponseFormat(msgspec.Struct, kw_only=True):
    """A constraint on the generated text, enforced by constrained decoding.

    OpenAI's ``response_format`` shape, with vLLM-like extensions: ``type`` is ``text`` (no
    constraint), ``json_object`` (any JSON object), ``json_schema`` (``json_schema`` holds
    ``{"name", "schema", "strict"}``; ``strict`` false lets unsupported schema keywords pass
    unenforced instead of failing), ``regex`` (``regex``: the whole output matches it) or
    ``grammar`` (``grammar``: a Lark grammar in llguidance's dialect, which also reads
    ``%json {schema}`` rules).
    """

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"] = "text"
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None

    def validate(self) -> ResponseFormat:
        """Check that the field ``type`` needs is there and bounded; raise ``InvalidParameter``."""
        field = "response_format"
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            _check(isinstance(schema, dict), field, "of type json_schema needs json_schema.schema (an object)")
            _check(
                len(msgspec.json.encode(schema)) <= MAX_CONSTRAINT_CHARS,
                field,
                f"schema has more than {MAX_CONSTRAINT_CHARS} characters",
            )
            strict = (self.json_schema or {}).get("strict")
            _check(strict is None or isinstance(strict, bool), field, "json_schema.strict must be true or false")
        for kind in ("regex", "grammar"):
            if self.type == kind:
                text = getattr(self, kind)
                _check(isinstance(text, str) and bool(text), field, f"of type {kind} needs '{kind}' (a string)")
                _check(
                    len(text) <= MAX_CONSTRAINT_CHARS, field, f"{kind} has more than {MAX_CONSTRAINT_CHARS} characters"
                )
        return self

    @property
    def is_constraint(self) -> bool:
        """True unless the type is ``text``."""
        return self.type != "text"

    def cache_key(self) -> str:
        """A canonical text of the constraint (equal constraints give equal keys)."""
        if self.type == "json_schema":
            spec = self.json_schema or {}
            return "json_schema:" + str(bool(spec.get("strict"))) + ":" + _canonical_json(spec.get("schema"))
        if self.type in ("regex", "grammar"):
            return f"{self.type}:" + str(getattr(self, self.type))
        return self.type


def _canonical_json(value: Any) -> str:
    return msgspec.json.encode(value, order="sorted").decode()


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling and stopping parameters (all optional, neutral defaults).

    ``temperature`` 0 means greedy. ``top_k`` 0 or -1 means off. ``logprobs`` None means no
    logprobs; 0 means the chosen token's logprob only; N > 0 adds the top N alternatives.
    ``prompt_logprobs`` does the same for every prompt token after the first, computed while
    the prompt is prefilled (such a request does not reuse the prefix cache: cached positions
    have no logits). ``max_tokens`` 0 prefills the prompt and generates nothing (``length``);
    only where the caller allows it (``validate``'s ``allow_prefill_only``).
    ``allowed_token_ids`` (vLLM's): when set, only these tokens may be chosen (None: any).
    ``num_beams`` > 1 selects beam search (deterministic; sampling fields are ignored).
    ``validate`` holds the bounds of every field; protocols map their wire fields here and
    rely on it rather than checking ranges themselves.
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
    allowed_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    response_format: ResponseFormat | None = None
    """Constrained decoding (``ResponseFormat``); a ``modify`` that sets it constrains the text
    generated from then on (not the text before)."""
    speculative: bool | int = True
    """Speculative decoding for this request, when the server runs it (``--speculative``):
    true takes the server's draft length, false or 0 turns it off, N in [1, 16] caps the draft
    at N tokens. Output is the same either way (greedy token for token; sampled from the same
    distribution, and with a seed the same text); only the speed differs."""

    def validate(
        self, vocab_size: int | None = None, max_logprobs: int = 20, allow_prefill_only: bool = False
    ) -> SamplingParams:
        """Check the type and range of every field; raise ``InvalidParameter`` naming the first bad
        one (``field`` is the engine's name; protocols rename it to their wire's). Returns self.

        ``max_tokens`` 0 (prefill only) passes only with ``allow_prefill_only``: the engine can
        do it, but on most wires a request that generates nothing is a client's mistake.

        Every bound is finite, so no accepted value can overflow the sampler or beam scores.
        """
        self._check_types()
        self._check_sampling_ranges()
        self._check_lengths(max_logprobs, allow_prefill_only)
        self._check_stop_strings()
        self._check_token_ids(vocab_size)
        self._check_response_format()
        return self

    def _check_types(self) -> None:
        """Every field has its type (numbers, integers, booleans)."""
        for name in _FLOAT_FIELDS:
            _check(_is_number(getattr(self, name)), name, "must be a number")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check((value is None and name in _OPTIONAL_INT_FIELDS) or _is_int(value), name, "must be an integer")
        for name in ("ignore_eos", "early_stopping"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")

    def _check_sampling_ranges(self) -> None:
        """Temperature, top-k/p, min-p and the penalties are within their bounds."""
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(self.temperature <= MAX_TEMPERATURE, "temperature", f"must be <= {MAX_TEMPERATURE:g}")
        _check(-1 <= self.top_k <= MAX_TOP_K, "top_k", f"must be in [-1, {MAX_TOP_K}] (0 or -1 disables it)")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _range(self.min_p, 0.0, 1.0, "min_p")
        _range(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, "repetition_penalty")
        _range(self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, "presence_penalty")
        _range(self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, "frequency_penalty")

    def _check_lengths(self, max_logprobs: int, allow_prefill_only: bool) -> None:
        """Token counts, logprob counts, beams and the seed are within their bounds."""
        low = 0 if allow_prefill_only else 1
        _check(self.max_tokens >= low, "max_tokens", f"must be >= {low}")
        _check(self.max_tokens <= MAX_TOKENS_LIMIT, "max_tokens", f"must be <= {MAX_TOKENS_LIMIT}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= max_logprobs, "logprobs", f"must be in [0, {max_logprobs}]"
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= max_logprobs,
            "prompt_logprobs",
            f"must be in [0, {max_logprobs}]",
        )
        _check(1 <= self.num_beams <= MAX_NUM_BEAMS, "num_beams", f"must be in [1, {MAX_NUM_BEAMS}]")
        _range(self.length_penalty, -MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY, "length_penalty")
        _check(self.seed is None or 0 <= self.seed < MAX_SEED, "seed", "must be in [0, 2**63)")
        _check(
            isinstance(self.speculative, bool)
            or (_is_int(self.speculative) and 0 <= self.speculative <= MAX_SPECULATIVE_TOKENS),
            "speculative",
            f"must be true, false or a number of draft tokens in [0, {MAX_SPECULATIVE_TOKENS}]",
        )

    def _check_stop_strings(self) -> None:
        """Stop strings: a list of non-empty strings, few and short enough."""
        _check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        _check(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"each stop string has at most {MAX_STOP_STRING_CHARS} characters",
        )

    def _check_token_ids(self, vocab_size: int | None) -> None:
        """Logit biases, stop token ids and allowed token ids name tokens of the vocabulary (when known)."""
        _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to numbers")
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries"
        )
        for token_id, bias in self.logit_bias.items():
            _check(_is_int(token_id) and token_id >= 0, "logit_bias", "keys must be token ids (integers >= 0)")
            _check(
                _is_number(bias) and math.isfinite(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS,
                "logit_bias",
                f"values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
            )
            if vocab_size is not None:
                _check(token_id < vocab_size, "logit_bias", f"token id {token_id} is outside the vocabulary")
        _check(
            isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
        )
        for token_id in self.stop_token_ids:
            _check(_is_int(token_id) and token_id >= 0, "stop_token_ids", "must be token ids (integers >= 0)")
            if vocab_size is not None:
                _check(token_id < vocab_size, "stop_token_ids", f"token id {token_id} is outside the vocabulary")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check(
                isinstance(allowed, list) and 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS,
                "allowed_token_ids",
                f"must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids",
            )
            _check(
                all(_is_int(t) and t >= 0 for t in allowed), "allowed_token_ids", "must be token ids (integers >= 0)"
            )
            if vocab_size is not None:
                _check(
                    max(allowed) < vocab_size, "allowed_token_ids", f"token id {max(allowed)} is outside the vocabulary"
                )

    def _check_response_format(self) -> None:
        """The response format is valid and not combined with beam search."""
        if self.response_format is not None:
            _check(isinstance(self.response_format, ResponseFormat), "response_format", "must be an object")
            self.response_format.validate()
            _check(
                self.num_beams == 1 or not self.response_format.is_constraint,
                "response_format",
                "cannot be combined with beam search (num_beams > 1)",
            )

    @property
    def constraint(self) -> ResponseFormat | None:
        """The response format when it constrains decoding, else None."""
        fmt = self.response_format
        return fmt if fmt is not None and fmt.is_constraint else None

    def patched(self, patch: dict[str, Any]) -> SamplingParams:
        """A copy with ``patch`` applied and its values converted to the fields' types, NOT
        range-checked: for a caller that validates the result once (``validate``, with the
        vocabulary), as the frontend does for a ``modify``.

        Raises:
            InvalidParameter: an unknown field name (a typo never passes silently) or a value
                that cannot become its field's type.
        """
        known = self.__struct_fields__
        for name in patch:
            if name not in known:
                raise InvalidParameter(f"unknown sampling parameter '{name}'", field=name)
        merged = msgspec.structs.asdict(self) | dict(patch)
        try:
            return msgspec.convert(merged, SamplingParams, strict=False)
        except msgspec.ValidationError as exc:
            raise InvalidParameter(f"invalid sampling parameter: {exc}", field=_path_field(str(exc))) from exc

    def updated(self, patch: dict[str, Any]) -> SamplingParams:
        """``patched`` then ``validate`` (no vocabulary); raise ``InvalidParameter`` on a bad field."""
        return self.patched(patch).validate()

    def speculative_tokens(self, server_k: int) -> int:
        """The most draft tokens this request lets the server verify per step, given the server's ``k``."""
        if self.speculative is True:
            return server_k
        return min(int(self.speculative), server_k)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


DRAW_ONLY_FIELDS = ("temperature", "top_k", "top_p", "min_p")
"""``SamplingParams`` fields that only shape the distribution a token is drawn from: greedy
decoding and beam search ignore them. A wire that, like Hugging Face's ``generate``, ignores
them when not sampling leaves them out (instead of validating them)."""

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
)
_INT_FIELDS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "num_beams")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _range(value: float, low: float, high: float, field: str) -> None:
    # NaN fails both comparisons, infinities fail one: only finite values in range pass.
    _check(low <= value <= high, field, f"must be in [{low:g}, {high:g}]")


class InvalidParameter(InvalidRequest):
    """A sampling parameter (a ``SamplingParams`` or ``ResponseFormat`` field) has a wrong type
    or value. An ``InvalidRequest`` on every wire; a protocol whose parameters sit under a key
    of their own names the field as its wire does (``/generate``: ``parameters.<name>``), unlike
    other refusals of the same field (a grammar that does not compile)."""


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise InvalidParameter(f"'{field}' {why}", field=field)


def _path_field(text: str) -> str | None:
    # msgspec messages end with "- at `$.field`"; keep the field name for the error.
    marker = "`$."
    if marker in text:
        return text.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0]
    return None


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The roles a chat message may have (OpenAI's; the chat template receives them as given)."""

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
"""Chat-template variables a client's ``chat_template_kwargs`` may not set (the server sets them)."""


def check_chat_messages(messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
    """Refuse a message list with an unknown role (``ChatMessage`` structs or plain dicts; an
    item that is neither, from a caller that did not validate its input, has no role and is
    refused too).

    Raises:
        InvalidRequest: ``field`` is ``messages``; the message names the index and the roles allowed.
    """
    for index, message in enumerate(messages):
        role = (
            message.role
            if isinstance(message, ChatMessage)
            else message.get("role")
            if isinstance(message, dict)
            else None
        )
        if role not in CHAT_ROLES:
            shown = repr(role) if isinstance(role, str) and len(role) <= 40 else "this value"
            raise InvalidRequest(
                f"messages[{index}].role {shown} is not a chat role; use one of {', '.join(sorted(CHAT_ROLES))}",
                field="messages",
            )


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A client's ``chat_template_kwargs``: a mapping of names to values, no reserved name.

    Returns:
        the mapping, as a new dict.
    Raises:
        InvalidRequest: not a mapping of string keys, or a key in ``RESERVED_TEMPLATE_KWARGS``.
    """
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise InvalidRequest(
            "'chat_template_kwargs' must be an object of template variables", field="chat_template_kwargs"
        )
    clash = RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
    if clash:
        raise InvalidRequest(
            f"'chat_template_kwargs' may not set '{sorted(clash)[0]}' (the server sets it)",
            field="chat_template_kwargs",
        )
    return dict(kwargs)


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat turn: ``content`` is text, or a list of parts as the chat template expects.

    ``role`` is one of ``CHAT_ROLES`` (checked by ``check_chat_messages`` at admission).
    """

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
    ``principal`` says who asks (``rill.auth.principal``: a digest of the API key that
    authenticated, else the client's address); the admission step's per-principal rate
    limits key on it, and in-process callers that set none share one principal.
    ``request_id`` is generated when None. ``deadline_s`` is a wall-clock time limit (the
    server's ``--request-timeout-s`` applies too: the shorter one wins). ``tools`` are the
    functions offered to the chat template (its own ``tools`` argument), with ``messages``.
    """

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: RequestId | None = None
    priority: int = 0
    protocol: str = "other"
    principal: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = {}
    tools: list[dict[str, Any]] | None = None
    deadline_s: float | None = None
    require_cached_prefix_tokens: int | None = None
    """If set, the engine finishes it with ``rill.errors.CacheMiss`` unless at least
    this many leading prompt tokens are still in its prefix cache (batch /ws continuation)."""


class TopLogprob(msgspec.Struct, array_like=True):
    """One alternative token and its log-probability."""

    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True):
    """Logprob of a chosen token, with the top alternatives (chosen token not repeated).

    ``rank`` (prompt logprobs only, else None): 1 + how many tokens were more likely.
    """

    token_id: int
    logprob: float
    top: list[TopLogprob] = []
    rank: int | None = None


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
    character). ``token_texts`` always concatenate exactly to ``text``, in every output and
    so over the whole request. The rule (``rill.engine.output``): a token's text is what it
    released; a token inside a matched stop string gets ""; text released with no new token
    (a held tail at the end, text a changed stop list no longer holds) goes on the last token
    not yet delivered, and so that one exists, a token whose text is held back (an
    incomplete character, a possible start of a stop string) is delivered with the output
    that releases it. ``finished`` is set on the last output only.
    ``error`` is a ``RillError`` when ``finish_reason`` is ``error``.
    ``prompt_logprobs`` (asked by ``SamplingParams.prompt_logprobs``) comes once, on the output
    of the step that finished the prompt: one entry per prompt token, None for the first.
    ``cumulative_logprob`` (with ``SamplingParams.logprobs``) sums the logprobs of every token
    generated so far, end-of-sequence included (``usage.completion_tokens`` counts them).
    ``modified`` carries the data of the ``MODIFIED`` events: one ``SamplingParams`` per such
    event in ``events``, in order, each the whole set of parameters in force from the next token
    (values the server caps already clamped).
    Times are ``time.monotonic()`` seconds.
    """

    request_id: RequestId
    text: str = ""
    token_ids: list[int] = []
    token_texts: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None
    events: list[RequestEvent] = []
    modified: list[SamplingParams] = []
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: Any = None
    usage: Usage = msgspec.field(default_factory=Usage)
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    """When the engine first put the request in a step (the end of its queue time)."""
    first_token_time: float | None = None
    last_token_time: float | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
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
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            cumulative_logprob=later.cumulative_logprob
            if later.cumulative_logprob is not None
            else self.cumulative_logprob,
            events=self.events + later.events,
            modified=self.modified + later.modified,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            error=later.error,
            usage=later.usage,
            arrival_time=self.arrival_time,
            scheduled_time=self.scheduled_time if self.scheduled_time is not None else later.scheduled_time,
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
    tool_call_format: str | None = None
    """The tool-call format the chat template teaches (``hermes``, ``llama3_json``), if any."""
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
    spec_draft_tokens_total: int = 0  # speculative draft tokens verified
    spec_accepted_tokens_total: int = 0  # of those, emitted as drafted
    last_batch_size: int = 0
    last_step_ms: float = 0.0
    step_ms_ewma: float = 0.0
    requests_finished_total: dict[str, int] = {}
    allied_processes: int = 0  # whose CPU the thread governor counts as the engine's own (a replica's front doors)
    linked_frontends: int = 0  # outputs streams a replica sends over a local socket (rill.cluster.link)


# ----------------------------------------------------------------------------- speech


@dataclasses.dataclass(frozen=True)
class Segment:
    """One stretch of recognized speech; times in seconds from the start of the audio."""

    start_s: float
    end_s: float
    text: str


@dataclasses.dataclass(frozen=True)
class Transcript:
    """What a recognizer heard in one piece of audio.

    ``text`` is empty when no speech was heard (``speech_s`` is then 0); ``language`` is the
    hint given or the detected language code (``en``, ``fr``, ...); ``duration_s`` is the whole
    audio's length, ``speech_s`` what voice-activity trimming kept.
    """

    text: str
    language: str
    duration_s: float
    speech_s: float
    segments: tuple[Segment, ...] = ()
    language_probability: float = 1.0
