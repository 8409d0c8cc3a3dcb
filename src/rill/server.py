"""Composition root of ``rill serve``: config → engine client → protocol adapters → listeners.

One process, one asyncio loop, one engine thread. Each protocol package's ``adapter`` module
may expose:

* ``routes(deps) -> list[starlette.routing.BaseRoute]`` — HTTP and WebSocket routes on the
  shared HTTP port;
* ``async start(deps) -> Callable[[], Awaitable[None]]`` — a listener of its own (Unix
  socket, gRPC); the returned coroutine function stops it.

``/health`` and ``/metrics`` come from ``rill.observability``. ``GET /`` is the browser
playground (``rill.playground``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from rill import auth, observability
from rill.config import ServerConfig
from rill.connections import FD_RESERVE, ConnectionGate, http_protocol_factory, raise_fd_limit
from rill.deps import Deps
from rill.errors import EngineDead, RillError
from rill.frontend.client import EngineClient
from rill.frontend.metrics import Metrics
from rill.frontend.ratelimit import RateLimits
from rill.protocols.openai_http import adapter as openai_adapter

log = logging.getLogger("rill.server")

PROTOCOLS = ("openai_http", "generate_ws", "batch_ws", "chat_ws", "evergreen", "framed_uds")


def _adapter(name: str) -> Any | None:
    module_name = f"rill.protocols.{name}.adapter"
    if importlib.util.find_spec(f"rill.protocols.{name}") is None:
        return None
    if importlib.util.find_spec(module_name) is None:
        return None
    return importlib.import_module(module_name)


def protocol_adapters() -> dict[str, Any]:
    """The protocol adapter modules present in this build, by protocol name."""
    return {name: mod for name in PROTOCOLS if (mod := _adapter(name)) is not None}


def build_app(deps: Deps) -> Starlette:
    """The Starlette app with /health, /metrics and every protocol's routes."""
    routes: list[Any] = list(observability.routes(deps))
    for adapter in protocol_adapters().values():
        if hasattr(adapter, "routes"):
            routes.extend(adapter.routes(deps))
    playground = _optional("rill.playground.routes")
    if playground is not None:
        routes.extend(playground.routes(deps))
    app: Starlette = Starlette(routes=routes)
    app.state.deps = deps
    middleware = _optional("rill.middleware")
    if middleware is not None:
        return middleware.wrap(app, deps, render_error=openai_adapter.http_error)
    return app


def _optional(module_name: str) -> Any | None:
    if importlib.util.find_spec(module_name) is None:
        return None
    return importlib.import_module(module_name)


def make_deps(config: ServerConfig, client: EngineClient) -> Deps:
    """Deps with the metrics registry (when the metrics module exists) and the API keys."""
    limits = config.connections
    gate = ConnectionGate(limits.max_connections, limits.max_connections_per_client)
    # Until the model has loaded, label refusals with the name it will be served under.
    metrics = Metrics(client, gate, model_name=config.engine.served_model_name or Path(config.engine.model or "").stem)
    if hasattr(client, "set_metrics_sink"):
        client.set_metrics_sink(metrics)
    if hasattr(client, "set_max_tokens_cap"):
        client.set_max_tokens_cap(config.http.max_tokens_cap)
    if hasattr(client, "set_rate_limits"):
        http = config.http
        client.set_rate_limits(RateLimits(requests=http.rate_limit_requests, window_s=http.rate_limit_window,
                                          tokens_per_s=http.rate_limit_tokens_per_s, burst=http.rate_limit_burst))
    return Deps(config=config, client=client, metrics=metrics, api_keys=config.api_keys(), gate=gate)


async def serve(
    config: ServerConfig,
    client: EngineClient | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run every front-end until SIGINT/SIGTERM (or ``stop`` is set); the model loads in the
    background. ``ready`` is set once the HTTP port listens (tests use both events)."""
    import uvicorn

    from rill.frontend.inproc import InprocClient

    config.api_keys()  # a key file with no key fails here, before the model starts loading
    fd_limit = raise_fd_limit(config.connections.max_connections)
    if client is None:
        client = InprocClient.start(config.engine)
    deps = make_deps(config, client)
    if deps.gate is not None and 0 < fd_limit - FD_RESERVE < deps.gate.max_total:
        # Past the open-file limit every listener would stop accepting: refuse before it.
        deps.gate.max_total = max(1, fd_limit - FD_RESERVE)
    app = build_app(deps)
    stoppers: list[Callable[[], Awaitable[None]]] = []
    try:
        for adapter in protocol_adapters().values():
            if hasattr(adapter, "start"):
                stopper = await adapter.start(deps)
                if stopper is not None:
                    stoppers.append(stopper)
    except BaseException:
        # A listener that cannot start (socket held by a live server, port in use) ends the
        # process at once, without leaving the engine thread or other listeners behind.
        for stopper in stoppers:
            with contextlib.suppress(Exception):
                await stopper()
        await client.shutdown()
        raise
    assert deps.gate is not None
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.http.host, port=config.http.port, log_level=config.http.log_level,
                       ws_max_size=config.http.max_body_bytes, timeout_graceful_shutdown=2, lifespan="off",
                       http=http_protocol_factory(deps.gate, config.connections.header_timeout_s))  # type: ignore[arg-type]
    )
    for logger_name in ("uvicorn.error", "uvicorn.access"):  # after uvicorn.Config set its logging up
        logging.getLogger(logger_name).addFilter(auth.QUERY_KEY_REDACTOR)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    log.info("rill listening on http://%s:%d", config.http.host, config.http.port)
    if stop is not None:
        async def _watch_stop() -> None:
            await stop.wait()
            server.should_exit = True

        stop_task = asyncio.create_task(_watch_stop())
    load_failure: list[BaseException] = []

    async def _watch_load() -> None:
        # A server whose model cannot load has nothing to serve: say why and exit.
        try:
            await client.wait_ready()
        except EngineDead as exc:
            error = getattr(client, "load_error", None) or exc
            log.error("the model failed to load: %s", error)
            load_failure.append(error)
            server.should_exit = True

    load_task = asyncio.create_task(_watch_load())
    try:
        serve_task = asyncio.create_task(server.serve())
        if ready is not None:
            while not server.started and not serve_task.done():
                await asyncio.sleep(0.01)
            ready.set()
        await serve_task
    finally:
        if stop is not None:
            stop_task.cancel()
        load_task.cancel()
        for stopper in stoppers:
            with contextlib.suppress(Exception):
                await stopper()
        await client.shutdown()
    if load_failure:
        error = load_failure[0]
        raise error if isinstance(error, RillError) else EngineDead(f"the model failed to load: {error}")
