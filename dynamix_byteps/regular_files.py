"""Open a file for reading only when it is a regular file (or a symlink to one).

A FIFO where a run's log, event file or checkpoint is expected blocks ``open`` until a writer
comes, for ever without one, and a device such as /dev/zero is read without end. Readers of a run
directory open through :func:`open_regular`, which never blocks on such a file and refuses it with
:class:`NotRegularFileError`.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}
_FLAGS = {"rb": os.O_RDONLY, "rb+": os.O_RDWR}


class NotRegularFileError(OSError):
    """``filename`` is not a regular file; ``kind`` says what it is (``"a FIFO (named pipe)"``, ...).
    An OSError (EINVAL), so readers that report an unreadable file report this one too."""

    def __init__(self, path: str | os.PathLike, kind: str):
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", os.fspath(path))
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


def kind_of(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is, in words; None for a regular file."""
    kind = stat.S_IFMT(mode)
    return None if kind == stat.S_IFREG else _KINDS.get(kind, "not a regular file")


def check_regular(path: str | os.PathLike) -> None:
    """Refuse ``path`` unless it is a regular file, for a reader that opens it itself (symlinks are
    followed).

    Raises:
        FileNotFoundError: it does not exist (another OSError: it cannot be looked at).
        NotRegularFileError: it is not a regular file.
    """
    if kind := kind_of(os.stat(path).st_mode):
        raise NotRegularFileError(path, kind)


def open_regular(path: str | os.PathLike, mode: str = "rb") -> BinaryIO:
    """``open(path, mode)`` (``"rb"`` or ``"rb+"``) for a regular file; the check and the open are
    one, so a file swapped in between is still refused.

    Raises:
        NotRegularFileError: ``path`` is not a regular file (it was not read).
        OSError: it cannot be opened (FileNotFoundError, PermissionError, ...).
    """
    fd = os.open(path, _FLAGS[mode] | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO's open returns
    try:
        if kind := kind_of(os.fstat(fd).st_mode):
            raise NotRegularFileError(path, kind)
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of regular file ``path`` (errors: :func:`open_regular`)."""
    with open_regular(path) as f:
        return f.read()
