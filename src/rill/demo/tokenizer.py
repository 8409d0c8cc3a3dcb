"""The demo model's tokenizer: byte-level BPE trained on the demo corpus, plus chat markers.

Writes the files a Hugging Face folder needs for text: ``tokenizer.json`` (BPE, ByteLevel
pre-tokenizer and decoder, a post-processor that puts ``<s>`` in front, as Llama does) and
``tokenizer_config.json`` (special tokens and the chat template). The chat template starts
with ``bos_token``, so rendered chats must be encoded with ``add_special_tokens=False``
(the usual Hugging Face convention); plain prompts get ``<s>`` from the post-processor.
Imports the standard library and ``tokenizers``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <pad>=3, then the chat markers 4..7.
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END)
ROLE_MARKERS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

# Roles other than system/assistant (e.g. "tool") are shown as user turns: the model
# never saw anything else. List contents keep their text parts only.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'assistant'] %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% else %}{{ '<|user|>\\n' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: list[dict[str, str]], *, add_generation_prompt: bool = False, bos: str = BOS) -> str:
    """Render string-content ``messages`` exactly as ``CHAT_TEMPLATE`` does (without jinja).

    The corpus uses this with ``bos=""`` because training adds ``<s>`` itself.
    """
    parts = [bos]
    for message in messages:
        marker = ROLE_MARKERS.get(message["role"], USER)
        parts.append(f"{marker}\n{message['content']}{END}\n")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT}\n")
    return "".join(parts)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; the vocabulary may stop short of ``vocab_size``.

    A small made-up corpus runs out of merges before 4096 (every word becomes one token),
    which is harmless: the model's ``vocab_size`` is taken from the result.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of every special token, by text."""
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}  # type: ignore[misc]


def tokenizer_config(max_context_tokens: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_context_tokens,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, folder: Path, max_context_tokens: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(max_context_tokens)
    _write_json(folder / "tokenizer_config.json", config)
    special_map = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    special_map["additional_special_tokens"] = config["additional_special_tokens"]
    _write_json(folder / "special_tokens_map.json", special_map)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
