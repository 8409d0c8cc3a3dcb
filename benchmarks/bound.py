"""What bounds a wave of concurrent requests on this machine: its GEMMs and its KV reads.

    .venv/bin/python benchmarks/bound.py --models smollm2,100m --peers-json bench-results/peers/peers.json

For ``benchmarks/peers.py``'s load (``--concurrency`` prompts of ``--prompt-tokens`` tokens
arriving at once, ``--max-tokens`` new tokens each), on the model's own packed weights as the
torch runner holds them (``--dtype``, default bfloat16 as ``peers.py`` serves; ``auto`` is what
``rill serve`` picks on this CPU), this times:

* **prefill GEMMs**: every linear layer at ``concurrency x prompt_tokens`` rows, and the LM head
  at ``concurrency`` rows (one logit row per prompt);
* **decode GEMMs**: every linear layer and the LM head at ``concurrency`` rows, i.e. one decode
  step; a wave has ``max_tokens - 1`` of them;
* **memory read speed**: the faster of a read-only pass over 256 MiB (a sum) and a 256 MiB
  copy counted as its read plus its write; the decode attention cannot take less than reading
  every decode row's keys and values once per step at that speed (``floor`` below). Taking the
  faster keeps the floor low, so the ceiling stays an upper bound.

It then prints the wave's time with everything else taken as free (attention arithmetic,
norms, RoPE, sampling, HTTP) and the throughput ceiling that follows. With ``--peers-json``
(written by ``peers.py``) each peer's measured c=``concurrency`` tokens/s is printed beside it
with the ceiling's ratio to it: a goal above that ratio cannot be met by this runner on this
machine, whatever the scheduler does. The decode GEMMs are the fastest of ``--repeat`` timings,
the prefill GEMMs of ``max(3, repeat // 4)`` (each takes seconds) and the memory passes of
``2 x repeat`` (the bound is of what the machine can do); the peers' figures are medians over
their rounds, and only a ``peers.py`` run with the same concurrency, prompt and output lengths
and no ``--hog`` is read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import model_folder


def _best_s(fn, repeat: int) -> float:
    # The fastest of ``repeat`` runs: a lower bound wants what the machine can do, not its noise.
    fn()  # warm: oneDNN builds its kernels on the first call of a shape
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_seconds(model, lm_weight, rows: int, lm_rows: int, repeat: int) -> float:
    """Seconds for one pass of every linear layer at ``rows`` rows plus the LM head at ``lm_rows``."""
    import torch
    from torch import nn

    from rill.models.packed import linear

    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.weight is not lm_weight]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    head_in = torch.randn(lm_rows, lm_weight.shape[1], dtype=lm_weight.dtype)

    def run() -> None:
        with torch.inference_mode():
            for w in weights:
                linear(inputs[w.shape[1]], w)
            linear(head_in, lm_weight)

    return _best_s(run, repeat)


def read_speed(repeat: int) -> tuple[float, float, float]:
    """Bytes per second this machine reads: ``(read_bps, sum_bps, copy_bps)``.

    ``sum_bps`` is a read-only pass (a float32 sum over 256 MiB); ``copy_bps`` counts a 256 MiB
    copy's bytes read plus written (a write may cost a read too, so it can undercount);
    ``read_bps`` is the faster of the two.
    """
    import torch

    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    size = src.numel() * 4
    sum_bps = size / _best_s(lambda: src.sum(), repeat)
    copy_bps = 2 * size / _best_s(lambda: dst.copy_(src), repeat)
    return max(sum_bps, copy_bps), sum_bps, copy_bps


def bound(
    folder: Path,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    repeat: int,
    read_bps: float,
    dtype: str = "bfloat16",
) -> dict:
    """The wave's lower bound for the model in ``folder`` in ``dtype`` (see the module
    docstring), with memory read at ``read_bps`` bytes per second."""
    from rill.engine.runner import TorchModelRunner
    from rill.models import load_model

    loaded = load_model(folder, dtype=dtype)
    runner = TorchModelRunner(loaded, num_rows=1, max_len=16)  # packs the weights as serving does
    model, config = runner.model, loaded.config
    lm_weight = model.lm_weight()
    prefill_s = gemm_seconds(model, lm_weight, concurrency * prompt_tokens, concurrency, max(3, repeat // 4))
    decode_gemm_s = gemm_seconds(model, lm_weight, concurrency, concurrency, repeat)
    decode_steps = max_tokens - 1
    # Keys and values each decode step reads: every row holds its prompt and the tokens so far.
    mean_len = prompt_tokens + (max_tokens + 1) / 2
    kv_bytes_per_step = concurrency * mean_len * config.kv_bytes_per_token()
    attention_floor_s = kv_bytes_per_step / read_bps
    gemm_s = prefill_s + decode_steps * decode_gemm_s
    wave_s = gemm_s + decode_steps * attention_floor_s
    return {
        "model": folder.name,
        "dtype": loaded.config.dtype,
        "concurrency": concurrency,
        "prefill_gemm_s": prefill_s,
        "decode_gemm_ms": decode_gemm_s * 1e3,
        "read_gb_s": read_bps / 1e9,
        "kv_mb_per_step": kv_bytes_per_step / 1e6,
        "attention_floor_ms": attention_floor_s * 1e3,
        "gemm_ceiling_tok_s": concurrency * max_tokens / gemm_s,
        "wave_s": wave_s,
        "ceiling_tok_s": concurrency * max_tokens / wave_s,
    }


def peer_figures(
    path: Path | None, folder: Path, concurrency: int, prompt_tokens: int, max_tokens: int, dtype: str = "bfloat16"
) -> dict[str, float]:
    """Each system's median tokens/s over the rounds at ``concurrency`` for the model in
    ``folder``, from a ``peers.py`` JSON file (empty without one).

    Raises:
        SystemExit: the file's run had another load (prompt or output length, ``--hog``) or dtype.
    """
    if path is None:
        return {}
    document = json.loads(path.read_text())
    run = document.get("args", {})
    theirs = (run.get("prompt_tokens"), run.get("max_tokens"), bool(run.get("hog")), run.get("dtype", "bfloat16"))
    ours = (prompt_tokens, max_tokens, False, dtype)
    if theirs != ours:
        raise SystemExit(
            f"{path} was measured with prompt_tokens, max_tokens, hog, dtype = {theirs}, not "
            f"{ours}: its figures are not of this bound's load"
        )
    found: dict[str, float] = {}
    for entry in document["models"].values():
        if Path(entry["folder"]).resolve() != folder.resolve():
            continue
        for system, by_level in entry["results"].items():
            rounds = [r["summary"]["output_tokens_per_s"] for r in by_level.get(str(concurrency), [])]
            if rounds:
                found[system] = statistics.median(rounds)
    return found


def main(argv: list[str] | None = None) -> int:
    """Print the bound per model, and the peers' figures beside it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,100m", help="comma list of smollm2, 100m or model folders")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--dtype", default="bfloat16", help="bfloat16 (peers.py's), float32, or auto (rill serve's choice)"
    )
    parser.add_argument("--peers-json", type=Path, default=None, help="peers.py's peers.json, for the peers' figures")
    args = parser.parse_args(argv)
    # Once for all models, before any is loaded: this machine's bandwidth varies with its neighbours.
    from rill.models.loader import auto_dtype

    print("--dtype auto here: {}, because {}".format(*auto_dtype("cpu")))
    read_bps, sum_bps, copy_bps = read_speed(2 * args.repeat)
    print(
        f"memory read speed {read_bps / 1e9:.1f} GB/s (read-only sum {sum_bps / 1e9:.1f}, "
        f"copy read + write {copy_bps / 1e9:.1f})"
    )
    for name in args.models.split(","):
        folder = model_folder(name.strip())
        b = bound(folder, args.concurrency, args.prompt_tokens, args.max_tokens, args.repeat, read_bps, args.dtype)
        print(
            f"{b['model']} ({b['dtype']}), c={b['concurrency']}, {args.prompt_tokens}-token prompts, "
            f"{args.max_tokens} new tokens:"
        )
        print(f"  prefill GEMMs        {b['prefill_gemm_s']:.2f} s")
        print(f"  decode GEMMs         {b['decode_gemm_ms']:.1f} ms per step x {args.max_tokens - 1} steps")
        print(f"  GEMMs alone          at most {b['gemm_ceiling_tok_s']:.0f} tok/s")
        print(
            f"  decode KV reads      {b['kv_mb_per_step']:.0f} MB per step at {b['read_gb_s']:.1f} GB/s: "
            f">= {b['attention_floor_ms']:.1f} ms per step"
        )
        print(f"  wave, all else free  >= {b['wave_s']:.2f} s: at most {b['ceiling_tok_s']:.0f} tok/s")
        figures = peer_figures(
            args.peers_json, folder, args.concurrency, args.prompt_tokens, args.max_tokens, b["dtype"]
        )
        for system, tok_s in sorted(figures.items()):
            print(f"  {system:<14} measured {tok_s:7.1f} tok/s; the ceiling is {b['ceiling_tok_s'] / tok_s:.2f}x it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
