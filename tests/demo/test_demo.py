"""Tests of rill.demo: corpus, tokenizer, training loop, tiny builds, and the atomic cached build."""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from pathlib import Path

import jinja2
import pytest
import torch
from torch import nn

from rill.demo import build as demo_build
from rill.demo import corpus, stories
from rill.demo import tokenizer as tk
from rill.demo import train as train_module
from rill.demo.train import ThreadTuner, TrainConfig, pack_documents, train

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_TRAIN = {"seq_len": 64, "batch_size": 4, "num_threads": 1}


# ---------------------------------------------------------------- corpus


def test_corpus_is_deterministic_per_seed():
    assert corpus.documents(1, 50_000) == corpus.documents(1, 50_000)
    assert corpus.documents(1, 50_000) != corpus.documents(2, 50_000)


def test_corpus_size_mix_and_punctuation():
    docs = corpus.documents(0, 400_000)
    assert 400_000 <= sum(map(len, docs)) < 420_000
    chats = [d for d in docs if d.startswith((tk.USER, tk.SYSTEM))]
    assert 0.15 < len(chats) / len(docs) < 0.35
    plain = [d for d in docs if d not in chats]
    assert sum(d.startswith(("Once", "There once")) for d in plain) == len(plain)
    assert sum(d.endswith("The end.") for d in plain) > 0.7 * len(plain)
    for doc in docs:
        assert doc.count('"') % 2 == 0, doc
        assert "  " not in doc and ".." not in doc
    for chat in chats:
        assert chat.endswith(f"{tk.END}\n")
        assert chat.count(tk.USER) == chat.count(tk.ASSISTANT)


def test_corpus_vocabulary_is_small_and_sentences_start_with_capitals():
    docs = corpus.documents(3, 300_000)
    words = {w.lower() for d in docs for w in re.findall(r"[A-Za-z']+", d)}
    assert 250 < len(words) < 1500
    for doc in docs[:200]:
        if doc.startswith("<|"):
            continue
        for sentence in re.split(r'(?<=[.!?])\s+(?=[^"\s])|\n\n', doc):
            assert sentence.lstrip('"')[:1].isupper() or sentence[:1].isdigit(), sentence


def test_story_follows_requested_subject():
    rng = random.Random(5)
    assert "cat" in stories.story(rng, kind="cat")
    assert "Lily" in stories.story(rng, name="Lily")
    assert "kite" in stories.story(rng, thing="kite")
    assert "beach" in stories.story(rng, place="beach", plot="trip")
    for plot in stories.PLOTS:
        text = stories.story(rng, plot=plot)
        assert text.startswith(("Once", "There once")) and len(text.split()) > 40


@pytest.mark.parametrize("plot", ["truth", "brave", "trying", "birthday", "rain"])
def test_pronouns_agree_with_the_hero(plot):
    # In these plots the only other character is a grown-up who is never a subject, so a
    # girl's story has no "he"/"his" and a boy's story no "she".
    rng = random.Random(7)
    for _ in range(30):
        girl = stories.story(rng, kind="girl", plot=plot)
        assert not re.search(r"\b(he|his|He|His)\b", girl), girl
        boy = stories.story(rng, kind="boy", plot=plot)
        assert not re.search(r"\b(she|She)\b", boy), boy
        assert re.search(r"\b(she|her|She|Her)\b", girl) and re.search(r"\b(he|his|He|His)\b", boy)


# ---------------------------------------------------------------- tokenizer and chat template


def _render_jinja(messages, add_generation_prompt):
    template = jinja2.Environment().from_string(tk.CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=tk.BOS)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_python_renderer(add_generation_prompt):
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a story about a cat."},
        {"role": "assistant", "content": "Once upon a time..."},
        {"role": "tool", "content": "odd role"},
    ]
    jinja = _render_jinja(messages, add_generation_prompt)
    assert jinja == tk.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert jinja.endswith("<|assistant|>\n" if add_generation_prompt else "<|end|>\n")


def test_chat_template_keeps_text_parts_of_list_content():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}, {"type": "text", "text": "!"}]}
    ]
    assert _render_jinja(messages, True) == "<s><|user|>\nHi!<|end|>\n<|assistant|>\n"


@pytest.fixture(scope="module")
def small_tokenizer():
    return tk.train_tokenizer(corpus.documents(0, 300_000))


