"""Bounded event-loop work per request (issue 31): grammar compiles, ``modify``, ``/detokenize``,
and a grammar that fails while sampling.

Over the FakeRunner engine (``fake_client``): the engine's gate holds a request running while
the test modifies it, and a compiler wrapped by the test blocks on an event the test sets, so
every ordering here is forced, never waited for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import llguidance
import pytest

from rill.engine.grammar import grammar_of
from rill.errors import ConstraintFailed, InvalidRequest, RateLimited, RequestNotFound
from rill.frontend.ratelimit import RateLimits
from rill.testing.fake_client import fake_client
from rill.types import GenerateRequest, ResponseFormat, SamplingParams
from tests.helpers import limit

WAIT_S = 30  # only reached if the code under test is broken


def regex(pattern: str) -> dict[str, Any]:
    """A ``modify`` patch that sets a regex constraint."""
    return {"response_format": {"type": "regex", "regex": pattern}}


class BlockingCompiler:
    """Wraps the engine's grammar compiler: records the thread of every ``matcher`` call and,
    while ``hold`` is set, blocks each call until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.threads: list[threading.Thread] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = True

    def matcher(self, fmt: ResponseFormat | None) -> Any:
        self.threads.append(threading.current_thread())
        self.entered.set()
        if self.hold:
            assert self.release.wait(WAIT_S), "the test never released the compile"
        return self.inner.matcher(fmt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def held_request(client: Any, principal: str = "key:a", **sampling: Any) -> Any:
    """A request the engine's gate keeps running until the test ends it."""
    client.engine.runner.gate = threading.Event()
    return await client.generate(
        GenerateRequest(
            prompt="hello", principal=principal, sampling=SamplingParams(max_tokens=50, ignore_eos=True, **sampling)
        )
    )


async def test_a_modify_compiles_its_grammar_off_the_event_loop() -> None:
    """Before, ``InprocClient.modify`` compiled on the loop: the loop could not even get to the
    line after ``create_task`` while the compile ran."""
    async with fake_client() as client:
        stream = await held_request(client)
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        loop_thread = threading.current_thread()
        task = asyncio.ensure_future(stream.modify(regex("(yes|no)!")))
        # The loop runs this while the compile is blocked in a worker.
        assert await asyncio.to_thread(compiler.entered.wait, WAIT_S)
        assert not task.done()
        compiler.release.set()
        params = await task
        assert params.response_format is not None and params.response_format.regex == "(yes|no)!"
        assert compiler.threads and loop_thread not in compiler.threads
        assert all(t.name.startswith("rill-grammar") for t in compiler.threads)
        await stream.aclose()


async def test_a_new_request_compiles_in_the_grammar_pool() -> None:
    async with fake_client() as client:
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        compiler.hold = False
        stream = await client.generate(
            GenerateRequest(
                prompt="hi",
                sampling=SamplingParams(max_tokens=4, response_format=ResponseFormat(type="regex", regex="[ab]{4}")),
            )
        )
        async with stream:
            async for _ in stream:
                pass
        assert [t.name.split("_")[0] for t in compiler.threads] == ["rill-grammar"]


async def test_modifies_of_one_request_apply_in_order() -> None:
    """A second modify sent while the first one's grammar compiles waits for it and patches
    what it left: the engine gets the constraint and then both changes."""
    async with fake_client() as client:
        stream = await held_request(client)
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        first = asyncio.ensure_future(stream.modify(regex("(yes|no)!")))
        assert await asyncio.to_thread(compiler.entered.wait, WAIT_S)
        second = asyncio.ensure_future(stream.modify({"temperature": 0.5}))
        await asyncio.sleep(0)  # the second reaches its turn's queue
        assert not second.done()
        compiler.release.set()
        one, two = await first, await second
        assert one.temperature != 0.5 and one.response_format is not None
        assert two.temperature == 0.5 and two.response_format == one.response_format
        assert stream.sampling == two
        await stream.aclose()


async def test_a_modify_whose_request_ends_during_its_compile_is_not_found() -> None:
    async with fake_client() as client:
        stream = await held_request(client)
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        task = asyncio.ensure_future(stream.modify(regex("(yes|no)!")))
        assert await asyncio.to_thread(compiler.entered.wait, WAIT_S)
        stream.abort()
        client.engine.runner.gate.set()
        async for output in stream:
            last = output
        assert last.finished and last.finish_reason == "cancelled"
        compiler.release.set()
        with pytest.raises(RequestNotFound):
            await task
        with pytest.raises(RequestNotFound):
            await stream.modify({"temperature": 0.5})


async def test_a_modify_compiling_a_new_grammar_counts_as_a_request() -> None:
    """Under ``--rate-limit-requests`` a compile-modify takes one request of the window; a
    format compiled before is only copied and costs nothing; once the window is full, a
    compile-modify is refused before compiling and nothing changes."""
    async with fake_client() as client:
        limit(client, RateLimits(requests=3, window_s=60.0), clock=lambda: 0.0)
        stream = await held_request(client)  # 1 of 3
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        compiler.hold = False
        await stream.modify(regex("a+"))  # 2 of 3
        await stream.modify(regex("b+"))  # 3 of 3
        compiles = len(compiler.threads)
        with pytest.raises(RateLimited) as refused:
            await stream.modify(regex("c+"))
        assert refused.value.retry_after_s == 60.0
        assert len(compiler.threads) == compiles  # refused before any compile
        assert stream.sampling.response_format.regex == "b+"  # nothing changed
        assert (await stream.modify(regex("a+"))).response_format.regex == "a+"  # cached: free
        assert (await stream.modify({"temperature": 0.3})).temperature == 0.3  # no compile: free
        with pytest.raises(RateLimited):
            await client.generate(GenerateRequest(prompt="x", principal="key:a"))
        await client.generate(GenerateRequest(prompt="x", principal="key:b"))  # another principal's window
        await stream.aclose()


async def test_a_constrained_request_over_the_limit_is_refused_before_its_compile() -> None:
    async with fake_client() as client:
        limit(client, RateLimits(requests=1, window_s=60.0), clock=lambda: 0.0)
        stream = await held_request(client)
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        compiler.hold = False
        with pytest.raises(RateLimited):
            await client.generate(
                GenerateRequest(
                    prompt="x",
                    principal="key:a",
                    sampling=SamplingParams(response_format=ResponseFormat(type="regex", regex="z+")),
                )
            )
        assert compiler.threads == []
        await stream.aclose()


async def test_a_format_compiled_before_waits_for_no_compile() -> None:
    """A cached format is copied at once: a principal's requests sharing one schema are not
    queued behind its compile of another."""
    async with fake_client() as client:
        shared = ResponseFormat(type="regex", regex="[ab]{3}")
        client.engine.grammars.matcher(shared)  # compiled before
        stream = await held_request(client)
        compiler = client.engine.grammars = BlockingCompiler(client.engine.grammars)
        modifying = asyncio.ensure_future(stream.modify(regex("(yes|no)!")))
        assert await asyncio.to_thread(compiler.entered.wait, WAIT_S)
        other = await asyncio.wait_for(
            client.generate(
                GenerateRequest(  # the bound only guards against a hang
                    prompt="x", principal="key:a", sampling=SamplingParams(max_tokens=3, response_format=shared)
                )
            ),
            WAIT_S,
        )
        assert not modifying.done() and len(compiler.threads) == 1  # the copy needed no compile
        compiler.release.set()
        await modifying
        await other.aclose()
        await stream.aclose()


async def test_one_compile_per_principal_at_a_time() -> None:
    """A principal's second compile starts only once its first has ended; another principal's
    runs meanwhile; no state is left once they end."""
    from rill.frontend.grammars import GrammarAdmission  # here: the rest of the file runs on older code too

    admission = GrammarAdmission(num_threads=3)
    started: list[str] = []
    gates = {name: threading.Event() for name in ("a1", "a2", "b1")}
    entered = {name: threading.Event() for name in gates}

    class Compiler:
        def matcher(self, fmt: Any) -> str:
            started.append(fmt)
            entered[fmt].set()
            assert gates[fmt].wait(WAIT_S)
            return fmt

        def is_cached(self, fmt: Any) -> bool:
            return False

        def cached(self, fmt: Any) -> None:
            return None

    try:
        a1 = asyncio.ensure_future(admission.matcher(Compiler(), "a1", "key:a"))
        a2 = asyncio.ensure_future(admission.matcher(Compiler(), "a2", "key:a"))
        b1 = asyncio.ensure_future(admission.matcher(Compiler(), "b1", "key:b"))
        assert await asyncio.to_thread(entered["a1"].wait, WAIT_S)
        assert await asyncio.to_thread(entered["b1"].wait, WAIT_S)
        assert "a2" not in started  # three threads, yet key:a's second waits for its first
        gates["b1"].set()
        assert await b1 == "b1"
        assert "a2" not in started
        gates["a1"].set()
        assert await a1 == "a1"
        assert await asyncio.to_thread(entered["a2"].wait, WAIT_S)
        gates["a2"].set()
        assert await a2 == "a2"
        assert admission.num_principals() == 0
    finally:
        for gate in gates.values():
            gate.set()
        admission.close()


# -- a grammar that compiles but cannot be followed while sampling ----------------------------

BIG_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string"} for i in range(200)},
    "required": [f"field_{i}" for i in range(200)],
}


