"""Fixtures for model tests: random-init checkpoints per architecture, written once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rill_model_helpers import CASES


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and the CPU is shared; restore afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Return ``make(case_name) -> folder``; each case is written once per session."""
    from rill.testing.checkpoints import make_checkpoint

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = make_checkpoint(tmp_path_factory.mktemp(name), **CASES[name])
        return made[name]

    return make