def test_tokenizer_round_trip_and_specials(small_tokenizer):
    tok = small_tokenizer
    assert [tok.token_to_id(t) for t in tk.SPECIAL_TOKENS] == list(range(8))
    assert 500 < tok.get_vocab_size() <= 4096
    for text in corpus.documents(9, 20_000) + ["Héllo wörld 😀 {x: 1}\n\ttabs", "  two  spaces "]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    encoded = tok.encode("Once upon a time")
    assert encoded.ids[0] == tok.token_to_id(tk.BOS) and len(encoded.ids) == 5  # one token per word
    chat = tk.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    tokens = tok.encode(chat, add_special_tokens=False).tokens
    assert tokens[0] == tk.BOS and tk.USER in tokens and tk.END in tokens and tokens[-2] == tk.ASSISTANT


# ---------------------------------------------------------------- training loop (stand-in model)


class Bigram(nn.Module):
    """Stand-in with the model interface: input_ids [B, T] -> logits [B, T, V]."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


def test_training_loop_lowers_loss_and_respects_limits():
    torch.manual_seed(0)
    tokens = pack_documents([[4, 5, 6, 7, 8, 9] * 20] * 20, bos_id=1, eos_id=2)
    model = Bigram(16)
    seen = []
    config = TrainConfig(
        seq_len=32,
        batch_size=4,
        steps=30,
        time_budget_s=None,
        peak_lr=1e-1,
        warmup_steps=3,
        use_bf16=False,
        num_threads=1,
    )
    result = train(model, tokens, config, progress=lambda f, s, loss: seen.append((f, s, loss)), holdout=tokens[:200])
    assert result.num_steps == 30 and seen[-1][0] == 1.0 and [s for _, s, _ in seen] == list(range(1, 31))
    assert seen[-1][2] < seen[0][2]  # smoothed, so it lags
    assert result.eval_loss < 0.4 * math.log(16)
    quick = train(Bigram(16), tokens, TrainConfig(seq_len=32, batch_size=4, steps=None, time_budget_s=0.2))
    assert 0 < quick.num_steps and quick.elapsed_s < 2.0
    with pytest.raises(ValueError):
        train(Bigram(16), tokens, TrainConfig(steps=None, time_budget_s=None))


def _run_tuner(monkeypatch, cost_s: dict[int, float], num_steps: int) -> tuple[ThreadTuner, list[int]]:
    now = [0.0]
    monkeypatch.setattr(train_module.time, "perf_counter", lambda: now[0])
    tuner, used = ThreadTuner([2, 1]), []
    old_threads = torch.get_num_threads()
    try:
        for _ in range(num_steps):
            tuner.begin()
            used.append(tuner.current)
            now[0] += cost_s[tuner.current]
            tuner.end()
    finally:
        torch.set_num_threads(old_threads)
    return tuner, used


def test_thread_tuner_keeps_all_cores_on_an_idle_machine(monkeypatch):
    tuner, used = _run_tuner(monkeypatch, {2: 0.3, 1: 0.5}, 100)
    assert used[:5] == [2, 2, 2, 1, 1] and [i for i in range(5, 100) if used[i] == 1] == [55, 56]


def test_thread_tuner_probes_each_count_then_uses_the_fastest(monkeypatch):
    # An overloaded machine: one thread is faster.
    tuner, used = _run_tuner(monkeypatch, {2: 1.0, 1: 0.25}, 200)
    assert used[:5] == [2, 2, 2, 1, 1]  # warm-up step, then two timed steps each
    probes = [i for i in range(5, 200) if used[i] == 2]
    assert probes == [30, 31, 82, 83, 184, 185]  # re-timed after 25, 50, 100 steps
    assert tuner.num_steps == {2: 9, 1: 191}


# ---------------------------------------------------------------- tiny real builds


REPORTED: list[tuple[float, str]] = []


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / "tiny"
    return demo_build.build_demo_model(
        folder,
        time_budget_s=None,
        steps=5,
        progress=False,
        report=lambda *event: REPORTED.append(event),
        model_overrides=TINY_MODEL,
        train_overrides=TINY_TRAIN,
        corpus_bytes=200_000,
    )


def test_tiny_build_writes_a_complete_hf_folder(tiny_folder):
    assert demo_build.is_complete(tiny_folder)
    percents = [percent for percent, _ in REPORTED]
    assert percents == sorted(percents) and percents[0] == 0.0 and percents[-1] == 100.0
    assert [text for _, text in REPORTED if "step" in text][-1].startswith("demo model: training, step 5, loss")
    stats = json.loads((tiny_folder / "rill_demo.json").read_text())
    assert stats["num_steps"] == 5 and stats["train_loss"] > 0
    generation = json.loads((tiny_folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 7] and generation["temperature"] == 0.8
    config = json.loads((tiny_folder / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"] and config["tie_word_embeddings"]


def test_tiny_build_loads_in_rill(tiny_folder):
    from rill.models import load_model

    loaded = load_model(tiny_folder, dtype="float32")
    assert loaded.config.eos_token_ids == (2, 7)
    assert loaded.config.max_context_tokens == demo_build.MAX_CONTEXT_TOKENS
    logits = loaded.model(torch.tensor([[1, 20, 30, 40]]))
    assert logits.shape == (1, 4, loaded.config.vocab_size) and torch.isfinite(logits).all()


def test_tiny_build_loads_in_transformers(tiny_folder):
    transformers = pytest.importorskip("transformers")
    from rill.models import load_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>\nTell me a story about a dog.<|end|>\n<|assistant|>\n"
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    ours = load_model(tiny_folder, dtype="float32").model(ids)
    with torch.no_grad():
        theirs = model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert list(model.generation_config.eos_token_id) == [2, 7]


# ---------------------------------------------------------------- cache folder, atomic build, lock


def test_demo_model_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path / "a"))
    assert demo_build.demo_model_dir() == tmp_path / "a" / "models" / demo_build.DEMO_NAME
    monkeypatch.delenv("RILL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert demo_build.demo_model_dir() == tmp_path / "x" / "rill" / "models" / demo_build.DEMO_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_build.demo_model_dir() == tmp_path / "home" / ".cache" / "rill" / "models" / demo_build.DEMO_NAME


class FakeBuild:
    """Stands in for build_demo_model: writes the required files, optionally slowly or failing."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.calls: list[Path] = []
        self.delay_s, self.fail = delay_s, fail

    def __call__(self, folder, **kwargs):
        self.calls.append(Path(folder))
        (Path(folder) / "config.json").write_text("{}")
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("killed mid-build")
        for name in demo_build.REQUIRED_FILES:
            (Path(folder) / name).write_text("{}")
        return Path(folder)


