"""The OpenAI Agents SDK's default model class (the Responses API) against a rill server.

The SDK lives in its own virtual environment (``.venv-agents``, made by ``make test``: it pins
``websockets<17``, which rill's own pin excludes), named by ``RILL_AGENTS_PYTHON``; the test
runs ``tests/fixtures/agents/run_agent.py`` with it. Run outside ``make test`` without that
environment, the test is skipped with the reason; under ``make test`` it is always there.

The model is a tiny random-init Qwen2 checkpoint with a Hermes tool template: the first turn
forces the tool (``tool_choice: required``; the SDK resets it to ``auto`` after a call) and the
last answer is a small structured output (``text.format`` json_schema), so random weights
still end it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveServer, start_server

SCRIPT = Path(__file__).parents[2] / "fixtures" / "agents" / "run_agent.py"


@pytest.fixture(scope="module")
def agents_python() -> str:
    python = os.environ.get("RILL_AGENTS_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip("the Agents SDK environment is not set up (make setup-agents; make test does it)")
    return python


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, agents_python: str) -> Iterator[LiveServer]:
    from rill.testing.checkpoints import TOOL_CHAT_TEMPLATE, make_checkpoint

    folder = make_checkpoint(
        tmp_path_factory.mktemp("models") / "tiny-qwen",
        arch="qwen2",
        chat_template=TOOL_CHAT_TEMPLATE,
        max_position_embeddings=2048,
    )
    live = start_server(folder, **{"engine.max_model_len": 2048, "http.data_dir": str(tmp_path_factory.mktemp("data"))})
    yield live
    live.stop()


def test_runner_completes_a_tool_round_trip(server: LiveServer, agents_python: str) -> None:
    done = subprocess.run(
        [
            agents_python,
            str(SCRIPT),
            f"{server.url}/v1",
            "tiny-qwen",
            "required",
            "What is the weather in Paris?",
            "--structured",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The model called the tool, the SDK ran it and sent its output back, and the model answered.
    assert result["items"] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert len(result["calls"]) == 1 and isinstance(result["calls"][0]["city"], str)
    assert isinstance(result["final_output"]["summary"], str)
    server.wait_idle()
