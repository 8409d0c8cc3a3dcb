"""``GET /health``, ``GET /version`` and ``GET /metrics``: the server's own HTTP routes, apart
from any protocol.

``/health`` answers 200 when the model (and the embedding model, when the server has one) is
ready and 503 with the loading progress (or why it cannot serve: a failed load, a stopped
engine) otherwise; load balancers and orchestrators probe it without a key. ``/metrics`` is
the Prometheus text exposition of ``rill.frontend.metrics`` (names and types that vLLM's
Grafana dashboard reads after one relabel rule, see ``docs/metrics.md``). ``/version`` answers
``{"version": rill.__version__}`` in vLLM's shape, without a key like ``/health``, so clients and
probes written for vLLM can tell what they talk to. Registered once by ``rill.server.build_app``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from rill import __version__
from rill.frontend.client import EngineClient
from rill.frontend.embeddings import EmbeddingService
from rill.frontend.metrics import CONTENT_TYPE, Metrics

if TYPE_CHECKING:
    from rill.deps import Deps


def routes(deps: Deps) -> list[BaseRoute]:
    """``/health`` and ``/version`` always; ``/metrics`` when the server keeps a metrics registry."""
    probes = _Probes(deps.client, deps.metrics, deps.embeddings)
    found: list[BaseRoute] = [
        Route("/health", probes.health, methods=["GET"]),
        Route("/version", probes.version, methods=["GET"]),
    ]
    if deps.metrics is not None:
        found.append(Route("/metrics", probes.metrics, methods=["GET"]))
    return found


class _Probes:
    """The handlers, bound to one server's engine client and registry."""

    def __init__(self, client: EngineClient, registry: Metrics | None, embeddings: EmbeddingService | None) -> None:
        self.client = client
        self.registry = registry
        self.embeddings = embeddings

    async def health(self, request: Request) -> Response:
        """``GET /health`` from ``client.state()``: 200 ``{"status": "ok", "model"}`` when ready;
        503 with the progress while loading, and with the reason once the engine cannot serve
        (a failed load, a stopped engine)."""
        state = self.client.state()
        if state.phase == "ready" and self.embeddings is not None:
            return self._embedding_health()
        if state.phase == "ready":
            return JSONResponse({"status": "ok", "model": self.client.served_model_name})
        if state.phase == "loading":
            progress = round(state.progress, 1) if state.progress is not None else None
            return JSONResponse(
                {"status": "loading", "progress": progress, "eta_seconds": state.eta_s}, status_code=503
            )
        reason = "model failed to load" if state.phase == "failed" else "engine stopped"
        return JSONResponse({"status": "error", "error": reason}, status_code=503)

    def _embedding_health(self) -> Response:
        """``/health`` once the chat model is ready, on a server that serves embeddings too."""
        assert self.embeddings is not None
        phase = self.embeddings.state().phase
        if phase == "ready":
            return JSONResponse(
                {
                    "status": "ok",
                    "model": self.client.served_model_name,
                    "embedding_model": self.embeddings.served_model_name,
                }
            )
        if phase == "loading":
            return JSONResponse(
                {"status": "loading", "progress": None, "eta_seconds": None, "embedding_model": "loading"},
                status_code=503,
            )
        reason = "embedding model failed to load" if phase == "failed" else "embedding model stopped"
        return JSONResponse({"status": "error", "error": reason}, status_code=503)

    async def version(self, request: Request) -> Response:
        """``GET /version``: ``{"version": "<rill version>"}``, as vLLM answers it."""
        return JSONResponse({"version": __version__})

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: the registry in Prometheus text format."""
        assert self.registry is not None  # the route exists only with a registry
        return Response(self.registry.render(), media_type=CONTENT_TYPE)
