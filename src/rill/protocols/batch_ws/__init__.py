"""Batch WebSocket ``/ws`` (and ``/api/ws``): many prompts per message, event arrays,
continuation by ``request_id``. See ``shared/specs/batch-websocket.md``.

``messages``, ``codec``, ``store`` and ``session`` are pure; ``adapter`` (the socket) and
``service`` (what every socket of a server shares) do I/O.
"""
