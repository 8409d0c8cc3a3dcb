"""Regenerates the checked-in protobuf/gRPC modules in ``_pb/`` from this folder's ``.proto`` files.

    python -m rill.protocols.evergreen.protogen          # rewrite _pb/ in place

The generated code is checked in (so ``pip install rill`` needs no compiler step), and
``tests/protocols/evergreen/test_protogen.py`` regenerates it into a temporary folder and
fails if the result differs, so the ``.proto`` files and ``_pb/`` never drift apart.

protoc writes ``import evergreen_pb2`` for ``import "evergreen.proto"`` (a top-level module);
the published protos must keep that import line, so the generated imports are rewritten to
package-relative ones here instead.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PB_DIR = HERE / "_pb"
PROTOS = ("evergreen.proto", "evergreen_service.proto", "rill_config.proto")
GRPC_PROTOS = ("evergreen_service.proto",)
_FLAT_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Compile the ``.proto`` files into ``out_dir``; return the written modules, sorted.

    Raises:
        RuntimeError: protoc failed (its messages are on stderr).
    """
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for protos, outs in ((PROTOS, ["--python_out"]), (GRPC_PROTOS, ["--grpc_python_out"])):
            args = ["protoc", f"-I{HERE}", f"-I{include}", *(f"{o}={tmp}" for o in outs), *protos]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for path in sorted(Path(tmp).glob("*.py")):
            text = _FLAT_IMPORT.sub(r"from . import \1 as \2", path.read_text())
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    return written


def main() -> int:
    """Rewrite ``_pb/`` and print what was written."""
    for path in generate(PB_DIR):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
