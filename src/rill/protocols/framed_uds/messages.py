"""Wire messages of the framed Unix-socket protocol (``shared/specs/framed-uds.md``).

Every frame carries one JSON object. Client → server: a generation ``Request``, a ``Cancel``
(``{"event": "cancel", "id": …}``) or the admin ``MetricsQuery`` (``{"type": "metrics"}`` or
``{"event": "metrics"}``). Server → client: ``Token``, ``Eos``, ``Error`` and ``Metrics``
frames, each tagged by its ``"event"`` field.

Field names are exactly the wire names; the codec renames nothing. Unknown request fields are
ignored (the spec: "future fields are optional and ignored by server until implemented").

Pure: msgspec structs (and ``rill.protocols._shared``'s sampling table) only.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rill.protocols._shared.sampling import SamplingMap, same
from rill.types import ResponseFormat


class Slo(msgspec.Struct, kw_only=True):
    """Latency targets of one request, in milliseconds (each optional, > 0 when given).

    ``target_ttft_ms`` sets the request's scheduling priority: any request with a TTFT target
    is admitted before requests without one, and a tighter target before a looser one.
    ``target_tbt_ms`` alone puts the request just ahead of requests without targets.
    """

    target_ttft_ms: float | None = None
    target_tbt_ms: float | None = None


class Request(msgspec.Struct, kw_only=True):
    """Client → server: generate from ``prompt``.

    Attributes:
        id: the client's request id; echoed in every event of this request.
        prompt: non-empty UTF-8 text to continue.
        max_tokens: most tokens to generate (default: the server's limit).
        temperature: 0.0 (the default) is greedy.
        top_p: nucleus sampling mass in (0, 1] (default 1.0, off).
        top_k: keep the k most likely tokens (default 0, off).
        stream: True streams ``token`` events; False sends one ``eos`` carrying all ``text``.
        slo: latency targets that set the scheduling priority.
        metadata: any JSON object; echoed as ``metadata`` in every event of this request.
        response_format: constrained decoding (``rill.types.ResponseFormat``: json_object,
            json_schema, regex, grammar), as OpenAI's ``response_format``.
        speculative: speculative decoding when the server runs it: false or 0 off, N at most
            N draft tokens (default: the server's); same output, only the speed differs.
        api_key: one of the server's API keys; required when it has any (``--api-key``),
            ignored otherwise.
    """

    id: str
    prompt: str
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = True
    slo: Slo | None = None
    metadata: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    speculative: bool | int | None = None
    api_key: str | None = None


SAMPLING = SamplingMap(Request, same("temperature", "top_p", "top_k", "max_tokens", "response_format", "speculative"))
"""``Request`` → ``SamplingParams``; a field left out (None) keeps the engine's default."""


class Cancel(msgspec.Struct, kw_only=True):
    """Client → server ``{"event": "cancel", "id": …}``: stop request ``id`` at the next token.

    Exactly one ``eos`` with ``reason: "cancelled"`` follows (unless the request had already
    ended, in which case the cancel is ignored). The connection stays open.
    """

    id: str


class MetricsQuery(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Client → server ``{"type": "metrics"}``: one ``Metrics`` frame, then the server closes.

    ``api_key``: required when the server has API keys, as for ``Request`` (and ``/metrics``).
    """

    api_key: str | None = None


ClientMessage = Request | Cancel | MetricsQuery


class Token(msgspec.Struct, kw_only=True, tag_field="event", tag="token", omit_defaults=True):
    """Server → client: one generated token.

    ``text`` is the token's text (may be empty when the token completes no character yet);
    the ``text`` of a request's ``token`` events concatenate to its completion.
    """

    id: str
    text: str
    token_id: int
    metadata: dict[str, Any] | None = None


EosReason = Literal["stop", "length", "cancelled", "error"]


class Eos(msgspec.Struct, kw_only=True, tag_field="event", tag="eos", omit_defaults=True):
    """Server → client: the request ended; exactly one per started request.

    ``reason``: ``stop`` (end-of-sequence token or stop string), ``length`` (``max_tokens`` or
    the context is full), ``cancelled`` (cancel frame), ``error`` (after an ``error`` event).
    ``text`` is the whole completion, sent only for ``stream: false`` requests.
    """

    id: str
    reason: EosReason
    text: str | None = None
    metadata: dict[str, Any] | None = None


class Error(msgspec.Struct, kw_only=True, tag_field="event", tag="error", omit_defaults=True):
    """Server → client: something failed; the server flushes this frame and closes.

    ``code`` is one of the ``E_*`` codes of ``codec.ERROR_CODES``; ``id`` is the request's id
    when the failing frame carried a readable one.
    """

    code: str
    message: str
    id: str | None = None
    metadata: dict[str, Any] | None = None


class Metrics(msgspec.Struct, kw_only=True, tag_field="event", tag="metrics"):
    """Server → client: the admin metrics snapshot (``codec.metrics_snapshot``)."""

    metrics: dict[str, Any]


ServerMessage = Token | Eos | Error | Metrics
