"""lm-evaluation-harness' ``local-completions`` model, run as its own CLI, against a real rill server.

The task (``lm_eval_task/rill_mc.yaml``) is a 12-question, 4-choice multiple-choice set read
offline from ``lm_eval_task/rill_mc.jsonl``; ``--limit 10`` scores 10 of them, i.e. 40
loglikelihood requests (``echo`` + ``logprobs`` + ``max_tokens`` 1 on ``/v1/completions``).
lm_eval tokenizes with the checkpoint folder's own tokenizer and sends token ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LiveServer

TASK_DIR = Path(__file__).parent / "lm_eval_task"
NUM_DOCS = 10
NUM_CHOICES = 4


@pytest.mark.timeout(900)
def test_lm_eval_local_completions_multiple_choice(server: LiveServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    before = server.wait_idle()
    model_args = ",".join(
        [
            "model=tiny-llama",
            f"base_url={server.url}/v1/completions",
            f"tokenizer={tiny_model_dir}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        OPENAI_API_KEY="unused",
    )
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        "rill_mc",
        "--include_path",
        str(TASK_DIR),
        "--limit",
        str(NUM_DOCS),
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
    ]
    # The task's data_files path is relative: lm_eval runs in the task's folder.
    done = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "rill_mc" in done.stdout and "acc" in done.stdout  # the printed results table

    [results_file] = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    acc = results["results"]["rill_mc"]["acc,none"]
    assert results["n-samples"]["rill_mc"]["effective"] == NUM_DOCS
    [samples_file] = (tmp_path / "out").rglob("samples_rill_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
    assert len(samples) == NUM_DOCS
    for sample in samples:
        scores = [float(resp[0]) for resp in sample["filtered_resps"]]
        assert len(scores) == NUM_CHOICES and all(s < 0 for s in scores)  # real loglikelihoods, not padding
        assert sample["acc"] == float(scores.index(max(scores)) == int(sample["target"]))
    assert acc == pytest.approx(sum(s["acc"] for s in samples) / NUM_DOCS)

    after = server.wait_idle()
    finished = sum(after.requests_finished_total.values()) - sum(before.requests_finished_total.values())
    assert finished == NUM_DOCS * NUM_CHOICES  # one echo request per (question, choice), all served by rill
    assert after.requests_finished_total.get("error", 0) == before.requests_finished_total.get("error", 0)
