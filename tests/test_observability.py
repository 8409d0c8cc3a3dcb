"""``rill.observability`` behind the server's middleware: ``/health`` and ``/version`` answer
without a key and under any Host name (probes), ``/metrics`` needs the key like every other
route, and ``/version`` has vLLM's shape with rill's version."""

from __future__ import annotations

import httpx
from starlette.applications import Starlette

import rill
from rill import config as config_mod
from rill import middleware, observability
from rill.deps import Deps
from rill.frontend.metrics import Metrics
from rill.protocols.openai_http.adapter import http_error
from rill.testing.fake_client import fake_client


async def test_version_answers_without_a_key_and_metrics_does_not() -> None:
    cfg = config_mod.load({"http.api_key": ["k1"]}, env={})
    async with fake_client() as client:
        deps = Deps(config=cfg, client=client, metrics=Metrics(client), api_keys=cfg.api_keys())
        app = middleware.wrap(Starlette(routes=observability.routes(deps)), deps, render_error=http_error)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            version = await http.get("/version")
            assert version.status_code == 200 and version.json() == {"version": rill.__version__}
            # A probe through a service name (compose, Kubernetes) is not a browser page: no Host check.
            assert (await http.get("/version", headers={"Host": "rill.internal"})).json()["version"] == rill.__version__
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/metrics")).status_code == 401
            scraped = await http.get("/metrics", headers={"Authorization": "Bearer k1"})
            assert scraped.status_code == 200 and b"rill_num_requests_running" in scraped.content
            assert (await http.post("/version")).status_code == 405
