"""The tokenizer of a model folder, loaded with the ``tokenizers`` library only.

``Tokenizer.from_folder`` reads what a Hugging Face model folder holds:

- ``tokenizer.json`` (required): the fast tokenizer itself;
- ``tokenizer_config.json``: special tokens (strings or AddedToken dicts), ``add_bos_token``
  / ``add_eos_token``, ``added_tokens_decoder``, ``chat_template`` (a string or a list of
  ``{name, template}``);
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``: where recent transformers
  (5.x ``save_pretrained`` included) writes templates; they win over ``tokenizer_config.json``;
  ``chat_template.json`` (processor format) is a last fallback;
- ``special_tokens_map.json``: fills special tokens the config does not name;
- ``generation_config.json`` / ``config.json``: extra end-of-sequence ids (int or list).

Behaviour follows ``transformers`` (v5) with two deliberate differences:
``decode`` never applies ``clean_up_tokenization_spaces`` (it corrupts BPE output and cannot
be streamed), and an explicit ``add_bos_token`` / ``add_eos_token`` in
``tokenizer_config.json`` is honoured even when ``tokenizer.json`` disagrees (transformers 5
ignores the flags when ``tokenizer.json`` exists; 4.x Llama-family tokenizers honoured them,
and model authors wrote them for 4.x).

Thread safety: padding and truncation are switched off at load and nothing mutates the
backend afterwards, so ``encode``/``decode`` may be called from several threads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from rill.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError
from rill.models.chat_template import render_chat_template

logger = logging.getLogger(__name__)

# The named special tokens transformers passes to chat templates (plus model-specific *_token keys).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


class Tokenizer:
    """Encode, decode and chat-format text for one model.

    Build it with ``Tokenizer.from_folder(path)``; the constructor takes already-parsed parts
    (useful in tests). Token ids are plain ``int``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_templates: dict[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> None:
        """Wrap ``backend``.

        Args:
            backend: the ``tokenizers.Tokenizer``; padding and truncation are turned off.
            special_tokens: named special tokens (``bos_token``... and model-specific
                ``*_token`` names) as strings; they are passed to chat templates.
            extra_special_tokens: other special token strings (``additional_special_tokens``).
            chat_templates: template sources by name (``default``, ``tool_use``...).
            extra_eos_token_ids: ids that also end generation (from generation_config.json).
            name: a label for messages (usually the folder).
        """
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.bos_token_id = self._id_of("bos_token")
        self.pad_token_id = self._id_of("pad_token")
        self.unk_token_id = self._id_of("unk_token")
        eos_id = self._id_of("eos_token")
        self.eos_token_id: int | None = eos_id if eos_id is not None else next(iter(extra_eos_token_ids), None)
        self.eos_token_ids: set[int] = {i for i in (eos_id, *extra_eos_token_ids) if i is not None}
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: set[int] = {i for i, token in added.items() if token.special}
        for text in (*self.special_tokens.values(), *extra_special_tokens):
            token_id = backend.token_to_id(text)
            if token_id is not None:
                self.special_token_ids.add(token_id)
        # NOTE: max id + 1 rather than get_vocab_size(): added tokens may leave gaps.
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1

    # ----------------------------------------------------------------- loading

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the model folder ``path`` (see the module docstring).

        Raises:
            ModelLoadError: the folder or its ``tokenizer.json`` is missing, or a file is unreadable.
        """
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file} not found: rill needs a fast tokenizer ({TOKENIZER_FILE})")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        special_tokens, extra_special = _special_tokens(config, _read_json(folder / SPECIAL_TOKENS_MAP_FILE))
        _register_added_tokens(backend, config)
        _apply_bos_eos_flags(backend, config, special_tokens)
        return cls(
            backend,
            special_tokens=special_tokens,
            extra_special_tokens=extra_special,
            chat_templates=_load_chat_templates(folder, config),
            extra_eos_token_ids=_config_eos_ids(folder),
            name=str(folder),
        )

    # ------------------------------------------------------------ text <-> ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not change its settings)."""
        return self._backend

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token text, or None."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token text, or None."""
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS/EOS).

        Special tokens written in ``text`` are always recognised, as in transformers.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_context_tokens: int | None = None
    ) -> list[list[int]]:
        """Token ids of each text, as ``encode`` gives them.

        Unlike ``encode``, the Rust side runs without holding the GIL (and skips the offsets
        nobody reads), so a long text tokenized in a worker thread leaves the event loop free;
        only building the Python lists of ids holds it.

        Raises:
            ContextLengthExceeded: a text has ``max_context_tokens`` tokens or more (no room
                left for a new token); raised from the count, before any id list is built.
        """
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        if max_context_tokens is not None:
            longest = max((len(encoding) for encoding in encodings), default=0)
            if longest >= max_context_tokens:
                raise ContextLengthExceeded(longest, max_context_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; unknown ids are ignored. No tokenization-space clean-up is applied."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Text of each id sequence, as ``decode`` gives it.

        Unlike ``decode``, the Rust side runs without holding the GIL: 585,000 ids decoded
        with ``decode`` in a worker thread held the event loop for 70-100 ms, with this for
        about 5 ms (only reading the Python lists of ids holds it).
        """
        return self._backend.decode_batch([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (e.g. ``Ġthe``), or None if unknown."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary string ``token``, or None."""
        return self._backend.token_to_id(token)

    def _id_of(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return self._backend.token_to_id(text) if text is not None else None

    # ----------------------------------------------------------- chat templates

    @property
    def has_chat_template(self) -> bool:
        """Whether the folder defines at least one chat template."""
        return bool(self.chat_templates)

    def get_chat_template(self, tools: Sequence[Any] | None = None) -> str | None:
        """The template to use: ``tool_use`` when tools are given and it exists, else ``default``.

        Returns None when the model has no template. Raises ``InvalidRequest`` when it has
        only named templates and none is the default.
        """
        if not self.chat_templates:
            return None
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        names = ", ".join(sorted(self.chat_templates))
        raise InvalidRequest(
            f"this model has several chat templates ({names}) and none is the default", field="messages"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        /,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (dicts or ``ChatMessage`` structs) to the prompt text.

        The model's special tokens are template variables. ``chat_template_kwargs`` (a
        client's mapping: any key is safe, reserved ones raise ``InvalidRequest``) and then
        ``template_kwargs`` (e.g. ``enable_thinking=False``, ``documents=[...]``) add to
        and override them.

        Raises:
            InvalidRequest: no chat template, or the template failed (see ``chat_template``).
        """
        return render_chat_template(
            self.get_chat_template(tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            template_kwargs={**(chat_template_kwargs or {}), **template_kwargs},
        )

    def encode_chat(
        self,
        messages: Sequence[Any],
        /,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, as ``transformers.apply_chat_template(tokenize=True)``.

        The template writes every special token it wants (``{{ bos_token }}`` included), so the
        text is encoded without the post-processor: no second BOS is added.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools, chat_template_kwargs, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: dict[str, Any], special_map: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Named special tokens (config first, then special_tokens_map.json) and the extra ones."""
    named: dict[str, str] = {}
    for source in (special_map, config):  # config last so that it wins
        for key, value in source.items():
            text = _token_text(value)
            if key.endswith("_token") and text is not None:
                named[key] = text
            elif key.endswith("_token") and value is None and source is config:
                named.pop(key, None)  # an explicit null in the config removes the token
    extra: list[str] = []
    for source in (special_map, config):
        for key in ("additional_special_tokens", "extra_special_tokens"):
            values = source.get(key)
            if isinstance(values, dict):  # v5 model-specific names: {"image_token": "<image>"}
                for name, value in values.items():
                    if (text := _token_text(value)) is not None:
                        named.setdefault(name, text)
                values = list(values.values())
            for value in values or ():
                if (text := _token_text(value)) is not None and text not in extra:
                    extra.append(text)
    return named, extra


def _register_added_tokens(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Mark as special the tokens ``added_tokens_decoder`` flags special but tokenizer.json does not."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return
    known = backend.get_added_tokens_decoder()
    to_add = []
    for raw_id, entry in decoder.items():
        if not isinstance(entry, dict) or not entry.get("special") or _token_text(entry) is None:
            continue
        current = known.get(int(raw_id))
        if current is not None and current.content == entry["content"] and current.special:
            continue
        if backend.token_to_id(entry["content"]) != int(raw_id):
            continue  # never re-number a token; the tokenizer.json ids are authoritative
        to_add.append(
            AddedToken(
                entry["content"],
                single_word=entry.get("single_word", False),
                lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False),
                normalized=entry.get("normalized", False),
                special=True,
            )
        )
    if to_add:
        backend.add_special_tokens(to_add)


def _apply_bos_eos_flags(backend: tokenizers.Tokenizer, config: dict[str, Any], special: dict[str, str]) -> None:
    """Make ``encode(add_special_tokens=True)`` add BOS/EOS exactly as the config's flags say."""
    wants = {key: config[key] for key in ("add_bos_token", "add_eos_token") if isinstance(config.get(key), bool)}
    if not wants:
        return
    bos, eos = special.get("bos_token"), special.get("eos_token")
    bos_id = backend.token_to_id(bos) if bos is not None else None
    eos_id = backend.token_to_id(eos) if eos is not None else None
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    has_bos = bos_id is not None and len(full) > len(plain) and full[0] == bos_id
    has_eos = eos_id is not None and len(full) > len(plain) and full[-1] == eos_id
    add_bos = wants.get("add_bos_token", has_bos) and bos_id is not None
    add_eos = wants.get("add_eos_token", has_eos) and eos_id is not None
    if (add_bos, add_eos) == (has_bos, has_eos):
        return
    # Same template transformers' update_post_processor() builds.
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    tokens = [(bos, bos_id)] if add_bos else []
    tokens += [(eos, eos_id)] if add_eos else []
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)
    logger.info("tokenizer post-processor rebuilt from tokenizer_config.json: add_bos=%s add_eos=%s", add_bos, add_eos)


def _load_chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """Templates by name; standalone .jinja files win over tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    default_file = folder / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        templates["default"] = _read_text(default_file)
    extra_dir = folder / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
    if templates:
        return templates
    value = config.get("chat_template")
    if value is None:
        value = _read_json(folder / LEGACY_CHAT_TEMPLATE_FILE).get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for entry in value:
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                templates[entry["name"]] = entry["template"]
        return templates
    if value is not None:
        raise ModelLoadError(f"chat_template in {folder / TOKENIZER_CONFIG_FILE} must be a string or a list")
    return templates


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _config_eos_ids(folder: Path) -> list[int]:
    """End-of-sequence ids named by generation_config.json and config.json (int or list)."""
    ids: list[int] = []
    config = _read_json(folder / "config.json")
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (_read_json(folder / "generation_config.json"), config, text_config):
        value = source.get("eos_token_id")  # type: ignore[union-attr]
        values = value if isinstance(value, list) else [value]
        ids.extend(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v not in ids)
    return ids
