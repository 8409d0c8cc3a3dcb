"""The process's open-file limit, raised toward what ``--max-connections`` needs."""

from __future__ import annotations

import logging

log = logging.getLogger("rill.connections")

FD_RESERVE = 256
"""File descriptors kept free beyond ``--max-connections``: model files, the feedback
store, recordings, gRPC's own connections, log files."""


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft open-file limit toward what ``max_connections`` needs; return the limit.

    The soft limit is raised up to the hard limit (never above it, never lowered). When even
    the hard limit is too small, a warning says so: past it, every listener stops accepting.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "the open-file limit (%d) is below --max-connections %d + %d reserved: connections are "
            "capped at %d; raise the limit (ulimit -n) for more",
            soft,
            max_connections,
            FD_RESERVE,
            max(1, soft - FD_RESERVE),
        )
    return soft
