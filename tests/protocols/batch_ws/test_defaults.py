"""generation_config defaults of batch /ws: environment, .env in the working folder, RILL_* names."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rill import config
from rill.errors import ConfigError
from rill.protocols.batch_ws import adapter, service


def test_source_project_names_and_rill_names(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text(
        "MODEL_DEFAULT_NUM_BEAMS = 2\nMODEL_DEFAULT_DO_SAMPLE = false\nMODEL_DEFAULT_TEMPERATURE=0.5\n"
        "RILL_DEFAULT_TOP_K=7\nMODEL_DEFAULT_TOP_K=9\nMODEL_DEFAULT_MAX_NEW_TOKENS=33\n"
    )
    defaults = config.sampling_defaults(
        {"MODEL_DEFAULT_TEMPERATURE": "0.9", "RILL_DEFAULT_LENGTH_PENALTY": "1.5"}, env_file
    )
    assert defaults == config.SamplingDefaults(
        num_beams=2,
        do_sample=False,
        temperature=0.9,
        top_p=1.0,
        top_k=7,
        max_new_tokens=33,
        repetition_penalty=1.0,
        length_penalty=1.5,
    )


def test_real_environment_wins_over_dotenv_and_rill_name_wins_within_a_source(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("RILL_DEFAULT_TOP_P=0.5\n")
    assert config.sampling_defaults({"MODEL_DEFAULT_TOP_P": "0.7"}, env_file).top_p == 0.7
    assert config.sampling_defaults({"MODEL_DEFAULT_TOP_P": "0.7", "RILL_DEFAULT_TOP_P": "0.8"}, env_file).top_p == 0.8


def test_without_env_or_file_the_source_project_defaults_apply(tmp_path: Path) -> None:
    assert config.sampling_defaults({}, tmp_path / "missing.env") == config.SamplingDefaults()


def test_bad_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="MODEL_DEFAULT_MAX_NEW_TOKENS: cannot use 'lots' as int"):
        config.sampling_defaults({"MODEL_DEFAULT_MAX_NEW_TOKENS": "lots"}, None)


def fake_deps(defaults: config.SamplingDefaults | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        client=None,
        config=config.load({}, env={}),
        sampling_defaults=defaults,
        api_keys=set(),
        metrics=None,
        memory=None,
    )


def test_adapter_reads_dotenv_of_the_working_folder_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MODEL_DEFAULT_TOP_K", raising=False)
    monkeypatch.delenv("RILL_DEFAULT_TOP_K", raising=False)
    (tmp_path / ".env").write_text("MODEL_DEFAULT_TOP_K=3\n")
    shared = service.BatchService(fake_deps())
    assert shared.defaults.top_k == 3
    assert [route.path for route in adapter.routes(fake_deps())] == ["/ws", "/api/ws"]


def test_adapter_refuses_to_start_with_invalid_defaults() -> None:
    bad = config.SamplingDefaults(top_p=3.0)
    with pytest.raises(ConfigError, match="MODEL_DEFAULT_.*'top_p' must be in"):
        adapter.routes(fake_deps(bad))
