"""Checks across the fields of a ``ServerConfig``: each error a ``ConfigError`` naming the
field and its value.

``load`` (``loader.py``) runs ``validate`` on every config it builds.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from rill.config.areas import (
    ROUTING_MODES,
    ChatConfig,
    ClusterConfig,
    ConnectionConfig,
    EmbeddingConfig,
    EngineConfig,
    HttpConfig,
    PolicyConfig,
    ResumeConfig,
    ServerConfig,
    SpeechConfig,
)
from rill.config.values import parse_size
from rill.database import check_url
from rill.errors import ConfigError

WEIGHTS = ("auto", "dense", "bf16", "int8", "int4")  # --weights' values


def validate(config: ServerConfig) -> None:
    """Cross-field checks; raise ``ConfigError`` naming the field and value."""
    _validate_engine(config.engine)
    _validate_http(config.http)
    _validate_policy(config.policy)
    _validate_stores(config.http, config.chat)
    if config.storage.database is not None:
        check_url(config.storage.database, "database")
    _validate_embeddings(config.embeddings)
    _at_least_one(
        config.evergreen,
        "evergreen_max_depth",
        "evergreen_max_nodes",
        "evergreen_max_bytes",
        "evergreen_max_actions",
        "evergreen_max_fragments",
        "evergreen_max_id_bytes",
        "evergreen_max_prompt_bytes",
    )
    _at_least_one(config.connections, "max_connections", "max_connections_per_client")
    _validate_session_memory(config.connections)
    _validate_resume(config.resume)
    _validate_speech(config.speech)
    _validate_cluster(config.cluster)
    _positive_seconds(config.connections, "first_message_timeout_s", "header_timeout_s", "body_timeout_s")
    _one_of("uds_protocol", config.uds.uds_protocol, ("framed", "newline"))
    try:
        int(config.uds.socket_mode, 8)
    except ValueError as exc:
        raise ConfigError(f"socket_mode must be an octal mode such as 0600, not {config.uds.socket_mode!r}") from exc


def _validate_cluster(c: ClusterConfig) -> None:
    """Replica counts and their reservations."""
    if c.replicas is not None and c.replicas < 1:
        raise ConfigError(f"replicas must be at least 1, not {c.replicas}")
    if c.ray_address is not None and c.replicas is None:
        raise ConfigError("--ray-address places engine replicas: give --replicas N with it")
    if not 0 < c.replica_cpus < float("inf"):
        raise ConfigError(f"replica_cpus must be a positive number, not {c.replica_cpus}")
    if c.replica_max_requests < 1:
        raise ConfigError(f"replica_max_requests must be at least 1, not {c.replica_max_requests}")
    _one_of("routing", c.routing, ROUTING_MODES)


def _validate_engine(e: EngineConfig) -> None:
    """The engine's dtype, sizes and runner."""
    _one_of("dtype", e.dtype, ("auto", "float32", "bfloat16", "float16"))
    _one_of("weights", e.weights, WEIGHTS)
    _one_of("draft_weights", e.draft_weights, ("same", *WEIGHTS))
    if e.kv_cache_memory != "auto":
        parse_size(e.kv_cache_memory, "kv_cache_memory")
    _at_least_one(
        e,
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_queue",
        "max_prompt_chars",
        "tokenizer_threads",
        "max_prompt_logprobs_tokens",
        "grammar_threads",
    )
    if e.max_model_len is not None and e.max_model_len < 16:
        raise ConfigError(f"max_model_len must be >= 16, not {e.max_model_len}")
    _one_of("runner", e.runner, ("torch", "llamacpp"))
    if e.runner == "llamacpp":
        _check_llamacpp_model(e)


def _validate_http(h: HttpConfig) -> None:
    """The HTTP port, body cap, choices per request, forwarding, tool-call parser and log level."""
    if not (0 <= h.port < 65536):
        raise ConfigError(f"port must be in 0..65535, not {h.port}")
    _at_least_one(h, "max_body_bytes", "max_choices_per_request")
    if h.sse_keepalive_s < 0:
        raise ConfigError(f"sse_keepalive_s must be >= 0 (0 disables keep-alives), not {h.sse_keepalive_s}")
    for entry in h.forwarded_allow_ips:
        try:
            if entry.strip() != "*":
                ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError as exc:
            raise ConfigError(
                f"forwarded_allow_ips: {entry!r} is not an IP address, a network (10.0.0.0/8) or '*'"
            ) from exc
    _one_of("tool_call_parser", h.tool_call_parser, ("auto", "none", "hermes", "llama3_json"))
    if h.log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise ConfigError(f"log_level must be debug, info, warning or error, not {h.log_level!r}")


def _validate_policy(p: PolicyConfig) -> None:
    """The token cap, the rate limits and the time limit."""
    _at_least_one(p, "max_tokens_cap", "rate_limit_requests")
    _positive_seconds(p, "rate_limit_window")
    if p.rate_limit_tokens_per_s is not None and not 0 < p.rate_limit_tokens_per_s < float("inf"):
        raise ConfigError(f"rate_limit_tokens_per_s must be > 0, not {p.rate_limit_tokens_per_s}")
    _at_least_one(p, "rate_limit_burst")
    if p.rate_limit_audio_s is not None and not 0 < p.rate_limit_audio_s < float("inf"):
        raise ConfigError(f"rate_limit_audio_s must be > 0, not {p.rate_limit_audio_s}")
    _positive_when_set(p, "request_timeout_s")


