"""Evergreen sessions (``evergreen.v2``): a bidirectional stream of content nodes and actions,
over gRPC (``EvergreenService/StartSession`` on ``--grpc-port``) and over the ``/evergreen``
WebSocket (one proto3-JSON ``SessionMessage`` per message). See ``shared/specs/evergreen.md``.

Files: the ``.proto`` files and their generated ``_pb/`` modules (``protogen`` regenerates
them), ``messages`` (wire structs), ``errors`` (the rules a session can break), ``codec``
(protobuf and JSON ⇄ structs, the error table), ``session`` (sans-I/O node store and action
readiness), ``prompt`` (flattened input → engine request), ``adapter`` (gRPC server and WebSocket route, the only modules with I/O).
"""
