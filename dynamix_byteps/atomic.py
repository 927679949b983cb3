"""Replace a file atomically: a reader of ``path`` sees the old content or the new, never half.

The new content is written to a temporary file next to ``path`` (same directory, so the same
file system), which is then renamed over ``path`` with :func:`os.replace` (atomic on POSIX).
The temporary file is created with mode ``0o666`` minus the process umask, like :func:`open`,
so the result has the permissions any newly created file would have (``tempfile.mkstemp``
would give ``0o600``). ``durable=True`` adds the fsync of the file before the rename and of the
directory after it, so the new content survives a power loss once the call returns. A
symlink at ``path`` is followed, as :func:`open` would: its target is replaced (the temporary
file goes next to the target, on its file system) and the link stays.

    with atomic_write(path) as f:           # binary; "w" for text (UTF-8)
        torch.save(state, f)
    write_atomic(path, json.dumps(record))  # bytes or str
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "write_atomic"]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, durable: bool = True) -> Iterator[IO]:
    """Yield a file open for writing whose content replaces ``path`` when the block exits cleanly.

    Args:
        path: the file to replace, or a symlink to it; its parent directories are created.
        mode: ``"wb"`` (bytes) or ``"w"`` (text, UTF-8).
        durable: fsync the file before and its directory after the rename. ``False`` for files
            rewritten often whose loss in a crash does not matter (progress, port files).

    Guarantees: on a clean exit the whole new content is at ``path`` (flushed; fsynced when
    ``durable``). On any exception in the block (``BaseException``, so ``KeyboardInterrupt``
    too) or while writing, the temporary file is removed, ``path`` is left as it was and the
    exception propagates. A process killed mid-write leaves ``path`` intact and at most one
    ``.<name>.<pid>.<random>.tmp`` beside it.

    Raises:
        ValueError: ``mode`` is not ``"w"`` or ``"wb"``.
        OSError: ``path`` exists and is not a regular file or a directory (``errno.EINVAL``;
            a device node would otherwise be replaced by a file), the directory or temporary file
            cannot be created, writing, fsync or the rename fails (``path`` unchanged), or the
            fsync of the directory after the rename fails (then the new content is in place but
            may not be durable).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', not {mode!r}")
    try:
        target = Path(os.path.realpath(path, strict=os.path.islink(path)))  # errors name ``path``, the caller's
    except FileNotFoundError:  # a link to a file still to be created
        target = Path(os.path.realpath(path))
    except OSError as error:  # a symlink loop, which open() would refuse too
        raise OSError(error.errno, error.strerror, str(path)) from None
    if target.exists() and not target.is_file() and not target.is_dir():  # a directory: os.replace refuses it below
        raise OSError(errno.EINVAL, "exists and is not a regular file (a device, pipe or socket), which a "
                      "replacement would destroy; name a file", str(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as error:  # name the file the caller asked for, not the temporary one
        raise OSError(error.errno, f"{error.strerror} (cannot create a file in {target.parent})", str(path)) from error
    try:
        with open(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_directory(target.parent)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (``bytes``, or ``str`` written as UTF-8) via :func:`atomic_write`.

    Raises:
        OSError: as :func:`atomic_write`; ``path`` keeps its old content unless the rename happened.
    """
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)
