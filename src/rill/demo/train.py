"""Training loop for the demo model: next-token loss on packed documents, AdamW, cosine LR.

The loop is model-agnostic: any module with ``model(input_ids [B, T]) -> logits [B, T, V]``
trains (the demo uses ``rill.models.build_model``; tests use a tiny stand-in). Training stops
at ``steps`` or when ``time_budget_s`` runs out, whichever comes first. The cosine schedule
runs over whichever of the two is binding, so a time-budgeted run still ends at its lowest
learning rate. On CPUs with native bf16 the forward runs under bf16 autocast (about twice
as fast here) while the master weights and optimizer state stay float32.
Imports torch and the standard library.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyper-parameters of one training run.

    Attributes:
        seq_len: tokens per training window (the model sees ``seq_len`` inputs).
        batch_size: windows per step.
        steps: at most this many optimizer steps (None: only the time budget limits).
        time_budget_s: stop after this many seconds of training (None: only ``steps`` limits).
        peak_lr: learning rate after warm-up; cosine-decays to ``peak_lr * min_lr_ratio``.
        warmup_steps: linear warm-up length.
        weight_decay, betas, grad_clip: AdamW and gradient-norm clipping settings.
        use_bf16: run the forward under bf16 autocast (None: when the CPU has native bf16).
        num_threads: torch intra-op threads while training (None: tuned between all CPUs and 1).
        seed: seeds the window sampler.
    """

    seq_len: int = 256
    # Batch 8 beat batch 16 at equal tokens (held-out loss 0.545 vs 0.604 after 1.2M
    # tokens): with a budget of minutes, more updates matter more than smoother ones.
    batch_size: int = 8
    steps: int | None = None
    time_budget_s: float | None = 230.0
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    use_bf16: bool | None = None
    num_threads: int | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What a run did: steps taken, smoothed final training loss, held-out loss, seconds,
    and how many steps ran with each thread count (``steps_by_threads``)."""

    num_steps: int
    train_loss: float
    eval_loss: float
    elapsed_s: float
    num_tokens: int
    steps_by_threads: dict[int, int]


ProgressFn = Callable[[float, int, float], None]
"""Called after every step with (fraction done in [0, 1], step, smoothed loss)."""


def pack_documents(docs: list[list[int]], bos_id: int, eos_id: int) -> torch.Tensor:
    """Concatenate ``<s> doc </s>`` for every document into one 1-D int64 tensor."""
    flat: list[int] = []
    for ids in docs:
        flat.append(bos_id)
        flat.extend(ids)
        flat.append(eos_id)
    return torch.tensor(flat, dtype=torch.long)


def split_holdout(
    tokens: torch.Tensor, fraction: float = 0.02, min_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split packed tokens into (train, held-out); the held-out part is the tail."""
    num_holdout = max(int(len(tokens) * fraction), min_tokens)
    return tokens[:-num_holdout], tokens[-num_holdout:]


