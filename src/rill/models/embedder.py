"""Sentence embeddings: an encoder, its tokenizer and sentence-transformers' pooling, in one object.

A sentence-embedding folder is a Hugging Face encoder folder (``config.json``,
``model.safetensors``, ``tokenizer.json``) plus sentence-transformers' description of what
follows the encoder:

* ``modules.json``: the pipeline, here ``Transformer`` → ``Pooling`` → optional ``Normalize``
  (any other module, such as ``Dense``, is refused by name rather than skipped);
* the pooling module's ``config.json`` (``1_Pooling/``): ``pooling_mode`` (or the older
  ``pooling_mode_*_tokens`` flags): ``cls``, ``max``, ``mean``, ``mean_sqrt_len_tokens``,
  ``weightedmean``, ``lasttoken``, several concatenated in the order given;
* ``sentence_bert_config.json``: ``max_seq_length`` (the longest input, in tokens, special
  tokens included) and ``do_lower_case``.

A folder without ``modules.json`` is read as mean pooling followed by L2 normalisation, what
OpenAI-style clients expect of an embedding (unit vectors, so a dot product is the cosine).

``Embedder.prepare`` turns one request's inputs into token-id lists (texts tokenized with
their special tokens; token-id inputs taken as given, as vLLM does), bounded by
``max_input_tokens``; ``Embedder.embed`` runs one padded batch through the encoder and pools
it. The two are separate so a server can gather the inputs of several requests into batches
of similar lengths. Device and dtype are the caller's choice: nothing here assumes a CPU.

Imports torch, numpy, ``tokenizers`` and ``rill.models`` (registry, loader) only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import tokenizers
import torch

from rill.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError
from rill.models.config import dtype_name
from rill.models.loader import read_json, read_tensors
from rill.models.registry import encoder_family_for_config

log = logging.getLogger("rill.models")

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
"""The pooling modes ``Embedder`` runs, in the order the older boolean flags concatenate them."""

_MODULES = ("Transformer", "Pooling", "Normalize")
"""The sentence-transformers modules ``Embedder`` runs (``modules.json`` ``type``'s last part)."""


@dataclass(frozen=True)
class SentenceConfig:
    """What a folder's sentence-transformers files say about the steps around the encoder.

    Attributes:
        encoder_dir: the folder holding the encoder's ``config.json``, weights and tokenizer
            (the ``Transformer`` module's path, usually the folder itself).
        pooling: the pooling modes, concatenated in this order.
        normalize: whether the pooled vector is scaled to unit length (L2).
        max_seq_length: the longest input in tokens (None: the encoder's positions bound it).
        do_lower_case: whether texts are lower-cased before tokenizing.
    """

    encoder_dir: Path
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = True
    max_seq_length: int | None = None
    do_lower_case: bool = False


def read_sentence_config(folder: Path) -> SentenceConfig:
    """The sentence-transformers description of ``folder`` (see the module docstring).

    Raises:
        ModelLoadError: a module rill does not run, no pooling module, or a pooling mode it
            does not know; the message names the file.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return SentenceConfig(encoder_dir=folder, **_bert_config(folder))
    modules = read_json(modules_file, required=True)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file} is not a list of modules")
    encoder_dir, pooling, normalize = None, None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer":
            encoder_dir = path
        elif kind == "Pooling":
            pooling = _pooling_modes(read_json(path / "config.json", required=True), path / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(
                f"{modules_file}: module {module.get('type')!r} is not supported (rill runs {', '.join(_MODULES)})"
            )
    if encoder_dir is None or pooling is None:
        raise ModelLoadError(f"{modules_file} needs a Transformer and a Pooling module")
    return SentenceConfig(encoder_dir=encoder_dir, pooling=pooling, normalize=normalize, **_bert_config(encoder_dir))


def _bert_config(encoder_dir: Path) -> dict[str, Any]:
    """``max_seq_length`` and ``do_lower_case`` from ``sentence_bert_config.json`` (if there)."""
    values = read_json(encoder_dir / "sentence_bert_config.json", required=False)
    length = values.get("max_seq_length")
    return {"max_seq_length": int(length) if length else None, "do_lower_case": bool(values.get("do_lower_case"))}


def _pooling_modes(config: dict[str, Any], source: Path) -> tuple[str, ...]:
    """The modes of a pooling ``config.json``: ``pooling_mode`` (a name or a list), else the
    older ``pooling_mode_<mode>_tokens`` flags (mean when none is set, as sentence-transformers)."""
    given = config.get("pooling_mode")
    if given is not None:
        modes = (given,) if isinstance(given, str) else tuple(given)
    else:
        flags = {
            "cls": "pooling_mode_cls_token",
            "max": "pooling_mode_max_tokens",
            "mean": "pooling_mode_mean_tokens",
            "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
            "weightedmean": "pooling_mode_weightedmean_tokens",
            "lasttoken": "pooling_mode_lasttoken",
        }
        modes = tuple(mode for mode, flag in flags.items() if config.get(flag)) or ("mean",)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown or not modes:
        raise ModelLoadError(f"{source}: pooling mode {unknown or modes} is not supported ({', '.join(POOLING_MODES)})")
    return modes


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` of right-padded inputs and their mask ``[B, T]`` → one vector
    per input ``[B, H * len(modes)]``, the modes' results concatenated in order (float32)."""
    hidden = hidden.float()
    keep = mask.unsqueeze(-1).float()  # [B, T, 1]
    count = keep.sum(dim=1).clamp(min=1e-9)  # [B, 1]
    lengths = mask.sum(dim=1).long()  # [B]
    pooled = []
    for mode in modes:
        if mode == "cls":
            pooled.append(hidden[:, 0])
        elif mode == "max":
            pooled.append(hidden.masked_fill(keep == 0, float("-inf")).max(dim=1).values)
        elif mode == "mean":
            pooled.append((hidden * keep).sum(dim=1) / count)
        elif mode == "mean_sqrt_len_tokens":
            pooled.append((hidden * keep).sum(dim=1) / count.sqrt())
        elif mode == "weightedmean":
            weights = keep * torch.arange(1, hidden.shape[1] + 1, device=hidden.device).view(1, -1, 1)
            pooled.append((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9))
        else:  # lasttoken
            pooled.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1])
    return torch.cat(pooled, dim=-1)


