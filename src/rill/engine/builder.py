"""The one place that turns a config and a model runner into a ready ``Engine``.

``build_engine(config)`` loads the model named by ``config`` (weights, tokenizer, KV cache
sized from the memory budget) and hands the parts to ``assemble_engine``.
``assemble_engine(config, runner, tokenizer, ...)`` takes any ``ModelRunner`` and tokenizer
(``rill.testing.FakeRunner`` and its tokenizer in tests) and builds the core, the grammar
compiler and the model facts around them, so a test gets the same engine the server runs,
minus the torch model.

Imports the engine, ``rill.config`` and ``rill.models`` (loaders imported when a model is
loaded); nothing of the frontend or protocols.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rill.engine.sizing as sizing
from rill.config import EngineConfig, parse_size
from rill.engine.batch import ModelRunner
from rill.engine.core import CoreConfig, EngineCore
from rill.engine.grammar import GrammarCompiler
from rill.engine.model_source import Progress, gguf_file, model_path, served_name
from rill.engine.speculative import SpeculativeConfig
from rill.errors import ConfigError, ModelLoadError, RillError
from rill.types import ModelInfo

if TYPE_CHECKING:
    from rill.engine.runner import TorchModelRunner
    from rill.engine.threads import ThreadGovernor
    from rill.models.loader import LoadedModel

log = logging.getLogger("rill.engine")


@dataclass
class Engine:
    """A model ready to step: the core, its runner and tokenizer, and the model's facts.

    Attributes:
        core: the ``EngineCore`` the engine thread steps.
        runner: the ``ModelRunner`` under the core.
        tokenizer: encodes prompts and decodes outputs (``rill.models.tokenizer.Tokenizer``).
        grammars: compiles response formats into grammar matchers (at admission).
        eos_token_ids: tokens that end a generation (model config and tokenizer alike).
        model_info: what protocols may tell clients about the model.
        generation_defaults: sampling defaults from the model's ``generation_config.json``.
    """

    core: EngineCore
    runner: ModelRunner
    tokenizer: Any
    grammars: GrammarCompiler
    eos_token_ids: frozenset[int]
    model_info: ModelInfo
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def assemble_engine(
    config: EngineConfig,
    runner: ModelRunner,
    tokenizer: Any,
    *,
    name: str,
    architecture: str,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: str | None = None,
    eos_token_ids: Iterable[int] = (),
    generation_defaults: Mapping[str, Any] | None = None,
    clock: Callable[[], float] | None = None,
    warm_grammars: bool = True,
    thread_governor: ThreadGovernor | None = None,
    draft_runner: ModelRunner | None = None,
) -> Engine:
    """Build the engine around ``runner`` and ``tokenizer`` (no model is loaded here).

    Args:
        config: scheduling limits (``max_num_seqs``, ``max_num_batched_tokens``).
        runner: the model backend; its ``vocab_size`` is the logits' width.
        tokenizer: a ``rill.models.tokenizer.Tokenizer`` (its own eos ids join ``eos_token_ids``).
        name: the served model name.
        architecture: the model's architecture name (shown to clients).
        dtype: the model's dtype name (shown to clients).
        device: the model's device (shown to clients).
        quantization: the weights' quantization type, when they run quantized (shown to clients).
        eos_token_ids: end-of-sequence ids from the model config.
        generation_defaults: sampling defaults the model ships.
        clock: the core's clock (deadlines); ``time.monotonic`` when None.
        warm_grammars: build the grammar compiler's vocabulary view now, in a background
            thread (else on the first constrained request).
        thread_governor: steers the runner's thread count around every step
            (``rill.engine.threads.default_governor``); None keeps the count fixed.
        draft_runner: the draft model's runner, for ``--speculative draft``.
    """
    eos = frozenset(set(eos_token_ids) | set(tokenizer.eos_token_ids))
    grammars = _grammar_compiler(tokenizer, runner.vocab_size, eos, warm=warm_grammars)
    core_config = CoreConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        speculative=speculative_config(config),
        max_cached_tokens=parse_size(config.prefix_cache_memory, "prefix_cache_memory")
        // max(1, runner.kv_bytes_per_token),
    )
    core = EngineCore(
        runner, tokenizer, core_config, clock or time.monotonic, thread_governor, draft_runner=draft_runner
    )
    model_info = ModelInfo(
        name=config.served_model_name or name,
        architecture=architecture,
        max_context_tokens=runner.max_len,
        vocab_size=runner.vocab_size,
        dtype=dtype,
        device=device,
        quantization=quantization,
        has_chat_template=tokenizer.has_chat_template,
        tool_call_format=_tool_call_format(tokenizer),
    )
    return Engine(
        core=core,
        runner=runner,
        tokenizer=tokenizer,
        grammars=grammars,
        eos_token_ids=eos,
        model_info=model_info,
        generation_defaults=dict(generation_defaults or {}),
    )


def speculative_config(config: EngineConfig) -> SpeculativeConfig:
    """The engine's speculation settings from the server's flags.

    Raises:
        ConfigError: a flag out of range.
    """
    method = config.speculative
    if config.draft_model:
        if method not in ("off", "draft"):
            raise ConfigError(f"--draft-model needs --speculative draft, not {method}")
        method = "draft"
    elif method == "draft":
        raise ConfigError("--speculative draft needs a --draft-model")
    try:
        return SpeculativeConfig(
            method=method, num_tokens=config.num_speculative_tokens, max_batch=config.speculative_max_batch
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _grammar_compiler(tokenizer: Any, vocab_size: int, eos: frozenset[int], *, warm: bool) -> GrammarCompiler:
    """The compiler of constrained-decoding grammars over the tokenizer's vocabulary; ``warm``
    builds its vocabulary view now, in a background thread, so the first constrained request
    does not wait for it."""
    grammars = GrammarCompiler(tokenizer.backend.to_str(), vocab_size, sorted(eos))
    if warm:
        threading.Thread(target=grammars.warm, name="rill-grammar-warmup", daemon=True).start()
    return grammars


def build_engine(config: EngineConfig, progress: Progress | None = None) -> Engine:
    """Load the model ``config`` names and build its engine (runs in the engine thread).

    Raises:
        ModelLoadError: the model cannot be loaded, or the KV budget holds no sequence.
        ConfigError: contradictory speculative decoding flags.
    """
    speculative_config(config)  # contradictory flags are named before any model is loaded
    if config.runner == "llamacpp":
        if config.draft_model:
            raise ConfigError("--draft-model needs the torch runner (--runner torch)")
        return _build_llamacpp_engine(config, progress)
    return _build_torch_engine(config, progress or (lambda pct, stage: None))


def _build_torch_engine(config: EngineConfig, report: Progress) -> Engine:
    """``--runner torch``: the model's weights in torch, packed or quantized for the CPU's kernels."""
    import torch

    from rill.engine.runner import TorchModelRunner
    from rill.engine.threads import default_choice, default_governor

    threads = default_choice(config.num_threads)
    torch.set_num_threads(threads.num_threads)
    import rill

    log.info("engine threads: %d (%s); OpenMP wait policy: %s", threads.num_threads, threads.reason, rill.WAIT_POLICY)
    path, loaded, tokenizer = _load_torch_model(config, report)
    mc = loaded.config
    max_len = sizing.max_len(config, mc)
    num_rows = sizing.cache_rows(
        config, mc.kv_bytes_per_token(), max_len, lazy=torch.device(config.device).type == "cpu"
    )
    report(90.0, "allocating KV cache")
    governor = default_governor(threads, config.num_threads, torch.set_num_threads)
    num_parameters = sizing.parameter_count(loaded.model)  # before packing frees the originals
    runner = TorchModelRunner(loaded, num_rows=num_rows, max_len=max_len)
    if runner.packed_weight_bytes:
        log.info(
            "weights packed for oneDNN's CPU kernels (originals freed; the tied LM head kept in both forms): +%.0f MiB",
            runner.packed_weight_bytes / 2**20,
        )
    report(95.0, "warming up")
    _warm_up(
        runner, sizing.warm_up_tokens(config.max_num_batched_tokens, num_parameters), config.max_num_seqs, governor
    )
    draft_runner = _draft_runner(config, tokenizer, runner, report) if config.draft_model else None
    engine = assemble_engine(
        config,
        runner,
        tokenizer,
        name=served_name(config.model, path),
        architecture=mc.architecture,
        dtype=mc.dtype,
        device=mc.device,
        quantization=None if loaded.weights == "dense" else loaded.weights,
        eos_token_ids=mc.eos_token_ids,
        generation_defaults=mc.generation_defaults,
        thread_governor=governor,
        draft_runner=draft_runner,
    )
    report(100.0, "ready")
    return engine


def _load_torch_model(config: EngineConfig, report: Progress) -> tuple[Path, LoadedModel, Any]:
    """The folder or file ``--model`` names, its weights loaded (``--dtype``, ``--weights``) and
    its tokenizer (a GGUF file's own, else ``tokenizer.json`` beside the weights)."""
    from rill.engine.allocator import release_free_memory, tune_allocator
    from rill.models.loader import load_model
    from rill.models.tokenizer import Tokenizer

    path = model_path(config.model, report)
    report(60.0, "loading weights")
    # Weights first: load_model names a missing folder, config or architecture best.
    loaded = load_model(
        path,
        dtype=config.dtype,
        device=config.device,
        weights=config.weights,
        progress=lambda done, stage: report(60.0 + 25.0 * done, stage),
    )
    log.info(
        "weights: %s (--weights %s%s)",
        loaded.weights,
        config.weights,
        AUTO_WEIGHTS_REASON if config.weights == "auto" else "",
    )
    # Loading's float32 copies are freed by now: return them, then keep step memory from here on.
    release_free_memory()
    log.info(tune_allocator())
    report(85.0, "loading tokenizer")
    return path, loaded, loaded.tokenizer or Tokenizer.from_folder(path)


def _warm_up(runner: TorchModelRunner, num_tokens: int, max_rows: int, governor: ThreadGovernor | None) -> None:
    """One prefill step of ``num_tokens`` and a decode step, judged by the thread governor
    before the engine reports ready, so a busy machine is seen before the first request."""

    def warm_up() -> tuple[int, int, float, float]:
        return runner.warm_up(num_tokens, max_rows=max_rows)

    rows, tokens, prefill_s, decode_s = governor.judge(warm_up) if governor is not None else warm_up()
    if tokens:
        log.info(
            "warm-up: a prefill step of %d rows, %d tokens, in %.2f s, then a decode step in %.0f ms",
            rows,
            tokens,
            prefill_s,
            decode_s * 1000,
        )


def draft_weights(config: EngineConfig) -> str:
    """How the draft model's matrices are held (``--draft-weights``): ``auto`` is int4 on the
    CPU, where a draft step reads every draft weight for one token and its cost decides what
    speculation saves (a coarser draft changes only which drafts the model accepts), and the
    model's own ``--weights`` on other devices, which int4 does not serve."""
    import torch

    if config.draft_weights == "same" or (config.draft_weights == "auto" and torch.device(config.device).type != "cpu"):
        return config.weights
    return "int4" if config.draft_weights == "auto" else config.draft_weights


def _draft_runner(config: EngineConfig, tokenizer: Any, target: ModelRunner, report: Progress) -> ModelRunner:
    """The draft model's runner: loaded like the target (same dtype; ``draft_weights``), with as many
    KV rows of the same length, after checking it reads and writes the same tokens.

    Raises:
        ModelLoadError: it cannot be loaded, or its tokenizer differs from the target's.
    """
    from rill.engine.runner import TorchModelRunner
    from rill.models.loader import load_model
    from rill.models.tokenizer import Tokenizer

    report(95.0, "loading the draft model")
    path = model_path(config.draft_model, lambda pct, stage: None)
    loaded = load_model(path, dtype=config.dtype, device=config.device, weights=draft_weights(config))
    draft_tokenizer = loaded.tokenizer or Tokenizer.from_folder(path)
    if draft_tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ModelLoadError(
            f"the draft model {config.draft_model} has another tokenizer than the model; "
            "speculative decoding needs the same vocabulary"
        )
    runner = TorchModelRunner(loaded, num_rows=target.num_rows, max_len=target.max_len)
    log.info(
        "draft model: %s (%s weights), %d KV rows of %d tokens", path, loaded.weights, runner.num_rows, runner.max_len
    )
    return runner


def _build_llamacpp_engine(config: EngineConfig, progress: Progress | None) -> Engine:
    """``--runner llamacpp``: llama.cpp computes the forward on the GGUF's own (quantized) weights;
    rill's tokenizer is built from the same file, rill's scheduler and sampler run as ever."""
    import torch

    from rill.engine.llamacpp_runner import MAX_SEQUENCES, LlamaCppRunner, import_llama_cpp
    from rill.engine.threads import default_choice, default_governor
    from rill.models.gguf_loader import read_gguf
    from rill.models.registry import parse_config

    report = progress or (lambda pct, stage: None)
    import_llama_cpp()  # a missing extra is named before anything is read
    file, name = gguf_file(config.model)
    threads = default_choice(config.num_threads)
    log.info("llama.cpp threads: %d (%s)", threads.num_threads, threads.reason)
    report(10.0, "reading the GGUF metadata")
    checkpoint = read_gguf(file)
    mc = parse_config(checkpoint.hf_config, checkpoint.generation_config, source=str(file))
    tokenizer = checkpoint.tokenizer()
    max_len = sizing.max_len(config, mc)
    num_rows = sizing.cache_rows(
        config, mc.kv_bytes_per_token(torch.float16), max_len, limit=MAX_SEQUENCES, lazy=False
    )  # llama.cpp's F16 cache is resident from the start
    report(30.0, "loading the model into llama.cpp")
    runner = LlamaCppRunner(
        file,
        num_rows=num_rows,
        max_len=max_len,
        num_threads=threads.num_threads,
        batch_tokens=min(config.max_num_batched_tokens, 2048),
    )
    engine = assemble_engine(
        config,
        runner,
        tokenizer,
        name=name,
        architecture=mc.architecture,
        dtype="float32",
        device="cpu",
        quantization=_quantization(checkpoint.tensor_types()),
        eos_token_ids=mc.eos_token_ids,
        generation_defaults=mc.generation_defaults,
        thread_governor=default_governor(threads, config.num_threads, runner.set_num_threads),
    )
    report(100.0, "ready")
    return engine


AUTO_WEIGHTS_REASON = (
    ": a GGUF file's Q4 matrices stay int4 (Q4_K with its own scales), its Q6_K ones 6-bit "
    "where rill's kernel runs and its other quantized ones become int8, so the weights take "
    "about the file's size; float tensors and folders stay dense"
)
"""Why ``--weights auto`` chose what it did (logged at start)."""


def _quantization(tensor_types: dict[str, str]) -> str:
    """The GGUF's quantization: the commonest type of its non-F32 weights (F32 when all are)."""
    from collections import Counter

    kinds = Counter(kind for name, kind in tensor_types.items() if name.endswith(".weight") and kind != "F32")
    return kinds.most_common(1)[0][0] if kinds else "F32"


def _tool_call_format(tokenizer: Any) -> str | None:
    """The tool-call format of the model's tool-use (or default) chat template, if it shows one."""
    from rill.models.chat_template import tool_call_format

    try:
        return tool_call_format(tokenizer.get_chat_template(tools=[{}]))
    except RillError:
        return None
