"""The checked-in ``_pb/`` modules are exactly what the ``.proto`` files generate, and the
protos keep the published evergreen.v2 names and field numbers."""

from __future__ import annotations

from pathlib import Path

from rill.protocols.evergreen import protogen
from rill.protocols.evergreen._pb import evergreen_pb2, evergreen_service_pb2

PUBLISHED_FIELDS = {
    "NodeFragment": {"id": 1, "seq": 2, "continued": 3, "child_ids": 4, "chunk_fragment": 5},
    "Chunk": {"metadata": 1, "ref": 3, "data": 10},
    "ChunkMetadata": {"mimetype": 1, "role": 2, "original_file_name": 3, "capture_time": 6, "experimental": 100},
    "NamedParameter": {"name": 1, "id": 2},
    "TargetSpec": {"id": 1},
    "Action": {"name": 2, "inputs": 3, "outputs": 4, "configs": 5, "target_spec": 6},
}
"""wire-notes §1.2 (google-deepmind/evergreen-spec 56d7b38)."""


def test_regenerating_gives_the_checked_in_code(tmp_path: Path):
    written = protogen.generate(tmp_path)
    checked_in = sorted(p for p in protogen.PB_DIR.glob("*_pb2*.py"))
    assert [p.name for p in written] == [p.name for p in checked_in]
    for new, old in zip(written, checked_in):
        assert new.read_text() == old.read_text(), (
            f"{old.name} is stale: run python -m rill.protocols.evergreen.protogen"
        )


def test_messages_field_names_and_numbers_match_the_published_protos():
    for name, fields in PUBLISHED_FIELDS.items():
        descriptor = evergreen_pb2.DESCRIPTOR.message_types_by_name[name]
        assert descriptor.full_name == f"evergreen.v2.{name}"
        assert {f.name: f.number for f in descriptor.fields} == fields
    session = evergreen_service_pb2.DESCRIPTOR.message_types_by_name["SessionMessage"]
    assert {f.name: f.number for f in session.fields} == {"node_fragments": 1, "actions": 2}
    method = evergreen_service_pb2.DESCRIPTOR.services_by_name["EvergreenService"].methods_by_name["StartSession"]
    assert method.full_name == "evergreen.v2.EvergreenService.StartSession"
    assert method.client_streaming and method.server_streaming
