"""Evergreen sessions (``evergreen.v2``): a bidirectional stream of content nodes and actions,
over gRPC (``EvergreenService/StartSession`` on ``--grpc-port``) and over the ``/evergreen``
WebSocket (one proto3-JSON ``SessionMessage`` per message). See ``shared/specs/evergreen.md``.

Files: the ``.proto`` files and their generated ``_pb/`` modules (``protogen`` regenerates
them), ``messages`` (wire structs), ``errors`` (the rules a session can break), ``codec``
(protobuf and JSON ⇄ structs, the error table), ``session`` (sans-I/O node store and action
readiness), ``prompt`` (flattened input → engine request); with I/O: ``runner`` (one session on
the shared driver), ``file_refs`` (reading ``file://`` refs), ``grpc_server`` (the gRPC
listener, health, reflection) and ``adapter`` (the gRPC and WebSocket transports).
"""
