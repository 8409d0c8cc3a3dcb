"""Python client of the framed Unix-socket protocol, and ``rill client uds``.

    with UdsClient("/tmp/rill.sock") as client:
        for event in client.generate({"id": "r1", "prompt": "Hello", "max_tokens": 20}):
            if event["event"] == "token":
                print(event["text"], end="")

``generate`` sends one request frame and yields its events up to and including the ``eos``
(or the ``error``, after which the server closes). ``cancel(id)`` may be called meanwhile
(e.g. from a signal handler); ``metrics()`` returns the admin snapshot.

``rill client uds --prompt TEXT [--socket PATH] [--id ID] [--max-tokens N] [--temp T]
[--top-p P] [--no-stream] [--metrics]`` — the flags and exit codes of uma-serve's ``uma-cli``:
0 after ``eos``, 1 usage error, 2 ``error`` event (its message on stderr), 3 connection or
framing error. Tokens go to stdout as they arrive. Ctrl-C sends a ``cancel`` and waits for
the ``eos`` (exit 130); a second Ctrl-C quits at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from rill.config import UdsConfig
from rill.protocols.framed_uds.framing import FrameDecoder, FramingError, encode_frame

DEFAULT_SOCKET = UdsConfig.socket  # where `rill serve` listens by default
MAX_EVENT_BYTES = 64 * 1024 * 1024
"""Largest server frame this client accepts (a ``stream: false`` answer can be long)."""

EXIT_OK, EXIT_USAGE, EXIT_ERROR_EVENT, EXIT_CONNECTION, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UdsConnectionError(Exception):
    """Could not connect, the connection broke, or the server sent a malformed frame."""


class UdsClient:
    """One connection to a rill Unix socket (blocking I/O)."""

    def __init__(self, path: str = DEFAULT_SOCKET) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(MAX_EVENT_BYTES)
        self._pending: list[bytes] = []

    def __enter__(self) -> UdsClient:
        self.connect()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def connect(self) -> None:
        """Open the connection (``UdsConnectionError`` if nobody listens at ``path``)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise UdsConnectionError(f"cannot connect to {self.path}: {exc.strerror or exc}") from exc
        self._sock = sock

    def close(self) -> None:
        """Close the connection (the server cancels a request still running)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def send(self, message: dict[str, Any]) -> None:
        """Send one frame."""
        assert self._sock is not None, "not connected"
        try:
            self._sock.sendall(encode_frame(json.dumps(message).encode("utf-8")))
        except OSError as exc:
            raise UdsConnectionError(f"connection to {self.path} broke: {exc.strerror or exc}") from exc

    def receive(self) -> dict[str, Any] | None:
        """The next event, or None when the server closed the connection."""
        assert self._sock is not None, "not connected"
        while not self._pending:
            try:
                data = self._sock.recv(64 * 1024)
            except OSError as exc:
                raise UdsConnectionError(f"connection to {self.path} broke: {exc.strerror or exc}") from exc
            if not data:
                if not self._decoder.is_idle:
                    raise UdsConnectionError("the server closed the connection in the middle of a frame")
                return None
            try:
                self._pending.extend(self._decoder.feed(data))
            except FramingError as exc:
                raise UdsConnectionError(f"bad frame from the server: {exc}") from exc
        payload = self._pending.pop(0)
        try:
            event = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UdsConnectionError(f"the server sent invalid JSON: {exc}") from exc
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise UdsConnectionError(f"the server sent a frame without an event: {payload[:200]!r}")
        return event

    def generate(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Send ``request``; yield its events through the ``eos`` or ``error``.

        Raises ``UdsConnectionError`` if the connection ends before either.
        """
        self.send(request)
        while True:
            event = self.receive()
            if event is None:
                raise UdsConnectionError("the server closed the connection before the end of the request")
            yield event
            if event["event"] in ("eos", "error"):
                return

    def cancel(self, request_id: str) -> None:
        """Ask the server to stop request ``request_id`` (an ``eos`` "cancelled" follows)."""
        self.send({"event": "cancel", "id": request_id})

    def metrics(self, api_key: str | None = None) -> dict[str, Any]:
        """The admin metrics frame (the server closes the connection after it); ``api_key`` for
        servers started with ``--api-key``."""
        self.send({"type": "metrics", "api_key": api_key} if api_key else {"type": "metrics"})
        event = self.receive()
        if event is None:
            raise UdsConnectionError("the server closed the connection without a metrics frame")
        return event


