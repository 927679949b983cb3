"""The launcher adopts its children's orphans (Linux ``PR_SET_CHILD_SUBREAPER``) and stops them.

A process a worker starts in a session of its own (``setsid``, ``Popen(start_new_session=True)``,
a daemon) leaves the worker's process group, so ``killpg`` misses it, and once its parent exits it
is re-parented to init. While :func:`adopting` is active, this process is a child subreaper: such
an orphan becomes this process's child instead; :func:`reap_exited` reaps those that exit while the
job runs, and :func:`stop_adopted` stops the rest at its end. Only the job's are stopped: the job's
processes carry a mark in their environment (:data:`MARK_ENV`, inherited by what they start), and an
adopted process without it (a daemon of another child of an embedding program, or one that cleared
its environment) is reaped once it exits but never signalled.

The flag belongs to the whole process, also when a program embeds the launcher's Python API: it is
set only while :func:`adopting` is active and its previous value is restored afterwards. Only
processes of this host are adopted: one a worker starts on another host (through ssh, say) is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterator

from dynamix_byteps.launcher._guardian import process_stats

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
MARK_ENV = "DYNAMIX_LAUNCH_RUN"  # marks every process of one Supervisor run: see carries_mark
NOTE_AFTER_S = 1.0  # an orphan still running this long after SIGTERM is announced
UNREAD_S = 1.0  # an orphan whose environment still reads empty after this long is not the job's
AFTER_KILL_S = 5.0  # an orphan still running this long after SIGKILL is given up on

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


def reap_exited(known: Collection[int]) -> None:
    """Reap every child of this process that has exited and whose pid is not in ``known`` (an orphan
    adopted while the job runs, which would stay a zombie until the job ends). ``known`` must hold every
    child the caller reaps itself (its ``Popen``s), whose exit status this would take."""
    for pid in children():
        if pid not in known:
            _reaped(pid)


def new_mark() -> str:
    """A value of :data:`MARK_ENV` no other run has: put it in every process the job starts."""
    return f"{os.getpid()}.{secrets.token_hex(8)}"


def carries_mark(pid: int, mark: str) -> bool | None:
    """Whether process ``pid`` was started with ``MARK_ENV=mark`` in its environment (inherited from a
    process of the job); False when its environment cannot be read (another user's process, gone);
    None when it reads empty or cannot be read yet: a process in the middle of an ``exec`` (the kernel
    shows no environment until the new program's is in place), one started with an empty environment
    (``env -i``), or one that is exiting (its memory released, not a zombie yet: Linux 6.x answers
    ESRCH, earlier kernels read empty)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except ProcessLookupError:
        return None
    except OSError:
        return False
    return f"{MARK_ENV}={mark}".encode() in environ.split(b"\0") if environ else None


def _describe(pids: Collection[int]) -> str:
    """``pid command`` of up to 5 of ``pids``, for a message."""
    shown = []
    for pid in sorted(pids)[:5]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        shown.append(f"{pid} {command[:60]}")
    return ", ".join(shown) + (", ..." if len(pids) > 5 else "")


def stop_adopted(known: Collection[int], mark: str, grace_s: float, poll_s: float, note: Callable[[str], None],
                 interrupted: Callable[[], bool]) -> None:
    """Stop and reap the job's adopted orphans: each child of this process whose pid is not in ``known``
    and that carries ``mark`` (:func:`carries_mark`) gets SIGTERM, SIGKILL ``grace_s`` seconds later if
    it still runs (at once once ``interrupted()`` is true: the user asks for "now"), and is
    reaped; until none is left, as an orphan's own children are adopted only once it has died. Adopted
    processes without the mark (a daemon of the embedding program's own children) are reaped if they
    have exited, never signalled. Checks every ``poll_s`` seconds.

    ``note`` gets one line when an orphan outlives SIGTERM by ``NOTE_AFTER_S`` (what runs, how long it
    gets), and one naming the orphans still there ``AFTER_KILL_S`` seconds after their SIGKILL (a
    process in uninterruptible sleep): they are left running and this returns. ``known`` must hold every
    child the caller started and has not reaped yet: a ``Popen``'s exit status would be taken.
    """
    deadline: dict[int, float] = {}  # the job's orphan -> when it gets SIGKILL (once it got it: when we give up)
    killed: set[int] = set()
    foreign: set[int] = set()  # adopted without the mark
    unread: dict[int, float] = {}  # adopted, environment empty so far (mid-exec?) -> when first seen
    noted = False
    while True:
        live = {pid for pid in children() if pid not in known and not _reaped(pid)}
        # Forget what was reaped: its pid may come back as another process.
        deadline = {pid: at for pid, at in deadline.items() if pid in live}
        unread = {pid: at for pid, at in unread.items() if pid in live}
        killed &= live
        foreign &= live
        now = time.monotonic()
        for pid in live - deadline.keys() - foreign:
            ours = carries_mark(pid, mark)
            if ours is None and now - unread.setdefault(pid, now) < UNREAD_S:
                continue  # asked again next time
            unread.pop(pid, None)
            if ours:
                _signal(pid, signal.SIGTERM)
                deadline[pid] = now + grace_s
            else:
                foreign.add(pid)
        now_or_never = interrupted()
        for pid in [pid for pid in deadline if pid not in killed and (now_or_never or now >= deadline[pid])]:
            _signal(pid, signal.SIGKILL)
            killed.add(pid)
            deadline[pid] = now + AFTER_KILL_S
        stuck = [pid for pid in killed if now >= deadline[pid]]
        if len(stuck) == len(deadline) and not unread:
            if stuck:
                note(f"warning: {len(stuck)} process(es) the workers left still run {AFTER_KILL_S:g} s after "
                     f"SIGKILL (in uninterruptible sleep?), left as they are: {_describe(stuck)}")
            return
        waiting = [pid for pid in deadline if pid not in killed]
        if not noted and any(now >= deadline[pid] - grace_s + NOTE_AFTER_S for pid in waiting):
            noted = True
            note(f"waiting up to {max(deadline[pid] for pid in waiting) - now:.0f} s for {len(waiting)} process(es) "
                 f"the workers left, still running after SIGTERM ({_describe(waiting)}), before SIGKILL; "
                 "a signal to the launcher (Ctrl-C) kills them now")
        time.sleep(poll_s)
