"""Composition root of ``rill serve``: config → engine client → protocol adapters → listeners.

One process, one asyncio loop, one engine thread. ``protocols()`` lists every protocol the
server mounts, each with what its ``adapter`` module provides:

* ``routes(deps) -> list[starlette.routing.BaseRoute]`` — HTTP and WebSocket routes on the
  shared HTTP port;
* ``async start(deps) -> Callable[[], Awaitable[None]] | None`` — a listener of its own (Unix
  socket, gRPC); the returned coroutine function stops it (None: not configured).

``/health`` and ``/metrics`` come from ``rill.observability``. ``GET /`` is the browser
playground (``rill.playground``).

Built in this order, once ``--database`` (if given) was reached: the parts every protocol shares (``make_parts``: connection gate,
session-memory budget, metrics registry, submission policy), the embedding model's service
when ``--embedding-model`` names one (``start_embeddings``: its worker loads the model while
the engine loads its own), the engine client with that policy and the registry as its sink
(``start_client``), then the ``Deps`` adapters receive (``make_deps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from rill import auth, database, middleware, observability
from rill.config import ServerConfig, served_model_name, session_memory_bytes
from rill.connections import FD_RESERVE, ConnectionGate, http_protocol_factory, raise_fd_limit
from rill.deps import Deps, Stopper
from rill.errors import EngineDead, RillError
from rill.frontend.budget import (
    MemoryBudget,
    MemoryReturner,
    freeze_startup_objects,
    malloc_trim,
    thaw_startup_objects,
)
from rill.frontend.client import EngineClient
from rill.frontend.embeddings import EmbeddingService
from rill.frontend.metrics import Metrics
from rill.frontend.policy import SubmissionPolicy
from rill.playground import routes as playground
from rill.protocols.openai_http import adapter as openai_http

if TYPE_CHECKING:
    import uvicorn

    from rill.frontend.inproc import InprocClient

log = logging.getLogger("rill.server")


@dataclass(frozen=True, slots=True)
class Protocol:
    """One wire protocol as the server mounts it: its routes on the shared HTTP port and/or
    a listener of its own."""

    name: str
    routes: Callable[[Deps], list[BaseRoute]] | None = None
    start: Callable[[Deps], Awaitable[Stopper | None]] | None = None


def protocols() -> tuple[Protocol, ...]:
    """Every protocol the server serves, in the order their routes are mounted.

    The adapters are imported here, when a server is built, not with this module: gRPC
    (Evergreen's) then loads after ``serve`` has checked the open-file limit and said so.
    """
    from rill.protocols.batch_ws import adapter as batch_ws
    from rill.protocols.chat_ws import adapter as chat_ws
    from rill.protocols.evergreen import adapter as evergreen
    from rill.protocols.framed_uds import adapter as framed_uds
    from rill.protocols.generate_ws import adapter as generate_ws

    return (
        Protocol("openai_http", routes=openai_http.routes),
        Protocol("generate_ws", routes=generate_ws.routes),
        Protocol("batch_ws", routes=batch_ws.routes),
        Protocol("chat_ws", routes=chat_ws.routes),
        Protocol("evergreen", routes=evergreen.routes, start=evergreen.start),
        Protocol("framed_uds", start=framed_uds.start),
    )


def build_app(deps: Deps, served: Sequence[Protocol] | None = None) -> ASGIApp:
    """The app with /health, /metrics, the routes of every protocol in ``served`` (default:
    ``protocols()``) and the playground, wrapped in the HTTP middleware (keys, CORS, limits;
    errors in the OpenAI API's shape)."""
    routes: list[BaseRoute] = list(observability.routes(deps))
    for protocol in protocols() if served is None else served:
        if protocol.routes is not None:
            routes.extend(protocol.routes(deps))
    routes.extend(playground.routes(deps))
    app: Starlette = Starlette(routes=routes)
    app.state.deps = deps
    return middleware.wrap(app, deps, render_error=openai_http.http_error)


@dataclass(frozen=True, slots=True)
class Parts:
    """What every protocol and the engine client share, made before the client."""

    gate: ConnectionGate
    """Counts client connections for every listener."""
    memory: MemoryBudget
    """The one session-memory budget every protocol charges (freed memory goes back to the OS)."""
    metrics: Metrics
    """The registry: the engine client's metrics sink, and ``/metrics``."""
    policy: SubmissionPolicy
    """The one submission policy (``config.policy``, the frontend's bounds of ``config.engine``,
    ``memory``): the engine client's, and the embeddings' rate limits."""


def make_parts(config: ServerConfig) -> Parts:
    """The connection gate, the session-memory budget, the metrics registry and the submission
    policy of ``config``."""
    limits = config.connections
    gate = ConnectionGate(limits.max_connections, limits.per_client_limit())
    total, per_principal = session_memory_bytes(limits)
    memory = MemoryBudget(total, per_principal, on_release=MemoryReturner(malloc_trim()).released)
    # Until a client is watched (and its model has loaded), refusals carry the name it will be served under.
    metrics = Metrics(gate=gate, model_name=served_model_name(config.engine), memory=memory)
    policy = SubmissionPolicy(config.policy, config.engine, memory=memory)
    return Parts(gate=gate, memory=memory, metrics=metrics, policy=policy)


def start_client(config: ServerConfig, parts: Parts) -> InprocClient:
    """The engine client, constructed with ``parts.policy`` and ``parts.metrics`` as its sink:
    in-process, or on Ray Serve replicas with ``--replicas`` (``rill.cluster``); its engine
    starts loading in the background."""
    from rill.frontend.inproc import InprocClient

    if config.cluster.replicas is not None:
        from rill.cluster.client import RayClient  # Ray only when replicas are asked for

        return RayClient.start_cluster(config.engine, config.cluster, policy=parts.policy, metrics=parts.metrics)
    return InprocClient.start(config.engine, policy=parts.policy, metrics=parts.metrics)


def start_embeddings(config: ServerConfig, parts: Parts) -> EmbeddingService | None:
    """The embedding model's service when ``--embedding-model`` names one (None otherwise): its
    worker thread starts loading the model on ``--device`` in the background, and its requests
    count in ``parts.policy``'s rate limits."""
    if not config.embeddings.embedding_model:
        return None
    return EmbeddingService.start(config.embeddings, policy=parts.policy, device=config.engine.device)


def make_deps(
    config: ServerConfig,
    client: EngineClient,
    parts: Parts | None = None,
    embeddings: EmbeddingService | None = None,
) -> Deps:
    """The ``Deps`` adapters receive: ``client``, the API keys, ``parts`` (made from ``config``
    when None), whose registry then reads ``client``'s gauges, the ``embeddings`` service, and
    the speech synthesizer and recognition ``config.speech`` names (nothing loads until first
    used).

    Raises:
        ConfigError: ``--tts piper``, ``--asr whisper`` or ``--ocr tesseract`` without their packages.
    """
    from rill.frontend.asr import make_asr
    from rill.frontend.ocr import make_ocr
    from rill.frontend.speech import make_synth

    parts = parts or make_parts(config)
    parts.metrics.watch(client)
    asr = make_asr(config.speech)
    ocr = make_ocr(config.speech)
    deps = Deps(
        config=config,
        client=client,
        metrics=parts.metrics,
        api_keys=config.api_keys(),
        gate=parts.gate,
        memory=parts.memory,
        embeddings=embeddings,
        speech_synth=make_synth(config.speech.tts),
        asr=asr,
        ocr=ocr,
    )
    if embeddings is not None:
        deps.stoppers.append(embeddings.shutdown)
    if asr is not None:

        async def stop_asr() -> None:
            asr.shutdown()

        deps.stoppers.append(stop_asr)
    if ocr is not None:

        async def stop_ocr() -> None:
            ocr.shutdown()

        deps.stoppers.append(stop_ocr)
    return deps


GIL_SWITCH_INTERVAL_S = 0.001
"""How long a thread may hold the GIL while another waits for it (Python's default: 5 ms).

The engine thread takes the GIL back between every two torch operations (hundreds per step),
and while the event loop encodes and writes a step's tokens it holds the GIL for up to the
switch interval at a time; meanwhile the engine's OpenMP threads idle. Measured over HTTP at
c=32 on the 100M Llama (bf16, 2 cores, ``profile_serve.py --only http``): 849 tok/s at 5 ms
(three runs), 913 at 1 ms, 900 at 0.5 ms, 878 at 0.1 ms (more switching costs more)."""


async def serve(
    config: ServerConfig,
    client: EngineClient | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    served: Sequence[Protocol] | None = None,
    started: Callable[[Deps], None] | None = None,
) -> None:
    """Run every front-end until SIGINT/SIGTERM (or ``stop`` is set); the model loads in the
    background. ``ready`` is set once the HTTP port listens; ``started`` is called with the
    server's ``Deps`` once they are built (tests use all three). ``client``: one already built
    with its own policy and sink (a test's fake) instead of ``start_client``'s; ``served``: the
    protocols to serve instead of ``protocols()`` (a test adds one of its own)."""
    config.api_keys()  # a key file with no key fails here, before the model starts loading
    if config.storage.database is not None:
        # An unreachable database fails here too (a ConfigError naming --database), not at
        # the first feedback a client sends.
        await asyncio.to_thread(database.probe, config.storage.database)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    fd_limit = raise_fd_limit(config.connections.max_connections)
    parts = make_parts(config)
    if 0 < fd_limit - FD_RESERVE < parts.gate.max_total:
        # Past the open-file limit every listener would stop accepting: refuse before it.
        parts.gate.max_total = max(1, fd_limit - FD_RESERVE)
    # The model package is imported here, on this thread, before any thread that imports
    # it starts (the engine's, the embedding model's): two threads importing it at once can
    # deadlock on its module locks, and Python then fails one of the imports (seen under
    # load: the engine thread loading the model while the speech set-up below imported
    # rill.models.speech). The embedding model's service still starts first, for the same
    # reason (see EmbeddingService.start).
    importlib.import_module("rill.models")
    embeddings = start_embeddings(config, parts)
    if client is None:
        client = start_client(config, parts)
    deps = make_deps(config, client, parts, embeddings)
    if started is not None:
        started(deps)
    served = protocols() if served is None else served
    app = build_app(deps, served)
    stoppers = await _start_listeners(deps, client, served)
    server = _http_server(config, app, parts.gate)
    log.info("rill listening on http://%s:%d", config.http.host, config.http.port)
    load_failure: list[BaseException] = []
    watchers = [asyncio.create_task(_watch_load(client, server, load_failure))]
    if embeddings is not None:
        watchers.append(asyncio.create_task(_watch_load(embeddings, server, load_failure, "the embedding model")))
    if stop is not None:
        watchers.append(asyncio.create_task(_watch_stop(stop, server)))
    try:
        await _serve_http(server, ready)
    finally:
        for watcher in watchers:
            watcher.cancel()
        deps.resumable.close()  # streams running with no reader: cancelled before the engine stops
        await _stop_all([*stoppers, *deps.stoppers], client)
        thaw_startup_objects()
    if load_failure:
        error = load_failure[0]
        raise error if isinstance(error, RillError) else EngineDead(f"the model failed to load: {error}")


async def _start_listeners(deps: Deps, client: EngineClient, served: Sequence[Protocol]) -> list[Stopper]:
    """Start every protocol's own listener and return what stops each.

    A listener that cannot start (socket held by a live server, port in use) ends the process
    at once, without leaving the engine thread or other listeners behind.
    """
    stoppers: list[Stopper] = []
    try:
        for protocol in served:
            if protocol.start is not None and (stopper := await protocol.start(deps)) is not None:
                stoppers.append(stopper)
    except BaseException:
        await _stop_all([*stoppers, *deps.stoppers], client)
        raise
    return stoppers


async def _stop_all(stoppers: list[Stopper], client: EngineClient) -> None:
    """Stop the protocols' own listeners (a failing one does not keep the others up), then the engine."""
    for stopper in stoppers:
        with contextlib.suppress(Exception):
            await stopper()
    await client.shutdown()


def _http_server(config: ServerConfig, app: ASGIApp, gate: ConnectionGate) -> uvicorn.Server:
    """The uvicorn server of the shared HTTP port: connections counted by ``gate``, API keys in
    query strings redacted from its logs, and SIGINT/SIGTERM asking it to exit (handled on the
    loop, not by uvicorn, so that ``serve`` can stop the other listeners and the engine)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.http.host,
            port=config.http.port,
            log_level=config.http.log_level,
            ws_max_size=config.http.max_body_bytes,
            # Off unless asked: a token's frame is a hundred bytes or so, and compressing each
            # was an eighth of the event loop's time under 32 /generate streams.
            ws_per_message_deflate=config.http.ws_compression,
            timeout_graceful_shutdown=2,
            lifespan="off",
            # Never uvicorn's: it would believe X-Forwarded-For from 127.0.0.1 by default,
            # and rewrite the client before the connection gate could find its socket.
            # rill.middleware applies --forwarded-allow-ips itself.
            proxy_headers=False,
            http=http_protocol_factory(
                gate,
                config.connections.header_timeout_s,  # type: ignore[arg-type]
                openai_http.http_error,
            ),
        )
    )
    for logger_name in ("uvicorn.error", "uvicorn.access"):  # after uvicorn.Config set its logging up
        logging.getLogger(logger_name).addFilter(auth.QUERY_KEY_REDACTOR)
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    return server


async def _serve_http(server: uvicorn.Server, ready: asyncio.Event | None) -> None:
    """Serve until the server exits, setting ``ready`` once it listens."""
    serve_task = asyncio.create_task(server.serve())
    if ready is not None:
        while not server.started and not serve_task.done():  # noqa: ASYNC110 - uvicorn's started is a flag, not an event
            await asyncio.sleep(0.01)
        ready.set()
    await serve_task


async def _watch_stop(stop: asyncio.Event, server: uvicorn.Server) -> None:
    """Ask the server to exit once ``stop`` is set."""
    await stop.wait()
    server.should_exit = True


async def _watch_load(
    client: EngineClient | EmbeddingService,
    server: uvicorn.Server,
    load_failure: list[BaseException],
    what: str = "the model",
) -> None:
    """A server whose model (the chat model, or the embedding model it was asked to serve too)
    cannot load has nothing to serve: say why, record it in ``load_failure`` (the loader's own
    error, the cause of the one requests get) and ask the server to exit. Once it has loaded,
    what start-up made is frozen out of the garbage collector's walks (``freeze_startup_objects``)."""
    try:
        await client.wait_ready()
        log.debug("%d start-up objects frozen", freeze_startup_objects())
    except EngineDead as exc:
        if client.state().phase != "failed":
            return  # it loaded, then stopped: requests get EngineDead, the server stays up
        error = exc.__cause__ if exc.__cause__ is not None else exc
        log.error("%s failed to load: %s", what, error)
        load_failure.append(error)
        server.should_exit = True
