"""Random-init sentence-embedding checkpoints (BERT) with a real WordPiece tokenizer, written offline.

``make_bert_checkpoint`` writes what a sentence-transformers model folder holds: ``transformers``'
own ``save_pretrained`` output (``config.json``, ``model.safetensors``), a lower-casing
WordPiece ``tokenizer.json`` trained here with ``tokenizers`` on the English-like sentences of
``rill.testing.checkpoints`` (``[CLS] text [SEP]``), and sentence-transformers' files:
``modules.json``, ``1_Pooling/config.json`` and ``sentence_bert_config.json``. Tests compare
rill's encoder and pooling with ``transformers``' ``BertModel`` and ``sentence-transformers``
loading the same folder.

``transformers`` is a test dependency: it is imported inside the function.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rill.testing.checkpoints import generate_text

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The WordPiece tokenizer's special tokens: ids 0 to 4."""


@functools.lru_cache(maxsize=2)
def _wordpiece_json(vocab_size: int) -> str:
    # Cached per process as JSON text: every checkpoint gets its own Tokenizer object.
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS), show_progress=False
    )
    tokenizer.train_from_iterator(generate_text().splitlines(), trainer=trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer.to_str()


def make_bert_checkpoint(
    folder: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    max_seq_length: int | None = 64,
    pooling: Sequence[str] = ("mean",),
    normalize: bool = True,
    hidden_act: str = "gelu",
    architecture: str = "BertModel",
    with_sentence_files: bool = True,
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write a random-init sentence-embedding folder; return its path.

    Args:
        folder: created if missing.
        max_seq_length: ``sentence_bert_config.json``'s bound (None: leave the key out).
        pooling: the pooling modes, in order (``1_Pooling/config.json``'s ``pooling_mode``).
        normalize: add the ``Normalize`` module.
        architecture: ``BertModel``, or ``BertForMaskedLM`` for a task model's checkpoint
            (``bert.``-prefixed tensors and a head rill ignores).
        with_sentence_files: write sentence-transformers' files (False: a bare encoder folder).
        extra_config: more ``config.json`` fields (e.g. ``matryoshka_dimensions``).
    """
    import torch
    import transformers
    from tokenizers import Tokenizer

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(_wordpiece_json(512))
    config = transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        hidden_act=hidden_act,
        pad_token_id=0,
        **(extra_config or {}),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    _randomise_norms_and_biases(model, seed)
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512}
    tokenizer_config |= dict(
        zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), BERT_SPECIAL_TOKENS)
    )
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if with_sentence_files:
        _write_sentence_files(out, hidden_size, max_seq_length, pooling, normalize)
    return out


def _randomise_norms_and_biases(model: Any, seed: int) -> None:
    """LayerNorm weights around 1 and biases around 0, so a dropped bias or a swapped norm shows."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def _write_sentence_files(
    out: Path, hidden_size: int, max_seq_length: int | None, pooling: Sequence[str], normalize: bool
) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir(exist_ok=True)
    mode: str | list[str] = pooling[0] if len(pooling) == 1 else list(pooling)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": hidden_size, "pooling_mode": mode}, indent=2) + "\n"
    )
    bert_config: dict[str, Any] = {"do_lower_case": False}
    if max_seq_length is not None:
        bert_config["max_seq_length"] = max_seq_length
    (out / "sentence_bert_config.json").write_text(json.dumps(bert_config, indent=2) + "\n")