def lr_at(progress: float, step: int, config: TrainConfig) -> float:
    """Learning rate: linear warm-up over steps, then cosine over ``progress`` in [0, 1]."""
    if step < config.warmup_steps:
        return config.peak_lr * (step + 1) / config.warmup_steps
    floor = config.peak_lr * config.min_lr_ratio
    return floor + (config.peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def bf16_is_native() -> bool:
    """True when this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        flags = ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def train(
    model: nn.Module,
    tokens: torch.Tensor,
    config: TrainConfig,
    progress: ProgressFn | None = None,
    holdout: torch.Tensor | None = None,
) -> TrainResult:
    """Train ``model`` in place on random windows of the packed 1-D ``tokens``.

    Raises ``ValueError`` when neither ``steps`` nor ``time_budget_s`` is set or when
    ``tokens`` is shorter than one window.
    """
    if config.steps is None and config.time_budget_s is None:
        raise ValueError("set steps, time_budget_s or both")
    if len(tokens) <= config.seq_len + 1:
        raise ValueError(f"need more than {config.seq_len + 1} tokens to train, got {len(tokens)}")
    use_bf16 = bf16_is_native() if config.use_bf16 is None else config.use_bf16
    old_threads = torch.get_num_threads()
    tuner = ThreadTuner([config.num_threads] if config.num_threads else None)
    try:
        return _run(model, tokens, config, use_bf16, progress, holdout, tuner)
    finally:
        torch.set_num_threads(old_threads)


class ThreadTuner:
    """Picks the fastest torch thread count while training, and keeps checking.

    On an idle machine all cores are fastest; on a shared, overloaded one a single thread
    can be several times faster, because every parallel region waits for its slowest,
    descheduled thread (measured here: 0.5 s against 1-7 s per step). So the tuner times
    the candidates, uses the fastest, and now and then re-times a loser for a couple of
    steps. Each time a loser loses again, its next re-timing waits twice as long: probes
    that lose are expensive on a busy machine.
    """

    PROBE_STEPS = 2
    FIRST_RECHECK = 25
    MAX_RECHECK = 400

    def __init__(self, candidates: list[int] | None = None) -> None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.candidates = candidates or sorted({cpus, 1}, reverse=True)
        self.times: dict[int, list[float]] = {n: [] for n in self.candidates}
        self.num_steps: dict[int, int] = dict.fromkeys(self.candidates, 0)
        self.interval = dict.fromkeys(self.candidates, self.FIRST_RECHECK)
        # Step 0 is a warm-up; the first candidate is timed next, then each other one.
        self.next_probe = {n: 1 + self.PROBE_STEPS * i for i, n in enumerate(self.candidates)}
        self.best = self.current = self.candidates[0]
        self.probe_left = 0
        self.step = 0
        self._started = 0.0

    def begin(self) -> None:
        """Call before a step: sets the thread count this step runs with."""
        if self.probe_left == 0:
            self._choose()
        torch.set_num_threads(self.current)
        self._started = time.perf_counter()

    def end(self) -> None:
        """Call after the step."""
        if self.step > 0:  # the first step pays one-off allocation costs
            times = self.times[self.current]
            times.append(time.perf_counter() - self._started)
            del times[:-3]
        self.num_steps[self.current] += 1
        self.probe_left = max(0, self.probe_left - 1)
        self.step += 1

    def _choose(self) -> None:
        if self.current != self.best:  # a probe just ended: did the probed count win?
            if _median(self.times[self.current]) < _median(self.times[self.best]):
                self.best, loser = self.current, self.best
                self.interval[self.best] = self.FIRST_RECHECK
            else:
                loser = self.current
                self.interval[loser] = min(2 * self.interval[loser], self.MAX_RECHECK)
            self.next_probe[loser] = self.step + self.interval[loser]
        due = [n for n in self.candidates if n != self.best and self.step >= self.next_probe[n]]
        self.current = due[0] if due else self.best
        if due:
            self.times[self.current].clear()  # old timings may come from other conditions
            self.probe_left = self.PROBE_STEPS


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("inf")


def _run(
    model: nn.Module,
    tokens: torch.Tensor,
    config: TrainConfig,
    use_bf16: bool,
    progress: ProgressFn | None,
    holdout: torch.Tensor | None,
    tuner: ThreadTuner,
) -> TrainResult:
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = _optimizer(model, config)
    model.train()
    start = time.monotonic()
    step, smoothed = 0, float("nan")
    while True:
        elapsed = time.monotonic() - start
        fraction = _fraction_done(step, elapsed, config)
        if fraction >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(fraction, step, config)
        inputs, targets = _batch(tokens, config, generator)
        tuner.begin()
        loss = _loss(model, inputs, targets, use_bf16)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        tuner.end()
        step += 1
        # Exponential moving average: single-batch losses are noisy at batch 16.
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        if progress is not None:
            progress(_fraction_done(step, time.monotonic() - start, config), step, smoothed)
    elapsed = time.monotonic() - start
    eval_loss = evaluate(model, holdout, config, use_bf16) if holdout is not None else float("nan")
    model.eval()
    num_tokens = step * config.batch_size * config.seq_len
    return TrainResult(step, smoothed, eval_loss, elapsed, num_tokens, dict(tuner.num_steps))


def _fraction_done(step: int, elapsed_s: float, config: TrainConfig) -> float:
    by_steps = step / config.steps if config.steps else 0.0
    by_time = elapsed_s / config.time_budget_s if config.time_budget_s else 0.0
    return min(1.0, max(by_steps, by_time))


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    # No weight decay on norms and biases (1-D tensors), as is usual for transformers.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.peak_lr, betas=config.betas)


def _batch(tokens: torch.Tensor, config: TrainConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(tokens) - config.seq_len - 1, (config.batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + config.seq_len + 1] for s in starts.tolist()])  # [B, T+1]
    return windows[:, :-1], windows[:, 1:]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, use_bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        logits = model(inputs)  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(
    model: nn.Module, tokens: torch.Tensor, config: TrainConfig, use_bf16: bool, max_windows: int = 32
) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of ``tokens``."""
    model.eval()
    num_windows = min(max_windows, (len(tokens) - 1) // config.seq_len)
    if num_windows == 0:
        return float("nan")
    span = tokens[: num_windows * config.seq_len + 1]
    inputs = span[:-1].view(num_windows, config.seq_len)
    targets = span[1:].view(num_windows, config.seq_len)
    losses = [_loss(model, inputs[i : i + 8], targets[i : i + 8], use_bf16).item() for i in range(0, num_windows, 8)]
    return sum(losses) / len(losses)
