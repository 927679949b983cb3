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
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "write_atomic"]

STALE_TEMPORARY_AGE_S = 600.0  # seconds unmodified before a dead writer's temporary is removed


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
    exception propagates. A process killed mid-write leaves ``path`` intact and its
    ``.<name>.<pid>.<random>.tmp`` beside it; the next write to ``path`` that succeeds removes
    such temporaries once their process is gone and they have been left alone for
    :data:`STALE_TEMPORARY_AGE_S` (a writer in another pid namespace, another container on a
    shared volume, may still be writing a fresh one).

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
    _remove_stale_temporaries(target)


def _remove_stale_temporaries(target: Path) -> None:
    """Remove the temporaries of ``target`` whose writer was killed mid-write (each as large as a
    checkpoint, one per interrupted save); a directory that cannot be listed keeps them."""
    # A pid has at most 7 digits (pid_max <= 2**22).
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d{{1,7}})\.[0-9a-f]{{8}}\.tmp")
    oldest = time.time() - STALE_TEMPORARY_AGE_S
    with contextlib.suppress(OSError), os.scandir(target.parent) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match and not _process_exists(int(match[1])):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < oldest:
                        os.unlink(entry.path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (``bytes``, or ``str`` written as UTF-8) via :func:`atomic_write`.

    Raises:
        OSError: as :func:`atomic_write`; ``path`` keeps its old content unless the rename happened.
    """
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)
