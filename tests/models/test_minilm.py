"""all-MiniLM-L6-v2 from the pinned wheel (``rill models``: ``all-minilm-l6-v2``): the catalog's
size and sha256 against the installed package, the extracted folder, and the model's limit and
truncation against ``sentence-transformers``. (rill's vectors against sentence-transformers' on
100 texts: through the server, in ``tests/protocols/openai_http/test_embeddings_e2e.py``.)"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rill.errors import ContextLengthExceeded
from rill.models.catalog import MINILM
from rill.models.embedder import Embedder
from rill.models.embedding_source import installed_zip, is_complete


def test_the_catalog_entry_is_the_installed_wheels_zip(minilm_dir: Path) -> None:
    zipped = installed_zip(MINILM)
    assert zipped is not None and zipped.stat().st_size == MINILM.size_bytes
    assert hashlib.sha256(zipped.read_bytes()).hexdigest() == MINILM.sha256
    assert is_complete(MINILM, minilm_dir) and minilm_dir.name == MINILM.file_name
    assert (minilm_dir / "model.safetensors").stat().st_size == 90_868_376
    assert (minilm_dir / "1_Pooling" / "config.json").is_file()


def test_truncation_matches_sentence_transformers(minilm_dir: Path, minilm_reference: tuple[list[str], Any]) -> None:
    from sentence_transformers import SentenceTransformer

    # sentence-transformers cuts a long text to 256 tokens; rill refuses it, or cuts it alike
    # when asked (-1: the model's limit).
    embedder = Embedder.load(minilm_dir, name=MINILM.name)
    assert (embedder.dimensions, embedder.max_input_tokens, embedder.pooling) == (384, 256, ("mean",))
    assert embedder.normalize and embedder.matryoshka_dimensions == ()
    long_text = " ".join(minilm_reference[0][30:70])
    with pytest.raises(ContextLengthExceeded):
        embedder.prepare([long_text])
    [ids] = embedder.prepare([long_text], truncate_to=-1)
    assert len(ids) == 256
    expected = SentenceTransformer(str(minilm_dir), device="cpu").encode([long_text], convert_to_numpy=True)
    assert cosines(embedder.embed([ids]), expected).min() >= 0.999


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("name", ["all-minilm-l6-v2", "minilm"])
def test_serve_names_it_by_its_catalog_name(name: str, minilm_dir: Path) -> None:
    from rill.config import EmbeddingConfig, embedding_model_name

    assert embedding_model_name(EmbeddingConfig(embedding_model=name)) == "all-minilm-l6-v2"
    assert embedding_model_name(EmbeddingConfig(embedding_model=str(minilm_dir))) == "all-MiniLM-L6-v2"
