"""A long prompt is prefilled in chunks while running streams keep producing a token every step."""

from __future__ import annotations

import random
import time

import pytest

from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import AbortCommand, AddCommand, Request
from rill.types import SamplingParams


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A tiny model whose context holds a 4k-token prompt."""
    from rill.testing.checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path_factory.mktemp("long") / "tiny-long", arch="llama", max_position_embeddings=4608)
    return build_engine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            kv_cache_memory="64MiB",
            max_model_len=4608,
            max_num_seqs=8,
            max_num_batched_tokens=2048,
        )
    )


def _request(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_ids=ids,
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=engine.eos_token_ids,
        arrival_time=time.monotonic(),
        seq_no=0,
    )


def test_running_streams_get_a_token_every_step_during_a_4k_prefill(long_engine: Engine) -> None:
    core = long_engine.core
    rng = random.Random(7)
    vocab = long_engine.model_info.vocab_size
    special = set(long_engine.tokenizer.special_token_ids)
    long_ids = [t for t in (rng.randrange(vocab) for _ in range(5000)) if t not in special][:4000]
    streams = [long_engine.tokenizer.encode(f"Story number {i} begins with a small cat") for i in range(4)]
    for i, ids in enumerate(streams):
        core.apply(AddCommand(_request(long_engine, f"s{i}", ids, 4000)))
    tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}
    for _ in range(3):  # the streams are decoding now
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    generated = {rid: core.requests[rid].num_output_tokens_counted for rid in tokens}
    core.apply(AddCommand(_request(long_engine, "long", long_ids, 4)))
    # Start from a small cap, as the cost feedback reaches on a real CPU; the loop adjusts it.
    core.scheduler.prefill_chunk_tokens = 64
    num_prefill_steps = 0
    long_tokens: list[int] = []
    while not long_tokens:
        cap = core.scheduler.prefill_chunk_tokens
        before = core.requests["long"].num_computed
        outs = {o.request_id: o for o in core.step()}
        num_prefill_steps += 1
        advanced = core.requests["long"].num_computed - before if "long" in core.requests else len(long_ids) - before
        assert 0 < advanced <= max(cap, 16), (
            cap,
            before,
            advanced,
            core.scheduler.prefill_chunk_tokens,
            [(o.request_id, len(o.token_ids), o.events) for o in outs.values()],
        )
        for rid in tokens:  # every running stream generated exactly one token in this step
            # (counted by usage: a token whose character is incomplete is delivered a step later)
            assert outs[rid].usage.completion_tokens == generated[rid] + 1, (num_prefill_steps, rid)
            generated[rid] += 1
            tokens[rid] += outs[rid].token_ids
        if "long" in outs:
            long_tokens += outs["long"].token_ids
    assert num_prefill_steps > 2
    for rid in tokens:
        core.apply(AbortCommand(rid))
    while core.has_work():
        for out in core.step():
            (long_tokens if out.request_id == "long" else tokens[out.request_id]).extend(out.token_ids)
    # Chunking changes nothing in the results: each equals its solo greedy run.
    solo = {}
    for rid, ids, n in [("long", long_ids, 4)] + [
        (f"s{i}", ids, len(tokens[f"s{i}"])) for i, ids in enumerate(streams)
    ]:
        core.apply(AddCommand(_request(long_engine, rid + "-solo", ids, n)))
        out_tokens: list[int] = []
        while core.has_work():
            for out in core.step():
                out_tokens += out.token_ids
        solo[rid] = out_tokens
    assert long_tokens == solo["long"]
    for rid in tokens:
        assert tokens[rid] == solo[rid]


def test_chunk_cap_follows_measured_costs(long_engine: Engine) -> None:
    from rill.engine.scheduler import SchedulerOutput

    core = long_engine.core
    core.chunk_tuner.decode_step_s = 0.020
    core.scheduler.prefill_chunk_tokens = 200
    core._update_costs(SchedulerOutput(num_decode_tokens=4, num_prefill_tokens=200), 0.060)  # 3 decode steps
    assert core.scheduler.prefill_chunk_tokens == 140  # too slow: shrink
    core._update_costs(SchedulerOutput(num_decode_tokens=4, num_prefill_tokens=140), 0.025)  # cheap and binding
    assert core.scheduler.prefill_chunk_tokens == 183  # grow
    core._update_costs(SchedulerOutput(num_decode_tokens=4, num_prefill_tokens=20), 0.021)  # cheap but not binding
    assert core.scheduler.prefill_chunk_tokens == 183
    for _ in range(50):  # never below the floor, never above the step budget
        core._update_costs(SchedulerOutput(num_decode_tokens=4, num_prefill_tokens=16), 1.0)
    assert core.scheduler.prefill_chunk_tokens == core.config.min_prefill_chunk_tokens
    for _ in range(50):
        core._update_costs(SchedulerOutput(num_decode_tokens=4, num_prefill_tokens=4000), 0.001)
    assert core.scheduler.prefill_chunk_tokens == core.config.max_num_batched_tokens


def test_a_burst_that_outnumbers_the_running_streams_is_prefilled_whole(long_engine: Engine) -> None:
    """Five prompts arriving beside one decoding stream are not held to the small chunk cap:
    they all start in the next step (the cap would keep the batch at one stream for many steps);
    one prompt beside two decoding streams still is."""
    core = long_engine.core
    tok = long_engine.tokenizer
    core.apply(AddCommand(_request(long_engine, "run0", tok.encode("A running stream about a fox"), 50)))
    core.step()
    core.step()  # run0 decodes now
    rng = random.Random(11)
    special = set(tok.special_token_ids)
    vocab = long_engine.model_info.vocab_size
    # Distinct random prompts: no shared prefix for the prefix cache to wait on.
    prompts = {
        f"burst{i}": [t for t in (rng.randrange(vocab) for _ in range(80)) if t not in special][:60] for i in range(5)
    }
    for rid, ids in prompts.items():
        core.apply(AddCommand(_request(long_engine, rid, ids, 2)))
    core.scheduler.prefill_chunk_tokens = 16
    outs = {o.request_id: o for o in core.step()}
    assert len(outs["run0"].token_ids) == 1
    assert all(len(outs[rid].token_ids) == 1 for rid in prompts), {
        rid: core.requests[rid].num_computed for rid in prompts
    }
    while any(rid in core.requests for rid in prompts):
        core.step()
    core.apply(AddCommand(_request(long_engine, "run1", tok.encode("A second running stream"), 50)))
    core.step()
    core.step()  # run0 and run1 decode
    late = [t for t in (rng.randrange(vocab) for _ in range(80)) if t not in special][:60]
    core.apply(AddCommand(_request(long_engine, "late", late, 2)))
    core.scheduler.prefill_chunk_tokens = 16
    core.step()
    assert core.requests["late"].num_computed <= 16
    core.apply(AbortCommand("run0"))
    core.apply(AbortCommand("run1"))
    core.apply(AbortCommand("late"))
    while core.has_work():
        core.step()
