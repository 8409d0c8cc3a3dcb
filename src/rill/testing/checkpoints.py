"""Random-init checkpoints with a real tokenizer, written offline, for tests and benchmarks.

``make_checkpoint`` writes a Hugging Face folder with ``transformers``' own ``save_pretrained``
(so rill's loader is tested against the reference writer): config, safetensors weights,
``generation_config.json`` and a small byte-level BPE tokenizer trained with ``tokenizers`` on
English-like sentences generated here from a seed. The tokenizer is trained once per process.

Weights use ``initializer_range`` 0.08 by default: random models with transformers' 0.02 have
near-flat logits, so greedy parity would fail at near-ties (engine-notes §10). Norm weights and
biases are randomised too, so a mix-up of q/k norms or a dropped bias shows in the logits.

``transformers`` is a test dependency: it is imported inside the function.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

# The demo model's special tokens and tokenizer_config.json, so fixtures and the served
# demo model speak the same chat markers (ids: <unk>=0, <s>=1, </s>=2, <pad>=3, markers 4..7).
from rill.demo.tokenizer import BOS, END, EOS, PAD, SPECIAL_TOKENS, UNK, tokenizer_config

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""A minimal chat template: ``<s><|user|>\\nhi<|end|>\\n<|assistant|>\\n``."""

TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Their signatures are in <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <args-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role != 'system' or not loop.first %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template with Hermes/Qwen-style tools (``<tools>`` in the system turn, calls as
``<tool_call>{json}</tool_call>``, results as ``<tool_response>``), written for the tests."""

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_CONFIG_CLASSES = {"gemma3": "Gemma3TextConfig"}

PRESETS: dict[str, dict[str, Any]] = {
    # engine-notes §2 "model100m": 100.7 M parameters with a 16,384-token vocabulary.
    "100m": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        tie_word_embeddings=False,
        vocab_size=16384,
        max_position_embeddings=2048,
    ),
}

TOKENIZER_VOCAB_SIZE = 1024
"""The BPE trainer's target; the generated text runs out of merges first (840 tokens today)."""

_WORDS = {
    "name": "Ada Ben Cleo Dan Eve Finn Gus Hana Ivo Jun Kai Lea Milo Nia Omar Pia Quin Rosa Sam Tia".split(),
    "noun": (
        "river stone garden window market teacher lantern bridge forest engine letter basket village "
        "mountain harbor kitchen library melody compass painter castle meadow candle ladder island "
        "station notebook orchard thunder whistle sparrow carpet mirror pocket ribbon tunnel"
    ).split(),
    "verb": (
        "found carried painted opened followed built watched cleaned answered visited borrowed "
        "repaired remembered described counted covered gathered measured planted shared"
    ).split(),
    "adj": (
        "quiet bright old small golden heavy gentle curious narrow warm silver patient busy "
        "distant hollow careful wooden tiny ancient cheerful"
    ).split(),
    "adv": "slowly quickly carefully happily quietly suddenly together again later often".split(),
    "prep": "near under behind beside across inside above along through past".split(),
}


def generate_text(num_sentences: int = 6000, seed: int = 0) -> str:
    """Return English-like sentences (a few hundred KB for the default size), deterministic in ``seed``."""
    rng = random.Random(seed)
    pick = lambda kind: rng.choice(_WORDS[kind])  # noqa: E731 - a local shorthand
    sentences = []
    for _ in range(num_sentences):
        shape = rng.randrange(4)
        if shape == 0:
            s = f"{pick('name')} {pick('verb')} the {pick('adj')} {pick('noun')} {pick('prep')} the {pick('noun')}."
        elif shape == 1:
            s = f"The {pick('noun')} was {pick('adj')}, so {pick('name')} {pick('adv')} {pick('verb')} it."
        elif shape == 2:
            s = f"Did {pick('name')} see {rng.randint(2, 99)} {pick('noun')}s {pick('prep')} the {pick('adj')} {pick('noun')}?"
        else:
            s = f'"{pick("adj").capitalize()} {pick("noun")}!" said {pick("name")}, and {pick("adv")} left.'
        sentences.append(s)
    return "\n".join(" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5))


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Cached per process as JSON text: every checkpoint gets its own Tokenizer object.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_text().splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer.to_str()


def make_tokenizer(vocab_size: int | None = None):
    """Return a ``tokenizers.Tokenizer`` (trained once per process) padded to ``vocab_size``.

    When ``vocab_size`` exceeds the trained vocabulary, filler tokens ``<|filler_N|>`` are
    added so every model id decodes.
    """
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(TOKENIZER_VOCAB_SIZE))
    missing = (vocab_size or 0) - tokenizer.get_vocab_size()
    if missing > 0:
        start = tokenizer.get_vocab_size()
        tokenizer.add_tokens([AddedToken(f"<|filler_{start + i}|>", normalized=False) for i in range(missing)])
    return tokenizer


