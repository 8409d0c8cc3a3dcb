"""The standard gRPC services on the Evergreen port: ``grpc.health.v1.Health`` and server
reflection, checked with grpcio's own clients (as grpcurl and Kubernetes' gRPC probe use them)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rill.frontend.inproc import InprocClient
from rill.protocols.evergreen import grpc_server
from rill.testing.fake_client import fake_client
from tests.conftest import free_port
from tests.protocols.evergreen.test_e2e import (  # noqa: F401  (the module's server fixtures: live and the files it needs)
    files,
    grpc_address,
    live,
)


async def _check(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=30
        )
    return reply.status


async def _reflect(
    address: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [reply async for reply in stub.ServerReflectionInfo(iter([request]), timeout=30)]
    [reply] = replies
    return reply


@pytest.mark.parametrize("fails", [False, True])
async def test_health_is_not_serving_until_the_model_is_ready(fails: bool) -> None:
    loading = threading.Event()
    async with fake_client(loading=loading, load_error=RuntimeError("bad weights") if fails else None) as client:
        await _health_follows_the_load(client, loading, fails)


async def _health_follows_the_load(client: InprocClient, loading: threading.Event, fails: bool) -> None:
    server = grpc.aio.server()
    health = grpc_server._add_standard_services(server)
    await grpc_server._set_health(health, serving=False)  # as grpc_server.start does before the port opens
    address = f"127.0.0.1:{free_port()}"
    assert server.add_insecure_port(address)
    await server.start()
    watch = asyncio.create_task(grpc_server._serving_when_ready(SimpleNamespace(client=client), health))
    try:
        assert await _check(address, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await _check(address, "evergreen.v2.EvergreenService") == health_pb2.HealthCheckResponse.NOT_SERVING
        loading.set()
        await watch
        expected = health_pb2.HealthCheckResponse.NOT_SERVING if fails else health_pb2.HealthCheckResponse.SERVING
        assert await _check(address, "") == expected
        assert await _check(address, "evergreen.v2.EvergreenService") == expected
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await _check(address, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        watch.cancel()
        await server.stop(None)


async def test_live_server_serves_health_and_reflection(live) -> None:  # noqa: F811
    address = grpc_address(live)
    assert await _check(address, "") == health_pb2.HealthCheckResponse.SERVING
    listed = await _reflect(address, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {service.name for service in listed.list_services_response.service}
    assert names == {
        "evergreen.v2.EvergreenService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    described = await _reflect(
        address, reflection_pb2.ServerReflectionRequest(file_containing_symbol="evergreen.v2.EvergreenService")
    )
    from google.protobuf import descriptor_pb2

    descriptors = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    methods = {m.name for f in descriptors for s in f.service if s.name == "EvergreenService" for m in s.method}
    assert "StartSession" in methods
