"""Test helpers shipped with the package: offline random-init checkpoints (``checkpoints``),
fault injection into a live engine (``faults``), and an engine without a model:
``FakeRunner`` (``fake_runner``) with ``fake_engine`` and ``fake_client`` (``fake_client``).

Nothing here is imported by the server; ``transformers`` is needed only when a helper runs.
The names below are imported on first use, so importing one helper module stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FakeRunner": "rill.testing.fake_runner",
    "fake_tokenizer": "rill.testing.fake_runner",
    "fake_engine": "rill.testing.fake_client",
    "fake_client": "rill.testing.fake_client",
}

__all__ = sorted(_LAZY)  # noqa: PLE0605 - sorted() returns a list


def __getattr__(name: str) -> Any:
    """Import ``FakeRunner``, ``fake_tokenizer``, ``fake_engine`` and ``fake_client`` on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rill.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
