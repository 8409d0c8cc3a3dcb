"""Prompt logprobs computed during prefill, ``max_tokens`` 0, and ``cumulative_logprob``.

The reference is transformers' own forward pass over the same float32 checkpoint.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import AddCommand, Request
from rill.errors import InvalidRequest
from rill.types import RequestEvent, RequestOutput, SamplingParams

TEXT = (
    "Once upon a time there was a little fox who lived in a den under an old oak tree. Every morning the fox "
    "ran to the river to drink, and the birds sang songs about the sea, the sky and the tall green trees."
)
CHUNK = 16  # max_num_batched_tokens of the engine below: every longer prompt is prefilled in chunks


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    """A float32 engine whose prefill chunks hold at most ``CHUNK`` tokens."""
    return build_engine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_memory="64MiB",
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=CHUNK,
        )
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    """The same checkpoint in transformers, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    return model.eval()


def _request(engine: Engine, rid: str, ids: list[int], **params: object) -> Request:
    return Request(
        request_id=rid,
        prompt_ids=list(ids),
        params=SamplingParams(**params).validate(allow_prefill_only=True),
        eos_token_ids=engine.eos_token_ids,
        arrival_time=time.monotonic(),
        seq_no=0,
    )


def _run(engine: Engine, requests: list[Request]) -> dict[str, list[RequestOutput]]:
    core = engine.core
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.apply(AddCommand(request))
    for _ in range(10000):
        if not core.has_work():
            return outputs
        for out in core.step():
            outputs[out.request_id].append(out)
    raise AssertionError("the engine did not finish")


def _reference_logprobs(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row j: the distribution of token j + 1


def _prompt_logprobs(outputs: list[RequestOutput]) -> list:
    carrying = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    assert len(carrying) == 1, "prompt logprobs come exactly once"
    return carrying[0]


def test_prompt_logprobs_match_transformers_across_chunks(engine: Engine, reference: torch.nn.Module) -> None:
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 3 * CHUNK
    outputs = _run(engine, [_request(engine, "p", ids, prompt_logprobs=5, max_tokens=2, temperature=0.0)])["p"]
    got = _prompt_logprobs(outputs)
    ref = _reference_logprobs(reference, ids)
    assert len(got) == len(ids) and got[0] is None
    max_diff = 0.0
    for j in range(1, len(ids)):
        entry, row = got[j], ref[j - 1]
        assert entry.token_id == ids[j]
        max_diff = max(max_diff, abs(entry.logprob - row[ids[j]].item()))
        assert entry.rank == 1 + int((row > row[ids[j]]).sum())
        others = [t for t in torch.argsort(row, descending=True, stable=True).tolist() if t != ids[j]][:5]
        assert [alt.token_id for alt in entry.top] == others
        for alt in entry.top:
            max_diff = max(max_diff, abs(alt.logprob - row[alt.token_id].item()))
    assert max_diff < 1e-3, max_diff
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert sum(len(out.token_ids) for out in outputs) == 2


def test_a_repeated_prompt_gets_full_prompt_logprobs_without_the_prefix_cache(engine: Engine) -> None:
    ids = engine.tokenizer.encode(TEXT)[: 2 * CHUNK + 5]
    first = _run(engine, [_request(engine, "a", ids, prompt_logprobs=0, max_tokens=1)])["a"]
    second = _run(engine, [_request(engine, "b", ids, prompt_logprobs=0, max_tokens=1)])["b"]
    plain = _run(engine, [_request(engine, "c", ids, max_tokens=1)])["c"]
    assert plain[-1].usage.cached_tokens > 0  # the prompt is in the prefix cache...
    assert second[-1].usage.cached_tokens == 0  # ...but a request asking prompt logprobs computes it all
    a, b = _prompt_logprobs(first), _prompt_logprobs(second)
    assert len(b) == len(ids) and b[0] is None and all(entry is not None for entry in b[1:])
    assert [(e.token_id, e.top) for e in b[1:]] == [(e.token_id, e.top) for e in a[1:]]
    assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-5) for x, y in zip(a[1:], b[1:]))


