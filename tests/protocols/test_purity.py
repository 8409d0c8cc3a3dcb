"""The pure files of every protocol import no I/O, engine, frontend or clock (STYLE §6.2, rule 2).

import-linter cannot police stdlib modules such as ``asyncio`` or ``socket``, so this test
walks the AST of each pure file (imports anywhere in the file, including inside functions)
and fails on a forbidden import or on ``await`` / ``async def``. The pure files are found,
not listed: every file under ``protocols/`` but the few in ``NOT_PURE``. One list of
forbidden modules serves all six protocols and ``protocols/_shared``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import rill.protocols

PROTOCOLS_DIR = Path(rill.protocols.__file__).parent

NOT_PURE = {
    "adapter.py": "the one file of each protocol that does I/O",
    "_shared/driver.py": "the adapters' shared engine plumbing: runs a session's requests on the engine client",
    "_shared/resume.py": "a connection's side of a resumable stream: the task that follows it to the peer",
    "batch_ws/service.py": "the batch sockets' server-wide state: reads the generation defaults (environment, .env)",
    "chat_ws/media.py": "decodes media in memory (MEDIA_ALLOWED; its own test below)",
    "chat_ws/service.py": "the chats' shared state: media decoded off the loop, queue mailboxes, recordings on disk",
    "framed_uds/listener.py": "binds the Unix socket (stale files replaced) and accepts connections",
    "generate_ws/conversation.py": "a /generate conversation on its driver, apart from its socket; follows its transcript",
    "generate_ws/service.py": "/generate's state beyond one connection: reads the engine client, writes feedback to disk",
    "evergreen/protogen.py": "build tool: runs protoc and writes the generated modules",
    "evergreen/grpc_server.py": "binds --grpc-port and hosts the Evergreen service beside health and reflection",
    "evergreen/file_refs.py": "reads the files that file:// refs name (blocking, in a worker thread)",
    "evergreen/runner.py": "runs a session on the driver for both transports: worker-thread receive, the outbox",
    "openai_http/responder.py": "writes one response (SSE or JSON) to the ASGI connection, watching for a disconnect",
    "openai_http/audio_api.py": "the audio routes: multipart bodies, files decoded and speech encoded off the loop",
    "openai_http/responses_api.py": "the Responses API's routes: producer tasks, the response store, SSE followers",
}
"""Files under ``protocols/`` exempt from the purity rules (a bare name: in every folder).
Every other ``.py`` file found there, including ones added later, is pure."""


def pure_files() -> list[Path]:
    """Every ``.py`` file under ``protocols/`` but the exempt ones and generated protobuf code."""
    found = []
    for path in sorted(PROTOCOLS_DIR.rglob("*.py")):
        relative = path.relative_to(PROTOCOLS_DIR)
        if "_pb" in relative.parts or relative.name in NOT_PURE or str(relative) in NOT_PURE:
            continue
        found.append(path)
    return found


PURE_FILES = pure_files()

FORBIDDEN = (
    # I/O, concurrency and clocks
    "asyncio",
    "socket",
    "threading",
    "selectors",
    "sqlite3",
    "time",
    "os",
    "pathlib",
    "io",
    "open",
    # web and RPC frameworks, tensors
    "starlette",
    "uvicorn",
    "websockets",
    "grpc",
    "torch",
    # media decoders (chat_ws/media.py owns them)
    "PIL",
    "av",
    # layers above the pure files
    "rill.engine",
    "rill.frontend",
    "rill.server",
    "rill.config",
    "rill.feedback",
    # the driver runs sessions; a session knows only its side of the contract (_shared/session.py)
    "rill.protocols._shared.driver",
)
"""Modules a pure file may not import (each with its submodules)."""

MEDIA_ALLOWED = ("io", "PIL", "av")
"""``chat_ws/media.py`` decodes images, audio and video in memory; it may use these, nothing else above."""


def imported_modules(path: Path, package: str) -> list[str]:
    """Every module ``path`` imports, relative imports resolved against ``package``."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names.append(importlib.util.resolve_name(module, package) if node.level else module)
    return names


def forbidden_in(names: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """The names that are, or are inside, a forbidden module."""
    return [name for name in names if any(name == root or name.startswith(root + ".") for root in forbidden)]


def test_discovery_finds_every_protocol() -> None:
    # An empty or mis-rooted walk would make the test below vacuous.
    folders = {p.relative_to(PROTOCOLS_DIR).parts[0] for p in PURE_FILES if p.parent != PROTOCOLS_DIR}
    assert folders >= {"_shared", "batch_ws", "chat_ws", "evergreen", "framed_uds", "generate_ws", "openai_http"}
    assert PROTOCOLS_DIR / "generate_ws" / "session.py" in PURE_FILES
    assert PROTOCOLS_DIR / "generate_ws" / "adapter.py" not in PURE_FILES


@pytest.mark.parametrize("path", PURE_FILES, ids=[str(p.relative_to(PROTOCOLS_DIR)) for p in PURE_FILES])
def test_pure_file_imports(path: Path) -> None:
    name = str(path.relative_to(PROTOCOLS_DIR))
    package = ".".join(("rill.protocols",) + path.relative_to(PROTOCOLS_DIR).parent.parts)
    bad = forbidden_in(imported_modules(path, package), FORBIDDEN)
    assert not bad, f"{name} imports {bad}"
    tree = ast.parse(path.read_text())
    assert not any(isinstance(node, (ast.Await, ast.AsyncFunctionDef)) for node in ast.walk(tree)), (
        f"{name}: no await in a pure file"
    )


def test_media_touches_no_socket_or_engine() -> None:
    forbidden = tuple(root for root in FORBIDDEN if root not in MEDIA_ALLOWED)
    bad = forbidden_in(imported_modules(PROTOCOLS_DIR / "chat_ws" / "media.py", "rill.protocols.chat_ws"), forbidden)
    assert not bad, f"chat_ws/media.py imports {bad}"
