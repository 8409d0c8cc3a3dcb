"""Peer comparison: rill against llama.cpp's ``llama-server`` and a transformers floor.

    .venv/bin/python benchmarks/compare.py [--model demo|tiny|100m|DIR] [--concurrency 1,8,32,64]
        [--max-tokens 64] [--prompt-len 64] [--threads 2] [--dtype auto|float32|bfloat16]
        [--peers llama.cpp,transformers] [--out DIR]

The same checkpoint is served, one server after the other in this run, by

* **rill** (``rill serve``, OpenAI API);
* **llama.cpp** ``llama-server`` with one slot per request of the largest concurrency
  (``-np``), continuous batching, per-sequence KV (``--no-kv-unified``, its fastest setting on
  this CPU, engine-notes §6), the same dtype (bf16 GGUF where the CPU has native bf16);
* **transformers** ``generate``, one request at a time (``benchmarks/hf_server.py``): the floor;

and each is driven by the same load generator (``rill.bench``, OpenAI driver, closed loop,
greedy, eos ignored) at each concurrency. Prints one table (tokens/s, TTFT and ITL
percentiles, errors) with the ratios rill / peer, and writes ``compare.png`` (tokens/s and
TTFT p99 against concurrency) and ``compare.json`` into ``--out``.

The llama.cpp peer is built on first use and cached in ``~/.cache/rill/peers`` (outside the
repository): the ``llama-cpp-python==0.3.36`` source distribution is fetched with pip, its
vendored llama.cpp is built with cmake (Release, no curl, ``llama-server`` target; about 4
minutes on 2 cores), and the checkpoint is converted with the converter that source ships
(a locally trained byte-level BPE tokenizer's unknown pre-tokenizer hash is mapped to
``gpt-2``). A peer that cannot be built, converted or started is skipped with a message and
shows as missing in the table: nothing is ever estimated in its place.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from rill.bench.drivers import BenchError, Options, Target
from rill.bench.runner import measure
from rill.bench.stats import Summary
from rill.bench.workload import synthetic_prompts

LLAMA_CPP_PYTHON = "0.3.36"
PEERS_DIR = Path(os.environ.get("RILL_CACHE_DIR", Path.home() / ".cache" / "rill")) / "peers"
HERE = Path(__file__).resolve().parent
ENGINES = ("rill", "llama.cpp", "transformers")


class PeerUnavailable(Exception):
    """A peer cannot be built, converted or started; the message says why."""


# --------------------------------------------------------------------------- llama.cpp build and conversion


def _run(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if result.returncode != 0:
        raise PeerUnavailable(f"{what} failed (exit {result.returncode}); see {log}")


def llama_source(cache: Path = PEERS_DIR) -> Path:
    """The vendored llama.cpp folder of the ``llama-cpp-python`` sdist (downloaded once)."""
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    source = folder / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        print(f"llama.cpp: downloading the llama-cpp-python=={LLAMA_CPP_PYTHON} source distribution ...", flush=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(cache),
            ],
            cache / "download.log",
            "pip download",
        )
    with tarfile.open(sdist) as archive:
        archive.extractall(cache, filter="data")
    if not (source / "CMakeLists.txt").exists():
        raise PeerUnavailable(f"{sdist} has no vendor/llama.cpp")
    return source


def ensure_llama_server(cache: Path = PEERS_DIR) -> Path:
    """``llama-server`` built from the vendored source (cached; about 4 minutes the first time)."""
    binary = cache / "llama-build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"{tool} is not installed: cannot build llama-server")
    source = llama_source(cache)
    build = cache / "llama-build"
    log = cache / "build.log"
    print(f"llama.cpp: building llama-server (about 4 minutes on 2 cores; log: {log}) ...", flush=True)
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
        "cmake configure",
    )
    _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{os.cpu_count() or 2}"], log, "cmake build")
    if not binary.exists():
        raise PeerUnavailable(f"the build finished but {binary} is missing; see {log}")
    return binary


# Runs in a child process: llama.cpp's converter with one patch. A tokenizer trained here has a
# pre-tokenizer hash the converter does not list; for a ByteLevel/GPT-2-regex tokenizer (the
# demo's and the test checkpoints') "gpt-2" is the right pre-tokenizer (engine-notes §6).
_CONVERT = r"""
import runpy, sys
source, model, out, outtype = sys.argv[1:5]
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        print("rill: unknown BPE pre-tokenizer hash, mapped to gpt-2 (byte-level BPE)", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def ensure_gguf(model_dir: Path, outtype: str, cache: Path = PEERS_DIR) -> Path:
    """``model_dir`` converted to GGUF (cached by the checkpoint's content and ``outtype``)."""
    try:
        import sentencepiece  # noqa: F401  (imported unconditionally by the converter)
    except ImportError as exc:
        raise PeerUnavailable("the GGUF converter needs sentencepiece: pip install -e '.[bench]'") from exc
    digest = hashlib.sha256()
    for name in sorted(p.name for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")):
        stat = (model_dir / name).stat()
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:12]}-{outtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: converting {model_dir} to GGUF ({outtype}) ...", flush=True)
    partial = out.with_suffix(".partial")
    _run(
        [sys.executable, "-c", _CONVERT, str(llama_source(cache)), str(model_dir), str(partial), outtype],
        cache / "convert.log",
        "GGUF conversion",
    )
    partial.rename(out)
    return out


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_servers_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` (from the main thread), so that a benchmark killed with
    it leaves its ``with Server(...)`` blocks and stops its servers: each runs in a process
    group of its own, which a signal to the benchmark never reaches."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))


class Server:
    """A server subprocess on loopback, stopped (terminate, then kill) on exit."""

    def __init__(
        self, name: str, cmd: list[str], port: int, log: Path, ready_path: str, env: dict | None = None
    ) -> None:
        self.name, self.cmd, self.port, self.log, self.ready_path = name, cmd, port, log, ready_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        _stop_servers_on_sigterm()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            # Its own process group, so pause/resume reach the workers a server spawns (vLLM's engine core).
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def pause(self) -> None:
        """Stop the whole process group (SIGSTOP), so an idle server takes no CPU from a measured one."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a paused process group (SIGCONT); harmless when it runs."""
        self._signal(signal.SIGCONT)

    def _signal(self, number: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, number)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``ready_path`` until it answers 200 (the model loaded) or fail."""
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}{self.ready_path}"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)  # polling a readiness condition with a deadline, not hiding a race
        raise PeerUnavailable(f"{self.name} not ready after {timeout_s:g} s; see {self.log}")

    def peak_rss_bytes(self) -> int | None:
        """Peak resident memory of the server process so far (Linux ``VmHWM``)."""
        if self.proc is None:
            return None
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def __exit__(self, *exc_info: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rill_server(model_dir: Path, port: int, args: argparse.Namespace, log: Path, max_seqs: int) -> Server:
    """``rill serve`` with only HTTP listening (no Unix socket, no gRPC)."""
    cmd = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--num-threads",
        str(args.threads),
        "--max-num-seqs",
        str(max_seqs),
        "--max-queue",
        "4096",
        "--max-model-len",
        str(args.context),
        "--no-socket",
        "--grpc-port",
        "0",
        "--log-level",
        "warning",
    ]
    return Server("rill", cmd, port, log, "/health")


def llama_server(binary: Path, gguf: Path, port: int, args: argparse.Namespace, log: Path, num_slots: int) -> Server:
    """``llama-server``: ``num_slots`` slots of ``--context`` tokens each, per-sequence KV."""
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(num_slots),
        "-c",
        str(num_slots * args.context),
        "--cont-batching",
        "--no-kv-unified",
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-ngl",
        "0",
        "--no-webui",
    ]
    return Server("llama.cpp", cmd, port, log, "/health")


def hf_server(model_dir: Path, port: int, args: argparse.Namespace, log: Path) -> Server:
    """The transformers floor (``benchmarks/hf_server.py``)."""
    cmd = [
        sys.executable,
        str(HERE / "hf_server.py"),
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
    ]
    return Server("transformers", cmd, port, log, "/health")


# --------------------------------------------------------------------------- measuring


def resolve_model(name: str) -> Path:
    """``demo`` (built on first use), ``tiny`` / ``100m`` (random-init, cached) or a folder."""
    if name == "demo":
        from rill.demo import ensure_demo_model

        return ensure_demo_model(progress=True)
    if name in ("tiny", "100m"):
        from rill.testing.checkpoints import make_checkpoint

        folder = PEERS_DIR.parent / "bench" / f"llama-{name}"
        if not (folder / "config.json").exists():
            make_checkpoint(folder, arch="llama", **({"preset": "100m"} if name == "100m" else {}))
        return folder
    return Path(name)


def resolve_dtype(dtype: str) -> str:
    """``auto``: bfloat16 where the CPU has native bf16 (avx512_bf16 / amx_bf16), else float32."""
    if dtype != "auto":
        return dtype
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text()
        if "avx512_bf16" in flags or "amx_bf16" in flags:
            return "bfloat16"
    return "float32"


def check_tokenizer(port: int, model_dir: Path) -> str | None:
    """Compare llama-server's tokenization with the checkpoint's; a message if they differ."""
    from tokenizers import Tokenizer

    text = 'Once upon a time, a little fox found 3 golden apples. "Why?" asked the owl — twice!'
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        theirs = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"content": text}, timeout=10).json()["tokens"]
        if theirs != reference:
            return f"llama.cpp tokenizes differently from the checkpoint ({len(theirs)} vs {len(reference)} tokens)"
        return None
    return "could not check llama.cpp's tokenizer"


def num_requests_for(engine: str, concurrency: int, args: argparse.Namespace) -> int:
    """Requests per run: two waves of the concurrency (at least 8); the sequential floor gets
    at most ``--floor-requests`` (its rate does not depend on the load, only its queueing)."""
    n = max(2 * concurrency, 8)
    return min(n, args.floor_requests) if engine == "transformers" else n


async def run_levels(engine: str, port: int, args: argparse.Namespace, levels: list[int]) -> dict[int, Summary]:
    """Every concurrency against one running server (OpenAI API, closed loop)."""
    target, options = Target(port=port), Options(temperature=0.0, ignore_eos=True)
    results: dict[int, Summary] = {}
    for level in levels:
        # A seed per level: no prompt repeats between levels, so no prefix cache answers one.
        requests = synthetic_prompts(
            num_requests_for(engine, level, args), args.prompt_len, args.max_tokens, args.seed + level
        )
        summary, _ = await measure(
            "openai",
            target,
            options,
            requests,
            concurrency=level,
            num_warmup=1,
            request_timeout_s=args.max_duration_s,
            max_duration_s=args.max_duration_s,
            progress=sys.stderr.isatty(),
        )
        summary.extra = {"engine": engine, "num_requests": len(requests)}
        results[level] = summary
        print(
            f"  {engine:<13} N={level:<3} {summary.output_tokens_per_s:9.1f} tok/s  TTFT p99 "
            f"{summary.ttft.p99_ms:8.0f} ms  errors {summary.num_errors}",
            flush=True,
        )
    return results


def measure_engine(
    engine: str, args: argparse.Namespace, model_dir: Path, levels: list[int]
) -> tuple[dict[int, Summary], dict]:
    """Start one engine's server, run every level, stop it; returns figures and facts."""
    port = free_port()
    log = args.out / f"{engine}.log"
    facts: dict[str, Any] = {}
    if engine == "rill":
        server = rill_server(model_dir, port, args, log, max(levels))
    elif engine == "transformers":
        server = hf_server(model_dir, port, args, log)
    else:
        binary = ensure_llama_server()
        gguf = ensure_gguf(model_dir, {"bfloat16": "bf16", "float32": "f32"}[args.dtype])
        facts["gguf"] = str(gguf)
        server = llama_server(binary, gguf, port, args, log, max(levels))
    print(f"\n== {engine} (log: {log})", flush=True)
    with server:
        server.wait_ready(args.startup_timeout_s)
        if engine == "llama.cpp" and (problem := check_tokenizer(port, model_dir)):
            print(f"  warning: {problem}", flush=True)
            facts["tokenizer_warning"] = problem
        results = asyncio.run(run_levels(engine, port, args, levels))
        facts["peak_rss_bytes"] = server.peak_rss_bytes()
    return results, facts


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(results: dict[str, dict[int, Summary]], levels: list[int]) -> str:
    """One table: a row per engine and concurrency, then the ratios rill / peer."""
    lines = [
        (
            f"{'engine':<14}{'N':>4}{'tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
            f"{'ITL p99':>9}{'errors':>8}{'reqs':>6}   (latencies in ms)"
        )
    ]
    for level in levels:
        for engine in ENGINES:
            summary = results.get(engine, {}).get(level)
            if summary is None:
                lines.append(f"{engine:<14}{level:>4}{'missing':>10}")
                continue
            lines.append(
                f"{engine:<14}{level:>4}{_fmt(summary.output_tokens_per_s, '.1f'):>10}"
                f"{_fmt(summary.requests_per_s, '.2f'):>8}{_fmt(summary.ttft.p50_ms, '.0f'):>10}"
                f"{_fmt(summary.ttft.p99_ms, '.0f'):>10}{_fmt(summary.itl.p50_ms, '.1f'):>9}"
                f"{_fmt(summary.itl.p99_ms, '.1f'):>9}{summary.num_errors:>8}{summary.num_requests:>6}"
            )
    lines.append("")
    lines.append("ratios rill / peer: tokens/s (> 1: rill faster), TTFT p99 (< 1: rill sooner)")
    for level in levels:
        mine = results.get("rill", {}).get(level)
        parts = []
        for peer in ENGINES[1:]:
            theirs = results.get(peer, {}).get(level)
            if mine is None or theirs is None:
                parts.append(f"vs {peer}: missing")
                continue
            tps = mine.output_tokens_per_s / theirs.output_tokens_per_s if theirs.output_tokens_per_s else math.nan
            ttft = mine.ttft.p99_ms / theirs.ttft.p99_ms if theirs.ttft.p99_ms else math.nan
            capped = "*" if theirs.num_requests < mine.num_requests else ""
            parts.append(f"vs {peer}: tok/s {_fmt(tps, '.2f')}x, TTFT p99 {_fmt(ttft, '.2f')}x{capped}")
        lines.append(f"  N={level:<3} " + "   ".join(parts))
    if any("x*" in line for line in lines):
        lines.append(
            "  * the peer ran fewer requests than rill (--floor-requests): its TTFT under that load is understated"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[int, Summary]], levels: list[int], path: Path, title: str) -> bool:
    """tokens/s and TTFT p99 against concurrency, one line per engine (False without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: the plot is skipped (pip install -e '.[bench]')", flush=True)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for engine in ENGINES:
        runs = results.get(engine)
        if not runs:
            continue
        xs = [n for n in levels if n in runs]
        left.plot(xs, [runs[n].output_tokens_per_s for n in xs], marker="o", label=engine)
        right.plot(xs, [runs[n].ttft.p99_ms for n in xs], marker="o", label=engine)
    for ax, label in ((left, "output tokens/s"), (right, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


BENCH_TOOLS = {"matplotlib": "matplotlib==3.11.2", "sentencepiece": "sentencepiece==0.2.3"}
"""The ``bench`` extra of pyproject.toml (plot; llama.cpp's GGUF converter), by import name."""


def ensure_bench_tools() -> None:
    """Install the pinned ``bench`` extra into this environment when a piece is missing, so
    the comparison builds its own environment; a failed install is reported, not fatal (the
    plot or the llama.cpp peer is then skipped with a message)."""
    import importlib.util

    missing = [spec for name, spec in BENCH_TOOLS.items() if importlib.util.find_spec(name) is None]
    if missing:
        print(f"installing the benchmark tools: {' '.join(missing)}", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing], check=False)
        if done.returncode != 0:
            print("could not install them; the parts that need them are skipped", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run every engine, print the table, write the plot and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, tiny, 100m or a model folder (default: demo)")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=64, help="words per prompt (default: 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    parser.add_argument("--context", type=int, default=512, help="context per sequence/slot (default: 512)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads of every engine (default: 2)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--peers", default="llama.cpp,transformers", help="comma list of peers to run")
    parser.add_argument("--floor-requests", type=int, default=16, help="most requests per level for transformers")
    parser.add_argument("--max-duration-s", type=float, default=900.0, help="limit of each level's run")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the PNG, JSON and logs")
    args = parser.parse_args(argv)
    ensure_bench_tools()
    levels = [int(x) for x in args.concurrency.split(",")]
    args.dtype = resolve_dtype(args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(args.model)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in ENGINES[1:]]
    if unknown:
        parser.error(f"unknown peer(s): {', '.join(unknown)}")
    print(
        f"model {model_dir} ({args.dtype}), {args.threads} threads per engine, prompts of {args.prompt_len} words, "
        f"{args.max_tokens} tokens each, concurrency {levels}",
        flush=True,
    )
    results: dict[str, dict[int, Summary]] = {}
    facts: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for engine in ["rill", *peers]:
        try:
            results[engine], facts[engine] = measure_engine(engine, args, model_dir, levels)
        except (PeerUnavailable, BenchError) as exc:
            print(f"skipping {engine}: {exc}", flush=True)
            skipped[engine] = str(exc)
    print("\n" + table(results, levels))
    for engine, reason in skipped.items():
        print(f"{engine}: skipped ({reason})")
    png = args.out / "compare.png"
    if plot(
        results,
        levels,
        png,
        f"{model_dir.name}, {args.dtype}, {args.threads} threads, {args.max_tokens} tokens/request",
    ):
        print(f"plot written to {png}")
    document = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "threads": args.threads,
        "levels": levels,
        "prompt_len_words": args.prompt_len,
        "max_tokens": args.max_tokens,
        "facts": facts,
        "skipped": skipped,
        "results": {e: {str(n): msgspec.to_builtins(s) for n, s in runs.items()} for e, runs in results.items()},
    }
    (args.out / "compare.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"figures written to {args.out / 'compare.json'}")
    return 0 if "rill" in results else 1


if __name__ == "__main__":
    sys.exit(main())
