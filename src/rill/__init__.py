"""rill: a streaming LLM inference server. One engine, many wire protocols."""

from rill.engine.threads import apply_wait_policy as _apply_wait_policy

__version__ = "0.1.0"

WAIT_POLICY = _apply_wait_policy()
"""The OpenMP wait policy in force (set here, before anything imports torch; see rill.engine.threads)."""