class Embedder:
    """A sentence-embedding model ready to run (build it with ``Embedder.load``).

    ``prepare`` may run on any thread; ``embed`` runs the encoder and is meant for one worker
    thread at a time (it is not locked).

    Attributes:
        name: the model's name for clients.
        dimensions: the length of every vector ``embed`` returns (before ``dimensions`` asks less).
        max_input_tokens: the most tokens of one input, special tokens included.
        vocab_size: token ids must be below it.
        matryoshka_dimensions: the shorter lengths the model was trained to be cut to (its
            ``config.json`` ``matryoshka_dimensions``); None when it may only be cut to any
            length (``is_matryoshka`` without a list); empty when it may not be cut at all.
        normalize: whether vectors are scaled to unit length.
    """

    def __init__(
        self,
        *,
        name: str,
        encoder: torch.nn.Module,
        tokenizer: tokenizers.Tokenizer,
        sentence: SentenceConfig,
        max_input_tokens: int,
        hf_config: dict[str, Any],
    ) -> None:
        self.name = name
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = sentence.pooling
        self.normalize = sentence.normalize
        self.do_lower_case = sentence.do_lower_case
        self.max_input_tokens = max_input_tokens
        self.vocab_size = int(hf_config["vocab_size"])
        self.pad_token_id = int(hf_config.get("pad_token_id") or 0)
        self.dimensions = int(hf_config["hidden_size"]) * len(sentence.pooling)
        if hf_config.get("matryoshka_dimensions"):
            self.matryoshka_dimensions: tuple[int, ...] | None = tuple(
                int(d) for d in hf_config["matryoshka_dimensions"]
            )
        else:
            self.matryoshka_dimensions = None if hf_config.get("is_matryoshka") else ()
        self.num_special_tokens = len(tokenizer.encode("").ids)
        self._truncating = threading.Lock()  # enable_truncation changes the shared tokenizer
        param = next(encoder.parameters())
        self.device, self.dtype = param.device, param.dtype

    @classmethod
    def load(cls, folder: Path, *, name: str | None = None, device: str = "cpu", dtype: str = "float32") -> Embedder:
        """Load a sentence-embedding folder onto ``device`` in ``dtype``.

        Raises:
            ModelLoadError: a missing or unreadable file, an encoder family or pipeline module
                rill does not run, or weights that do not fit the config.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelLoadError(f"embedding model folder {folder} does not exist")
        sentence = read_sentence_config(folder)
        hf = read_json(sentence.encoder_dir / "config.json", required=True)
        family = encoder_family_for_config(hf, str(sentence.encoder_dir / "config.json"))
        config = family.parse_config(hf, str(sentence.encoder_dir / "config.json"))
        tokenizer_file = sentence.encoder_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"tokenizer.json not found in {sentence.encoder_dir} (rill reads fast tokenizers only)"
            )
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        # tokenizer.json may carry the padding and truncation it was saved with (all-MiniLM-L6-v2's
        # pads and cuts to 128): batches are padded here, and a long input is refused, not cut.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        positions = int(hf.get("max_position_embeddings", 512))
        max_input_tokens = min(sentence.max_seq_length or positions, positions)
        with torch.device("meta"):
            encoder = family.build(config)
        try:
            state = family.from_hf(read_tensors(sentence.encoder_dir), config)
            encoder.load_state_dict(state, strict=True, assign=True)
        except (RuntimeError, ModelLoadError) as exc:
            raise ModelLoadError(f"{sentence.encoder_dir}: the weights do not fit config.json: {exc}") from exc
        encoder = encoder.to(device=torch.device(device), dtype=getattr(torch, dtype_name(dtype))).eval()
        log.info(
            "embedding model %s: %s, pooling %s%s, %d dimensions, inputs up to %d tokens, on %s",
            name or folder.name,
            family.name,
            "+".join(sentence.pooling),
            ", normalized" if sentence.normalize else "",
            int(hf["hidden_size"]) * len(sentence.pooling),
            max_input_tokens,
            device,
        )
        return cls(
            name=name or folder.name,
            encoder=encoder,
            tokenizer=tokenizer,
            sentence=sentence,
            max_input_tokens=max_input_tokens,
            hf_config=hf,
        )

    # -- requests ----------------------------------------------------------------------------
    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse a ``dimensions`` the model cannot give (``InvalidRequest`` naming the field):
        its own length always works; a shorter one only if it was trained for it."""
        if dimensions is None or dimensions == self.dimensions:
            return
        allowed = self.matryoshka_dimensions
        if allowed is None and 1 <= dimensions <= self.dimensions:
            return
        if allowed and dimensions in allowed:
            return
        if allowed == ():
            reason = f"{self.name} gives {self.dimensions}-dimensional vectors and cannot be cut shorter"
        else:
            reason = f"{self.name} gives {self.dimensions} dimensions, or {', '.join(map(str, allowed or ()))}"
        raise InvalidRequest(f"'dimensions' {dimensions} is not supported: {reason}", field="dimensions")

    def prepare(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], truncate_to: int | None = None
    ) -> list[list[int]]:
        """One request's inputs as token-id lists: texts tokenized (with the model's special
        tokens), token-id lists checked against the vocabulary and taken as they are.

        Args:
            inputs: the texts, or the token-id lists, of one request (not mixed).
            truncate_to: keep at most this many tokens of each input (texts keep their special
                tokens); -1 means ``max_input_tokens``; None: an input that is too long is refused.

        Raises:
            InvalidRequest: an empty token-id list, an id outside the vocabulary, or
                ``truncate_to`` out of range (fields ``inputs``, ``truncate_to``: a protocol
                names its own).
            ContextLengthExceeded: an input longer than ``max_input_tokens`` (field ``inputs``).
        """
        limit = self._truncation(truncate_to)
        if inputs and isinstance(inputs[0], str):
            texts = list(cast(Sequence[str], inputs))
            if self.do_lower_case:
                texts = [text.lower() for text in texts]
            if limit is not None and limit <= self.num_special_tokens:
                raise InvalidRequest(
                    f"'truncate_to' must leave room for a text's {self.num_special_tokens} special "
                    f"tokens: at least {self.num_special_tokens + 1}",
                    field="truncate_to",
                )
            ids = [encoding.ids for encoding in self._encode(texts, limit)]
        else:
            ids = [
                self._checked_ids(list(given), index)
                for index, given in enumerate(cast(Sequence[Sequence[int]], inputs))
            ]
            if limit is not None:
                ids = [given[:limit] for given in ids]
        for index, given in enumerate(ids):
            if not given:  # a tokenizer without special tokens makes nothing of ""
                raise InvalidRequest(f"input {index} has no token to embed", field="inputs")
            if len(given) > self.max_input_tokens:
                raise ContextLengthExceeded(
                    len(given),
                    self.max_input_tokens,
                    f"input {index} has {len(given)} tokens, but {self.name} reads at most {self.max_input_tokens} "
                    "per input; shorten it, or set 'truncate_to' to cut it",
                    field="inputs",
                )
        return ids

    def _truncation(self, truncate_to: int | None) -> int | None:
        if truncate_to is None:
            return None
        if truncate_to == -1:
            return self.max_input_tokens
        if not 1 <= truncate_to <= self.max_input_tokens:
            raise InvalidRequest(
                f"'truncate_to' must be -1 (the model's limit) or in [1, {self.max_input_tokens}], not {truncate_to}",
                field="truncate_to",
            )
        return truncate_to

    def _encode(self, texts: list[str], limit: int | None) -> list[tokenizers.Encoding]:
        # The truncation setting belongs to the shared tokenizer: an untruncated call must not
        # run while another thread has it switched on, so both paths take the lock.
        with self._truncating:
            if limit is None:
                return self.tokenizer.encode_batch(texts)
            self.tokenizer.enable_truncation(limit)
            try:
                return self.tokenizer.encode_batch(texts)
            finally:
                self.tokenizer.no_truncation()

    def _checked_ids(self, ids: list[int], index: int) -> list[int]:
        if not ids:
            raise InvalidRequest(f"input {index} is an empty list of token ids", field="inputs")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"input {index} holds token id {bad}, outside the vocabulary of {self.name} (0 to {self.vocab_size - 1})",
                field="inputs",
            )
        return ids

    def embed(self, batch: Sequence[Sequence[int]], dimensions: int | None = None) -> np.ndarray:
        """``finish(pooled(batch), dimensions)``: the vectors of ``batch`` as clients get them."""
        return self.finish(self.pooled(batch), dimensions)

    @torch.inference_mode()
    def pooled(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """One forward over ``batch`` (token-id lists from ``prepare``, padded here to the
        longest) → the pooled vectors, float32 ``[len(batch), self.dimensions]``, not yet
        normalised (``finish`` does, after any cut to fewer dimensions)."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        vectors = pool(self.encoder(input_ids, mask), mask, self.pooling)
        return vectors.cpu().numpy().astype(np.float32, copy=False)

    def finish(self, vectors: np.ndarray, dimensions: int | None = None) -> np.ndarray:
        """Pooled vectors ``[N, self.dimensions]`` → what clients get: the first ``dimensions``
        (checked with ``check_dimensions``; None: all), scaled to unit length if the model
        normalises (a cut vector is normalised again, as a Matryoshka model is read)."""
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        if self.normalize:
            norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32)
