"""``protocols/_shared/actions``: ``Send``, ``Start``, ``Abort`` and ``Close`` exist once, and
every session hands its adapter those very classes."""

from __future__ import annotations

import ast
from pathlib import Path

import rill.protocols
from rill.protocols._shared import actions
from rill.protocols.batch_ws import session as batch_ws
from rill.protocols.chat_ws import session as chat_ws
from rill.protocols.evergreen import session as evergreen
from rill.protocols.framed_uds import session as framed_uds
from rill.protocols.generate_ws import actions as generate_ws

COMMON = {"Send", "Start", "Abort", "Close"}
PROTOCOLS_DIR = Path(rill.protocols.__file__).parent


def test_no_protocol_defines_its_own_common_action() -> None:
    found = {}
    for path in PROTOCOLS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in COMMON:
                found.setdefault(node.name, []).append(str(path.relative_to(PROTOCOLS_DIR)))
    assert found == {name: ["_shared/actions.py"] for name in COMMON}


def test_each_session_uses_the_shared_classes() -> None:
    for module in (batch_ws, chat_ws, evergreen, framed_uds, generate_ws):
        for name in COMMON & set(vars(module)):
            assert getattr(module, name) is getattr(actions, name), (module.__name__, name)
    assert batch_ws.Start is actions.Start and framed_uds.Close is actions.Close and evergreen.Send is actions.Send
