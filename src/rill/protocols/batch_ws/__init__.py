"""Batch WebSocket ``/ws`` (and ``/api/ws``): many prompts per message, event arrays,
continuation by ``request_id``. See ``shared/specs/batch-websocket.md``.

``messages``, ``codec`` and ``session`` are pure; only ``adapter`` does I/O.
"""
