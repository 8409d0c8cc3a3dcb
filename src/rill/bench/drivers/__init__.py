"""Protocol drivers of ``rill bench``: one module per wire protocol, one shared interface.

A driver is built from a ``Target`` (where the server listens) and the run's ``Options``;
``open()`` prepares what is shared between requests (an HTTP connection pool, a gRPC
channel), ``run(request, timer)`` sends one request and reports what arrives through the
``Timer``, ``close()`` releases everything. Failures are raised as ``BenchError(kind)``;
the runner turns any other exception into a record whose kind is its class name.

Drivers only talk to 127.0.0.1 / unix sockets given on the command line.
"""

from __future__ import annotations

import importlib
import time
from typing import Protocol

import msgspec

from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest
from rill.clients.evergreen import DEFAULT_ADDRESS
from rill.clients.uds import DEFAULT_SOCKET

DRIVERS: dict[str, str] = {
    "openai": "rill.bench.drivers.openai",
    "generate-ws": "rill.bench.drivers.generate_ws",
    "batch-ws": "rill.bench.drivers.batch_ws",
    "uds": "rill.bench.drivers.uds",
    "chat-ws": "rill.bench.drivers.chat_ws",
    "evergreen": "rill.bench.drivers.evergreen",
}
"""CLI name → module; each module exposes ``SERVER_PROTOCOL`` and a ``Driver`` class."""


class Target(msgspec.Struct, kw_only=True):
    """Where the server under test listens (only loopback and unix sockets)."""

    host: str = "127.0.0.1"
    port: int = 8000
    socket: str = DEFAULT_SOCKET
    grpc_address: str = DEFAULT_ADDRESS
    api_key: str | None = None
    model: str | None = None  # OpenAI "model" field; None: the first of GET /v1/models

    @property
    def http_url(self) -> str:
        """Base HTTP URL."""
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        """Base WebSocket URL."""
        return f"ws://{self.host}:{self.port}"


class Options(msgspec.Struct, kw_only=True):
    """What every request of a run asks for, whatever the protocol.

    ``ignore_eos`` asks the server to generate exactly ``max_tokens`` (where the protocol
    can say so: OpenAI ``ignore_eos``, /generate ``ignore_eos``, chat ``min_new_tokens``,
    Evergreen ``ignore_eos``; batch /ws and the Unix socket cannot, so a model's eos may
    end those early, and their token counts say so). ``temperature`` 0 is greedy.
    """

    temperature: float = 0.0
    ignore_eos: bool = True
    openai_endpoint: str = "completions"  # or "chat"


class BenchError(Exception):
    """A request failed in a way the server reported or the driver recognised.

    Attributes:
        kind: a short stable name for the error table (``http_503``, ``queue_full`` …).
    """

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind
        self.message = message


class Timer:
    """Collects one request's timings; drivers call ``tokens()`` per token-bearing message.

    The clock starts at construction (the runner builds it just before calling the driver).
    """

    def __init__(self, index: int, protocol: str, run_start: float) -> None:
        self.index = index
        self.protocol = protocol
        self.start = time.perf_counter()
        self.start_s = self.start - run_start
        self.first: float | None = None
        self.last: float | None = None
        self.itl_s: list[float] = []
        self.num_messages_tokens = 0

    def tokens(self, num_tokens: int = 1) -> None:
        """A message carrying ``num_tokens`` new tokens (1 when the protocol does not say) arrived."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None and num_tokens > 0:
            gap = (now - self.last) / num_tokens
            self.itl_s.extend([gap] * num_tokens)
        self.last = now
        self.num_messages_tokens += max(num_tokens, 1)

    def done(self, num_output_tokens: int | None = None, num_prompt_tokens: int | None = None) -> RequestRecord:
        """The request completed; counts given by the server win over counted messages."""
        end = time.perf_counter()
        return RequestRecord(
            index=self.index,
            protocol=self.protocol,
            start_s=self.start_s,
            ttft_s=None if self.first is None else self.first - self.start,
            e2e_s=end - self.start,
            itl_s=self.itl_s,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=self.num_messages_tokens if num_output_tokens is None else num_output_tokens,
        )

    def failed(self, kind: str, message: str = "") -> RequestRecord:
        """The request failed with ``kind``."""
        end = time.perf_counter()
        return RequestRecord(
            index=self.index,
            protocol=self.protocol,
            start_s=self.start_s,
            e2e_s=end - self.start,
            num_output_tokens=self.num_messages_tokens,
            error=kind,
            error_message=message[:300] or None,
        )


class Driver(Protocol):
    """What the runner needs of a protocol driver."""

    name: str

    async def open(self) -> None:
        """Prepare shared resources (pools, channels); raise ``BenchError`` if the server is unreachable."""
        ...

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Send one request, feed ``timer`` as messages arrive, return ``timer.done(...)``."""
        ...

    async def close(self) -> None:
        """Release shared resources."""
        ...


class SocketPerRequestDriver:
    """Base of the drivers that open a new connection per request and share nothing."""

    name = ""

    def __init__(self, target: Target, options: Options) -> None:
        self.target = target
        self.options = options

    async def open(self) -> None:
        """Nothing is shared between requests."""

    async def close(self) -> None:
        """Nothing to release."""

    def auth_headers(self) -> dict[str, str] | None:
        """The bearer header when the target has an API key."""
        return {"Authorization": f"Bearer {self.target.api_key}"} if self.target.api_key else None


def make_driver(name: str, target: Target, options: Options) -> Driver:
    """The driver for CLI protocol ``name``.

    Raises:
        BenchError: ``name`` is not a known protocol (kind ``unknown_protocol``).
    """
    if name not in DRIVERS:
        raise BenchError("unknown_protocol", f"unknown protocol {name!r}; choose from {', '.join(DRIVERS)}")
    module = importlib.import_module(DRIVERS[name])
    return module.Driver(target, options)


def server_protocol(name: str) -> str:
    """The ``rill.protocols`` package a CLI protocol name drives (to check it exists)."""
    return importlib.import_module(DRIVERS[name]).SERVER_PROTOCOL