# -- rill client uds -----------------------------------------------------------------------


def register(client_subparsers: Any) -> None:
    """Add ``rill client uds`` (the flags of uma-serve's ``uma-cli``)."""
    parser = client_subparsers.add_parser(
        "uds",
        help="framed-JSON client for the Unix socket",
        description="Send one prompt over rill's Unix socket and stream the answer to stdout. Exit codes: "
        "0 eos, 1 usage, 2 error event, 3 connection or framing error, 130 interrupted (Ctrl-C).",
    )
    parser.add_argument("--prompt", help="text to generate from (required unless --metrics)")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"Unix socket path (default: {DEFAULT_SOCKET})")
    parser.add_argument("--id", help="request id (default: req-<pid>-<time>)")
    parser.add_argument("--max-tokens", type=int, default=-1, help="most tokens to generate (default: the server's)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default: 0.0, greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--no-stream", action="store_true", help="receive the whole answer in one eos event")
    parser.add_argument("--metrics", action="store_true", help="print the server's metrics snapshot and exit")
    parser.add_argument(
        "--api-key",
        default=None,
        help="API key, sent as the request's 'api_key' (servers started with --api-key require it)",
    )
    _exit_1_on_usage_errors(parser)
    parser.set_defaults(func=run)


def _exit_1_on_usage_errors(parser: argparse.ArgumentParser) -> None:
    # uma-cli exits 1 on a usage error; argparse would exit 2, which here means "error event".
    def error(message: str) -> NoReturn:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)

    parse_known_args = parser.parse_known_args

    def strict_parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        # Unknown flags would otherwise reach the top-level parser (exit 2).
        parsed, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = strict_parse_known_args  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> int:
    """``rill client uds``: returns the exit code."""
    if not args.metrics and not args.prompt:
        print("rill client uds: error: --prompt is required (or use --metrics)", file=sys.stderr)
        return EXIT_USAGE
    client = UdsClient(args.socket)
    try:
        client.connect()
        if args.metrics:
            print(json.dumps(client.metrics(args.api_key)))
            return EXIT_OK
        return _run_request(client, args)
    except UdsConnectionError as exc:
        print(f"rill client uds: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    finally:
        client.close()


def _run_request(client: UdsClient, args: argparse.Namespace) -> int:
    request: dict[str, Any] = {
        "id": args.id or f"req-{os.getpid()}-{int(time.time())}",
        "prompt": args.prompt,
        "stream": not args.no_stream,
        "temperature": args.temp,
        "top_p": args.top_p,
    }
    if args.max_tokens > 0:
        request["max_tokens"] = args.max_tokens
    if args.api_key:
        request["api_key"] = args.api_key
    client.send(request)
    # Installed after the request is sent: the handler's cancel frame never splits another frame.
    interrupted = _cancel_on_ctrl_c(client, request["id"])
    out = sys.stdout
    try:
        while (event := client.receive()) is not None:
            kind = event["event"]
            if kind == "token":
                out.write(event.get("text", ""))
                out.flush()
            elif kind == "eos":
                out.write((event.get("text") or "") + "\n")
                out.flush()
                return EXIT_INTERRUPTED if interrupted.is_set() else EXIT_OK
            elif kind == "error":
                out.flush()
                print(f"{event.get('message', '')} ({event.get('code', 'error')})", file=sys.stderr)
                return EXIT_ERROR_EVENT
    except KeyboardInterrupt:  # the second Ctrl-C
        out.write("\n")
        return EXIT_INTERRUPTED
    finally:
        _restore_ctrl_c()
    raise UdsConnectionError("the server closed the connection before the end of the request")


_previous_handler: Any = None


def _cancel_on_ctrl_c(client: UdsClient, request_id: str) -> threading.Event:
    """First Ctrl-C sends a cancel (the eos still arrives); the second interrupts."""
    global _previous_handler
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return interrupted  # signal handlers can only be set from the main thread

    def on_sigint(signum: int, frame: Any) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        print("\n[cancelling; Ctrl-C again to quit]", file=sys.stderr)
        try:
            client.cancel(request_id)
        except UdsConnectionError:
            raise KeyboardInterrupt from None

    _previous_handler = signal.signal(signal.SIGINT, on_sigint)
    return interrupted


def _restore_ctrl_c() -> None:
    global _previous_handler
    if _previous_handler is not None:
        signal.signal(signal.SIGINT, _previous_handler)
        _previous_handler = None
