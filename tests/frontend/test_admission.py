"""``rill.frontend.admission``: where prompts are tokenized, the size bound, the batch path."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest

from rill.errors import ContextLengthExceeded, InvalidRequest, PromptTooLarge
from rill.frontend.admission import FAST_PATH_MAX_SIZE, PromptAdmission, check_size
from rill.models.tokenizer import Tokenizer
from rill.models.tool_prompt import tool_system_prompt
from rill.testing.checkpoints import make_tokenizer
from rill.types import ChatMessage, GenerateRequest, ModelInfo

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
VOCAB = 100_000
MODEL = ModelInfo(
    name="m", architecture="a", max_context_tokens=100_000, vocab_size=VOCAB, dtype="float32", device="cpu"
)


class RecordingTokenizer:
    """The real tokenizer, recording the thread of every call."""

    def __init__(self, template: str = TEMPLATE) -> None:
        self.inner = Tokenizer(make_tokenizer(), chat_templates={"default": template})
        self.threads: list[tuple[str, int]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(("encode", threading.get_ident()))
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_context_tokens: int | None = None
    ) -> list[list[int]]:
        self.threads.append(("encode_batch", threading.get_ident()))
        return self.inner.encode_batch(
            texts, add_special_tokens=add_special_tokens, max_context_tokens=max_context_tokens
        )

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        /,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        self.threads.append(("template", threading.get_ident()))
        return self.inner.apply_chat_template(messages, add_generation_prompt, tools, chat_template_kwargs)

    def get_chat_template(self, tools: Sequence[Any] | None = None) -> str | None:
        return self.inner.get_chat_template(tools)


def _run(
    prompts: list[Any],
    *,
    max_chars: int = 1_000_000,
    tokenizer: RecordingTokenizer | None = None,
    model: ModelInfo = MODEL,
) -> tuple[list[list[int]], RecordingTokenizer, int]:
    """Admit ``prompts``; the ids, the tokenizer (with its call log) and the loop's thread id."""
    tok = tokenizer or RecordingTokenizer()

    async def main() -> tuple[list[list[int]], int]:
        admission = PromptAdmission(max_prompt_chars=max_chars, num_threads=2)
        try:
            return await admission.token_ids(tok, prompts, model), threading.get_ident()
        finally:
            admission.close()

    ids, loop_thread = asyncio.run(main())
    return ids, tok, loop_thread


def test_a_long_prompt_is_tokenized_in_a_pool_thread_not_the_loops() -> None:
    text = "the quick brown fox " * 200
    ids, tok, loop_thread = _run([GenerateRequest(prompt=text)])
    assert ids == [tok.inner.encode(text)]
    assert [name for name, _ in tok.threads] == ["encode_batch"]
    assert all(thread != loop_thread for _, thread in tok.threads)


def test_chat_templating_runs_in_a_pool_thread() -> None:
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content=None)]
    ids, tok, loop_thread = _run([GenerateRequest(messages=messages, add_generation_prompt=True)])
    rendered = tok.inner.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == "<user>hi<assistant><a>"  # None content is dropped, not rendered as "None"
    assert ids == [tok.inner.encode(rendered, add_special_tokens=False)]  # the template writes any BOS itself
    assert {name for name, _ in tok.threads} >= {"template"}
    assert all(thread != loop_thread for _, thread in tok.threads)


def test_a_small_prompt_takes_the_fast_path_on_the_loop() -> None:
    text = "x" * FAST_PATH_MAX_SIZE
    ids, tok, loop_thread = _run([GenerateRequest(prompt=text)])
    assert ids == [tok.inner.encode(text)]
    assert tok.threads == [("encode", loop_thread)]


def test_a_prompt_list_is_one_batch_in_order_with_token_id_prompts_kept() -> None:
    texts = [f"prompt number {i} about a fox" for i in range(50)]
    # Plain texts and id lists (as a protocol's prompt list) mix with requests.
    prompts: list[Any] = [*texts[:20], [3, 4, 5], GenerateRequest(prompt_token_ids=[6]), *texts[20:40]]
    prompts += [GenerateRequest(prompt=t) for t in texts[40:]]
    ids, tok, loop_thread = _run(prompts)
    expected = [tok.inner.encode(t) for t in texts[:20]] + [[3, 4, 5], [6]] + [tok.inner.encode(t) for t in texts[20:]]
    assert ids == expected
    assert [name for name, _ in tok.threads] == ["encode_batch"]
    assert tok.threads[0][1] != loop_thread


def test_encode_batch_matches_encode() -> None:
    tok = Tokenizer(make_tokenizer())
    texts = ["", "hello world", "café 😀 über\n\tfox", "<s> starts with a special token", "a" * 3000]
    for special in (True, False):
        assert tok.encode_batch(texts, add_special_tokens=special) == [
            tok.encode(t, add_special_tokens=special) for t in texts
        ]


