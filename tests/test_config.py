"""The config loader: precedence flags > RILL_* environment > TOML file > defaults, and errors.

Flags are given both as ``load()`` mappings and through the real ``rill serve`` argument
parser, so the dest names the CLI produces are covered too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rill import config
from rill.cli import _config_flags, build_parser
from rill.errors import ConfigError


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rill.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_source() -> None:
    cfg = config.load({}, env={})
    assert cfg.http.port == 8000 and cfg.policy.api_key == [] and cfg.engine.max_queue == 1024
    assert cfg.api_keys() == set()


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "port = 7001\nmax_queue = 11\nhost = '0.0.0.0'\n[http]\nmax_tokens_cap = 99\n")
    file_only = config.load({"config": path}, env={})
    assert (file_only.http.port, file_only.engine.max_queue, file_only.http.host) == (7001, 11, "0.0.0.0")
    assert file_only.policy.max_tokens_cap == 99  # from the [http] section, where it was before [policy]

    env = {"RILL_PORT": "7002", "RILL_MAX_QUEUE": "22"}
    with_env = config.load({"config": path}, env=env)
    assert (with_env.http.port, with_env.engine.max_queue, with_env.http.host) == (7002, 22, "0.0.0.0")

    with_flags = config.load({"config": path, "http.port": "7003"}, env=env)
    assert (with_flags.http.port, with_flags.engine.max_queue, with_flags.http.host) == (7003, 22, "0.0.0.0")


def test_precedence_through_the_cli_parser(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[http]\nport = 7001\napi_key = ['from-file']\ncors_origins = ['https://a.example']\n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", path, "--api-key", "k1", "--api-key", "k2", "--max-queue", "5"])
    cfg = config.load(_config_flags(args), env={"RILL_PORT": "7100", "RILL_API_KEY": "from-env"})
    assert cfg.http.port == 7100  # env beats the file
    assert cfg.policy.api_key == ["k1", "k2"]  # repeated flag beats env and file
    assert cfg.engine.max_queue == 5
    assert cfg.http.cors_origins == ["https://a.example"]


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    path = _toml(tmp_path, "max_body_bytes = 1234\n")
    assert config.load({}, env={"RILL_CONFIG": path}).http.max_body_bytes == 1234


def test_env_conversions() -> None:
    cfg = config.load(
        {},
        env={
            "RILL_API_KEY": "a, b,,c",
            "RILL_NO_SOCKET": "yes",
            "RILL_SSE_KEEPALIVE_S": "0.5",
            "RILL_MAX_TOKENS_CAP": "",
        },
    )
    assert cfg.policy.api_key == ["a", "b", "c"]
    assert cfg.uds.no_socket is True and cfg.http.sse_keepalive_s == 0.5
    assert cfg.policy.max_tokens_cap is None  # empty means unset for an optional setting
    assert config.load({}, env={"RILL_NO_SOCKET": "off"}).uds.no_socket is False


def test_api_keys_from_flags_and_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\n  alpha  \n\n   # indented comment\nbeta\n")
    cfg = config.load({"http.api_key": ["gamma"], "http.api_key_file": str(key_file)}, env={})
    assert cfg.api_keys() == {"alpha", "beta", "gamma"}
    missing = config.load({"http.api_key_file": str(tmp_path / "nope")}, env={})
    with pytest.raises(ConfigError, match="api-key-file"):
        missing.api_keys()


@pytest.mark.parametrize(
    ("source", "value", "message"),
    [
        ("env", {"RILL_PORT": "eighty"}, "RILL_PORT"),
        ("env", {"RILL_NO_SOCKET": "maybe"}, "RILL_NO_SOCKET"),
        ("flags", {"http.max_body_bytes": "0"}, "max_body_bytes"),
        ("flags", {"http.max_tokens_cap": "0"}, "max_tokens_cap"),
        ("flags", {"http.port": "70000"}, "port"),
        ("flags", {"http.log_level": "loud"}, "log_level"),
        ("flags", {"engine.dtype": "int3"}, "dtype"),
        ("flags", {"http.sse_keepalive_s": "-1"}, "sse_keepalive_s"),
        ("flags", {"http.rate_limit_requests": "0"}, "rate_limit_requests must be >= 1"),
        ("flags", {"http.rate_limit_window": "0"}, "rate_limit_window must be a number of seconds > 0"),
        ("flags", {"http.rate_limit_window": "nan"}, "rate_limit_window"),
        ("flags", {"http.rate_limit_tokens_per_s": "0"}, "rate_limit_tokens_per_s must be > 0"),
        ("flags", {"http.rate_limit_burst": "0"}, "rate_limit_burst must be >= 1"),
        ("flags", {"http.request_timeout_s": "nan"}, "request_timeout_s must be > 0 and finite, not nan"),
        ("flags", {"http.request_timeout_s": "inf"}, "request_timeout_s must be > 0 and finite, not inf"),
        ("flags", {"http.forwarded_allow_ips": ["proxy.local"]}, "forwarded_allow_ips: 'proxy.local' is not an IP"),
        ("flags", {"http.feedback_max_bytes_per_principal": "lots"}, "feedback_max_bytes_per_principal"),
        ("flags", {"embeddings.embedding_max_inputs": "0"}, "embedding_max_inputs must be >= 1"),
        ("flags", {"embeddings.embedding_batch_tokens": "0"}, "embedding_batch_tokens must be >= 1"),
        (
            "flags",
            {"embeddings.embedding_max_inputs": "64", "embeddings.embedding_max_queued_inputs": "32"},
            r"embedding_max_queued_inputs \(32\) must be at least embedding_max_inputs \(64\)",
        ),
    ],
)
def test_bad_values_name_the_setting(source: str, value: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        if source == "env":
            config.load({}, env=value)
        else:
            config.load(value, env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_tokens_cap = 2.7\n", "max_tokens_cap: cannot use 2.7"),  # not silently 2
        ("port = true\n", "port: cannot use True"),
        ("[http]\ncors_origin = ['x']\n", "unknown setting 'cors_origin' in \\[http\\] \\(did you mean 'cors_origins'"),
        ("[engin]\nmax_queue = 3\n", "unknown section 'engin' \\(did you mean 'engine'"),
        ("porrt = 1\n", "unknown setting 'porrt'"),
        ("http = 3\n", "must be a table"),
        ("port = \n", "not valid TOML"),
    ],
)
def test_bad_config_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.load({"config": _toml(tmp_path, text)}, env={})


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load({"config": "/nonexistent/rill.toml"}, env={})


def test_every_field_has_a_flag_and_help() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for cls in config.AREAS.values():
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in help_text
            assert f.metadata.get("help")


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({}, {"RILL_API_KEY": ""}, "RILL_API_KEY: an API key must not be empty"),
        ({}, {"RILL_API_KEY": "  "}, "RILL_API_KEY: an API key must not be empty"),
        ({"http.api_key": [""]}, {}, "--api-key: an API key must not be empty"),
        ({"http.api_key": ["good", " "]}, {}, "--api-key: an API key must not be empty"),
        ({"http.api_key": ["two words"]}, {}, "printable ASCII without spaces"),
        ({"http.api_key": ["clé"]}, {}, "printable ASCII without spaces"),
    ],
)
def test_empty_or_unusable_api_keys_are_startup_errors(flags: dict, env: dict, message: str) -> None:
    # Regression (issue 12 item 10): RILL_API_KEY="" turned auth off without a word.
    with pytest.raises(ConfigError, match=message):
        config.load(flags, env=env)


@pytest.mark.parametrize("text", ["", "# only a comment\n\n   # another\n", "\n  \n"])
def test_a_key_file_without_a_key_is_a_startup_error(tmp_path: Path, text: str) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text(text)
    cfg = config.load({"http.api_key_file": str(key_file)}, env={})
    with pytest.raises(ConfigError, match="has no key"):
        cfg.api_keys()


def test_a_bad_key_in_the_file_names_its_line(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# keys\nalpha\nbad key\n")
    with pytest.raises(ConfigError, match="line 3: an API key must be printable ASCII"):
        config.load({"http.api_key_file": str(key_file)}, env={}).api_keys()


def test_per_client_shares_default_to_an_eighth_of_their_total() -> None:
    cfg = config.load(
        {
            "connections.max_connections": "400",
            "http.feedback_max_store_bytes": "8MiB",
            "http.forwarded_allow_ips": ["10.0.0.0/8", "127.0.0.1"],
        },
        env={},
    )
    assert cfg.connections.per_client_limit() == 50 and cfg.http.feedback_quota_bytes() == 1024 * 1024
    assert cfg.http.forwarded_allow_ips == ["10.0.0.0/8", "127.0.0.1"]
    assert config.load({}, env={}).http.forwarded_allow_ips == []  # default: no proxy believed


def test_policy_settings_have_their_own_section_and_keep_their_old_names(tmp_path: Path) -> None:
    # What binds every protocol lives in [policy]; the flags keep their names, and the old
    # [http] section and ``http.`` destinations still reach the settings that moved.
    path = _toml(tmp_path, "[policy]\nmax_tokens_cap = 7\nrate_limit_requests = 3\n[http]\nrequest_timeout_s = 2.5\n")
    cfg = config.load({"config": path}, env={})
    assert (cfg.policy.max_tokens_cap, cfg.policy.rate_limit_requests, cfg.policy.request_timeout_s) == (7, 3, 2.5)
    assert not hasattr(cfg.http, "max_tokens_cap") and not hasattr(cfg.http, "api_key")
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-tokens-cap", "9", "--api-key", "k", "--rate-limit-burst", "5"])
    flags = _config_flags(args)
    assert {"policy.max_tokens_cap", "policy.api_key", "policy.rate_limit_burst"} <= set(flags)
    from_flags = config.load(flags, env={})
    assert (from_flags.policy.max_tokens_cap, from_flags.api_keys(), from_flags.policy.rate_limit_burst) == (
        9,
        {"k"},
        5,
    )
    assert config.load({"http.max_tokens_cap": "4"}, env={}).policy.max_tokens_cap == 4
    with pytest.raises(ConfigError, match="unknown setting 'port' in \\[policy\\]"):
        config.load({"config": _toml(tmp_path, "[policy]\nport = 1\n")}, env={})


def test_served_model_name_before_and_after_the_model_loads() -> None:
    from rill.models.default import DEFAULT_MODEL_NAME
    from rill.types import ModelInfo

    name = config.served_model_name
    assert name(config.EngineConfig(model="/m/tiny-llama")) == "tiny-llama"
    assert name(config.EngineConfig(model="/m/Qwen2.5-0.5B.Q4_K_M.GGUF")) == "Qwen2.5-0.5B.Q4_K_M"
    assert name(config.EngineConfig()) == DEFAULT_MODEL_NAME
    assert name(config.EngineConfig(model="/m/tiny-llama", served_model_name="mine")) == "mine"
    loaded = ModelInfo(name="loaded", architecture="a", max_context_tokens=8, vocab_size=8, dtype="f", device="cpu")
    assert name(config.EngineConfig(model="/m/tiny-llama", served_model_name="mine"), loaded) == "loaded"


def test_the_embedding_model_from_each_source(tmp_path: Path) -> None:
    assert config.load({}, env={}).embeddings.embedding_model is None
    from_file = config.load({"config": _toml(tmp_path, "[embeddings]\nembedding_model = 'minilm'\n")}, env={})
    assert from_file.embeddings.embedding_model == "minilm"
    from_env = config.load({}, env={"RILL_EMBEDDING_MODEL": "/models/bge", "RILL_EMBEDDING_MAX_INPUTS": "16"})
    assert (from_env.embeddings.embedding_model, from_env.embeddings.embedding_max_inputs) == ("/models/bge", 16)
    args = build_parser().parse_args(["serve", "--embedding-model", "minilm", "--embedding-served-model-name", "e"])
    flags = config.load(_config_flags(args), env={}).embeddings
    assert (flags.embedding_model, flags.embedding_served_model_name) == ("minilm", "e")
    assert config.embedding_model_name(flags) == "e"
    assert config.embedding_model_name(config.EmbeddingConfig(embedding_model="/models/bge")) == "bge"
