"""Reading an operator file (policy, providers) safely, as its watchers do on every change.

A path can be swapped for something that is not a file: a FIFO blocked the watcher thread in
open() for good (later valid edits never applied, and the process never exited on SIGTERM), and a
link to /dev/zero passed the size check (st_size 0) and was read without end. So the file is
opened non-blocking, must be a regular file on the open descriptor (fstat: what was opened, not
what the path named a moment before), and is read to the limit plus one byte.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from openalice_runner.config_files.yaml_nodes import LIMITS

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnreadableFile(OSError):
    """The file cannot be used; str() says why (the caller adds where and what: "FILE:1:1: cannot read: ...")."""


def read_operator_file(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (default: the YAML loader's).
    A symbolic link is followed (mounted configs are links); what it leads to must be a regular file."""
    limit = LIMITS.max_bytes if limit is None else limit
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(Path(path), flags)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket file, or a FIFO that cannot be opened without a peer
            raise UnreadableFile("not a regular file") from None
        raise UnreadableFile(exc.strerror or str(exc)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise UnreadableFile(f"not a regular file ({kind})")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except UnreadableFile:
        raise
    except OSError as exc:
        raise UnreadableFile(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if size > limit:
        raise UnreadableFile(f"file is larger than the limit of {limit} bytes")
    return b"".join(chunks)
