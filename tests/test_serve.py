"""`rill serve` as a user runs it: a broken model folder ends it with a clear reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port


def _serve(model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rill",
            "serve",
            "--model",
            str(model),
            "--port",
            str(free_port()),
            "--no-socket",
            "--grpc-port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "setup, reason",
    [
        (lambda folder: None, "does not exist"),
        (lambda folder: folder.mkdir(), "config.json"),
        (
            lambda folder: (
                folder.mkdir(),
                (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})),
            ),
            "unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
        ),
    ],
    ids=["missing-folder", "no-config", "unknown-architecture"],
)
def test_broken_model_folder_ends_serve_with_its_reason(tmp_path: Path, setup, reason: str) -> None:
    folder = tmp_path / "model"
    setup(folder)
    result = _serve(folder, tmp_path)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rill: error: ") and reason in last
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "reason"),
    [
        (["--api-key", ""], {}, "--api-key: an API key must not be empty"),
        ([], {"RILL_API_KEY": ""}, "RILL_API_KEY: an API key must not be empty"),
        (["--api-key-file", "{keys}"], {}, "has no key"),
    ],
    ids=["empty-flag", "empty-env", "comment-only-file"],
)
def test_auth_that_would_turn_itself_off_ends_serve_with_exit_2(
    tmp_path: Path, args: list, env: dict, reason: str
) -> None:
    # Regression (issue 12 item 10): each of these used to start a server without auth
    # (or, for --api-key "", one whose gRPC port accepted an empty bearer token).
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys go here\n\n")
    command = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--port",
        str(free_port()),
        "--no-socket",
        "--grpc-port",
        "0",
        "--data-dir",
        str(tmp_path / "data"),
        *[a.format(keys=keys) for a in args],
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rill: error: ") and reason in last
    assert "Traceback" not in result.stderr


def test_a_low_open_file_limit_caps_the_connections_below_it(tmp_path: Path) -> None:
    # Issue 12 item 8: at the process's fd limit every listener stops accepting, so the
    # connection limit must stay below it when the limit cannot be raised.
    # The child lowers its own limit and then becomes rill: a preexec_fn would fork this
    # test process, whose gRPC (loaded by other tests) runs its fork handlers in the child
    # before exec, and under load that child sometimes died there with only gRPC's epoll
    # error on stderr, never starting rill.
    launcher = (
        "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (600, 600)); "
        "os.execv(sys.executable, [sys.executable, '-m', 'rill', *sys.argv[1:]])"
    )
    command = [
        sys.executable,
        "-c",
        launcher,
        "serve",
        "--port",
        str(free_port()),
        "--no-socket",
        "--grpc-port",
        "0",
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        str(tmp_path / "missing-model"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert "open-file limit (600) is below --max-connections 2048" in result.stderr
    assert "connections are capped at 344" in result.stderr


def test_every_protocol_package_is_registered_once() -> None:
    # The server mounts an explicit list; a protocol package left out of it would never serve.
    import rill.protocols
    from rill import server

    packages = {
        p.name
        for p in Path(rill.protocols.__file__).parent.iterdir()
        if p.is_dir() and not p.name.startswith("_") and (p / "adapter.py").exists()
    }
    names = [protocol.name for protocol in server.protocols()]
    assert sorted(names) == sorted(packages) and len(packages) == 6
    assert all(protocol.routes or protocol.start for protocol in server.protocols())


def test_a_server_without_replicas_never_loads_ray(tiny_model_dir: Path) -> None:
    """Ray is an optional extra: a single-process server (serving a request, too) never imports
    it; its compiled core would show in the process's memory map."""
    import httpx

    from tests.helpers import rill_process

    with rill_process(tiny_model_dir) as (proc, url):
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "_raylet" not in maps and "/ray/" not in maps


def test_replica_settings_are_checked(tmp_path: Path) -> None:
    """--replicas and its companions are refused with the setting named, before anything starts."""
    from rill.config import ClusterConfig, ServerConfig, validate
    from rill.errors import ConfigError

    for cluster, named in (
        (ClusterConfig(replicas=0), "replicas"),
        (ClusterConfig(ray_address="auto"), "--replicas"),
        (ClusterConfig(replicas=2, replica_cpus=0), "replica_cpus"),
        (ClusterConfig(replicas=2, routing="random"), "routing"),
    ):
        with pytest.raises(ConfigError, match=named):
            validate(ServerConfig(cluster=cluster))


def test_a_loaded_server_freezes_its_start_up_objects_and_thaws_them_when_it_stops(tiny_model_dir: Path) -> None:
    """Once the model is loaded, what start-up made is out of the garbage collector's walks
    (a full collection of a loaded server paused both threads for ~140 ms); a stopped server
    gives them back to a process that goes on."""
    import gc

    from tests.cluster.conftest import wait_for
    from tests.conftest import start_server

    live = start_server(tiny_model_dir)
    try:
        wait_for(gc.get_freeze_count, 30, "the start-up objects frozen after the model loaded")
    finally:
        live.stop()
    assert gc.get_freeze_count() == 0
