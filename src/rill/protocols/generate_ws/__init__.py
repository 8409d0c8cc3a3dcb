"""The ``/generate`` WebSocket protocol (live control and feedback), plus ``POST /v1/generate``
(JSON or Server-Sent Events). See ``shared/specs/generate-websocket.md``.

Files: ``messages`` (wire structs), ``codec`` (text ⇄ structs, error table), ``session``
(sans-I/O state machine) with its ``actions`` and ``deltas`` (per-token text pieces),
``adapter`` (Starlette routes, the only module with I/O).
"""
