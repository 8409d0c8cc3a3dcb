"""The ``grpc.aio`` server on ``--grpc-port``: binding, options, and the standard services beside
Evergreen's (``grpc.health.v1.Health``, NOT_SERVING until the model is ready, and server
reflection).

The Evergreen servicer itself is the adapter's (``adapter.EvergreenServicer``); this module
only hosts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rill.errors import ConfigError

if TYPE_CHECKING:
    from rill.deps import Deps

log = logging.getLogger("rill.protocols.evergreen")

GRPC_GRACE_S = 1.0
"""Seconds running calls get to finish when the server stops."""

HEALTH_SERVICES = ("", "evergreen.v2.EvergreenService")
"""Health-check service names: the whole server ("") and the Evergreen service."""


async def start(deps: Deps, servicer: Any) -> Callable[[], Awaitable[None]]:
    """Serve ``servicer`` (an ``evergreen.v2.EvergreenService``) on ``--grpc-port``; return the
    async stopper.

    Raises:
        ConfigError: the port cannot be bound.
    """
    import grpc

    from rill.protocols.evergreen._pb import evergreen_service_pb2_grpc as service_grpc

    max_bytes = max(deps.config.http.max_body_bytes, 4 * 1024 * 1024)
    limits = deps.config.connections
    first_message_ms = int(limits.first_message_timeout_s * 1000)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            # grpc sets SO_REUSEPORT by default, which would let a second server share the port
            # silently (splitting sessions between two processes): refuse it, as for the HTTP port.
            ("grpc.so_reuseport", 0),
            # Connections that never finish the HTTP/2 handshake, or that hold no call, are
            # closed like idle WebSockets; calls themselves are counted by the gate.
            ("grpc.server_handshake_timeout_ms", first_message_ms),
            ("grpc.max_connection_idle_ms", first_message_ms),
        ],
        maximum_concurrent_rpcs=limits.max_connections,
    )
    service_grpc.add_EvergreenServiceServicer_to_server(servicer, server)
    health = _add_standard_services(server)
    await _set_health(health, serving=False)  # before the port opens: no probe sees SERVING early
    address = f"{deps.config.http.host}:{deps.config.evergreen.grpc_port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {address} (--grpc-port): {exc}") from exc
    if not bound:
        raise ConfigError(f"cannot listen for gRPC on {address} (--grpc-port)")
    await server.start()
    log.info("evergreen gRPC listening on %s", address)
    watch = asyncio.create_task(_serving_when_ready(deps, health))

    async def stop() -> None:
        watch.cancel()
        await health.enter_graceful_shutdown()  # probes see NOT_SERVING while calls drain
        await server.stop(GRPC_GRACE_S)

    return stop


def _add_standard_services(server: Any) -> Any:
    """Add ``grpc.health.v1.Health`` (NOT_SERVING until the model is ready) and server
    reflection, as ``grpc.reflection.v1`` and the older ``v1alpha`` (``grpcurl list``,
    ``grpcurl describe``; newer clients ask v1 first), to ``server``; return the health servicer.

    Both answer without an API key, as ``/health`` does: they tell nothing of any session.
    """
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

    from rill.protocols.evergreen._pb import evergreen_service_pb2 as service_pb2

    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    v1_service = _reflection_v1_service()
    names = (
        service_pb2.DESCRIPTOR.services_by_name["EvergreenService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        v1_service,
        reflection.SERVICE_NAME,
    )
    # grpcio-reflection ships v1alpha only. v1 is the same proto under another package, so the
    # same servicer answers both: the messages are identical on the wire.
    reflector = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflector, server)  # type: ignore[no-untyped-call]
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            reflector.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(v1_service, handlers),))
    return servicer


REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"
"""Where ``grpc.reflection.v1`` is declared (its canonical file name in grpc's protos)."""


def _reflection_v1_service() -> str:
    """Put ``grpc.reflection.v1``'s file descriptor in the default pool (so reflection can
    describe the v1 service it lists) and return the service's full name.

    The file is v1alpha's with the package renamed, which is how grpc wrote v1; it is derived
    here rather than generated because grpcio-reflection ships no v1 module.
    """
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(REFLECTION_V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_renamed_reflection_file(reflection_pb2.DESCRIPTOR).SerializeToString())
    return pool.FindServiceByName("grpc.reflection.v1.ServerReflection").full_name


def _renamed_reflection_file(v1alpha: Any) -> Any:
    """``v1alpha``'s ``FileDescriptorProto`` as ``grpc.reflection.v1``: file name, package,
    every type reference and the language options renamed; no longer deprecated."""
    from google.protobuf import descriptor_pb2

    old, new = "grpc.reflection.v1alpha", "grpc.reflection.v1"
    file = descriptor_pb2.FileDescriptorProto()
    v1alpha.CopyToProto(file)
    file.name, file.package = REFLECTION_V1_FILE, new

    def renamed(type_name: str) -> str:
        return type_name.replace(f".{old}.", f".{new}.", 1)

    for message in file.message_type:
        for message_field in message.field:
            if message_field.type_name:
                message_field.type_name = renamed(message_field.type_name)
    for service in file.service:
        for method in service.method:
            method.input_type, method.output_type = renamed(method.input_type), renamed(method.output_type)
    file.options.java_package = "io.grpc.reflection.v1"
    file.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    file.options.ClearField("deprecated")
    return file


async def _set_health(health: Any, *, serving: bool) -> None:
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in HEALTH_SERVICES:
        await health.set(name, status)


async def _serving_when_ready(deps: Deps, health: Any) -> None:
    """Turn health to SERVING once the model is ready; a failed load keeps NOT_SERVING
    (and ends ``rill serve``)."""
    try:
        await deps.client.wait_ready()
    except Exception:  # noqa: BLE001 - an engine that never gets ready leaves health unset
        return
    await _set_health(health, serving=True)
