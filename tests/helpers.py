"""Helpers shared by several test files: an ASGI app on a loopback port, bounded polling, WebSocket reads,
the speculative-decoding check every protocol runs, ``rill serve`` as a process of its own.

Import as ``from tests.helpers import ...`` (like ``tests.conftest``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn

RECV_LIMIT_S = 60
"""How long ``recv_json`` waits: a hang fails the test instead of blocking the run; never a pass condition."""


async def start_uvicorn(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve ``app`` with uvicorn on ``127.0.0.1`` at a free port; return once it listens.

    Returns:
        The server (its port: ``port_of(server)``) and the task running it; stop both with
        ``stop_uvicorn``. A server that fails to start raises here instead of hanging.
    """
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:  # polls a condition, bounded by the task failing
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    return server, task


def port_of(server: uvicorn.Server) -> int:
    """The port a started server listens on."""
    return server.servers[0].sockets[0].getsockname()[1]


async def stop_uvicorn(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Ask ``server`` to exit and wait until it has."""
    server.should_exit = True
    await task


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    """``async with serving(app) as port:`` — ``app`` on a loopback port for the block's duration."""
    server, task = await start_uvicorn(app)
    try:
        yield port_of(server)
    finally:
        await stop_uvicorn(server, task)


async def wait_until(predicate: Callable[[], Any], *, attempts: int, interval_s: float) -> None:
    """Poll ``predicate`` until it is true; fail the test if it never is.

    A bounded wait for a server-side effect (engine state, an abort reaching a fake), not a
    timing assertion: ``attempts`` checks, ``interval_s`` apart.

    Raises:
        AssertionError: ``predicate`` stayed false for all ``attempts``.
    """
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(interval_s)
    raise AssertionError("condition never held")


async def recv_json(ws: Any) -> Any:
    """The next message of a ``websockets`` client connection, parsed as JSON.

    Raises:
        TimeoutError: nothing came within ``RECV_LIMIT_S`` (a missing message fails the test).
    """
    return json.loads(await asyncio.wait_for(ws.recv(), RECV_LIMIT_S))


SPEC_PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
"""A prompt that repeats itself: random-init models then loop, so prompt lookup's drafts get accepted."""


async def same_output_with_and_without_speculation(server: Any, run: Callable[[bool | None], Awaitable[Any]]) -> Any:
    """Run one greedy request twice on a speculating ``server``: ``run(None)`` leaves the wire's
    ``speculative`` field out (the server's default: on), ``run(False)`` sends ``false``.

    ``run`` returns what the client saw (token ids, text); it must be equal both times. Engine
    counters prove speculation happened: draft tokens were accepted during the first run, and
    none was drafted during the second. Returns the first run's output.
    """
    before = server.wait_idle()
    speculated = await run(None)
    between = server.wait_idle()
    plain = await run(False)
    after = server.wait_idle()
    assert speculated == plain
    assert between.spec_accepted_tokens_total > before.spec_accepted_tokens_total, "no draft token was accepted"
    assert after.spec_draft_tokens_total == between.spec_draft_tokens_total, "drafted with speculative: false"
    assert after.spec_accepted_tokens_total == between.spec_accepted_tokens_total
    return speculated


def speculative_field(value: bool | int | None) -> dict[str, Any]:
    """``{"speculative": value}`` for a JSON body, or ``{}`` for None (the field left out)."""
    return {} if value is None else {"speculative": value}


def limit(client: Any, limits: Any, clock: Callable[[], float] | None = None) -> None:
    """Rate-limit ``client``'s requests by ``limits`` (a ``RateLimits``) from now on, on
    ``clock`` (a test's clock, often one that stands still): its submission policy's limiter
    replaced, as a server built with those limits would have it."""
    import time

    from rill.frontend.ratelimit import LocalLimiter, RateLimiter

    client.policy.limiter = LocalLimiter(RateLimiter(limits, clock or time.monotonic)) if limits.is_on else None


def embedding_texts() -> list[str]:
    """100 varied texts for embedding parity, each well under all-MiniLM-L6-v2's 256 tokens:
    sentences and fragments, questions, numbers, code, markup, accents, CJK, emoji, odd spacing,
    one word, the empty string and a long paragraph."""
    import random

    from rill.testing.checkpoints import generate_text

    fixed = [
        "",
        "a",
        "Hello, world!",
        "What is the capital of France?",
        "Paris is the capital and most populous city of France.",
        "The mitochondria is the powerhouse of the cell.",
        "def add(a, b):\n    return a + b",
        "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
        "<html><body><p class='x'>Some <b>bold</b> text</p></body></html>",
        '{"key": [1, 2, 3], "nested": {"a": null}}',
        "Café, naïve, résumé, façade, jalapeño, Zürich, Ångström.",
        "東京は日本の首都です。",
        "Машинное обучение — это раздел искусственного интеллекта.",
        "مرحبا بالعالم",
        "I love pizza 🍕🍕 and tacos 🌮!",
        "   leading and trailing spaces   ",
        "tabs\tand\nnewlines\r\nmixed",
        "3.14159 2.71828 1.41421 6.02214076e23",
        "ALL CAPS SENTENCE ABOUT NOTHING IN PARTICULAR",
        "https://example.com/path?query=value&other=1#fragment",
        "e-mail me at someone@example.org, or call +1 (555) 010-9999",
        "The quick brown fox jumps over the lazy dog. " * 8,
        "Embeddings map text to vectors so that similar meanings lie close together.",
        "Retrieval-augmented generation looks up documents before answering.",
        "¿Dónde está la biblioteca? Está cerca del parque.",
        "Der schnelle braune Fuchs springt über den faulen Hund.",
    ]
    rng = random.Random(7)
    sentences = [s for line in generate_text(num_sentences=400, seed=3).splitlines() for s in line.split(". ")]
    generated = [" ".join(rng.sample(sentences, rng.randint(1, 6))) for _ in range(100 - len(fixed))]
    return fixed + generated


@contextlib.contextmanager
def rill_process(
    model_dir: Any, *args: str, ready_timeout_s: float = 90
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``with rill_process(model, *flags) as (proc, url):`` — ``rill serve`` as a process of its
    own (float32, a small KV cache, no Unix socket, no gRPC, a free port) until it answers
    ``/health`` with 200; killed at the end if it still runs. ``url`` is its HTTP base URL.

    Raises:
        AssertionError: the process exited first (with its stderr), or was not ready in
            ``ready_timeout_s`` (a start-up bound, never a pass condition).
    """
    import httpx

    from tests.conftest import free_port

    port = free_port()
    command = [sys.executable, "-m", "rill", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--no-socket", "--grpc-port", "0", "--dtype", "float32", "--kv-cache-memory", "64MiB"]
    command += ["--log-level", "warning", *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ | {"HF_HUB_OFFLINE": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:  # poll readiness (a start-up wait, not a timing assertion)
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
