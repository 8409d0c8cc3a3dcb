"""Tests of rill.models.tokenizer, compared with transformers (a test-only dependency).

Model folders are built here: tokenizers trained with ``tokenizers`` on generated text, with
configs written by hand or by transformers' own ``save_pretrained``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from rill.errors import InvalidRequest, ModelLoadError
from rill.models.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

WORDS = [
    "hello",
    "world",
    "the",
    "fox",
    "über",
    "café",
    "日本語",
    "中文字符",
    "😀",
    "🚀🔥",
    "Ελληνικά",
    "русский",
    "¡hola!",
    "\n",
    "  ",
    "\t",
    "1234",
    "é",
]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
CHATML_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role ' + m.role) }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
TOOL_TEMPLATE = "TOOLS:{{ tools | tojson }}{{ messages[-1].content }}"
MESSAGES = [
    {"role": "system", "content": "Be brief 😀"},
    {"role": "user", "content": "  日本語 über fox  "},
    {"role": "assistant", "content": "café"},
    {"role": "user", "content": "<|eot_id|> again"},
]


def _texts(num: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return [
        "".join(rnd.choice(WORDS) + rnd.choice([" ", "", "  "]) for _ in range(rnd.randint(1, 10))) for _ in range(num)
    ]


def _byte_level(specials: list[str]) -> HFTokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=450,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_texts(1000, seed=1), trainer)
    return backend


def _write(folder: Path, name: str, data: object) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")


def _added(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory) -> Path:
    """Byte-level BPE whose post-processor adds BOS; template in tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("llama3")
    backend = _byte_level(LLAMA3_SPECIALS)
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    backend.save(str(folder / "tokenizer.json"))
    _write(
        folder,
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": _added("<|begin_of_text|>"),
            "eos_token": "<|eot_id|>",
            "chat_template": LLAMA3_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {str(backend.token_to_id(t)): _added(t) for t in LLAMA3_SPECIALS},
        },
    )
    _write(
        folder,
        "generation_config.json",
        {"eos_token_id": [backend.token_to_id("<|end_of_text|>"), backend.token_to_id("<|eot_id|>")]},
    )
    _write(folder, "config.json", {"eos_token_id": backend.token_to_id("<|end_of_text|>"), "bos_token_id": bos_id})
    return folder


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory) -> Path:
    """Saved by transformers' save_pretrained, which writes the template to chat_template.jinja."""
    folder = tmp_path_factory.mktemp("chatml")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_level(CHATML_SPECIALS), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def llama2_folder(tmp_path_factory) -> Path:
    """SentencePiece-style BPE with byte fallback, BOS from the post-processor, tokens in special_tokens_map."""
    folder = tmp_path_factory.mktemp("llama2")
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(
        _texts(400, seed=2),
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=30, show_progress=False
        ),
    )
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    backend = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    backend.save(str(folder / "tokenizer.json"))
    _write(
        folder,
        "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False},
    )
    _write(folder, "special_tokens_map.json", {"bos_token": "<s>", "eos_token": _added("</s>"), "unk_token": "<unk>"})
    return folder


# ------------------------------------------------------------------ same as transformers


@pytest.mark.parametrize("name", ["llama3_folder", "chatml_folder", "llama2_folder"])
def test_encode_decode_match_transformers(name: str, request) -> None:
    folder: Path = request.getfixturevalue(name)
    ours, hf = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in [*_texts(60, seed=3), "", " ", "<|eot_id|>x<|im_end|>", "<s>hi</s>", "🦀 ŉ"]:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert ours.vocab_size == len(hf)
    # Every id that decode(skip_special_tokens=True) drops, named or not.
    flagged = {i for i, token in hf.added_tokens_decoder.items() if token.special}
    assert ours.special_token_ids == flagged | set(hf.all_special_ids)
    assert all(ours.id_to_token(i) == hf.convert_ids_to_tokens(i) for i in range(ours.vocab_size))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", ["llama3_folder", "chatml_folder"])
def test_chat_template_matches_transformers(name: str, add_generation_prompt: bool, request) -> None:
    folder: Path = request.getfixturevalue(name)
    ours, hf = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.has_chat_template
    for kwargs in ({}, {"enable_thinking": False}):
        text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs)
        assert text == hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        ids = ours.encode_chat(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs)
        assert ids == hf.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, return_dict=False, **kwargs
        )


