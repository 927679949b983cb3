"""Shared-memory mailbox between a worker process and its node agent.

One POSIX shared-memory segment per worker (``/dev/shm/dynamix.<job>.<rank>`` on Linux), with
one "latest value" slot written by the worker only:

* **metrics** (worker -> agent): a training ``step`` and up to :data:`METRICS_CAPACITY` (32)
  float64 values; the meaning of each index is agreed between the two sides, not stored.
  Every publish gets the next version (1, 2, 3, ...).

Assignments travel the other way by gRPC and broadcast, not through the mailbox.

The slot is a seqlock (``csrc/mailbox.hpp`` has the protocol and its memory-ordering
argument): a publish never waits, and a read either returns one complete record or ``None``,
never a mix of two records. A read that keeps overlapping writes gives up after
:data:`MAX_READ_ATTEMPTS` attempts (a few microseconds) and returns ``None`` as if nothing new
had arrived, so the agent never waits on the worker. Records are overwritten, not queued: a
reader that polls less often than the writer publishes sees only the newest one.

Lifetime: the worker creates the segment (:meth:`Mailbox.create`) and removes it on
:meth:`~Mailbox.close`, when the object is garbage-collected, on ``with``-block exit and at
interpreter exit (``atexit``). A process killed by a signal cannot clean up; the next
:meth:`Mailbox.create` with that name finds the dead owner's pid in the header, removes the
stale segment and warns. The agent attaches with :meth:`Mailbox.open`; closing it only unmaps.

Truncation: every access first checks with ``fstat`` that the segment still has its full size.
A segment that someone truncated (which would make touching its pages raise SIGBUS and kill the
process) is *detached*: reads return ``None``, publishes publish nothing and return 0,
:attr:`~Mailbox.owner_pid` is 0, and one :class:`MailboxDetachedWarning` says why. A truncation
in the microseconds between that check and the access can still fault; the check closes the
window any real mistake (a cleanup script, a second job) leaves open.

Calls on one :class:`Mailbox` are serialised by the GIL; share a handle between threads
freely, but publish from the creating process only (one writer; the role is enforced).
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np

from dynamix_byteps import _core
from dynamix_byteps.errors import DynamixError

__all__ = [
    "MAX_READ_ATTEMPTS",
    "METRICS_CAPACITY",
    "Mailbox",
    "MailboxDetachedWarning",
    "MailboxLayoutError",
    "MailboxRoleError",
    "StaleMailboxWarning",
    "job_mailboxes",
    "mailbox_name",
    "remove_job_mailboxes",
    "unavailable_reason",
]

METRICS_CAPACITY: int = _core.MAILBOX_METRICS_CAPACITY  # float64 values per metrics record
MAX_READ_ATTEMPTS: int = _core.MAILBOX_MAX_READ_ATTEMPTS  # seqlock attempts before a read gives up
SEGMENT_BYTES: int = _core.MAILBOX_SEGMENT_BYTES  # size of the shared-memory segment, bytes
LAYOUT_VERSION: int = _core.MAILBOX_LAYOUT_VERSION
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory segments


class MailboxLayoutError(DynamixError, ValueError):
    """The segment is not a mailbox of this layout: wrong magic number, layout version or size.

    Usually a worker and an agent from different dynamix_byteps versions, or a foreign file in
    /dev/shm with the same name.
    """


class MailboxRoleError(DynamixError, RuntimeError):
    """The slot was written from the wrong side: metrics only by the creator."""


class StaleMailboxWarning(RuntimeWarning):
    """Mailbox.create replaced a segment left behind by a process that no longer runs."""


class MailboxDetachedWarning(RuntimeWarning):
    """The segment was truncated under this handle: it reads and publishes nothing from now on."""


def mailbox_name(job: str, rank: int) -> str:
    """The conventional segment name of a worker: ``/dynamix.<job>.<rank>``.

    Raises:
        ValueError: ``job`` contains characters other than ``[A-Za-z0-9_-]``, or ``rank < 0``.
    """
    if not job or not all(c.isascii() and (c.isalnum() or c in "_-") for c in job):
        raise ValueError(f"job name {job!r} must be non-empty and use only [A-Za-z0-9_-]")
    if int(rank) < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"/dynamix.{job}.{int(rank)}"


def job_mailboxes(job: str) -> list[Path]:
    """The segment files of job ``job`` on this host: ``/dev/shm/dynamix.<job>.<rank>``, any rank."""
    prefix = f"dynamix.{job}."
    return [path for path in SHM_DIR.glob(prefix + "*") if path.name[len(prefix):].isdigit()]


def remove_job_mailboxes(job: str) -> list[Path]:
    """Remove every segment of job ``job`` on this host that belongs to this process's user.

    For the launcher, once the job's workers are gone: a worker killed by a signal cannot
    remove its own. Returns the paths removed; never raises for a segment that vanished or
    cannot be removed.
    """
    removed = []
    for path in job_mailboxes(job):
        try:
            if path.lstat().st_uid != os.geteuid():
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def unavailable_reason(name: str) -> str | None:
    """Why a worker could not create the mailbox ``name`` now (another live process holds it,
    a foreign file has the name, an invalid name, /dev/shm full), or None when it can.

    Creates and removes the segment to find out; warns as :meth:`Mailbox.create` does when it
    replaces a stale one.
    """
    try:
        Mailbox.create(name).close()
    except (OSError, ValueError, TypeError) as error:
        return str(error)
    return None


def _normalise(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"mailbox name must be a str, got {type(name).__name__}")
    return name if name.startswith("/") else "/" + name


_created: "weakref.WeakSet[Mailbox]" = weakref.WeakSet()


@atexit.register
def _close_created() -> None:
    for mb in list(_created):
        mb.close()


class Mailbox:
    """One end of a worker's shared-memory mailbox. Build it with :meth:`create` or :meth:`open`.

    Usable as a context manager (``close()`` on exit).
    """

    __slots__ = ("_mb", "_fd", "_detached", "__weakref__")

    def __init__(self, native: _core.Mailbox) -> None:
        """Internal: wraps a native handle. Use :meth:`create` (worker) or :meth:`open` (agent)."""
        if not isinstance(native, _core.Mailbox):
            raise TypeError("use Mailbox.create(name) or Mailbox.open(name)")
        self._mb = native
        self._detached = False
        try:  # the file behind the mapping, to see its size before every access
            self._fd = os.open(SHM_DIR / native.name.lstrip("/"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1  # no /dev/shm (not Linux) or already removed: nothing to check against

    def _attached(self) -> bool:
        """False once the segment is shorter than a mailbox (touching it would raise SIGBUS)."""
        if self._detached or self._fd < 0 or self._mb.closed:
            return not self._detached
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return True
        if size >= SEGMENT_BYTES:
            return True
        self._detached = True
        warnings.warn(
            f"mailbox {self.name} was truncated to {size} bytes (a mailbox is {SEGMENT_BYTES}) by another "
            "process; this handle reads and publishes nothing from now on",
            MailboxDetachedWarning,
            stacklevel=3,
        )
        return False

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def create(cls, name: str) -> "Mailbox":
        """Create the segment ``name`` (worker side) and own it.

        ``name`` is ``/`` followed by 1-254 characters from ``[A-Za-z0-9._-]``, e.g.
        ``mailbox_name(job, rank)``; the leading ``/`` is added if missing. The segment is
        created with ``O_EXCL`` and mode 0600 and is removed again by :meth:`close`, garbage
        collection or interpreter exit (only in this process, never in a forked child).

        If the name exists, belongs to a mailbox (any layout version) and its creating process
        no longer runs (gone, zombie, or its pid was reused), the stale segment is removed and
        replaced, with a :class:`StaleMailboxWarning`.

        Raises:
            ValueError: invalid name.
            FileExistsError: the name is held by a live process, or by something that is not
                an initialised mailbox (remove ``/dev/shm/<name>`` by hand if nothing uses it).
            OSError: shm_open/ftruncate/mmap failed otherwise (e.g. ``/dev/shm`` full).
        """
        native, stale_pid = _core.Mailbox.create(_normalise(name))
        if stale_pid:
            warnings.warn(
                f"mailbox {native.name}: replaced a stale segment left by pid {stale_pid}, which no longer runs",
                StaleMailboxWarning,
                stacklevel=2,
            )
        mb = cls(native)
        _created.add(mb)
        return mb

    @classmethod
    def open(cls, name: str, *, timeout: float = 0.0) -> "Mailbox":
        """Attach to an existing segment (agent side). Closing it never removes the segment.

        Args:
            name: as for :meth:`create`.
            timeout: seconds to keep retrying (every 10 ms) while the segment does not exist
                yet or its creator is still initialising it; 0 tries once.

        Raises:
            ValueError: invalid name or negative timeout.
            FileNotFoundError: no such segment (after ``timeout``).
            MailboxLayoutError: the segment is not a mailbox of this layout (bad magic, layout
                version or size), or still uninitialised after ``timeout``.
            OSError: permission denied (segments are mode 0600: same user only) and others.
        """
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        name = _normalise(name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls(_core.Mailbox.open(name))
            except (FileNotFoundError, _core.MailboxNotReadyError) as e:
                if time.monotonic() >= deadline:
                    if isinstance(e, FileNotFoundError):
                        raise
                    raise MailboxLayoutError(str(e)) from None
            except _core.MailboxLayoutError as e:
                raise MailboxLayoutError(str(e)) from None
            time.sleep(0.01)

    # -- worker -> agent -------------------------------------------------------------------

    def publish_metrics(self, step: int, values: Sequence[float]) -> int:
        """Publish the worker's metrics for ``step``, replacing the previous record. Never blocks.

        Args:
            step: the training step the values belong to, an int in [0, 2**64).
            values: up to 32 numbers, stored as float64 (a list/tuple of numbers, or anything
                numpy turns into a 1-D float64 array; a float64 ndarray is not copied). NaN and
                +-inf are allowed and passed through unchanged: a diverging loss is exactly what
                the policy's fallback must see.

        Returns:
            The record's version: 1 for the first publish, then +1 each time; 0 when the segment
            was truncated under this handle (nothing is published, see :attr:`detached`).

        Raises:
            ValueError: more than 32 values, an array that is not 1-D, step out of range,
                handle closed.
            TypeError: step not an int, or a value that is not a number.
            MailboxRoleError: this handle came from :meth:`open` (metrics are the creator's).
        """
        if not self._attached():
            return 0
        try:
            return self._mb.publish_metrics(step, values)
        except _core.MailboxRoleError as e:
            raise MailboxRoleError(str(e)) from None

    def read_metrics(self, newer_than: int = 0) -> tuple[int, int, np.ndarray] | None:
        """The newest metrics record if its version is greater than ``newer_than``.

        Returns:
            ``(version, step, values)`` with ``values`` a new float64 array of the published
            length, or ``None`` when nothing was published yet, nothing newer than
            ``newer_than`` was, every attempt overlapped a write (counted in
            :attr:`busy_reads`; ask again later), or the segment was truncated
            (:attr:`detached`). Never blocks.

        Raises:
            ValueError: ``newer_than`` outside [0, 2**64), handle closed.
        """
        if not self._attached():
            return None
        return self._mb.read_metrics(newer_than)

    # -- lifetime and introspection --------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment; the creator also removes its name. Idempotent.

        Further publish/read calls raise ValueError.
        """
        self._mb.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        _created.discard(self)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:  # the native handle unmaps (and unlinks) by itself
            os.close(self._fd)

    def __enter__(self) -> "Mailbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def name(self) -> str:
        """The segment's name, with its leading ``/`` (the file is ``/dev/shm`` + name on Linux)."""
        return self._mb.name

    @property
    def closed(self) -> bool:
        return self._mb.closed

    @property
    def is_creator(self) -> bool:
        """True for the worker's handle from :meth:`create`, False for an agent's from :meth:`open`."""
        return self._mb.is_creator

    @property
    def owner_pid(self) -> int:
        """Pid of the process that created the segment, as stored in its header; 0 when the
        segment was truncated (:attr:`detached`). Anyone who can write the file can write it:
        check the file's owner before trusting it."""
        if not self._attached():
            return 0
        return self._mb.owner_pid

    @property
    def owner_alive(self) -> bool:
        """True while the process that created the segment runs: its pid is not gone, not a zombie,
        and not reused by a process that started at another time (the header keeps the creator's
        start time); False when the segment was truncated (:attr:`detached`)."""
        if not self._attached():
            return False
        return self._mb.owner_alive

    @property
    def detached(self) -> bool:
        """True once this handle found the segment truncated; it then reads and publishes nothing."""
        return self._detached

    @property
    def busy_reads(self) -> int:
        """Reads through this handle that gave up because every attempt overlapped a write."""
        return self._mb.busy_reads

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("creator" if self.is_creator else "opened")
        return f"Mailbox({self.name!r}, {state})"
