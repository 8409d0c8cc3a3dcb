"""``GET /health`` and ``GET /metrics``: the server's own HTTP routes, apart from any protocol.

``/health`` answers 200 when the model is ready and 503 with the loading progress (or the
failure) before; load balancers and orchestrators probe it without a key. ``/metrics`` is
the Prometheus text exposition of ``rill.frontend.metrics`` (names and types that vLLM's
Grafana dashboard reads after one relabel rule, see ``docs/metrics.md``).
Registered once by ``rill.server.build_app``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from rill.frontend.client import EngineClient
from rill.frontend.metrics import CONTENT_TYPE, Metrics

if TYPE_CHECKING:
    from rill.deps import Deps


def routes(deps: Deps) -> list[BaseRoute]:
    """``/health`` always; ``/metrics`` when the server keeps a metrics registry."""
    probes = _Probes(deps.client, deps.metrics)
    found: list[BaseRoute] = [Route("/health", probes.health, methods=["GET"])]
    if deps.metrics is not None:
        found.append(Route("/metrics", probes.metrics, methods=["GET"]))
    return found


class _Probes:
    """The two handlers, bound to one server's engine client and registry."""

    def __init__(self, client: EngineClient, registry: Metrics | None) -> None:
        self.client = client
        self.registry = registry

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 ``{"status": "ok"}`` when ready; 503 with progress while loading."""
        client = self.client
        if client.is_ready():
            return JSONResponse({"status": "ok", "model": client.model_info.name if client.model_info else None})
        if client.load_error is not None:
            return JSONResponse({"status": "error", "error": "model failed to load"}, status_code=503)
        progress, eta = client.load_progress()
        return JSONResponse({"status": "loading", "progress": round(progress, 1), "eta_seconds": eta},
                            status_code=503)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: the registry in Prometheus text format."""
        assert self.registry is not None  # the route exists only with a registry
        return Response(self.registry.render(), media_type=CONTENT_TYPE)