def make_checkpoint(
    folder: str | Path,
    arch: str = "llama",
    *,
    preset: str | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    initializer_range: float = 0.08,
    is_random_norms_and_biases: bool = True,
    seed: int = 0,
    with_chat_template: bool = True,
    chat_template: str | None = None,
    dtype: str = "float32",
    max_shard_size: str | int | None = None,
    generation_config: dict[str, Any] | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write a random-init checkpoint folder with a tokenizer; return its path.

    Args:
        folder: created if missing.
        arch: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` or ``gemma3``.
        preset: ``"100m"`` for engine-notes' model100m shape (overrides the shape arguments).
        vocab_size: model vocabulary; default the tokenizer's size (840). Larger values pad
            the tokenizer with filler tokens.
        rope_scaling: e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}`` (Llama only).
        sliding_window: Mistral's window; Qwen2/Qwen3 get ``use_sliding_window`` with it;
            Gemma 3's local layers use it (global base ``rope_theta``, local base 10k).
        is_random_norms_and_biases: draw norm weights around 1 and biases around 0 instead of
            transformers' exact ones/zeros.
        chat_template: the template to write (default ``CHAT_TEMPLATE``; ``TOOL_CHAT_TEMPLATE``
            for a Qwen-style model that takes tools).
        dtype: ``float32`` or ``bfloat16`` weights on disk.
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"200KB"``) to write shards.
        generation_config: extra ``generation_config.json`` fields (eos ids are set here).
        extra_config: more configuration fields (e.g. Gemma 3's ``layer_types``,
            ``query_pre_attn_scalar``, ``final_logit_softcapping``).
    """
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(ARCHITECTURES)}")
    shape = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
    )
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
        shape |= PRESETS[preset]
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(shape["vocab_size"])
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = _hf_config(
        arch, shape, head_dim, rope_theta, rope_scaling, sliding_window, initializer_range, ids, extra_config or {}
    )
    config.vocab_size = shape["vocab_size"] or tokenizer.get_vocab_size()
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[arch])(config)
    if is_random_norms_and_biases:
        _randomise_norms_and_biases(model, initializer_range, seed)
    model = model.to(getattr(torch, dtype))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[END]], pad_token_id=ids[PAD], **(generation_config or {})
    )
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(out, **kwargs)
    _write_tokenizer(tokenizer, out, config.max_position_embeddings, with_chat_template, chat_template)
    return out


def _hf_config(arch, shape, head_dim, rope_theta, rope_scaling, sliding_window, initializer_range, ids, extra):
    import transformers

    name = _CONFIG_CLASSES.get(arch, ARCHITECTURES[arch].replace("ForCausalLM", "Config"))
    kwargs: dict[str, Any] = dict(
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta} | (rope_scaling or {}),
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch == "mistral":
        kwargs["sliding_window"] = sliding_window
    elif arch in ("qwen2", "qwen3"):
        kwargs |= dict(
            use_sliding_window=sliding_window is not None, sliding_window=sliding_window, max_window_layers=0
        )
    elif arch == "gemma3":
        kwargs |= dict(
            head_dim=head_dim or shape["hidden_size"] // shape["num_heads"],
            sliding_window=sliding_window or 4096,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": rope_theta} | (rope_scaling or {}),
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    return getattr(transformers, name)(**kwargs | extra)


def _randomise_norms_and_biases(model, initializer_range: float, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(initializer_range * torch.randn(param.shape, generator=generator))


def _write_tokenizer(
    tokenizer, folder: Path, max_context_tokens: int, with_chat_template: bool, chat_template: str | None = None
) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(max_context_tokens)
    if with_chat_template:
        config["chat_template"] = chat_template or CHAT_TEMPLATE  # the fixtures' minimal one, not the demo's
    else:
        del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
