"""Perplexity of rill's loaded weights against llama.cpp's ``llama-perplexity`` on the same GGUF file.

    .venv/bin/python benchmarks/perplexity.py --model qwen2.5-coder-1.5b
    .venv/bin/python benchmarks/perplexity.py --model path/to/file.gguf --weights auto,dense --chunks 8

Both sides score the same fixed text the way ``llama-perplexity`` does: the text is tokenized
once (no BOS unless the model adds one, then it replaces each chunk's first token), cut into
chunks of ``--ctx`` tokens, each chunk is run from an empty cache, and only the second half of
each chunk is scored (every scored token sees at least ``ctx/2`` tokens of context); the
perplexity is ``exp`` of the mean negative log-likelihood over all scored tokens.

rill's side goes through its own loader and runner (``--weights`` as ``rill serve`` takes it,
weights packed as served), teacher-forced with all logits. llama.cpp's side is
``llama-perplexity``, built from the same ``llama-cpp-python`` source distribution as
``llama-server`` (``benchmarks/compare.py``; cached, a minute or two the first time), run with
``-c ctx -t <cores>`` and the same chunk count.

Two built-in texts, both fixed, on every machine this project runs on, and written to one file
that both programs read:

* ``python-reference`` (the default): the first 40,000 characters of the Python language
  reference's topics as the running interpreter ships them (``pydoc_data.topics``, in key
  order; about 9,000 tokens of technical prose);
* ``gpl-3``: the GNU GPL version 3 as Debian ships it (``/usr/share/common-licenses/GPL-3``,
  about 7,000 tokens): a text models have seen many times, so its perplexity is near 1.

``--text PATH`` scores any other file. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import PEERS_DIR, PeerUnavailable, llama_source  # benchmarks/ is not a package

from rill.engine.batch import RowWork
from rill.engine.runner import TorchModelRunner
from rill.models.loader import load_model

GPL_3 = Path("/usr/share/common-licenses/GPL-3")
PYTHON_REFERENCE_CHARS = 40_000


def builtin_text(name: str) -> str | None:
    """The text of a built-in name (``python-reference``, ``gpl-3``), or None for a path."""
    if name == "python-reference":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))[:PYTHON_REFERENCE_CHARS]
    if name == "gpl-3":
        return GPL_3.read_text()
    return None


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def ensure_llama_perplexity(cache: Path = PEERS_DIR) -> Path:
    """``llama-perplexity`` from the vendored llama.cpp, built next to ``llama-server`` (cached)."""
    build = cache / "llama-build"
    binary = build / "bin" / "llama-perplexity"
    if binary.exists():
        return binary
    log = cache / "build-perplexity.log"
    if not (build / "CMakeCache.txt").exists():
        source = llama_source(cache)
        _run(
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=ON",
                "-DLLAMA_OPENSSL=OFF",
            ],
            log,
        )
    print(f"llama.cpp: building llama-perplexity (log: {log}) ...", flush=True)
    _run(["cmake", "--build", str(build), "--target", "llama-perplexity", f"-j{os.cpu_count() or 2}"], log)
    if not binary.exists():
        raise PeerUnavailable(f"the build finished but {binary} is missing; see {log}")
    return binary


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise PeerUnavailable(f"{cmd[0]} failed; see {log}")


def chunks_of(text: str, tokenizer: Any, ctx: int) -> list[list[int]]:
    """The text's whole chunks as ``llama-perplexity`` cuts them: tokenized once with the model's
    own special tokens (a BOS when it adds one), then that BOS starts every chunk."""
    tokens = tokenizer.encode(text, add_special_tokens=True)
    plain = tokenizer.encode(text, add_special_tokens=False)
    bos = tokens[0] if len(tokens) > len(plain) and tokens[0] == tokenizer.bos_token_id else None
    tokens = tokens[: len(plain) + (bos is not None)]  # never score an added end-of-sequence token
    chunks = [tokens[i : i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]
    return [[bos] + chunk[1:] if bos is not None else chunk for chunk in chunks]


def rill_perplexity(path: Path, weights: str, text: str, ctx: int, num_chunks: int) -> tuple[float, int, int]:
    """rill's perplexity over the first ``num_chunks`` chunks (all when 0), the tokens scored and
    the chunks the text has."""
    loaded = load_model(path, weights=weights)
    chunks = chunks_of(text, loaded.tokenizer, ctx)
    num_chunks = min(num_chunks or len(chunks), len(chunks))
    if num_chunks < 1:
        raise SystemExit(f"the text is shorter than one chunk of {ctx} tokens")
    runner = TorchModelRunner(loaded, num_rows=1, max_len=ctx)
    first = ctx // 2
    nll, scored = 0.0, 0
    for i in range(num_chunks):
        chunk = chunks[i]
        logits = runner.forward([RowWork(0, chunk, 0, all_logits=True)])
        # Row j predicts token j + 1; rows first .. ctx-2 predict the chunk's second half.
        logprobs = logits[first : ctx - 1].float().log_softmax(dim=-1)
        targets = torch.tensor(chunk[first + 1 : ctx])
        nll -= logprobs[torch.arange(len(targets)), targets].sum().item()
        scored += len(targets)
        print(
            f"  rill --weights {weights}: chunk {i + 1}/{num_chunks}  running PPL {math.exp(nll / scored):.4f}",
            flush=True,
        )
    return math.exp(nll / scored), scored, len(chunks)


def llama_perplexity(binary: Path, path: Path, text: Path, ctx: int, num_chunks: int) -> tuple[float, float, int]:
    """``llama-perplexity``'s final estimate, its ± and the chunks it scored."""
    cmd = [
        str(binary),
        "-m",
        str(path),
        "-f",
        str(text),
        "-c",
        str(ctx),
        "-b",
        str(ctx),
        "-t",
        str(os.cpu_count() or 2),
        "--chunks",
        str(num_chunks),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    output = done.stdout + done.stderr
    final, chunks = _FINAL.search(output), _CHUNKS.search(output)
    if done.returncode != 0 or final is None:
        raise PeerUnavailable(f"llama-perplexity failed (exit {done.returncode}):\n{output[-2000:]}")
    return float(final.group(1)), float(final.group(2)), int(chunks.group(1)) if chunks else -1


def main(argv: list[str] | None = None) -> int:
    """Score the text with each rill weight mode and with llama-perplexity; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file or a catalog name (rill models)")
    parser.add_argument("--weights", default="auto", help="rill weight modes, comma-separated (default: auto)")
    parser.add_argument(
        "--text", default="python-reference", help="python-reference (default), gpl-3, or a file to score"
    )
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default: 512)")
    parser.add_argument("--chunks", type=int, default=0, help="chunks to score (default: every whole chunk)")
    parser.add_argument("--no-llama", action="store_true", help="rill only")
    args = parser.parse_args(argv)
    from rill.models.catalog import resolve

    path = resolve(args.model) or Path(args.model)
    if path.suffix != ".gguf":
        parser.error("llama-perplexity reads GGUF files: give a .gguf file or a catalog GGUF model")
    text = builtin_text(args.text)
    if text is None:
        if not Path(args.text).exists():
            parser.error(f"{args.text} does not exist; give --text")
        text = Path(args.text).read_text()
    text_file = Path(tempfile.mkdtemp(prefix="rill-ppl-")) / "text.txt"
    text_file.write_text(text)  # the same bytes for both programs
    print(f"{path.name}: {args.text}, chunks of {args.ctx} tokens, the second half of each scored", flush=True)
    rows = []
    num_chunks = args.chunks
    for mode in args.weights.split(","):
        started = time.monotonic()
        ppl, scored, available = rill_perplexity(path, mode, text, args.ctx, num_chunks)
        num_chunks = min(num_chunks or available, available)
        rows.append((f"rill --weights {mode}", ppl, None, scored, time.monotonic() - started))
    if not args.no_llama:
        started = time.monotonic()
        ppl, plus_minus, chunks = llama_perplexity(ensure_llama_perplexity(), path, text_file, args.ctx, num_chunks)
        if chunks != num_chunks:
            print(f"  note: llama-perplexity scored {chunks} chunks (its tokenizer cut the text differently)")
        rows.append(
            ("llama-perplexity", ppl, plus_minus, chunks * (args.ctx - 1 - args.ctx // 2), time.monotonic() - started)
        )
    reference = rows[-1][1]
    print(f"\n| system | PPL | vs {rows[-1][0]} | tokens scored | wall s |\n|---|---|---|---|---|")
    for name, ppl, plus_minus, scored, wall in rows:
        shown = f"{ppl:.4f}" + (f" ± {plus_minus:.4f}" if plus_minus is not None else "")
        print(f"| {name} | {shown} | {100 * (ppl / reference - 1):+.2f} % | {scored} | {wall:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