def failing_matcher_factory(grammars: Any) -> Any:
    """``grammars.matcher`` made to return matchers over llguidance limits that fail at the
    first sampled token, with llguidance's verbose errors ON (the whole grammar in the
    message), so the test sees what the engine would have logged before."""

    def matcher(fmt: ResponseFormat | None) -> Any:
        return llguidance.LLMatcher(
            grammars.tokenizer,
            grammar_of(fmt),
            log_level=0,
            limits=llguidance.LLParserLimits(step_max_items=1, verbose_errors=True),
        )

    return matcher


@pytest.fixture
def failing_format() -> ResponseFormat:
    return ResponseFormat(type="json_schema", json_schema={"name": "big", "schema": BIG_SCHEMA})


async def test_a_grammar_failing_while_sampling_ends_its_request_with_constraint_failed(
    failing_format: ResponseFormat, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_client() as client:
        client.engine.grammars.matcher = failing_matcher_factory(client.engine.grammars)
        caplog.set_level(logging.INFO)
        stream = await client.generate(
            GenerateRequest(
                prompt="hi",
                request_id="bad-grammar",
                sampling=SamplingParams(max_tokens=20, response_format=failing_format),
            )
        )
        other = await client.generate(
            GenerateRequest(prompt="hi", sampling=SamplingParams(max_tokens=5, ignore_eos=True))
        )
        async with stream:
            outputs = [output async for output in stream]
        async with other:
            others = [output async for output in other]
    last = outputs[-1]
    assert last.finish_reason == "error"
    assert isinstance(last.error, ConstraintFailed) and last.error.field == "response_format"
    assert "Too many items" in last.error.message and len(last.error.message) <= 300
    assert others[-1].finish_reason == "length"  # the other request of the step is unaffected
    mentions = [r for r in caplog.records if "bad-grammar" in r.getMessage()]
    assert len(mentions) == 1  # once, not per step
    record = mentions[0]
    assert record.exc_info is None and len(record.getMessage()) <= 400
    assert "field_199" not in caplog.text  # no grammar text in the log


# -- /detokenize ---------------------------------------------------------------------------------


class ThreadRecordingIds(list):  # type: ignore[type-arg]
    """Token ids that record which threads walk them."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.threads: set[threading.Thread] = set()

    def __iter__(self) -> Iterator[int]:
        self.threads.add(threading.current_thread())
        return super().__iter__()


async def test_detokenize_checks_and_decodes_the_ids_off_the_event_loop() -> None:
    """Before, the ids were copied and checked on the loop (``check_size([list(ids)])`` and
    ``_checked_ids``), 20 ms for 585k ids, and decoded with a call that holds the GIL."""
    async with fake_client() as client:
        plain = [40] * 1000 + [41]
        ids = ThreadRecordingIds(plain)
        text = await client.detokenize(ids)
        assert text == client.engine.tokenizer.decode(plain, skip_special_tokens=False)
        assert ids.threads and threading.current_thread() not in ids.threads
        bad = ThreadRecordingIds([40] * 1000 + [10**9])
        with pytest.raises(InvalidRequest) as refused:
            await client.detokenize(bad)
        assert refused.value.field == "tokens" and str(10**9) in refused.value.message
        assert bad.threads and threading.current_thread() not in bad.threads
