"""Which model ``--model`` names: a path, a catalog name (``rill models``), ``demo`` (the story
model rill trains itself) or nothing (the default model), and the name it is served under.

Imports ``rill.models`` (catalog, default model) and ``rill.demo`` when a name needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rill.errors import ModelLoadError

DEMO_MODEL = "demo"
"""``--model demo`` serves the story model rill trains itself (``rill.demo``)."""

Progress = Callable[[float, str], None]
"""Loading progress callback: percent done and the stage's name."""


def gguf_file(model: str | None) -> tuple[Path, str]:
    """The GGUF file ``--model`` names (or the default model's) and the name it is served under."""
    from rill.models.gguf_loader import find_gguf

    if not model:
        from rill.models.default import DEFAULT_MODEL_NAME, default_gguf_path

        return default_gguf_path(), DEFAULT_MODEL_NAME  # the default model keeps its name on either runner
    from rill.models.catalog import lookup, resolve

    named = resolve(model)  # a catalog name (rill models): its pulled file, served under that name
    if named is not None:
        return named, lookup(model).name  # type: ignore[union-attr]
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist")
    file = find_gguf(path)
    if file is None:
        raise ModelLoadError(f"--runner llamacpp needs a .gguf file; {path} is not one")
    return file, file.stem


def served_name(model: str | None, path: Path) -> str:
    """A catalog model's catalog name; else the file's stem or the folder's name."""
    from rill.models.catalog import lookup

    entry = lookup(model) if model and not Path(model).exists() else None
    if entry is not None:
        return entry.name
    return path.stem if path.is_file() else path.name


def model_path(model: str | None, report: Progress) -> Path:
    """``--model``: a path; a catalog name (``rill.models.catalog``): its pulled file; ``demo``
    (unless a path of that name exists): the story model rill trains itself; none: the default
    model (SmolLM2-135M-Instruct)."""
    # Preparing a cached model reports 0-100 %; it is the first 55 % of loading.
    scaled = lambda pct, stage: report(1.0 + 0.54 * pct, stage)  # noqa: E731 - a local shorthand
    if model == DEMO_MODEL and not Path(model).exists():
        from rill.demo import ensure_demo_model

        report(1.0, "building the demo model (first run only)")
        return ensure_demo_model(progress=True, report=scaled)
    if model:
        from rill.models.catalog import resolve

        return resolve(model) or Path(model)  # a catalog name (rill models) means its pulled file
    from rill.models.default import ensure_default_model

    report(1.0, "preparing the default model")
    return ensure_default_model(progress=True, report=scaled)