def _validate_stores(h: HttpConfig, chat: ChatConfig) -> None:
    """The limits of the feedback store and of the chat record store."""
    _at_least_one(h, "feedback_max_per_generation", "feedback_max_per_connection", "feedback_max_text_bytes")
    parse_size(h.feedback_max_store_bytes, "feedback_max_store_bytes")
    if h.feedback_max_bytes_per_principal is not None:
        parse_size(h.feedback_max_bytes_per_principal, "feedback_max_bytes_per_principal")
    _positive_when_set(h, "feedback_retention_days")
    parse_size(chat.record_max_bytes, "record_max_bytes")
    _positive_when_set(chat, "record_retention_days")


def _validate_resume(r: ResumeConfig) -> None:
    """The grace period and the bounds of resumable streams and stored responses."""
    if not 0 <= r.resume_grace_s < float("inf"):
        raise ConfigError(f"resume_grace_s must be a number of seconds >= 0, not {r.resume_grace_s}")
    _at_least_one(r, "resume_max_streams", "responses_max_stored", "resume_max_streams_per_principal")
    if r.responses_max_store_bytes_per_principal is not None:
        parse_size(r.responses_max_store_bytes_per_principal, "responses_max_store_bytes_per_principal")
    for name in ("resume_max_stream_bytes", "responses_max_store_bytes", "responses_max_history_bytes"):
        if parse_size(getattr(r, name), name) < 1:
            raise ConfigError(f"{name} must be at least 1 byte, not {getattr(r, name)!r}")
    _positive_when_set(r, "responses_retention_days")


def _validate_embeddings(e: EmbeddingConfig) -> None:
    """The embeddings' bounds: counts >= 1, and a queue that holds at least one whole request."""
    _at_least_one(e, "embedding_max_inputs", "embedding_max_queued_inputs", "embedding_batch_tokens")
    if e.embedding_max_queued_inputs < e.embedding_max_inputs:
        raise ConfigError(
            f"embedding_max_queued_inputs ({e.embedding_max_queued_inputs}) must be at least "
            f"embedding_max_inputs ({e.embedding_max_inputs}): a request that large could never be queued"
        )


def _validate_speech(s: SpeechConfig) -> None:
    """The synthesizer and recognizer choices and the recognition pool's bounds."""
    _one_of("tts", s.tts, ("auto", "piper", "espeak"))
    _one_of("asr", s.asr, ("auto", "whisper", "off"))
    _at_least_one(s, "asr_workers", "asr_threads", "asr_max_queue")
    _positive_seconds(s, "asr_max_audio_s")
    _one_of("ocr", s.ocr, ("auto", "tesseract", "off"))
    _at_least_one(s, "ocr_workers", "ocr_max_queue", "ocr_max_pixels")
    _positive_seconds(s, "ocr_timeout_s")


def _validate_session_memory(c: ConnectionConfig) -> None:
    """The session-memory budget and a principal's share of it (both sizes, share <= total)."""
    total = parse_size(c.max_session_memory, "max_session_memory")
    if total < 1:
        raise ConfigError(f"max_session_memory must be at least 1 byte, not {c.max_session_memory!r}")
    if c.max_session_memory_per_principal is not None:
        share = parse_size(c.max_session_memory_per_principal, "max_session_memory_per_principal")
        if not 1 <= share <= total:
            raise ConfigError(
                f"max_session_memory_per_principal must be between 1 byte and max_session_memory "
                f"({c.max_session_memory}), not {c.max_session_memory_per_principal!r}"
            )


def _at_least_one(section: object, *names: str) -> None:
    """Each named count must be >= 1 (an optional one may be None: no limit)."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, not {value}")


def _positive_when_set(section: object, *names: str) -> None:
    """Each named optional number must be > 0 and finite when set (NaN is refused too)."""
    for name in names:
        value = getattr(section, name)
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"{name} must be > 0 and finite, not {value}")


def _positive_seconds(section: object, *names: str) -> None:
    """Each named duration must be a finite number of seconds > 0."""
    for name in names:
        value = getattr(section, name)
        if not 0 < value < float("inf"):  # also refuses NaN
            raise ConfigError(f"{name} must be a number of seconds > 0, not {value}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}")


def _check_llamacpp_model(e: EngineConfig) -> None:
    """``--runner llamacpp`` runs GGUF files only, on the CPU."""
    if e.device != "cpu":
        raise ConfigError(f"--runner llamacpp runs on the CPU only; drop --device {e.device}")
    if e.model is None:
        return  # the default model's GGUF file
    path = Path(e.model)
    if not path.exists():
        from rill.models.catalog import lookup

        entry = lookup(e.model)
        if entry is not None and entry.kind == "chat":
            return  # a catalog chat model (rill models) is a GGUF file
    is_gguf = path.suffix.lower() == ".gguf" or (
        path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))
    )
    if not is_gguf:
        raise ConfigError(
            f"--runner llamacpp needs a .gguf --model (or a folder holding one), not {e.model!r}; "
            "use --runner torch for Hugging Face folders and the demo model"
        )
