"""Opening a file that will hold users' text (saved prompts, traces with content) for appending,
readable by its owner only.

The path must not be a symbolic link (O_NOFOLLOW: someone who can write the directory could point
it at a file they can read), must be a regular file this user owns with no other hard link (a
link elsewhere is another name for the same data, maybe readable: chmod fixes this name's inode
but the other path was chosen by whoever made the link), and ends up mode 0600 even when it
existed with a wider mode (fchmod on the open descriptor, so no other path is involved).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class PrivateFileError(ValueError):
    """The path cannot be used for private data; the message says why and names the path."""


def open_private_append(path: str | os.PathLike[str], what: str) -> int:
    """A descriptor open for appending to `path` (created 0600). `what` names the file in errors
    (e.g. "--log-prompts file")."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_NONBLOCK: a FIFO planted at the path fails at once instead of blocking the open.
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            raise PrivateFileError(
                f"{what} {path} is a symbolic link; refusing to write through it (give the real path)"
            ) from None
        raise PrivateFileError(f"{what} {path}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PrivateFileError(f"{what} {path} is not a regular file")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise PrivateFileError(
                f"{what} {path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()}); "
                "refusing to write private data into it"
            )
        if info.st_nlink > 1:
            raise PrivateFileError(
                f"{what} {path} has {info.st_nlink} hard links; another name for the same file could "
                "expose what is written here, so it is refused (give a file with one link, or a new path)"
            )
        os.fchmod(fd, 0o600)  # an existing file keeps no wider mode
    except BaseException:
        os.close(fd)
        raise
    return fd
