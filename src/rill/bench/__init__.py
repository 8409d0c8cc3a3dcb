"""``rill bench``: a load generator that drives a running rill server over any protocol.

Layout: ``workload`` (prompts, arrival times) and ``stats`` (records → figures) are pure;
``drivers/<protocol>.py`` speak one wire protocol each; ``runner`` runs the closed or open
loop; ``cli`` parses flags and prints. ``benchmarks/*.py`` reuse ``runner.measure``.
"""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    """Add ``rill bench`` (called by ``rill.cli`` for every plugin module that exists)."""
    from rill.bench.cli import register as register_cli

    register_cli(subparsers)
