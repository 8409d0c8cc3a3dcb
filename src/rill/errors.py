"""The one exception tree of rill.

Every layer raises these; each protocol maps them to its own wire errors in one table
(looked up by MRO so the most specific class wins). Unexpected exceptions never reach a
client as text: protocols answer them with a generic message.

    RillError
    ├── ConfigError                 bad setting or broken model folder (startup)
    │   └── ModelLoadError          checkpoint missing files / unsupported architecture
    ├── InvalidRequest              a field of a request is invalid; .field names it
    │   ├── ContextLengthExceeded   prompt (+ generation) longer than the context
    │   ├── ConstraintFailed        a grammar that compiled could not be followed while sampling
    │   ├── PromptTooLarge          prompt over the character bound (checked before tokenizing)
    │   ├── PositionOutOfRange      a resume from a position a resumable stream has no event at (yet)
    │   └── BodyTooLarge            HTTP request body over the configured limit
    ├── Unauthorized                no API key or a wrong one
    ├── Forbidden                   a foreign web page or host name (browser checks)
    ├── RouteNotFound               no such HTTP path
    ├── MethodNotAllowed            the HTTP path exists, not for this method
    ├── RequestRejected             admission refused; .retryable
    │   ├── QueueFull               waiting queue over its bound (retryable)
    │   ├── MemoryPressure          request can never fit in the KV budget
    │   ├── RateLimited             token bucket empty (retryable, .retry_after_s)
    │   ├── ModelNotReady           model still loading (retryable)
    │   ├── TooManyConnections      connection limit (total or per client) reached (retryable)
    │   ├── StorageFull             a durable store is at its size cap (nothing deleted for room)
    │   └── ResourceExhausted       a server-wide budget (session memory) or this principal's share of it is used up
    ├── RequestNotFound             control action for an unknown or finished request
    │   └── ResumeExpired           a stream to resume ended longer ago than its grace period
    ├── CacheMiss                   a required cached prefix was evicted
    ├── RequestTimeout              per-request time limit reached
    │   └── IdleTimeout             a client sent no first message / not all of its request in time
    └── EngineError
        ├── GenerationError         one request failed; others continue
        ├── ReplicaLost             the engine replica running a request died (retryable)
        └── EngineDead              the engine loop crashed; nothing more can run
"""

from __future__ import annotations


class RillError(Exception):
    """Base of every error rill raises on purpose.

    Attributes:
        code: a short stable machine name (``snake_case``) that protocols may put on the wire.
        retryable: whether the same request may succeed if sent again later.
        retry_after_s: seconds after which a retry may succeed, or None when the error
            gives no such hint (the refusals that know one set it).
    """

    code = "internal_error"
    retryable = False
    retry_after_s: float | None = None

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message or self.__class__.__doc__ or self.code

    def __str__(self) -> str:
        return self.message


class ConfigError(RillError):
    """A setting is invalid or a required resource is missing at startup."""

    code = "config_error"


class ModelLoadError(ConfigError):
    """A model folder cannot be loaded (missing file, unsupported architecture, bad weights)."""

    code = "model_loading_error"


