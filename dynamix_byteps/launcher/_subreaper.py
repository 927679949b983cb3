"""The launcher adopts its children's orphans (Linux ``PR_SET_CHILD_SUBREAPER``) and stops them.

A process a worker starts in a session of its own (``setsid``, ``Popen(start_new_session=True)``,
a daemon) leaves the worker's process group, so ``killpg`` misses it, and once its parent exits it
is re-parented to init. While :func:`adopting` is active, this process is a child subreaper: such
an orphan becomes this process's child instead, and :func:`stop_adopted` finds it (a child this
process did not start) and stops it.

The flag belongs to the whole process, also when a program embeds the launcher's Python API: it is
set only while :func:`adopting` is active and its previous value is restored afterwards. Only
processes of this host are adopted: one a worker starts on another host (through ssh, say) is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Collection, Iterator

from dynamix_byteps.launcher._guardian import process_stats

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

try:  # Linux only; elsewhere nothing is adopted.
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    PRCTL = _LIBC.prctl if _LIBC is not None else None
except (OSError, AttributeError):  # pragma: no cover - exotic libc
    PRCTL = None


def _set_subreaper(on: bool) -> None:
    if PRCTL(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(int(on)), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    if PRCTL(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return bool(flag.value)


@contextlib.contextmanager
def adopting() -> Iterator[str | None]:
    """Make this process a child subreaper while the ``with`` block runs.

    Yields None, or where Linux refuses the flag (a kernel before 3.4, a seccomp filter) the error
    of ``prctl``: then orphans go to init as before and :func:`stop_adopted` has nothing to stop.
    Elsewhere than Linux nothing is adopted and it yields None. The flag's previous value is
    restored at the end (a program that was a subreaper before stays one).
    """
    if PRCTL is None:
        yield None
        return
    try:
        was_subreaper = _is_subreaper()
        _set_subreaper(True)
    except OSError as error:
        yield f"prctl PR_SET_CHILD_SUBREAPER: {error.strerror}"
        return
    try:
        yield None
    finally:
        if not was_subreaper:
            _set_subreaper(False)


def children() -> list[int]:
    """The pids of this process's children, zombies included, read from ``/proc`` (empty without it)."""
    me = os.getpid()
    return [pid for pid, fields in process_stats() if len(fields) > 1 and int(fields[1]) == me]


def _reaped(pid: int) -> bool:
    """Reap child ``pid`` if it has exited; whether it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def _signal(pid: int, sig: int) -> None:
    """``sig`` to child ``pid``, to its whole process group when it leads one (a ``setsid`` process
    does): the group's other members go with it, as a worker's do."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop_adopted(known: Collection[int], grace_s: float, poll_s: float) -> None:
    """Stop and reap every adopted orphan: each child of this process whose pid is not in ``known``
    gets SIGTERM, SIGKILL ``grace_s`` seconds later if it still runs, and is reaped; until none is
    left, as an orphan's own children are adopted only once it has died. Checks every ``poll_s``
    seconds. ``known`` must hold every child the caller started and has not reaped yet: a
    ``Popen``'s child among the orphans would be stopped, and its exit status taken from the ``Popen``.
    """
    kill_at: dict[int, float] = {}  # adopted orphan -> when it gets SIGKILL (inf: it got it)
    while True:
        adopted = [pid for pid in children() if pid not in known]
        live = []
        for pid in adopted:
            if _reaped(pid):
                kill_at.pop(pid, None)
            else:
                live.append(pid)
        if not live:
            return
        now = time.monotonic()
        for pid in live:
            if pid not in kill_at:
                _signal(pid, signal.SIGTERM)
                kill_at[pid] = now + grace_s
            elif now >= kill_at[pid]:
                _signal(pid, signal.SIGKILL)
                kill_at[pid] = float("inf")
        time.sleep(poll_s)
