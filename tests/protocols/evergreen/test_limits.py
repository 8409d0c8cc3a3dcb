"""Issue 12, items 3 and 7: what one session may hold and read is bounded, each bound a
setting with a typed error (``SessionLimit``, RESOURCE_EXHAUSTED) past it; file refs are
counted, read once per file, regular files only, and bad paths are INVALID_ARGUMENT."""

from __future__ import annotations

import os
import threading

import pytest

from rill.protocols._shared.actions import Abort
from rill.protocols.evergreen import codec, file_refs
from rill.protocols.evergreen.errors import RefNotFound, SessionLimit, UnsupportedInput
from rill.protocols.evergreen.messages import Chunk, ChunkMetadata, NodeFragment
from rill.protocols.evergreen.session import (
    AbortSession,
    EvergreenSession,
    FileRef,
    Generate,
    ModelFacts,
    SessionLimits,
)
from rill.protocols.evergreen.store import FRAGMENT_COST_BYTES, ID_COST_BYTES, fragment_bytes

from .helpers import engine_output, generate, leaf, msg, parent

MIB = 1024 * 1024


def new(**limits) -> EvergreenSession:
    return EvergreenSession(SessionLimits(**limits), ModelFacts(name="tiny"))


def empty(node_id: str, seq: int) -> NodeFragment:
    return NodeFragment(id=node_id, seq=seq, continued=True)


def status(exc: BaseException) -> str:
    return codec.status_of(exc)[0]


def ref_leaf(node_id: str, uri: str, num_refs: int) -> list[NodeFragment]:
    """A leaf whose ``num_refs`` chunks all reference ``uri`` (the item-3 message)."""
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


# -- item 7: nodes, fragments, ids -----------------------------------------------------------------------


def test_a_million_empty_fragments_stop_at_the_default_fragment_limit():
    # The audit's message: empty fragments of one node, each a new seq. Only chunk data
    # counted before, so a session grew by 116 MB.
    s = new()
    with pytest.raises(SessionLimit, match="100000 node fragments") as info:
        s.receive(msg(*(empty("n", seq) for seq in range(SessionLimits().max_fragments + 1))))
    assert status(info.value) == "RESOURCE_EXHAUSTED"


def test_the_fragment_limit_is_a_setting_and_counts_generated_fragments():
    s = new(max_fragments=3)
    [g] = [c for c in s.receive(msg(leaf("p", "x"), generate("p", "r"))) if isinstance(c, Generate)]
    s.on_output(g.action_id, engine_output("a"), 0.0)
    s.on_output(g.action_id, engine_output("b"), 0.0)  # 3 fragments: p, r/0, r/1
    abort, *rest = s.on_output(g.action_id, engine_output("c", True), 0.0)  # a limit aborts the session
    assert isinstance(abort, AbortSession) and isinstance(abort.error, SessionLimit)
    assert "3 node fragments" in str(abort.error) and rest == [Abort(g.action_id)]


def test_empty_fragments_count_against_the_byte_limit():
    s = new(max_bytes=10 * FRAGMENT_COST_BYTES)
    with pytest.raises(SessionLimit, match="bytes"):
        s.receive(msg(*(empty("n", seq) for seq in range(10))))  # 10 x (cost + the id's byte)


@pytest.mark.parametrize("where", ["fragment", "child", "input", "output"])
def test_long_node_ids_are_refused_wherever_they_appear(where):
    # The audit sent 500 ids of 390 KB (+279 MB); the first is refused now.
    long_id = "x" * 390_000
    message = {
        "fragment": msg(leaf(long_id, "hi")),
        "child": msg(parent("p", long_id)),
        "input": msg(generate(long_id, "r")),
        "output": msg(generate("p", long_id)),
    }[where]
    with pytest.raises(SessionLimit, match="1024 bytes") as info:
        new().receive(message)
    assert status(info.value) == "RESOURCE_EXHAUSTED"


def test_the_id_limit_is_in_utf8_bytes():
    s = new(max_id_bytes=4)
    s.receive(msg(leaf("éé", "x")))  # 4 bytes
    with pytest.raises(SessionLimit):
        s.receive(msg(leaf("ééé", "x")))  # 3 characters, 6 bytes


def test_child_ids_cost_their_memory():
    f = parent("p", *(f"c{i}" for i in range(10)))
    assert fragment_bytes(f) == FRAGMENT_COST_BYTES + 1 + sum(ID_COST_BYTES + len(f"c{i}") for i in range(10))
    s = new(max_bytes=fragment_bytes(f) - 1)
    with pytest.raises(SessionLimit):
        s.receive(msg(f))


# -- item 3: file refs -------------------------------------------------------------------------------------


