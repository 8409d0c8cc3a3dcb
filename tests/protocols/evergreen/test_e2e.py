"""Evergreen end to end: a real server (tiny random model) over a real gRPC channel and the
``/evergreen`` WebSocket. Random weights give gibberish, so tests assert structure, equality
between transports and runs, status codes and engine counters, never wording."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from rill.clients.evergreen import EvergreenClient, EvergreenError, prompt_message
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.messages import GenerateConfig, SessionMessage
from tests.conftest import free_port, start_server

from .helpers import (
    conversation_turn_1,
    conversation_turn_2,
    customized_generate,
    generate,
    leaf,
    msg,
    parent,
    streamed_chains,
)

GREEDY = GenerateConfig(temperature=0.0, max_tokens=6)
LONG = GenerateConfig(temperature=0.0, max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("evergreen-files")
    (root / "question.txt").write_text("Tell me about the jam doughnut.")
    return root


@pytest.fixture(scope="module")
def live(tiny_model_dir, files):
    """This module's server: gRPC on, one file root, one torch thread.

    NOTE: one OpenMP thread per engine step is many times faster than two on this shared
    2-core machine under load (as batch_ws's tests measured).
    """
    import torch

    threads_before = torch.get_num_threads()
    server = start_server(
        tiny_model_dir,
        **{"evergreen.grpc_port": free_port(), "engine.num_threads": 1, "evergreen.evergreen_file_root": [str(files)]},
    )
    yield server
    server.stop()
    torch.set_num_threads(threads_before)  # the engine sets it process-wide


def grpc_address(live) -> str:
    return f"127.0.0.1:{live.config.evergreen.grpc_port}"


async def run_grpc(live, messages: list[SessionMessage], *, end_input: bool = True) -> list[SessionMessage]:
    """Send every message, half-close, collect replies until the status (raises EvergreenError)."""
    async with EvergreenClient(grpc_address(live)) as client:
        session = client.open_session()
        for m in messages:
            await session.send(m)
        if end_input:
            await session.end_input()
        replies = []
        while (reply := await session.receive()) is not None:
            replies.append(reply)
        return replies


async def run_ws(live, messages: list[SessionMessage], *, wait_for: set[str]) -> list[SessionMessage]:
    """Send every message over /evergreen; collect replies until each node in ``wait_for`` is final."""
    replies = []
    async with ws_connect(f"{live.ws_url}/evergreen") as ws:
        for m in messages:
            await ws.send(codec.encode_json(m))
        pending = set(wait_for)
        while pending:
            reply = codec.decode_json(await ws.recv())
            replies.append(reply)
            pending -= {f.id for f in reply.node_fragments if not f.continued}
    return replies


def output(replies: list[SessionMessage], node_id: str) -> tuple[str, list]:
    """The text of output node ``node_id`` and its fragments, checking the fragment rules."""
    fragments = [f for r in replies for f in r.node_fragments if f.id == node_id]
    assert [f.seq for f in fragments] == list(range(len(fragments)))
    assert [f.continued for f in fragments] == [True] * (len(fragments) - 1) + [False]
    assert fragments[0].chunk_fragment.metadata.mimetype == "text/plain"
    assert fragments[0].chunk_fragment.metadata.role == "model"
    assert all(f.chunk_fragment.metadata is None for f in fragments[1:])
    return b"".join(f.chunk_fragment.data or b"" for f in fragments).decode(), fragments


# -- README examples ------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", [customized_generate, streamed_chains])
async def test_readme_examples_over_grpc_and_websocket_give_the_same_reply(live, example):
    by_grpc, fragments = output(await run_grpc(live, example(GREEDY)), "response_1")
    by_ws, _ = output(await run_ws(live, example(GREEDY), wait_for={"response_1"}), "response_1")
    assert by_grpc  # (how many fragments depends on how the engine's deltas coalesce)
    assert by_grpc == by_ws
    live.wait_idle()


async def test_both_readme_examples_build_the_same_prompt(live):
    # "Streamed chains" is "Customized generate action" with prompt_1 streamed in two parts.
    a, _ = output(await run_grpc(live, customized_generate(GREEDY)), "response_1")
    b, _ = output(await run_grpc(live, streamed_chains(GREEDY)), "response_1")
    assert a == b


async def _two_turns(live, send_turn, tag: str) -> tuple[str, int, int]:
    before = live.stats()
    first = await send_turn(conversation_turn_1(GREEDY, tag), "response_1")
    middle = live.wait_idle()
    second = await send_turn(conversation_turn_2(GREEDY), "response_2")
    after = live.wait_idle()
    turn_1_prompt_tokens = middle.prompt_tokens_total - before.prompt_tokens_total
    hits = after.prefix_cache_hits_tokens - middle.prefix_cache_hits_tokens
    # Turn 1 is new to the cache (only the chat template's opening can match earlier prompts).
    assert middle.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens < turn_1_prompt_tokens - 4
    print(
        f"turn 1 prompt {turn_1_prompt_tokens} tokens; turn 2 reused {hits} cached tokens "
        f"(prompt {after.prompt_tokens_total - middle.prompt_tokens_total})"
    )
    return first + second, turn_1_prompt_tokens, hits


async def test_two_turn_conversation_over_grpc_reuses_the_first_turns_kv(live):
    async with EvergreenClient(grpc_address(live)) as client:
        session = client.open_session()
        replies: list[SessionMessage] = []

        async def send_turn(messages, node_id):
            for m in messages:
                await session.send(m)
            while True:
                reply = await session.receive()
                replies.append(reply)
                if any(f.id == node_id and not f.continued for f in reply.node_fragments):
                    return reply.node_fragments[-1].id

        _, turn_1_tokens, hits = await _two_turns(live, send_turn, " (gRPC)")
        await session.end_input()
        assert await session.receive() is None  # status OK once every action finished
    output(replies, "response_1")
    output(replies, "response_2")
    assert hits >= turn_1_tokens > 0


async def test_two_turn_conversation_over_websocket_reuses_the_first_turns_kv(live):
    async with ws_connect(f"{live.ws_url}/evergreen") as ws:
        replies: list[SessionMessage] = []

        async def send_turn(messages, node_id):
            for m in messages:
                await ws.send(codec.encode_json(m))
            while True:
                reply = codec.decode_json(await ws.recv())
                replies.append(reply)
                if any(f.id == node_id and not f.continued for f in reply.node_fragments):
                    return node_id

        _, turn_1_tokens, hits = await _two_turns(live, send_turn, " (WebSocket)")
    output(replies, "response_2")
    assert hits >= turn_1_tokens > 0


async def test_second_turn_sent_before_the_first_finishes_waits_for_it(live):
    replies = await run_grpc(live, conversation_turn_1(GREEDY) + conversation_turn_2(GREEDY))
    first = [i for i, r in enumerate(replies) for f in r.node_fragments if f.id == "response_1" and not f.continued]
    second = [i for i, r in enumerate(replies) for f in r.node_fragments if f.id == "response_2"]
    assert first and second and first[0] < second[0]


# -- cancellation frees KV ------------------------------------------------------------------------------


async def test_cancelling_the_grpc_call_mid_generation_frees_the_kv(live):
    async with EvergreenClient(grpc_address(live)) as client:
        session = client.open_session()
        message, output_id = prompt_message("Go on and on.", config=LONG)
        await session.send(message)
        reply = await session.receive()
        assert reply.node_fragments[0].id == output_id and reply.node_fragments[0].continued
        busy = live.stats()
        assert busy.num_running == 1 and busy.kv_used_bytes > 0
        session.cancel()
        idle = live.wait_idle()
    assert idle.generation_tokens_total - busy.generation_tokens_total < LONG.max_tokens
    assert idle.requests_finished_total.get("cancelled", 0) >= 1


async def test_closing_the_websocket_mid_generation_frees_the_kv(live):
    message, output_id = prompt_message("Go on and on.", config=LONG)
    async with ws_connect(f"{live.ws_url}/evergreen") as ws:
        await ws.send(codec.encode_json(message))
        reply = codec.decode_json(await ws.recv())
        assert reply.node_fragments[0].id == output_id
        assert live.stats().kv_used_bytes > 0
    live.wait_idle()


async def test_an_abort_cancels_every_running_action(live):
    message, _ = prompt_message("Go on and on.", config=LONG)
    other, _ = prompt_message("And on.", config=LONG)
    with pytest.raises(EvergreenError, match="INVALID_ARGUMENT"):
        async with EvergreenClient(grpc_address(live)) as client:
            session = client.open_session()
            await session.send(message)
            await session.send(other)
            await session.receive()
            await session.send(msg(generate(name="DANCE")))
            while await session.receive() is not None:
                pass
    live.wait_idle()


# -- aborts and their status ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, status, words",
    [
        ([msg(generate(target="no-such-model"))], "NOT_FOUND", "target_spec.id 'no-such-model'"),
        ([msg(generate(name="DANCE"))], "INVALID_ARGUMENT", "unknown action name 'DANCE'"),
        (
            [msg(generate(configs=(codec.AnyMessage(type_url="type.googleapis.com/x.Y"),)))],
            "INVALID_ARGUMENT",
            "unknown config type",
        ),
        (
            [msg(leaf("p", ref="file:///data/v.mp4", mimetype="video/mp4")), msg(generate())],
            "INVALID_ARGUMENT",
            "mimetype 'video/mp4'",
        ),
        ([msg(leaf("p", ref="https://example.com/a.txt")), msg(generate())], "INVALID_ARGUMENT", "scheme 'https'"),
        ([msg(leaf("p", ref="file:///etc/hostname")), msg(generate())], "PERMISSION_DENIED", "outside the allowed"),
        (
            [msg(leaf("p", "x")), msg(leaf("p", "y", seq=1, mimetype=None))],
            "INVALID_ARGUMENT",
            "after the final fragment",
        ),
        ([msg(parent("p", "never")), msg(generate())], "FAILED_PRECONDITION", "'never'"),
    ],
)
async def test_aborts_over_grpc_carry_status_and_rule(live, messages, status, words):
    with pytest.raises(EvergreenError) as info:
        await run_grpc(live, messages)
    assert info.value.status == status
    assert words in info.value.message


async def test_aborts_before_the_engine_count_as_rejections(live):
    import httpx

    with pytest.raises(EvergreenError):
        await run_grpc(live, [msg(generate(name="DANCE"))])
    metrics = httpx.get(f"{live.url}/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    rejected = [
        s.labels
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "rill_requests_rejected_total"
    ]
    assert any(
        {"protocol": "evergreen", "code": "session_rule_broken"}.items() <= labels.items() and labels["model_name"]
        for labels in rejected
    )


async def test_missing_file_under_a_root_is_not_found(live, files):
    with pytest.raises(EvergreenError) as info:
        await run_grpc(live, [msg(leaf("p", ref=f"file://{files}/missing.txt")), msg(generate())])
    assert (info.value.status, "no such file" in info.value.message) == ("NOT_FOUND", True)


async def test_symlink_out_of_a_root_is_denied(live, files, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    link = files / "link.txt"
    if not link.exists():
        os.symlink(secret, link)
    with pytest.raises(EvergreenError) as info:
        await run_grpc(live, [msg(leaf("p", ref=f"file://{link}")), msg(generate())])
    assert info.value.status == "PERMISSION_DENIED"


async def test_file_ref_under_a_root_is_read_as_the_prompt(live, files):
    by_ref, _ = output(
        await run_grpc(live, [msg(leaf("p", ref=f"file://{files}/question.txt")), msg(generate(config=GREEDY))]), "r"
    )
    by_data, _ = output(
        await run_grpc(live, [msg(leaf("p", (files / "question.txt").read_text())), msg(generate(config=GREEDY))]), "r"
    )
    assert by_ref == by_data


async def test_websocket_abort_is_a_close_code_and_reason(live):
    async with ws_connect(f"{live.ws_url}/evergreen") as ws:
        await ws.send(codec.encode_json(msg(generate(target="no-such-model"))))
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
    assert info.value.rcvd.code == 4005
    assert info.value.rcvd.reason.startswith("NOT_FOUND: action 0")


async def test_websocket_accepts_snake_case_json_and_rejects_garbage(live):
    text = json.dumps(
        {
            "node_fragments": [
                {"id": "p", "chunk_fragment": {"metadata": {"mimetype": "text/plain"}, "data": "SGVsbG8="}}
            ],
            "actions": [
                {
                    "name": "GENERATE",
                    "inputs": [{"name": "text", "id": "p"}],
                    "outputs": [{"name": "text", "id": "out"}],
                    "configs": [{"@type": codec.GENERATE_CONFIG_TYPE_URL, "temperature": 0, "max_tokens": 3}],
                }
            ],
        }
    )
    async with ws_connect(f"{live.ws_url}/evergreen") as ws:
        await ws.send(text)
        replies = []
        while not replies or replies[-1].node_fragments[-1].continued:
            replies.append(codec.decode_json(await ws.recv()))
        assert json.loads(codec.encode_json(replies[0]))["nodeFragments"][0]["id"] == "out"
        await ws.send("{not json")
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
    assert info.value.rcvd.code == 4003
    output(replies, "out")


# -- independent client and command line -----------------------------------------------------------------

PUBLISHED_EVERGREEN = """
syntax = "proto3";
package evergreen.v2;
import "google/protobuf/any.proto";
import "google/protobuf/timestamp.proto";

message NodeFragment {
  string id = 1;
  int32 seq = 2;
  bool continued = 3;
  repeated string child_ids = 4;
  optional Chunk chunk_fragment = 5;
}
message Chunk {
  ChunkMetadata metadata = 1;
  oneof payload {
    string ref = 3;
    bytes data = 10;
  }
}
message ChunkMetadata {
  string mimetype = 1;
  string role = 2;
  string original_file_name = 3;
  google.protobuf.Timestamp capture_time = 6;
  repeated google.protobuf.Any experimental = 100;
}
message NamedParameter {
  string name = 1;
  string id = 2;
}
message TargetSpec {
  string id = 1;
}
message Action {
  reserved 1;
  string name = 2;
  repeated NamedParameter inputs = 3;
  repeated NamedParameter outputs = 4;
  repeated google.protobuf.Any configs = 5;
  TargetSpec target_spec = 6;
}
"""

PUBLISHED_SERVICE = """
syntax = "proto3";
package evergreen.v2;
import "evergreen.proto";

message SessionMessage {
  repeated NodeFragment node_fragments = 1;
  repeated Action actions = 2;
}

service EvergreenService {
  rpc StartSession(stream SessionMessage) returns (stream SessionMessage) {}
}
"""

INDEPENDENT_CLIENT = """
import sys
sys.path.insert(0, sys.argv[1])
import grpc
import evergreen_pb2 as pb, evergreen_service_pb2 as spb, evergreen_service_pb2_grpc as sgrpc
assert "rill" not in sys.modules

def messages():
    yield spb.SessionMessage(actions=[pb.Action(name="GENERATE", inputs=[pb.NamedParameter(name="prompt", id="q")],
                                                outputs=[pb.NamedParameter(name="response", id="a")])])
    yield spb.SessionMessage(node_fragments=[pb.NodeFragment(id="q", chunk_fragment=pb.Chunk(
        metadata=pb.ChunkMetadata(mimetype="text/plain", role="user"), data=b"Hello"))])

with grpc.insecure_channel(sys.argv[2]) as channel:
    fragments = [f for reply in sgrpc.EvergreenServiceStub(channel).StartSession(messages()) for f in reply.node_fragments]
print([(f.id, f.seq, f.continued, f.chunk_fragment.metadata.mimetype) for f in fragments])
"""


def test_a_client_built_from_the_published_protos_completes_a_generate(live, tmp_path):
    import grpc_tools
    from grpc_tools import protoc

    (tmp_path / "evergreen.proto").write_text(PUBLISHED_EVERGREEN)
    (tmp_path / "evergreen_service.proto").write_text(PUBLISHED_SERVICE)
    include = Path(grpc_tools.__file__).parent / "_proto"
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{tmp_path}",
                f"-I{include}",
                f"--python_out={tmp_path}",
                f"--grpc_python_out={tmp_path}",
                "evergreen.proto",
                "evergreen_service.proto",
            ]
        )
        == 0
    )
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(INDEPENDENT_CLIENT))
    # A fresh interpreter: nothing of rill is imported, and its descriptors cannot collide.
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), grpc_address(live)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    fragments = eval(done.stdout.strip())  # a list literal printed by the script
    assert fragments[0] == ("a", 0, len(fragments) > 1, "text/plain")
    assert fragments[-1][2] is False and all(f[0] == "a" for f in fragments)


def test_rill_client_evergreen_streams_a_reply(live, capsys):
    from rill.cli import main

    code = main(
        [
            "client",
            "evergreen",
            "--prompt",
            "Hello",
            "--address",
            grpc_address(live),
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ]
    )
    assert code == 0
    assert capsys.readouterr().out.endswith("\n")
    assert main(["client", "evergreen", "--prompt", "Hi", "--address", grpc_address(live), "--target", "nope"]) == 2
    assert "NOT_FOUND" in capsys.readouterr().err


# -- issue 12: file refs and large prompts (items 3 and 6) ---------------------------------------------


def _ref_leaf(node_id: str, uri: str, num_refs: int) -> list:
    from rill.protocols.evergreen.messages import Chunk, ChunkMetadata, NodeFragment

    meta = ChunkMetadata(mimetype="text/plain")
    return [
        NodeFragment(
            id=node_id,
            seq=i,
            continued=i < num_refs - 1,
            chunk_fragment=Chunk(metadata=meta if i == 0 else None, ref=uri),
        )
        for i in range(num_refs)
    ]


async def test_twenty_refs_to_a_1mb_file_are_refused_and_the_server_stays_up(live, files):
    # The audit's 2.4 KB message took the server from 0.7 to 2.1 GB; now the prompt it
    # expands to is over --evergreen-max-prompt-bytes before anything is copied per ref.
    (files / "big.txt").write_bytes(b"word " * (1024 * 1024 // 5))
    with pytest.raises(EvergreenError) as info:
        await run_grpc(live, [msg(*_ref_leaf("p", f"file://{files}/big.txt", 20)), msg(generate(config=GREEDY))])
    assert info.value.status == "RESOURCE_EXHAUSTED" and "max-prompt-bytes" in info.value.message
    text, _ = output(await run_grpc(live, [msg(leaf("p", "Hello")), msg(generate(config=GREEDY))]), "r")
    assert text  # the server still serves


async def test_a_fifo_in_the_root_is_invalid_argument_and_blocks_nothing(live, files):
    fifo = files / "pipe"
    if not fifo.exists():
        os.mkfifo(fifo)
    with pytest.raises(EvergreenError) as info:
        await run_grpc(live, [msg(leaf("p", ref=f"file://{fifo}")), msg(generate(config=GREEDY))])
    assert info.value.status == "INVALID_ARGUMENT" and "regular file" in info.value.message


async def test_a_nul_in_a_ref_is_invalid_argument(live, files):
    with pytest.raises(EvergreenError) as info:
        await run_grpc(live, [msg(leaf("p", ref=f"file://{files}/question.txt%00.png")), msg(generate(config=GREEDY))])
    assert info.value.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize("method", ["receive", "request_for"])
async def test_health_answers_while_a_message_is_taken_and_a_prompt_built(live, monkeypatch, method):
    # Item 6: taking a message (decoding it, storing its fragments, expanding the inputs of
    # the actions it starts: a 21 MB shared-node expansion stalled the loop 12.7 s) and
    # building an action's prompt (refs joined, text decoded) run in a worker thread. The
    # work is held at a gate; /health must answer meanwhile, which it could not if the work
    # ran on the event loop.
    import asyncio
    import threading

    import httpx

    from rill.protocols.evergreen.session import EvergreenSession

    entered, release = threading.Event(), threading.Event()
    threads: list[int] = []
    real = getattr(EvergreenSession, method)

    def gated(self, *args):
        if not entered.is_set() and (method == "request_for" or args[0].actions):  # the message with the action
            threads.append(threading.get_ident())
            entered.set()
            release.wait(60)
        return real(self, *args)

    monkeypatch.setattr(EvergreenSession, method, gated)
    shared = "A shared line about jam doughnuts. "
    messages = [
        msg(leaf("shared", shared)),
        msg(parent("p", "shared", "s2", "s3")),
        msg(parent("s2", "shared"), parent("s3", "shared")),
        msg(generate(config=GREEDY)),
    ]
    run = asyncio.ensure_future(run_grpc(live, messages))
    try:
        assert await asyncio.to_thread(entered.wait, 60)
        async with httpx.AsyncClient() as http:
            health = await http.get(f"{live.url}/health", timeout=30)
        assert health.status_code == 200 and not run.done()
    finally:
        release.set()
    text, _ = output(await run, "r")
    assert text and threads and live.thread.ident not in threads


async def test_long_ids_and_fragment_floods_abort_with_resource_exhausted(live):
    # Item 7: 500 node ids of 390 KB held +279 MB and 1,000,000 empty fragments +116 MB.
    # One message each: grpc's asyncio client replaces the server's status by a local
    # INTERNAL when it writes after the server ended the call (grpc/grpc#36066).
    from rill.protocols.evergreen.messages import NodeFragment, SessionMessage

    long_id = SessionMessage(node_fragments=(NodeFragment(id="x" * 390_000, continued=True),))
    flood = SessionMessage(
        node_fragments=tuple(NodeFragment(id="n", seq=seq, continued=True) for seq in range(100_001))
    )
    for message, words in ((long_id, "evergreen-max-id-bytes"), (flood, "evergreen-max-fragments")):
        with pytest.raises(EvergreenError) as info:
            await run_grpc(live, [message])
        assert info.value.status == "RESOURCE_EXHAUSTED" and words in info.value.message
