"""Framed JSON over a Unix domain socket (``shared/specs/framed-uds.md``).

``framing`` (uint32-LE length frames, newline lines), ``messages`` (wire structs), ``codec``
(bytes ⇄ messages, error table, metrics snapshot) and ``session`` (per-connection state
machines) are pure; ``adapter`` owns the socket and talks to the engine client.
"""