def test_twenty_refs_to_a_1mb_file_count_once_per_use_in_the_prompt():
    # The audit's 2.4 KB message: a leaf of 20 chunks that all reference one 1 MB file. The
    # file is read once; the prompt it expands to (20 MB) is over the default prompt bound.
    s = new(file_roots=("/data",))
    [g] = [
        c
        for c in s.receive(msg(*ref_leaf("p", "file:///data/big.txt", 20), generate("p", "r")))
        if isinstance(c, Generate)
    ]
    assert s.ref_budget(g) == SessionLimits().max_prompt_bytes  # nothing inline
    content = b"x" * MIB
    with pytest.raises(SessionLimit, match="max-prompt-bytes") as info:
        s.count_refs(g, {"/data/big.txt": content}, len(content))
    assert status(info.value) == "RESOURCE_EXHAUSTED"


def test_bytes_read_through_refs_count_against_the_session():
    s = new(file_roots=("/data",), max_bytes=100_000)
    [g] = [
        c
        for c in s.receive(msg(*ref_leaf("p", "file:///data/a.txt", 2), generate("p", "r")))
        if isinstance(c, Generate)
    ]
    budget = s.ref_budget(g)
    assert 0 < budget < 100_000  # the session's own fragments and action took their share
    s.count_refs(g, {"/data/a.txt": b"y" * 10}, 10)
    assert s.ref_budget(g) == budget - 10
    with pytest.raises(SessionLimit, match="evergreen-max-bytes"):
        s.count_refs(g, {"/data/a.txt": b"y" * 10}, budget)  # another action read this much


def test_shared_nodes_count_once_per_use_in_the_prompt():
    s = new(max_prompt_bytes=1000)
    s.receive(msg(leaf("big", "z" * 300)))
    s.receive(
        msg(
            parent("three", "big", "big2", "big3"),
            parent("big2", "big"),
            parent("big3", "big"),
            generate("three", "r1"),
        )
    )
    with pytest.raises(SessionLimit, match="max-prompt-bytes"):
        s.receive(msg(parent("four", "three", "big"), generate("four", "r2")))  # 4 uses = 1200 bytes


@pytest.mark.parametrize("uri", ["file:///data/a%00b.txt", "file:///data/%ff%fe.txt"])
def test_nul_and_non_utf8_paths_are_invalid_argument(uri):
    with pytest.raises(UnsupportedInput) as info:
        new(file_roots=("/data",)).receive(msg(leaf("p", ref=uri), generate("p", "r")))
    assert status(info.value) == "INVALID_ARGUMENT"


def test_read_refs_reads_each_file_once_and_counts_it_once(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"a" * 1000)
    os.symlink(tmp_path / "a.txt", tmp_path / "link.txt")
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(file_refs.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    refs = [FileRef("u", str(tmp_path / "a.txt"))] * 20 + [FileRef("l", str(tmp_path / "link.txt"))]
    contents, num_read = file_refs.read_refs(refs, (str(tmp_path),), 5000)
    assert (opened, num_read) == ([str(tmp_path / "a.txt")], 1000)
    assert contents[str(tmp_path / "link.txt")] is contents[str(tmp_path / "a.txt")]


def test_read_refs_never_reads_past_its_budget(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"a" * 1000)
    with pytest.raises(SessionLimit):
        file_refs.read_refs([FileRef("u", str(tmp_path / "a.txt"))], (str(tmp_path),), 999)
    # A file that grows after its stat is read to the budget + 1 at most, then refused.
    read_sizes: list[int] = []
    real_read, real_stat = os.read, os.stat
    monkeypatch.setattr(file_refs.os, "stat", lambda p: os.stat_result((*real_stat(p)[:6], 1, *real_stat(p)[7:])))
    monkeypatch.setattr(file_refs.os, "read", lambda fd, n: read_sizes.append(n) or real_read(fd, n))
    with pytest.raises(SessionLimit):
        file_refs.read_refs([FileRef("u", str(tmp_path / "a.txt"))], (str(tmp_path),), 100)
    assert sum(read_sizes) <= 101


def _in_a_thread(fn):
    """Run ``fn`` in a daemon thread; the thread still running after 30 s means it blocked."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "reading the ref blocked its thread"
    return box


def test_a_fifo_in_the_root_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    box = _in_a_thread(lambda: file_refs.read_refs([FileRef("f", str(fifo))], (str(tmp_path),), 1000))
    assert isinstance(box.get("error"), UnsupportedInput) and "regular file" in str(box["error"])
    assert status(box["error"]) == "INVALID_ARGUMENT"


def test_a_device_is_refused(tmp_path):
    box = _in_a_thread(lambda: file_refs.read_refs([FileRef("z", "/dev/zero")], ("/dev",), 1000))
    assert isinstance(box.get("error"), UnsupportedInput)


def test_a_folder_or_missing_file_is_not_found(tmp_path):
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(RefNotFound):
            file_refs.read_refs([FileRef("d", str(path))], (str(tmp_path),), 1000)


def test_a_nul_path_reaching_the_reader_is_invalid_argument(tmp_path):
    with pytest.raises(UnsupportedInput):
        file_refs.read_refs([FileRef("n", f"{tmp_path}/a\x00b")], (str(tmp_path),), 1000)
