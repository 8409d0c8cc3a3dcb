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


async def _reflect_v1(
    address: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    """One call to ``grpc.reflection.v1.ServerReflection``, as grpcurl and grpcio's newer
    clients make it (v1's messages are v1alpha's on the wire, so v1alpha's classes encode them)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        replies = [reply async for reply in call(iter([request]), timeout=30)]
    [reply] = replies
    return reply


async def test_reflection_v1_lists_and_describes_the_services() -> None:
    server = grpc.aio.server()
    grpc_server._add_standard_services(server)
    address = f"127.0.0.1:{free_port()}"
    assert server.add_insecure_port(address)
    await server.start()
    try:
        listed = await _reflect_v1(address, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {service.name for service in listed.list_services_response.service}
        assert {"evergreen.v2.EvergreenService", "grpc.reflection.v1.ServerReflection"} <= names
        assert "grpc.reflection.v1alpha.ServerReflection" in names  # older clients keep theirs
        described = await _reflect_v1(
            address,
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
        )
        from google.protobuf import descriptor_pb2

        [file] = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in described.file_descriptor_response.file_descriptor_proto
        ]
        assert (file.name, file.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
        [method] = [m for service in file.service for m in service.method]
        assert (method.name, method.input_type, method.output_type) == (
            "ServerReflectionInfo",
            ".grpc.reflection.v1.ServerReflectionRequest",
            ".grpc.reflection.v1.ServerReflectionResponse",
        )
        missing = await _reflect_v1(address, reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such"))
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    finally:
        await server.stop(None)


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
        "grpc.reflection.v1.ServerReflection",
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
