"""Build the demo model folder and cache it: corpus → tokenizer → training → Hugging Face files.

``build_demo_model(folder)`` writes a complete folder (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``, a README model card
and ``rill_demo.json`` with the training figures). ``ensure_demo_model()`` returns the cached
folder, building it first if needed: the build happens in a temporary sibling folder that is
renamed into place only when complete, under an exclusive ``flock`` so that two processes
never train at once (the second waits, then finds the folder built). A killed build leaves
at most a ``.tmp-*`` folder, removed by the next build.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import rill.demo.corpus as corpus
import rill.demo.tokenizer as tk
from rill.cache import build_atomically, cache_root
from rill.demo.train import TrainConfig, TrainResult, pack_documents, split_holdout, train

DEMO_NAME = "rill-demo-v1"
"""Folder name of the demo model; bump the version when the recipe changes."""
DEFAULT_TIME_BUDGET_S = 240.0
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "rill_demo.json")
MAX_CONTEXT_TOKENS = 1024
UNDERTRAINED_LOSS = 1.0
"""Held-out loss above which the demo model writes poor text (a warning is printed)."""
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 256}
# About 5M parameters (1.8k-token vocabulary): small enough for a few minutes of 2-core CPU
# training, large enough to learn the corpus's grammar. GQA (8 query heads, 2 KV heads)
# exercises the engine's GQA path.
DEFAULT_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}

ReportFn = Callable[[float, str], None]
"""Progress callback: (percent done in [0, 100], stage description)."""
# Where each stage ends on the 0-100 progress scale; training takes nearly all the time.
_CORPUS_END, _TOKENIZER_END, _TRAINING_END = 2.0, 5.0, 98.0


def demo_model_dir() -> Path:
    """Where the demo model lives (it may not be built yet): ``<cache root>/models/rill-demo-v1``."""
    return cache_root() / "models" / DEMO_NAME


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds every file of a finished build."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def ensure_demo_model(
    progress: bool = True,
    time_budget_s: float | None = None,
    folder: Path | None = None,
    report: ReportFn | None = None,
    rebuild: bool = False,
) -> Path:
    """Return the demo model folder, building it first (once, atomically) if it is missing.

    Args:
        progress: show a progress bar on stderr while building.
        time_budget_s: build time budget (default ``DEFAULT_TIME_BUDGET_S``).
        folder: where the model lives (default ``demo_model_dir()``).
        report: called with (percent, stage text) while building (see ``build_demo_model``).
        rebuild: build again even if a complete folder exists; it is swapped in when done.
    """
    folder = Path(folder) if folder is not None else demo_model_dir()

    def build(tmp: Path) -> None:
        build_demo_model(tmp, time_budget_s=time_budget_s or DEFAULT_TIME_BUDGET_S, progress=progress, report=report)

    build_atomically(folder, build, is_complete, rebuild=rebuild, progress=progress, what="the demo model")
    _warn_if_undertrained(folder, progress)
    return folder


def _warn_if_undertrained(folder: Path, progress: bool) -> None:
    # A build on a busy machine can run out of time early; say so instead of serving
    # gibberish without explanation.
    try:
        stats = json.loads((folder / "rill_demo.json").read_text())
    except (OSError, ValueError):
        return
    loss = stats.get("eval_loss")
    if progress and isinstance(loss, (int, float)) and loss > UNDERTRAINED_LOSS:
        print(
            f"rill: the demo model in {folder} is undertrained (held-out loss {loss:.2f} after "
            f"{stats.get('num_steps')} steps; the machine was probably busy) and will write poor text. "
            f"Delete that folder to build it again.",
            file=sys.stderr,
        )


def model_config(vocab_size: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of the demo model (``overrides`` replace any field)."""
    hidden = (overrides or {}).get("hidden_size", DEFAULT_MODEL["hidden_size"])
    heads = (overrides or {}).get("num_attention_heads", DEFAULT_MODEL["num_attention_heads"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **DEFAULT_MODEL,
        "head_dim": hidden // heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_CONTEXT_TOKENS,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tk.SPECIAL_TOKENS.index(tk.BOS),
        "eos_token_id": tk.SPECIAL_TOKENS.index(tk.EOS),
        "pad_token_id": tk.SPECIAL_TOKENS.index(tk.PAD),
        "use_cache": True,
    }
    config.update(overrides or {})
    return config


def build_demo_model(
    folder: str | Path,
    *,
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
    steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    report: ReportFn | None = None,
    model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
    corpus_bytes: int = corpus.DEFAULT_TARGET_BYTES,
) -> Path:
    """Generate the corpus, train tokenizer and model, and write a Hugging Face folder.

    Args:
        folder: output folder (created; existing files are overwritten). Not atomic: use
            ``ensure_demo_model`` for the cached copy.
        time_budget_s: wall-clock budget for the whole build; training gets what the other
            stages leave. None: ``steps`` alone limits training.
        steps: at most this many training steps.
        seed: seeds the corpus, the initial weights and the batch order.
        progress: show a tqdm bar on stderr (stages corpus, tokenizer, training with loss, saving).
        report: also called with (percent done, stage text) as the build advances, e.g. to
            feed a server's loading status.
        model_overrides: ``config.json`` fields replacing the defaults (tests use a tiny model).
        train_overrides: ``TrainConfig`` fields replacing the defaults.
        corpus_bytes: how much text to generate.
    """
    from rill.models import build_model, save_checkpoint  # torch-heavy; imported when building

    start = time.monotonic()
    folder = Path(folder)
    with _Progress(progress, report) as bar:
        bar.stage("corpus", 0.0)
        docs = corpus.documents(seed, corpus_bytes)
        bar.stage("tokenizer", _CORPUS_END)
        tokenizer = tk.train_tokenizer(docs)
        ids = [e.ids for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
        tokens = pack_documents(ids, tokenizer.token_to_id(tk.BOS), tokenizer.token_to_id(tk.EOS))  # type: ignore[arg-type]
        config = model_config(tokenizer.get_vocab_size(), model_overrides)
        model = build_model(config, "float32", "cpu", seed=seed)
        budget = None if time_budget_s is None else max(1.0, time_budget_s - (time.monotonic() - start) - 3.0)
        train_config = TrainConfig(
            **({"steps": steps, "time_budget_s": budget, "seed": seed} | (train_overrides or {}))
        )
        train_tokens, holdout = split_holdout(tokens, min_tokens=train_config.seq_len + 1)
        bar.stage("training", _TOKENIZER_END)
        result = train(model, train_tokens, train_config, bar.training, holdout)  # type: ignore[arg-type]
        bar.stage("saving", _TRAINING_END, f"loss {result.train_loss:.3f}")
        _save(folder, model, config, tokenizer, result, train_config, save_checkpoint)  # type: ignore[arg-type]
        bar.stage("done", 100.0, f"loss {result.train_loss:.3f}")
    return folder


class _Progress:
    """One tqdm bar for the whole build (stage in the description), plus an optional callback."""

    def __init__(self, show: bool, report: ReportFn | None) -> None:
        self.bar = tqdm(
            total=100.0,
            unit="%",
            disable=not show,
            file=sys.stderr,
            bar_format="{desc}{percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
        )
        self.report = report
        self.percent = 0.0

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.close()

    def stage(self, name: str, percent: float, postfix: str = "") -> None:
        """Enter stage ``name`` at ``percent``."""
        self.bar.set_description(f"rill demo model: {name}", refresh=False)
        self._move(percent, postfix, f"demo model: {name}")

    def training(self, fraction: float, step: int, loss: float) -> None:
        """The training loop's ``ProgressFn``."""
        percent = _TOKENIZER_END + (_TRAINING_END - _TOKENIZER_END) * fraction
        self._move(percent, f"step {step} loss {loss:.3f}", f"demo model: training, step {step}, loss {loss:.3f}")

    def _move(self, percent: float, postfix: str, text: str) -> None:
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(percent - self.percent)
        self.percent = percent
        if self.report is not None:
            self.report(percent, text)


def _save(
    folder: Path,
    model: torch.nn.Module,
    config: dict[str, Any],
    tokenizer: Any,
    result: TrainResult,
    train_config: TrainConfig,
    save_checkpoint: Any,
) -> None:
    ids = tk.special_token_ids(tokenizer)
    generation = {
        "bos_token_id": ids[tk.BOS],
        "eos_token_id": [ids[tk.EOS], ids[tk.END]],
        "pad_token_id": ids[tk.PAD],
        **GENERATION_CONFIG,
    }
    save_checkpoint(model, config, folder, generation)
    tk.save_tokenizer(tokenizer, folder, MAX_CONTEXT_TOKENS)
    num_params = sum(p.numel() for p in model.parameters())
    stats = {
        "name": DEMO_NAME,
        "num_parameters": num_params,
        "num_steps": result.num_steps,
        "num_training_tokens": result.num_tokens,
        "train_loss": round(result.train_loss, 4),
        "eval_loss": round(result.eval_loss, 4),
        "training_s": round(result.elapsed_s, 1),
        "steps_by_threads": result.steps_by_threads,
        "seq_len": train_config.seq_len,
        "batch_size": train_config.batch_size,
        "peak_lr": train_config.peak_lr,
        "seed": train_config.seed,
    }
    (folder / "rill_demo.json").write_text(json.dumps(stats, indent=2) + "\n")
    (folder / "README.md").write_text(_model_card(stats))


def _model_card(stats: dict[str, Any]) -> str:
    return (
        f"# {DEMO_NAME}\n\n"
        "A tiny Llama-architecture model built on this machine by `rill demo-model` so that\n"
        "`rill serve` works without downloading anything. It writes short, simple stories\n"
        "and answers chats with them. It knows nothing else.\n\n"
        "Training text: stories and chats generated by `rill.demo.corpus` (code of the rill\n"
        "project, no external data), so the weights are covered by rill's license (Apache-2.0).\n\n"
        f"* parameters: {stats['num_parameters']:,}\n"
        f"* training: {stats['num_steps']} steps, {stats['num_training_tokens']:,} tokens,"
        f" {stats['training_s']} s on CPU\n"
        f"* final loss: train {stats['train_loss']}, held-out {stats['eval_loss']}\n"
    )
