"""Connection accounting and connection-level timeouts, shared by every listener.

One ``ConnectionGate`` per server counts open client connections, in total and per client
IP address, and refuses (``TooManyConnections``) past ``--max-connections-per-client`` or,
when it cannot make room, past ``--max-connections``.

Fair share: when every place is taken, a newcomer from an address holding less than its
fair share (``--max-connections`` over the number of addresses connected, the newcomer's
included) is let in by closing one idle connection of the address holding the most
connections over its share (``ConnectionGate.victim``), so a few addresses holding idle
sockets cannot lock everyone else out. Idle means nothing of the client is being served:
an HTTP connection between requests (or before its first), a WebSocket or Unix-socket
connection that has not sent its first message. A connection with a request or a generation in flight is never closed.
The listener marks its leases idle or busy (``Lease.set_idle``) and gives each the means
to close it (``Lease.evict``).

Every listener takes a ``Lease`` from the gate:

* the HTTP/WebSocket port through ``http_protocol_factory``: uvicorn's protocol runs inside
  ``GuardedProtocol``, which takes the lease when the TCP connection is accepted (before a
  byte is read, so idle sockets count too), refuses with a 503 past the limits, and closes
  a connection whose request headers do not arrive within ``--header-timeout-s`` (408);
  the ASGI middleware (``rill.middleware``) tells it when a request's headers are complete
  and when its response has ended, and applies the body and first-message timeouts; the
  refusals it writes itself (503, 408) come from the error renderer the server passes
  (``ErrorRenderer``: the OpenAI API's error JSON), so this module knows no protocol;
* the Unix socket through ``stream_handler`` (total only: a Unix peer has no address; for
  fair shares its peers together count as one address, ``UNADDRESSED``);
* gRPC per call (``ConnectionGate.open`` in the servicer), besides gRPC's own handshake and
  idle-connection timeouts.

``raise_fd_limit`` lifts the process's soft file-descriptor limit so the connection limit,
not the kernel, is what refuses: at the fd limit every listener would stop accepting.

Modules: ``gate`` (the count, fair shares, leases), ``http_guard`` (the HTTP/WebSocket
port's protocol wrapper), ``stream_guard`` (stream servers), ``fd_limit``; this package
gathers their public names. None of them knows a protocol: the HTTP refusals are written by
the ``ErrorRenderer`` the server passes (the OpenAI API's error JSON).
"""

from rill.auth import client_key
from rill.connections.fd_limit import FD_RESERVE, raise_fd_limit
from rill.connections.gate import REFUSAL_LOG_INTERVAL_S, UNADDRESSED, ConnectionGate, Lease, peer_host
from rill.connections.http_guard import ErrorRenderer, GuardedProtocol, http_protocol_factory
from rill.connections.stream_guard import LeasedHandler, Refuser, StreamHandler, stream_handler

__all__ = [
    "FD_RESERVE",
    "REFUSAL_LOG_INTERVAL_S",
    "UNADDRESSED",
    "ConnectionGate",
    "ErrorRenderer",
    "GuardedProtocol",
    "Lease",
    "LeasedHandler",
    "Refuser",
    "StreamHandler",
    "client_key",
    "http_protocol_factory",
    "peer_host",
    "raise_fd_limit",
    "stream_handler",
]
