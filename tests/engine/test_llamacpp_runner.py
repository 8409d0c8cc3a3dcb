"""``--runner llamacpp``: rill's engine over llama.cpp on the default SmolLM2 Q4_1 GGUF.

Parity: greedy tokens equal llama.cpp's own greedy decode (``llama_cpp.Llama``, temperature 0)
on the same file. Then the runner's contract as the engine uses it: a batch of requests gives
each the tokens it gets alone, a finished or aborted request's sequence is reused by the next,
a prefix copied by ``llama_memory_seq_cp`` continues like a recomputed one, ``all_logits``
chunks give every position's logits. And ``rill serve --runner llamacpp`` answers a chat.

Skipped (with the reason) where the ``llamacpp`` extra is not installed; the configuration
errors are checked everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from rill.config import load
from rill.engine.batch import RowWork
from rill.engine.request import AbortCommand, AddCommand
from rill.errors import ConfigError, ModelLoadError
from tests.conftest import free_port
from tests.engine.fake_core import Result, make_request, run, step

try:
    import llama_cpp  # noqa: F401 - only whether it imports
except ImportError as exc:  # the reason is shown by pytest -rs
    needs_llama_cpp = pytest.mark.skip(
        reason=f"the llamacpp extra is not installed ({exc}): pip install 'rill[llamacpp]'"
    )
else:
    needs_llama_cpp = pytest.mark.skipif(False, reason="")

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
]
NUM_TOKENS = 24
NEAR_TIE = 0.1
"""Largest logit gap (to the best token) at which a greedy choice may flip between batchings."""
THREADS = 1  # the machine is shared; one thread is also llama.cpp's most reproducible setting


@pytest.fixture(scope="module")
def gguf() -> Path:
    from rill.models.default import default_gguf_path

    return default_gguf_path()


def _engine(gguf: Path, num_rows: int = 8, max_len: int = 512, max_num_seqs: int = 8, **engine: Any) -> Any:
    from rill.engine.builder import build_engine

    config = load(
        {
            "engine.model": str(gguf),
            "engine.runner": "llamacpp",
            "engine.num_threads": THREADS,
            "engine.max_model_len": max_len,
            "engine.max_num_seqs": max_num_seqs,
            "engine.kv_cache_memory": str(num_rows * max_len * 30 * 2 * 192 * 2),
            **{f"engine.{k}": v for k, v in engine.items()},
        },
        env={},
    ).engine
    built = build_engine(config)
    assert built.runner.num_rows == num_rows, "the KV budget above is meant to give exactly num_rows rows"
    return built


@pytest.fixture(scope="module")
def engine(gguf: Path) -> Any:
    built = _engine(gguf)
    yield built
    built.runner.close()


@needs_llama_cpp
def test_the_engine_describes_the_quantized_model(engine: Any) -> None:
    info = engine.model_info
    assert (info.architecture, info.quantization, info.dtype, info.vocab_size) == (
        "LlamaForCausalLM",
        "Q4_1",
        "float32",
        49152,
    )
    assert info.has_chat_template and engine.runner.vocab_size == 49152


@needs_llama_cpp
def test_without_a_model_the_default_gguf_is_served_under_its_name() -> None:
    from rill.engine.builder import build_engine
    from rill.models.default import DEFAULT_MODEL_NAME

    config = load(
        {
            "engine.runner": "llamacpp",
            "engine.num_threads": THREADS,
            "engine.max_model_len": 64,
            "engine.kv_cache_memory": "16MiB",
        },
        env={},
    ).engine
    built = build_engine(config)
    try:
        assert built.model_info.name == DEFAULT_MODEL_NAME and built.model_info.quantization == "Q4_1"
    finally:
        built.runner.close()


def _greedy(engine: Any, prompts: list[list[int]], **params: Any) -> dict[str, Result]:
    requests = [
        make_request(engine, f"r{i}", ids, temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, **params)
        for i, ids in enumerate(prompts)
    ]
    return run(engine, requests)


def _encode(engine: Any, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


# -- configuration (no llama_cpp needed) ---------------------------------------------------------
def test_the_runner_flag_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="runner must be torch or llamacpp, not 'onnx'"):
        load({"engine.runner": "onnx"}, env={})
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for model in (str(folder), "demo", str(tmp_path / "model.safetensors")):
        with pytest.raises(ConfigError, match="--runner llamacpp needs a .gguf --model"):
            load({"engine.runner": "llamacpp", "engine.model": model}, env={})
    with pytest.raises(ConfigError, match="CPU only"):
        load({"engine.runner": "llamacpp", "engine.device": "cuda"}, env={})
    assert (
        load({"engine.runner": "llamacpp", "engine.model": str(tmp_path / "x.gguf")}, env={}).engine.runner
        == "llamacpp"
    )
    assert load({}, env={}).engine.runner == "torch"


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from rill.engine.llamacpp_runner import import_llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an uninstalled package looks like to import
    with pytest.raises(ModelLoadError, match=r"pip install 'rill\[llamacpp\]'"):
        import_llama_cpp()


# -- parity --------------------------------------------------------------------------------------
PARITY_TIE = 0.01
"""Largest logit gap at which rill's greedy tokens may part from llama.cpp's own: float32 sums
in another order. On an AVX2-only host one of the four prompts parted at a gap of 0.0006."""


@needs_llama_cpp
def test_greedy_tokens_equal_llama_cpp_own_greedy_decode(engine: Any, gguf: Path, reference_runner: Any) -> None:
    """Equal tokens, or a parting where the two tokens' logits are within ``PARITY_TIE``; at
    most one prompt may part."""
    from llama_cpp import Llama

    reference = Llama(
        model_path=str(gguf), n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, flash_attn=True
    )
    same = []
    try:
        for text in PROMPTS:
            ids = _encode(engine, text)
            assert ids == reference.tokenize(text.encode(), add_bos=True, special=False), text  # same tokenizer
            reference.reset()
            expected = []
            for token in reference.generate(ids, temp=0.0, top_k=1, reset=True):
                expected.append(token)
                if len(expected) == NUM_TOKENS:
                    break
            got = _greedy(engine, [ids])["r0"].token_ids
            same.append(_assert_same_or_near_tie(reference_runner, ids, expected, got, tie=PARITY_TIE))
    finally:
        reference.close()
    assert sum(same) >= len(PROMPTS) - 1, "more than one prompt parted from llama.cpp's own greedy tokens"


def _assert_same_or_near_tie(
    reference: Any, prompt: list[int], expected: list[int], got: list[int], tie: float = NEAR_TIE
) -> bool:
    """``got`` equals ``expected``, or they part at a near-tie of the two tokens; True when equal.

    llama.cpp is not bitwise batch-invariant: in its unified KV cache a row's cells sit wherever
    free cells were when they were written, and flash attention sums over cells in cell order,
    so the same history can give logits that differ in the last bits. Greedy decoding then
    flips only where two tokens are within that noise. Checked against ``reference`` (a fresh
    runner): after the shared history both tokens must be within ``tie`` of the best logit.
    """
    if got == expected:
        return True
    k = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    logits = reference.forward([RowWork(row=0, token_ids=prompt + expected[:k], start=0)])[0]
    best = float(logits.max())
    gaps = best - float(logits[expected[k]]), best - float(logits[got[k]])
    assert max(gaps) < tie, f"tokens part at {k} where the logits are not a near-tie: gaps {gaps}"
    return False


@pytest.fixture(scope="module")
def reference_runner(gguf: Path) -> Any:
    """A fresh llama.cpp runner that recomputes a history in one prefill (for near-tie checks)."""
    from rill.engine.llamacpp_runner import LlamaCppRunner

    runner = LlamaCppRunner(gguf, num_rows=1, max_len=512, num_threads=THREADS)
    yield runner
    runner.close()


@needs_llama_cpp
def test_a_batch_gives_each_request_its_tokens_alone(engine: Any, reference_runner: Any) -> None:
    prompts = [_encode(engine, text) for text in PROMPTS]
    for _ in range(2):  # the second round runs on rows (and KV cells) the first one left behind
        alone = [_greedy(engine, [ids])["r0"].token_ids for ids in prompts]
        together = _greedy(engine, prompts)
        same = [
            _assert_same_or_near_tie(reference_runner, prompts[i], alone[i], together[f"r{i}"].token_ids)
            for i in range(len(prompts))
        ]
        assert sum(same) >= len(prompts) - 1, "more than one near-tie flip in a few short greedy runs"


@needs_llama_cpp
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_kv_bytes_per_token_follow_the_file_s_head_width(arch: str, tmp_path: Path) -> None:
    """Heads 32 wide where hidden / heads is 16: the runner's KV accounting (memory gauges,
    ``kv_capacity_bytes``) equals what the builder sized the cache by."""
    from rill.engine.llamacpp_runner import LlamaCppRunner
    from rill.models.gguf_loader import read_gguf
    from rill.models.registry import parse_config
    from rill.testing.checkpoints import make_checkpoint
    from rill.testing.gguf_files import write_gguf

    folder = make_checkpoint(
        tmp_path / arch,
        arch=arch,
        head_dim=32,
        num_kv_heads=1,
        extra_config={"query_pre_attn_scalar": 32} if arch == "gemma3" else None,
    )
    file = write_gguf(folder, tmp_path / f"{arch}.gguf", "F32")
    checkpoint = read_gguf(file)
    expected = parse_config(checkpoint.hf_config, checkpoint.generation_config).kv_bytes_per_token(torch.float16)
    assert expected == 2 * 2 * 1 * 32 * 2  # layers x (keys, values) x kv heads x head width x F16
    runner = LlamaCppRunner(file, num_rows=2, max_len=64, num_threads=THREADS)
    try:
        assert runner.kv_bytes_per_token == expected
        assert runner.kv_capacity_bytes == expected * 2 * 64
    finally:
        runner.close()


@needs_llama_cpp
def test_the_thread_governor_steers_llama_cpp_threads(gguf: Path) -> None:
    """The count the governor sets is the one llama.cpp runs the next step on; the engine gets
    a governor unless the count is fixed (the engine core calls it around every step)."""
    from rill.engine.llamacpp_runner import LlamaCppRunner
    from rill.engine.threads import default_choice

    runner = LlamaCppRunner(gguf, num_rows=1, max_len=64, num_threads=2)
    try:
        assert runner.threads_in_use == 2
        runner.forward([RowWork(row=0, token_ids=[1, 2, 3], start=0)])
        runner.set_num_threads(1)
        assert runner.threads_in_use == 1
        runner.forward([RowWork(row=0, token_ids=[4], start=3)])
        with pytest.raises(ValueError):
            runner.set_num_threads(0)
    finally:
        runner.close()
    fixed = _engine(gguf, num_rows=1, max_num_seqs=1)  # --num-threads given: no governor
    chosen = _engine(gguf, num_rows=1, max_num_seqs=1, num_threads=None)
    try:
        assert fixed.core.thread_governor is None
        assert (chosen.core.thread_governor is not None) == (default_choice(None).num_threads >= 2)
        if chosen.core.thread_governor is not None:
            chosen.core.thread_governor._set_threads(1)  # the setter is the runner's (the engine is closed next)
            assert chosen.runner.threads_in_use == 1
    finally:
        fixed.runner.close()
        chosen.runner.close()


@needs_llama_cpp
def test_finished_and_aborted_sequences_are_reused(gguf: Path) -> None:
    # Two rows of 96 tokens: the context holds 192 cells, so unless every reuse of a row first
    # drops its old cells, the third request finds no KV slot (llama_decode fails).
    engine = _engine(gguf, num_rows=2, max_len=96, max_num_seqs=2)
    try:
        runner = engine.runner
        ids = [_encode(engine, text) for text in PROMPTS]
        reference = _greedy(engine, [ids[0]])["r0"].token_ids
        for round_ in range(3):
            results: dict[str, Result] = {}
            victim = make_request(engine, f"abort{round_}", ids[3], temperature=0.0, max_tokens=60, ignore_eos=True)
            engine.core.apply(AddCommand(victim))
            while len(results.get(victim.request_id, Result()).token_ids) < 5:
                step(engine, results)
            engine.core.apply(AbortCommand(victim.request_id))
            step(engine, results)
            assert results[victim.request_id].finish_reason == "cancelled"
            done = _greedy(engine, [ids[1], ids[2] + ids[1]])
            assert all(r.finish_reason == "length" for r in done.values())
            assert _greedy(engine, [ids[0]])["r0"].token_ids == reference
        rows = {row: runner.row_length(row) for row in range(runner.num_rows)}
        assert all(0 < n <= runner.max_len for n in rows.values()), rows
    finally:
        engine.runner.close()


@needs_llama_cpp
def test_a_copied_prefix_continues_like_a_computed_one(engine: Any, gguf: Path, reference_runner: Any) -> None:
    shared = _encode(engine, PROMPTS[3])
    first, second = shared + _encode(engine, " big")[1:], shared + _encode(engine, " tall")[1:]
    copies: list[tuple[int, int, int]] = []
    real_copy = engine.runner.copy_row

    def record(src: int, dst: int, num_tokens: int) -> None:
        copies.append((src, dst, num_tokens))
        real_copy(src, dst, num_tokens)

    engine.core.scheduler.copy_row = record
    try:
        _greedy(engine, [first])
        reused = _greedy(engine, [second])["r0"]
    finally:
        engine.core.scheduler.copy_row = real_copy
    assert copies and copies[-1][2] >= len(shared) - 1, copies
    assert reused.usage.cached_tokens >= len(shared) - 1
    fresh = _engine(gguf)
    try:
        _assert_same_or_near_tie(reference_runner, second, _greedy(fresh, [second])["r0"].token_ids, reused.token_ids)
    finally:
        fresh.runner.close()


@needs_llama_cpp
def test_all_logits_chunks_give_every_position(engine: Any) -> None:
    runner = engine.runner
    prompt = _encode(engine, PROMPTS[3])[:20]
    rows = runner.forward([RowWork(row=0, token_ids=prompt, start=0, all_logits=True)])
    assert rows.shape == (len(prompt), runner.vocab_size) and rows.dtype == torch.float32
    for n in (1, 7, 20):
        alone = runner.forward([RowWork(row=1, token_ids=prompt[:n], start=0)])
        torch.testing.assert_close(rows[n - 1], alone[0], atol=2e-3, rtol=0)
        assert int(rows[n - 1].argmax()) == int(alone[0].argmax())
    assert np.isfinite(rows.numpy()).all()


@needs_llama_cpp
def test_copy_row_copies_a_prefix_and_leaves_the_source_alone(gguf: Path) -> None:
    from rill.engine.llamacpp_runner import LlamaCppRunner

    runner = LlamaCppRunner(gguf, num_rows=4, max_len=64, num_threads=THREADS)
    try:
        prompt = list(range(1000, 1020))
        full = runner.forward([RowWork(row=0, token_ids=prompt, start=0)])[0]
        runner.copy_row(0, 3, 12)
        assert (runner.row_length(0), runner.row_length(3)) == (20, 12)
        resumed = runner.forward([RowWork(row=3, token_ids=prompt[12:], start=12)])[0]
        torch.testing.assert_close(resumed, full, atol=2e-2, rtol=0)
        # A fork that diverges writes over its copy only: the source continues as before.
        runner.forward([RowWork(row=3, token_ids=[7, 8, 9], start=12)])
        again = runner.forward([RowWork(row=0, token_ids=prompt[19:], start=19)])[0]
        torch.testing.assert_close(again, full, atol=2e-2, rtol=0)
        # A step llama.cpp refuses (a token outside the vocabulary) leaves every row as it was.
        with pytest.raises(RuntimeError, match="llama_decode failed"):
            runner.forward([RowWork(row=0, token_ids=[5], start=20), RowWork(row=1, token_ids=[10**7], start=0)])
        assert (runner.row_length(0), runner.row_length(1)) == (20, 0)
        torch.testing.assert_close(
            runner.forward([RowWork(row=0, token_ids=prompt[19:], start=19)])[0], full, atol=2e-2, rtol=0
        )
        runner.copy_row(3, 3, 5)  # in place: keep 5 positions
        assert runner.row_length(3) == 5
        with pytest.raises(ValueError, match="row 3 holds 5 tokens; cannot copy 6"):
            runner.copy_row(3, 1, 6)
        with pytest.raises(ValueError, match="would leave a gap"):
            runner.forward([RowWork(row=3, token_ids=[1], start=6)])
    finally:
        runner.close()


@needs_llama_cpp
def test_beam_search_runs_on_llama_cpp(engine: Any) -> None:
    ids = _encode(engine, PROMPTS[0])
    beams = run(engine, [make_request(engine, "b", ids, num_beams=3, max_tokens=8, temperature=0.0)])["b"]
    assert beams.error is None and beams.finish_reason in ("length", "stop") and beams.token_ids, beams


@needs_llama_cpp
def test_prompt_logprobs_work_on_llama_cpp(engine: Any) -> None:
    ids = _encode(engine, PROMPTS[0])
    requests = [make_request(engine, "p", ids, temperature=0.0, max_tokens=2, prompt_logprobs=1)]
    results: dict[str, Result] = {r.request_id: Result() for r in requests}
    engine.core.apply(AddCommand(requests[0]))
    scored = None
    while engine.core.has_work():
        for out in step(engine, results):
            scored = out.prompt_logprobs or scored
    assert scored is not None and scored[0] is None and len(scored) == len(ids)
    assert all(entry is not None and entry.logprob <= 0.0 for entry in scored[1:])


def _llama_cpp_greedy_text(gguf: Path, messages: list[dict], max_tokens: int) -> str:
    """What llama.cpp's own greedy decode answers to ``messages`` (rendered by rill's template)."""
    from llama_cpp import Llama

    from rill.models.gguf_loader import read_gguf

    tokenizer = read_gguf(gguf).tokenizer()
    reference = Llama(
        model_path=str(gguf), n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, flash_attn=True
    )
    try:
        tokens: list[int] = []
        for token in reference.generate(tokenizer.encode_chat(messages), temp=0.0, top_k=1, reset=True):
            if token in tokenizer.eos_token_ids or len(tokens) == max_tokens:
                break
            tokens.append(token)
    finally:
        reference.close()
    return tokenizer.decode(tokens)


# -- the server ------------------------------------------------------------------------------------
@needs_llama_cpp
def test_rill_serve_with_the_llamacpp_runner_answers_a_chat(gguf: Path, tmp_path: Path) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--model",
        str(gguf),
        "--runner",
        "llamacpp",
        "--num-threads",
        str(THREADS),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "256MiB",
        "--port",
        str(port),
        "--no-socket",
        "--grpc-port",
        "0",
        "--data-dir",
        str(tmp_path / "data"),
    ]
    server = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else "server exited"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        # Without a system message SmolLM2's template adds its own, after which the Q4_1 file
        # answers with French landmarks on llama.cpp (its own greedy decode too), not "Paris".
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        reply = httpx.post(
            f"{url}/v1/chat/completions", timeout=120, json={"messages": messages, "temperature": 0, "max_tokens": 32}
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        content = body["choices"][0]["message"]["content"]
        assert "Paris" in content, json.dumps(body)
        assert content == _llama_cpp_greedy_text(gguf, messages, 32)
        schema = {
            "type": "object",
            "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
            "required": ["capital"],
            "additionalProperties": False,
        }
        constrained = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=120,
            json={
                "messages": messages,
                "temperature": 0,
                "max_tokens": 32,
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            },
        )
        assert constrained.status_code == 200, constrained.text
        assert json.loads(constrained.json()["choices"][0]["message"]["content"]) == {"capital": "Paris"}
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == gguf.stem
    finally:
        server.terminate()
        server.wait(30)
