"""The BERT encoder and sentence embeddings (``rill.models.bert``, ``rill.models.embedder``) on tiny
random-init checkpoints written by ``transformers``: hidden states against ``BertModel``'s own
forward, every pooling mode against ``sentence-transformers`` loading the same folder, and the
refusals a server relies on (too long, bad ids, dimensions, unsupported pipelines)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rill.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError
from rill.models.embedder import Embedder
from rill.models.registry import parse_config
from rill.testing.encoders import make_bert_checkpoint

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ada found the golden lantern near the river.",
    "hi",
    "",
    "Did Milo see 12 sparrows behind the old castle? The meadow was quiet, so Pia slowly left. " * 2,
    "UNUSUAL Casing and ünïcödé, with punctuation!!",
]


@pytest.fixture
def bert_dir(tiny_bert_dir: Path) -> Path:
    return tiny_bert_dir


def test_hidden_states_match_transformers_bert_model(bert_dir: Path) -> None:
    import transformers

    embedder = Embedder.load(bert_dir)
    reference = transformers.BertModel.from_pretrained(bert_dir).eval()
    ids = embedder.prepare(TEXTS)
    longest = max(map(len, ids))
    input_ids = torch.tensor([row + [0] * (longest - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in ids])
    with torch.no_grad():
        ours = embedder.encoder(input_ids, mask)
        theirs = reference(input_ids=input_ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)
    # Mean pooling over the real tokens, then L2: what the folder's modules.json asks for.
    pooled = (theirs * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    expected = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    np.testing.assert_allclose(embedder.embed(ids), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("pooling", "normalize"),
    [
        (("cls",), True),
        (("max",), False),
        (("mean_sqrt_len_tokens",), True),
        (("weightedmean",), True),
        (("lasttoken",), False),
        (("mean", "max", "cls"), True),
    ],
)
def test_pooling_modes_match_sentence_transformers(tmp_path: Path, pooling: tuple[str, ...], normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    folder = make_bert_checkpoint(tmp_path / "bert", pooling=pooling, normalize=normalize)
    embedder = Embedder.load(folder)
    assert embedder.dimensions == 64 * len(pooling)
    ours = embedder.embed(embedder.prepare(TEXTS))
    theirs = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(ours, theirs, atol=2e-5)


def test_a_task_models_checkpoint_and_a_bare_folder_load(tmp_path: Path) -> None:
    # BertForMaskedLM: tensors under bert., a head rill ignores; no sentence-transformers files:
    # mean pooling and L2 normalisation, and positions bound the input length.
    folder = make_bert_checkpoint(tmp_path / "mlm", architecture="BertForMaskedLM", with_sentence_files=False)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    embedder = Embedder.load(folder)
    assert embedder.max_input_tokens == 128 and embedder.pooling == ("mean",) and embedder.normalize
    vectors = embedder.embed(embedder.prepare(TEXTS[:2]))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_a_bert_folder_given_as_a_chat_model_points_to_embedding_model(bert_dir: Path) -> None:
    hf = json.loads((bert_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="--embedding-model"):
        parse_config(hf)


def test_inputs_longer_than_the_limit_are_refused_or_truncated(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir, name="tiny")
    long_text = "river " * 100
    with pytest.raises(ContextLengthExceeded, match="input 1 has 102 tokens, but tiny reads at most 64") as caught:
        embedder.prepare(["short", long_text])
    assert caught.value.field == "inputs"
    [cut] = embedder.prepare([long_text], truncate_to=10)
    assert len(cut) == 10 and cut[0] == 2 and cut[-1] == 3  # [CLS] ... [SEP] kept
    assert len(embedder.prepare([long_text], truncate_to=-1)[0]) == 64
    assert embedder.prepare([[5] * 100], truncate_to=7) == [[5] * 7]  # token ids: the first ones
    for bad in (0, 65, -2):
        with pytest.raises(InvalidRequest) as caught:
            embedder.prepare(["x"], truncate_to=bad)
        assert caught.value.field == "truncate_to"
    with pytest.raises(InvalidRequest, match="at least 3"):
        embedder.prepare(["x"], truncate_to=2)


def test_token_ids_are_checked_and_embedded_as_given(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir)
    ids = embedder.prepare(["Ada found the lantern."])
    np.testing.assert_array_equal(embedder.embed(embedder.prepare(ids)), embedder.embed(ids))
    with pytest.raises(InvalidRequest, match="token id 512, outside the vocabulary"):
        embedder.prepare([[1, 2], [512]])
    with pytest.raises(InvalidRequest, match="input 0 is an empty list"):
        embedder.prepare([[]])


def test_dimensions(tmp_path: Path, bert_dir: Path) -> None:
    plain = Embedder.load(bert_dir, name="tiny")
    plain.check_dimensions(64)
    with pytest.raises(InvalidRequest, match="'dimensions' 32 is not supported: tiny gives 64") as caught:
        plain.check_dimensions(32)
    assert caught.value.field == "dimensions"
    matryoshka = Embedder.load(
        make_bert_checkpoint(tmp_path / "mrl", extra_config={"matryoshka_dimensions": [64, 32, 16]})
    )
    matryoshka.check_dimensions(16)
    with pytest.raises(InvalidRequest, match="or 64, 32, 16"):
        matryoshka.check_dimensions(20)
    ids = matryoshka.prepare(TEXTS[:2])
    cut = matryoshka.embed(ids, dimensions=16)
    full = matryoshka.pooled(ids)[:, :16]
    np.testing.assert_allclose(cut, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-6)


def test_unsupported_pipelines_are_named(tmp_path: Path) -> None:
    folder = make_bert_checkpoint(tmp_path / "dense")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match=r"module 'sentence_transformers.models.Dense' is not supported"):
        Embedder.load(folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "attention"}))
    (folder / "modules.json").write_text(json.dumps(modules[:2]))
    with pytest.raises(ModelLoadError, match="pooling mode"):
        Embedder.load(folder)
    (folder / "tokenizer.json").unlink()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ModelLoadError, match="tokenizer.json not found"):
        Embedder.load(folder)