def test_save_pretrained_writes_chat_template_jinja(chatml_folder: Path) -> None:
    assert (chatml_folder / "chat_template.jinja").read_text(encoding="utf-8") == CHATML_TEMPLATE
    assert "chat_template" not in json.loads((chatml_folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_folder(chatml_folder)
    assert tokenizer.chat_templates == {"default": CHATML_TEMPLATE}
    assert tokenizer.apply_chat_template(MESSAGES[1:2], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    with pytest.raises(InvalidRequest, match="Unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    client_kwargs = {"enable_thinking": False, "tools": None}
    with pytest.raises(InvalidRequest, match="reserved"):
        tokenizer.encode_chat(MESSAGES, chat_template_kwargs=client_kwargs)
    del client_kwargs["tools"]
    assert tokenizer.encode_chat(MESSAGES, chat_template_kwargs=client_kwargs) == tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, enable_thinking=False), add_special_tokens=False
    )


def test_encode_chat_has_a_single_bos(llama3_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(llama3_folder)
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert tokenizer.encode(text)[:2] == [tokenizer.bos_token_id] * 2  # what encode() alone would do
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


# ------------------------------------------------------------------ config details


def test_eos_ids_from_tokenizer_and_generation_config(llama3_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(llama3_folder)
    eot, end = tokenizer.token_to_id("<|eot_id|>"), tokenizer.token_to_id("<|end_of_text|>")
    assert tokenizer.eos_token_id == eot and tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.eos_token_ids == {eot, end}
    assert tokenizer.bos_token == "<|begin_of_text|>"


def _copy_tokenizer(src: Path, dst: Path, config: dict, files: dict[str, object] | None = None) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    _write(dst, "tokenizer_config.json", config)
    for name, data in (files or {}).items():
        _write(dst, name, data)
    return dst


def test_named_templates_and_template_files(llama3_folder: Path, tmp_path: Path) -> None:
    listed = _copy_tokenizer(
        llama3_folder,
        tmp_path / "listed",
        {
            "eos_token": "<|eot_id|>",
            "chat_template": [
                {"name": "default", "template": "D{{ messages[0].content }}"},
                {"name": "tool_use", "template": TOOL_TEMPLATE},
            ],
        },
    )
    tokenizer = Tokenizer.from_folder(listed)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools).startswith("TOOLS:[{")
    hf = transformers.AutoTokenizer.from_pretrained(str(listed))
    assert tokenizer.apply_chat_template(MESSAGES, tools=tools) == hf.apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
    )

    files = _copy_tokenizer(
        llama3_folder,
        tmp_path / "files",
        {"chat_template": "ignored: files win"},
        {"chat_template.jinja": "F{{ messages | length }}", "additional_chat_templates/tool_use.jinja": "T"},
    )
    tokenizer = Tokenizer.from_folder(files)
    assert tokenizer.chat_templates == {"default": "F{{ messages | length }}", "tool_use": "T"}
    assert tokenizer.apply_chat_template(MESSAGES) == "F4"

    only_named = _copy_tokenizer(
        llama3_folder, tmp_path / "named", {"chat_template": [{"name": "rag", "template": "R"}]}
    )
    with pytest.raises(InvalidRequest, match="none is the default"):
        Tokenizer.from_folder(only_named).apply_chat_template(MESSAGES)

    legacy = _copy_tokenizer(llama3_folder, tmp_path / "legacy", {}, {"chat_template.json": {"chat_template": "L"}})
    assert Tokenizer.from_folder(legacy).apply_chat_template(MESSAGES) == "L"


def test_no_chat_template(llama2_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(llama2_folder)
    assert not tokenizer.has_chat_template
    with pytest.raises(InvalidRequest, match="this model has no chat template"):
        tokenizer.apply_chat_template(MESSAGES)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token_id) == ("<s>", "</s>", 0)


def test_add_bos_token_flag_is_honoured(llama2_folder: Path, tmp_path: Path) -> None:
    backend = HFTokenizer.from_file(str(llama2_folder / "tokenizer.json"))
    bos, eos = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    plain = backend.encode("hello", add_special_tokens=False).ids
    no_bos = _copy_tokenizer(
        llama2_folder,
        tmp_path / "no_bos",
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": True},
    )
    assert Tokenizer.from_folder(no_bos).encode("hello") == plain + [eos]
    backend.post_processor = None
    (tmp_path / "bare").mkdir()
    backend.save(str(tmp_path / "bare" / "tokenizer.json"))
    _write(tmp_path / "bare", "tokenizer_config.json", {"bos_token": "<s>", "add_bos_token": True})
    assert Tokenizer.from_folder(tmp_path / "bare").encode("hello") == [bos, *plain]
    _write(tmp_path / "bare", "tokenizer_config.json", {"bos_token": "<s>"})
    assert Tokenizer.from_folder(tmp_path / "bare").encode("hello") == plain  # no flag: tokenizer.json rules


def test_config_marks_extra_special_tokens(llama3_folder: Path, tmp_path: Path) -> None:
    backend = HFTokenizer.from_file(str(llama3_folder / "tokenizer.json"))
    backend.add_tokens(["<tool>"])  # a plain added token in tokenizer.json...
    (tmp_path / "m").mkdir()
    backend.save(str(tmp_path / "m" / "tokenizer.json"))
    tool_id = backend.token_to_id("<tool>")
    _write(
        tmp_path / "m",
        "tokenizer_config.json",
        {  # ...that the config says is special
            "eos_token": {"content": "<|eot_id|>"},
            "bos_token": None,
            "image_token": "<|start_header_id|>",
            "added_tokens_decoder": {str(tool_id): _added("<tool>")},
            "additional_special_tokens": ["<|end_header_id|>"],
        },
    )
    tokenizer = Tokenizer.from_folder(tmp_path / "m")
    assert tool_id in tokenizer.special_token_ids
    assert tokenizer.decode(tokenizer.encode("a<tool>b")) == "ab"
    assert tokenizer.bos_token_id is None and tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.special_tokens["image_token"] == "<|start_header_id|>"  # model-specific names reach templates
    assert tokenizer.token_to_id("<|end_header_id|>") in tokenizer.special_token_ids


def test_missing_and_broken_files(tmp_path: Path, llama3_folder: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "does-not-exist")
    _write(tmp_path, "tokenizer.json", "{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    broken = _copy_tokenizer(llama3_folder, tmp_path / "broken", {})
    (broken / "tokenizer_config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_folder(broken)
