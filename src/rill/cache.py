"""rill's cache folder and building things into it atomically (the demo model, the default model).

``cache_root()`` is ``$RILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/rill``, else ``~/.cache/rill``.
``build_atomically(folder, build, is_complete)`` builds into a temporary sibling folder that is
renamed into place only when complete, under an exclusive ``flock`` so that two processes never
build at once (the second waits, then finds the folder built). A killed build leaves at most a
``.tmp-*`` folder, removed by the next build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_root() -> Path:
    """``$RILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/rill``, else ``~/.cache/rill``."""
    if os.environ.get("RILL_CACHE_DIR"):
        return Path(os.environ["RILL_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "rill"
    return Path.home() / ".cache" / "rill"


def build_atomically(
    folder: Path,
    build: Callable[[Path], None],
    is_complete: Callable[[Path], bool],
    *,
    rebuild: bool = False,
    progress: bool = True,
    what: str = "the model",
) -> Path:
    """Return ``folder``, first running ``build(tmp)`` and renaming ``tmp`` to it if it is not
    complete (or ``rebuild``). One builder at a time; a waiting process re-checks after the lock."""
    if is_complete(folder) and not rebuild:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder.parent / f".{folder.name}.lock", progress, what):
        if is_complete(folder) and not rebuild:  # another process built it while we waited
            return folder
        remove_leftovers(folder, is_complete)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            build(tmp)
            make_readable(tmp)
            swap_in(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def swap_in(new: Path, folder: Path) -> None:
    """Rename ``new`` to ``folder``, moving an existing ``folder`` aside first."""
    # Renames are atomic: the folder appears complete or not at all. A rebuild moves the
    # old folder aside first; a process that looks in between waits on the lock.
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        folder.rename(old)
        new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(folder)


@contextlib.contextmanager
def exclusive_lock(path: Path, progress: bool, what: str = "the model") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (waiting, with a note on stderr, if another holds it)."""
    # flock is released by the kernel when the holder dies, so a killed build never
    # leaves a stale lock behind.
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"rill: another process is preparing {what}; waiting for it ({path})", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def make_readable(folder: Path) -> None:
    """Make a built folder world-readable (mkdtemp makes it 0700, safetensors writes 0600)."""
    # A cache shared through RILL_CACHE_DIR should be readable by everyone, like any
    # downloaded model.
    folder.chmod(0o755)
    for path in folder.iterdir():
        if path.is_dir():  # an extracted model keeps sentence-transformers' module folders
            make_readable(path)
        else:
            path.chmod(0o644)


def remove_leftovers(folder: Path, is_complete: Callable[[Path], bool]) -> None:
    """Remove temp/old folders of killed builds and an incomplete ``folder`` (call with the lock held)."""
    # Renames are atomic, so a folder at the final path that is not complete was not made by a build.
    for pattern in (f".{folder.name}.tmp-*", f".{folder.name}.old-*"):
        for stale in folder.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    if folder.exists() and not is_complete(folder):
        shutil.rmtree(folder)