def test_max_tokens_zero_prefills_and_generates_nothing(engine: Engine, reference: torch.nn.Module) -> None:
    ids = engine.tokenizer.encode(TEXT)[:40]
    outputs = _run(engine, [_request(engine, "z", ids, max_tokens=0, prompt_logprobs=1)])["z"]
    assert all(not out.token_ids and not out.text for out in outputs)
    last = outputs[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.usage.completion_tokens == 0 and last.usage.prompt_tokens == len(ids)
    got = _prompt_logprobs(outputs)
    ref = _reference_logprobs(reference, ids)
    assert max(abs(got[j].logprob - ref[j - 1][ids[j]].item()) for j in range(1, len(ids))) < 1e-3


def test_other_requests_of_the_step_are_unaffected(engine: Engine) -> None:
    ids = engine.tokenizer.encode(TEXT)
    others = [engine.tokenizer.encode(text) for text in ("A big dog ran", "The sun rose over the quiet village and")]
    alone = {
        f"o{i}": _run(engine, [_request(engine, f"o{i}", p, max_tokens=6, temperature=0.0)])[f"o{i}"]
        for i, p in enumerate(others)
    }
    mixed = _run(
        engine,
        [
            _request(engine, "o0", others[0], max_tokens=6, temperature=0.0),
            _request(engine, "p", ids, prompt_logprobs=2, max_tokens=3, temperature=0.0),
            _request(engine, "o1", others[1], max_tokens=6, temperature=0.0),
        ],
    )
    for rid, outs in alone.items():
        assert [t for o in mixed[rid] for t in o.token_ids] == [t for o in outs for t in o.token_ids]
        assert all(o.prompt_logprobs is None for o in mixed[rid])
    assert len(_prompt_logprobs(mixed["p"])) == len(ids)


def test_cumulative_logprob_sums_the_sampled_tokens(engine: Engine) -> None:
    ids = engine.tokenizer.encode("Mia found a red ball in the garden.")
    outputs = _run(engine, [_request(engine, "s", ids, max_tokens=5, logprobs=0, ignore_eos=True, seed=7)])["s"]
    logprobs = [lp.logprob for out in outputs for lp in (out.logprobs or [])]
    assert len(logprobs) == 5
    assert math.isclose(outputs[-1].cumulative_logprob, sum(logprobs), abs_tol=1e-9)
    plain = _run(engine, [_request(engine, "t", ids, max_tokens=2)])["t"]
    assert plain[-1].cumulative_logprob is None


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_bounds(value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(prompt_logprobs=value).validate()  # type: ignore[arg-type]
    assert info.value.field == "prompt_logprobs"


def test_max_tokens_zero_only_where_allowed() -> None:
    assert SamplingParams(max_tokens=0).validate(allow_prefill_only=True).max_tokens == 0
    for params, allow in ((SamplingParams(max_tokens=0), False), (SamplingParams(max_tokens=-1), True)):
        with pytest.raises(InvalidRequest) as info:
            params.validate(allow_prefill_only=allow)
        assert info.value.field == "max_tokens"


def test_prompt_logprobs_survive_a_preemption_mid_prefill() -> None:
    """FakeRunner engine: a prompt-logprobs request preempted half-way through its prefill is
    recomputed from its first token and still gets one entry per prompt token, each the one it
    gets alone; its chunks stay under the logits cap while other requests decode beside it."""
    from rill.engine.batch import RowWork
    from tests.engine.fake_core import PROMPTS, assert_idle, make_engine, make_request

    engine = make_engine(num_rows=1, max_num_seqs=1, max_num_batched_tokens=32)
    engine.core.scheduler.max_logits_chunk_tokens = 6
    chunks: list[RowWork] = []
    real_forward = engine.runner.forward

    def forward(work: list[RowWork]) -> torch.Tensor:
        chunks.extend(w for w in work if w.all_logits)
        return real_forward(work)

    engine.runner.forward = forward  # type: ignore[method-assign]
    scored = make_request(engine, "scored", PROMPTS[5], priority=5, prompt_logprobs=3, max_tokens=2)
    urgent = make_request(engine, "urgent", PROMPTS[4], priority=0, max_tokens=3)
    outputs: dict[str, list[RequestOutput]] = {"scored": [], "urgent": []}
    engine.core.apply(AddCommand(scored))
    for num in range(1, 1000):
        if num == 4:
            engine.core.apply(AddCommand(urgent))
        for out in engine.core.step():
            outputs[out.request_id].append(out)
        if not engine.core.has_work():
            break
    assert any(RequestEvent.PREEMPTED in out.events for out in outputs["scored"])
    assert outputs["urgent"][-1].finish_reason == "length"
    assert chunks and all(len(w.token_ids) <= 6 for w in chunks)
    got = _prompt_logprobs(outputs["scored"])
    alone_engine = make_engine()
    alone = _prompt_logprobs(
        _run(alone_engine, [make_request(alone_engine, "scored", PROMPTS[5], prompt_logprobs=3, max_tokens=2)])[
            "scored"
        ]
    )
    assert len(got) == len(scored.prompt_ids) == len(alone)
    assert [(e.token_id, e.rank, [a.token_id for a in e.top]) for e in got[1:]] == [
        (e.token_id, e.rank, [a.token_id for a in e.top]) for e in alone[1:]
    ]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-6) for a, b in zip(got[1:], alone[1:]))
    assert_idle(engine)