def test_ensure_builds_once_in_a_temp_folder_then_renames(monkeypatch, tmp_path):
    fake = FakeBuild()
    monkeypatch.setattr(demo_build, "build_demo_model", fake)
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path))
    folder = demo_build.ensure_demo_model(progress=False)
    assert folder == demo_build.demo_model_dir() and demo_build.is_complete(folder)
    assert len(fake.calls) == 1 and fake.calls[0] != folder and fake.calls[0].parent == folder.parent
    assert demo_build.ensure_demo_model(progress=False) == folder and len(fake.calls) == 1
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{folder.name}.lock", folder.name]
    assert folder.stat().st_mode & 0o777 == 0o755
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in folder.iterdir())


def test_failed_build_leaves_nothing_that_looks_complete(monkeypatch, tmp_path):
    monkeypatch.setattr(demo_build, "build_demo_model", FakeBuild(fail=True))
    folder = tmp_path / "models" / "demo"
    with pytest.raises(RuntimeError):
        demo_build.ensure_demo_model(progress=False, folder=folder)
    assert not folder.exists() and not list(folder.parent.glob(".demo.tmp-*"))


def test_leftovers_of_a_killed_build_are_cleaned(monkeypatch, tmp_path):
    folder = tmp_path / "demo"
    (tmp_path / ".demo.tmp-dead").mkdir()
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # incomplete: no weights
    monkeypatch.setattr(demo_build, "build_demo_model", FakeBuild())
    assert demo_build.ensure_demo_model(progress=False, folder=folder) == folder
    assert demo_build.is_complete(folder) and not (tmp_path / ".demo.tmp-dead").exists()


def test_concurrent_callers_build_once(monkeypatch, tmp_path):
    fake = FakeBuild(delay_s=0.5)
    monkeypatch.setattr(demo_build, "build_demo_model", fake)
    folder = tmp_path / "demo"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(demo_build.ensure_demo_model(False, folder=folder)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results == [folder] * 3 and len(fake.calls) == 1


def test_rebuild_swaps_in_a_new_folder_and_warns_when_undertrained(monkeypatch, tmp_path, capsys):
    fake = FakeBuild()
    monkeypatch.setattr(demo_build, "build_demo_model", fake)
    folder = demo_build.ensure_demo_model(False, folder=tmp_path / "demo")
    (folder / "rill_demo.json").write_text(json.dumps({"eval_loss": 5.4, "num_steps": 14}))
    demo_build.ensure_demo_model(True, folder=folder)
    assert "undertrained" in capsys.readouterr().err and len(fake.calls) == 1
    demo_build.ensure_demo_model(True, folder=folder, rebuild=True)
    assert len(fake.calls) == 2 and (folder / "rill_demo.json").read_text() == "{}"
    assert "undertrained" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.lock", "demo"]
