"""Server-sent events framing (pure): bytes for ``data:`` events, comments and ``[DONE]``.

Every SSE byte rill writes comes from here, so no call site formats ``data: ...\\n\\n`` by
hand. See the WHATWG HTML standard, "Server-sent events", for the grammar: an event is a
run of ``field: value`` lines ended by a blank line; a line starting with ``:`` is a
comment that clients ignore, which is what keeps idle connections alive through proxies.
"""

from __future__ import annotations

MEDIA_TYPE = "text/event-stream"
"""Content type of an SSE response."""

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Response headers that stop proxies (nginx) from caching or buffering the stream."""

DONE = b"data: [DONE]\n\n"
"""OpenAI's end-of-stream sentinel event."""

KEEP_ALIVE = b": keep-alive\n\n"
"""A comment event: ignored by clients, keeps the connection (and proxies) from timing out."""


def encode_event(data: bytes | str, event: str | None = None) -> bytes:
    """One SSE event carrying ``data`` (one ``data:`` line per line of ``data``).

    Args:
        data: the payload, typically one JSON document (which has no newlines).
        event: an optional event name (``event:`` line); OpenAI streams never set one.
    """
    text = data.decode() if isinstance(data, bytes) else data
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    head = f"event: {event}\n" if event else ""
    return (head + "".join(f"data: {line}\n" for line in lines) + "\n").encode()


def encode_comment(text: str) -> bytes:
    """A comment event (``: text``), one ``:`` line per line of ``text``."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return ("".join(f": {line}\n" for line in lines) + "\n").encode()
