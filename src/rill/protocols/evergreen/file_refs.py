"""Reading the files that an action's ``file://`` refs name (blocking: the runner calls it in a
worker thread).

The session has already checked each ref's normalised path against the file roots
(``prompt.file_ref``); here the path is resolved (symlinks included) and checked again, and
only regular files are read, non-blocking, within the byte budget the session gives.

I/O: the one module of the protocol that opens files.
"""

from __future__ import annotations

import os
import stat

from rill.protocols.evergreen.errors import RefDenied, RefNotFound, SessionLimit, UnsupportedInput
from rill.protocols.evergreen.prompt import FileRef, is_under


def read_refs(refs: list[FileRef], roots: tuple[str, ...], max_bytes: int) -> tuple[dict[str, bytes], int]:
    """Read the file refs of a started action (blocking: run it in a thread).

    Each file is read once however many refs name it (by its real path). Symlinks are
    resolved and the real path is checked against the roots again, so a link inside a root
    cannot reach a file outside it. Only regular files are read: a FIFO, device or socket is
    refused after a ``stat``, without opening it, and the file is opened non-blocking, so a
    ref can never hold a worker thread. At most ``max_bytes + 1`` bytes are read in total.

    Returns:
        The content of each ref by its ``path``, and the number of bytes read (each file once).

    Raises:
        RefDenied: the real path leaves every root.
        RefNotFound: the file is missing, a folder or unreadable.
        UnsupportedInput: not a regular file, or a path the OS cannot take.
        SessionLimit: the files hold more than ``max_bytes``.
    """
    contents: dict[str, bytes] = {}
    by_real_path: dict[str, bytes] = {}
    num_read_bytes = 0
    for ref in refs:
        if ref.path in contents:
            continue
        try:
            real = os.path.realpath(ref.path)
        except (ValueError, UnicodeError) as exc:  # NUL or an unencodable name: never a file
            raise UnsupportedInput(f"ref '{ref.uri}' is not a valid path") from exc
        if not any(is_under(real, root) for root in roots):
            raise RefDenied(f"ref '{ref.uri}' resolves outside the allowed file roots")
        data = by_real_path.get(real)
        if data is None:
            data = by_real_path[real] = _read_regular_file(ref.uri, real, max_bytes - num_read_bytes)
            num_read_bytes += len(data)
        contents[ref.path] = data
    return contents, num_read_bytes


READ_BLOCK_BYTES = 1024 * 1024
"""Most bytes one ``os.read`` of a ref asks for."""


def _read_regular_file(uri: str, path: str, max_bytes: int) -> bytes:
    """The content of the regular file at real ``path``, read non-blocking, at most ``max_bytes``."""
    try:
        info = os.stat(path)
        _check_regular(uri, info)
        if info.st_size > max_bytes:
            raise _too_big(uri, max_bytes)
        # O_NOFOLLOW: the path was resolved; a symlink swapped in since then is refused.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            _check_regular(uri, os.fstat(fd))  # the file may have been replaced after the stat
            blocks: list[bytes] = []
            num_bytes = 0
            while num_bytes <= max_bytes:
                block = os.read(fd, min(READ_BLOCK_BYTES, max_bytes + 1 - num_bytes))
                if not block:
                    break
                blocks.append(block)
                num_bytes += len(block)
        finally:
            os.close(fd)
    except FileNotFoundError as exc:
        raise RefNotFound(f"ref '{uri}': no such file") from exc
    except OSError as exc:
        raise RefNotFound(f"ref '{uri}' cannot be read: {exc.strerror}") from exc
    except (ValueError, UnicodeError) as exc:
        raise UnsupportedInput(f"ref '{uri}' is not a valid path") from exc
    if num_bytes > max_bytes:
        raise _too_big(uri, max_bytes)  # it grew after the stat
    return b"".join(blocks)


def _check_regular(uri: str, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise RefNotFound(f"ref '{uri}' is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise UnsupportedInput(
            f"ref '{uri}' is not a regular file (a FIFO, device or socket); rill reads regular files only"
        )


def _too_big(uri: str, max_bytes: int) -> SessionLimit:
    return SessionLimit(
        f"ref '{uri}' holds more than the {max_bytes} bytes left to this session and prompt "
        "(--evergreen-max-bytes, --evergreen-max-prompt-bytes)"
    )