class InvalidRequest(RillError):
    """A request field is invalid.

    Attributes:
        field: the offending field's name as the engine knows it (``temperature``), or None.
    """

    code = "invalid_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus the tokens asked for) does not fit in the model's context."""

    code = "context_length_exceeded"

    def __init__(
        self, num_prompt_tokens: int, max_context_tokens: int, message: str | None = None, field: str = "prompt"
    ) -> None:
        super().__init__(
            message
            or f"prompt has {num_prompt_tokens} tokens but the model's context holds at most {max_context_tokens}",
            field=field,
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context_tokens = max_context_tokens


class PromptTooLarge(InvalidRequest):
    """The prompt holds more characters than the server tokenizes for one request."""

    code = "prompt_too_large"

    def __init__(self, num_chars: int, max_chars: int) -> None:
        super().__init__(
            f"the prompt has {num_chars} characters or more; this server takes at most {max_chars} "
            "per request (--max-prompt-chars)",
            field="prompt",
        )
        self.num_chars = num_chars
        self.max_chars = max_chars


class PositionOutOfRange(InvalidRequest):
    """A resume asked for the events after a position the stream has no event at (yet).

    The field is the protocol's to name (each calls the position its own way), so ``field``
    is None here.

    Attributes:
        position: the position asked for (-1: before the first event).
        last_position: the position of the stream's last event so far (-1: none yet).
    """

    def __init__(self, position: int, last_position: int) -> None:
        super().__init__(
            f"position {position} is out of range: the stream's last event so far has position {last_position}"
        )
        self.position = position
        self.last_position = last_position


class RequestRejected(RillError):
    """Admission was refused before the request started."""

    code = "rejected"
    retryable = True


class QueueFull(RequestRejected):
    """The waiting queue is at its bound; retry later."""

    code = "queue_full"
    retryable = True

    def __init__(self, message: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message or "the server's waiting queue is full; retry later")
        self.retry_after_s = retry_after_s


class MemoryPressure(RequestRejected):
    """The request can never fit in the KV cache memory budget."""

    code = "memory_pressure"
    retryable = False


class RateLimited(RequestRejected):
    """A rate limit was hit; ``retry_after_s`` says when a token will be available."""

    code = "rate_limited"
    retryable = True

    def __init__(self, message: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message or f"rate limit reached; retry in {retry_after_s:.2f} s")
        self.retry_after_s = retry_after_s


class ModelNotReady(RequestRejected):
    """The model is still loading."""

    code = "model_loading"
    retryable = True


class TooManyConnections(RequestRejected):
    """The server holds as many connections as it allows (in total or from this client)."""

    code = "too_many_connections"
    retryable = True
    retry_after_s = 1.0


class RequestNotFound(RillError):
    """A control action named a request that is unknown or already finished."""

    code = "request_not_found"


class ResumeExpired(RequestNotFound):
    """A stream the client asked to resume is known but no longer kept: it ended (or lost
    its last reader) longer ago than the resume grace period, or the events after the
    client's position were dropped to keep the stream within its memory bound."""

    code = "resume_expired"


class CacheMiss(RillError):
    """A continuation asked for a cached prefix that was evicted from the KV cache."""

    code = "cache_miss"


class RequestTimeout(RillError):
    """The request ran past its time limit."""

    code = "timeout"
    retryable = True


class StorageFull(RequestRejected):
    """A durable store (the feedback store) is at its configured size cap: the new record
    is refused; nothing already stored is deleted to make room."""

    code = "storage_full"
    retryable = False


class ResourceExhausted(RequestRejected):
    """A server-wide budget shared by every client (``--max-session-memory``), or this
    principal's share of it, is used up; retry once other work has ended."""

    code = "resource_exhausted"
    retryable = True

    def __init__(self, message: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message or "the server's session memory is used up; retry later")
        self.retry_after_s = retry_after_s


class ConstraintFailed(InvalidRequest):
    """The request's grammar (``response_format``, a tool schema) compiled, but sampling
    could not follow it (no token allowed, or the matcher refused a token): the request
    ends; its problem is the constraint it gave, not the server."""

    code = "constraint_failed"

    def __init__(self, message: str, field: str | None = "response_format") -> None:
        super().__init__(message, field=field)


class EngineError(RillError):
    """The engine failed."""

    code = "engine_error"


class GenerationError(EngineError):
    """One request failed inside the engine; other requests continue."""

    code = "generation_error"


class EngineDead(EngineError):
    """The engine loop has crashed; no request can run until restart."""

    code = "engine_dead"


class ReplicaLost(EngineError):
    """The engine replica running a request died (``rill.cluster``): that request is lost, the
    other replicas serve on, and the same request sent again runs on one of them."""

    code = "replica_lost"
    retryable = True
    retry_after_s = 1.0


class IdleTimeout(RequestTimeout):
    """A client sent no first message, or not all of its request, within the time allowed."""

    code = "idle_timeout"


class BodyTooLarge(InvalidRequest):
    """The HTTP request body is over the configured limit."""

    code = "request_too_large"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"Request body is larger than the limit of {limit_bytes} bytes", field=None)
        self.limit_bytes = limit_bytes


class Unauthorized(RillError):
    """No API key or a wrong one."""

    code = "invalid_api_key"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or "Missing or invalid API key: send 'Authorization: Bearer <key>'")


class Forbidden(RillError):
    """A browser request from a foreign web page or through a foreign host name."""

    code = "forbidden"


class RouteNotFound(RillError):
    """No such path on this server."""

    code = "not_found"


class MethodNotAllowed(RillError):
    """The path exists but not for this HTTP method."""

    code = "method_not_allowed"