@pytest.mark.parametrize(
    "prompts",
    [
        [GenerateRequest(prompt="x" * 1001)],
        [GenerateRequest(prompt="x" * 600), GenerateRequest(prompt="y" * 401)],
        ["x" * 500, [1] * 500, "z"],
        [GenerateRequest(prompt_token_ids=[1] * 1001)],
        [GenerateRequest(messages=[ChatMessage(role="user", content="x" * 1001)])],
        [GenerateRequest(messages=[ChatMessage(role="user", content=[{"type": "text", "text": "x" * 1001}])])],
        [GenerateRequest(messages=[ChatMessage(role="user", content="hi")], chat_template_kwargs={"doc": "x" * 1001})],
    ],
    ids=["text", "list-total", "plain-list-total", "token-ids", "message", "message-parts", "template-kwargs"],
)
def test_a_prompt_over_the_bound_is_refused_before_any_tokenizer_call(prompts: list[Any]) -> None:
    tok = RecordingTokenizer()
    with pytest.raises(PromptTooLarge) as caught:
        _run(prompts, max_chars=1000, tokenizer=tok)
    assert isinstance(caught.value, InvalidRequest) and caught.value.field == "prompt"
    assert caught.value.max_chars == 1000 and caught.value.num_chars > 1000
    assert "--max-prompt-chars" in str(caught.value)
    assert tok.threads == []


def test_the_bound_itself_is_allowed() -> None:
    ids, _, _ = _run([GenerateRequest(prompt="ab " * 333 + "a")], max_chars=1000)
    assert ids and ids[0]
    check_size([GenerateRequest(messages=[ChatMessage(role="us", content="x" * 998)])], 1000)  # role counts too


def test_deep_nesting_in_messages_is_counted_without_recursion() -> None:
    nested: Any = "x" * 10
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(PromptTooLarge):
        check_size(
            [GenerateRequest(messages=[ChatMessage(role="user", content="y" * 5)], chat_template_kwargs={"a": nested})],
            12,
        )


@pytest.mark.parametrize(
    "prompt",
    [
        "the quick brown fox " * 100,  # the pool: refused from the token count, no id list built
        "fox " * 40,  # the fast path on the loop
        [5] * 60,  # client-given ids
        GenerateRequest(messages=[ChatMessage(role="user", content="fox " * 100)]),
    ],
    ids=["long-text", "short-text", "token-ids", "chat"],
)
def test_a_prompt_that_fills_the_context_is_refused_with_its_length(prompt: Any) -> None:
    small = msgspec.structs.replace(MODEL, max_context_tokens=40)
    with pytest.raises(ContextLengthExceeded) as caught:
        _run([prompt], model=small)
    assert caught.value.max_context_tokens == 40 and caught.value.num_prompt_tokens >= 40


def test_encode_batch_counts_before_building_ids() -> None:
    tok = Tokenizer(make_tokenizer())
    text = "the quick brown fox " * 50
    num_tokens = len(tok.encode(text))
    assert tok.encode_batch([text], max_context_tokens=num_tokens + 1) == [tok.encode(text)]
    with pytest.raises(ContextLengthExceeded) as caught:
        tok.encode_batch(["short", text], max_context_tokens=num_tokens)
    assert caught.value.num_prompt_tokens == num_tokens


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        _run([GenerateRequest(prompt_token_ids=[1] * 500 + [VOCAB])])
    assert caught.value.field == "prompt_token_ids" and str(VOCAB) in str(caught.value)


def test_exactly_one_prompt_field() -> None:
    with pytest.raises(InvalidRequest, match="exactly one"):
        _run([GenerateRequest(prompt="a" * 300, prompt_token_ids=[1])])
    with pytest.raises(InvalidRequest, match="exactly one"):
        _run([GenerateRequest()])


def test_a_template_error_comes_back_as_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        _run([GenerateRequest(messages=[], add_generation_prompt=True)])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Renders the tools itself, as Qwen's and Hermes' templates do.
TOOLS_TEMPLATE = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}" + TEMPLATE


def _admitted_text(
    messages: list[ChatMessage], *, template: str = TEMPLATE, model: ModelInfo = MODEL
) -> tuple[str, RecordingTokenizer]:
    tok = RecordingTokenizer(template)
    ids, _, _ = _run([GenerateRequest(messages=messages, tools=[WEATHER])], tokenizer=tok, model=model)
    return tok.inner.decode(ids[0]), tok


def test_tools_a_template_drops_are_listed_in_a_system_prompt_with_the_call_format() -> None:
    text, tok = _admitted_text([ChatMessage(role="user", content="Weather in Paris?")])
    prompt = tool_system_prompt([WEATHER], "hermes")
    assert text == tok.inner.apply_chat_template(
        [ChatMessage(role="system", content=prompt), ChatMessage(role="user", content="Weather in Paris?")]
    )
    assert '"name": "get_weather"' in text and "<tool_call>" in text


def test_the_tool_prompt_joins_the_system_message_there_is() -> None:
    text, _ = _admitted_text([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="hi")])
    assert text.count("<system>") == 1
    assert text.startswith("<system>Be brief.\n\n# Tools")


def test_the_tool_prompt_is_in_the_models_own_tool_call_format() -> None:
    model = msgspec.structs.replace(MODEL, tool_call_format="llama3_json")
    text, _ = _admitted_text([ChatMessage(role="user", content="hi")], model=model)
    assert '"parameters": <args-json-object>' in text and "<tool_call>" not in text


def test_a_template_that_renders_tools_gets_nothing_added() -> None:
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    text, tok = _admitted_text(messages, template=TOOLS_TEMPLATE)
    assert text == tok.inner.apply_chat_template(messages, tools=[WEATHER])
    assert "<system>" not in text and "# Tools" not in text


def test_without_tools_nothing_is_added_and_the_template_is_not_probed() -> None:
    messages = [ChatMessage(role="user", content="hi")]
    ids, tok, _ = _run([GenerateRequest(messages=messages, tools=[])])
    assert tok.inner.decode(ids[0]) == tok.inner.apply_chat_template(messages)
    assert [name for name, _ in tok.threads] == ["template", "encode"]
