"""Guardian process of ``bpslaunch`` (and of a private Ray instance): kills what the launcher started
if the launcher dies.

``PR_SET_PDEATHSIG`` reaches only the launcher's direct children; a worker's own children
(data-loader workers, a shell pipeline, ...) would survive a SIGKILLed launcher. This tiny
stdlib-only script closes that gap. The launcher starts it in its own session with a pipe
on stdin and writes one line per event:

* ``<pgid>``: a worker process group to guard;
* ``mailboxes <job>``: the job's workers keep mailboxes ``/dev/shm/dynamix.<job>.<rank>``;
* ``scratch <dir>``: a temporary directory of the launcher's (an absolute path whose name starts
  with ``dynamix-``);
* ``users <dir>``: such a directory, where every process of a program the launcher started keeps an
  open file (a private Ray instance: its logs and sockets), including those ``PR_SET_PDEATHSIG``
  and process groups miss (the raylet's agents and workers, in sessions or groups of their own);
* ``exit``: the launcher is finishing normally and has cleaned up; stop guarding.

End of file without ``exit`` means the launcher died (it was SIGKILLed or crashed): the
guardian sends SIGTERM to every recorded group and to every process with a file of a ``users``
directory open, waits ``argv[1]`` seconds (default 5) for them to end, sends SIGKILL to what is
left, removes the recorded jobs' mailboxes and the
recorded scratch directories that belong to its user (a killed process cannot remove its own),
and exits. It runs by path, so it starts without importing the package; the launcher imports
:class:`Guardian`, its end of the pipe, and the two checks both sides share.
"""

import os
import shutil
import signal
import stat
import subprocess
import sys
import time


class Guardian:
    """The launcher's handle on a guardian process: :meth:`start` it, :meth:`tell` it each event
    line of the module docstring, :meth:`stop` it once the launcher has cleaned up. Writes to a
    guardian that could not start, or has died, are dropped."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self._proc = None

    def start(self) -> None:
        """Start the guardian in its own session; raises OSError when Python cannot start."""
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(self.grace_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        """The guardian's process id (after :meth:`start`)."""
        return self._proc.pid

    def tell(self, message: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(message.encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        """Say ``exit`` and wait for the guardian to end (SIGKILL after ``grace_s`` + 5 s)."""
        if self._proc is None:
            return
        self.tell("exit")
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=self.grace_s + 5)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie.

    ``killpg(pgid, 0)`` also succeeds for a group of unreaped zombies (common in containers
    whose PID 1 does not reap), so on Linux the members are read from ``/proc``.
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not os.path.isdir("/proc/self"):
        return True
    return any(len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X")
               for _, fields in process_stats())


def process_stats():
    """``(pid, fields)`` of every process in ``/proc`` (none without it): ``fields`` are the
    ``/proc/<pid>/stat`` fields after the command name, as bytes (state, ppid, pgrp, ...)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(name), stat[stat.rfind(b")") + 2 :].split()


def users_of(folders) -> set[int]:
    """The processes, other than this one, that have a file under one of ``folders`` (absolute
    paths, as bytes) open; those of other users cannot be read and are not listed."""
    me = os.getpid()
    return {pid for pid, fields in process_stats()
            if pid != me and fields[0] not in (b"Z", b"X") and _has_open_file_under(pid, folders)}


def _has_open_file_under(pid: int, folders) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}".encode())
        except OSError:
            continue
        if any(target.startswith(folder + b"/") for folder in folders):
            return True
    return False


def _signal_all(pgids, pids, sig) -> None:
    for kill, targets in ((os.killpg, pgids), (os.kill, pids)):
        for target in targets:
            try:
                kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _stop(pgids, users, grace_s: float) -> None:
    """SIGTERM, then SIGKILL ``grace_s`` seconds later, to the groups ``pgids`` and the processes with
    a file under one of ``users`` open; waits up to ``grace_s`` seconds after each for them to end."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal_all(pgids, users_of(users) if users else (), sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (any(group_alive(p) for p in pgids) or users and users_of(users)):
            time.sleep(0.05)


def _valid_job(job: bytes) -> bool:
    return bool(job) and all(chr(c).isalnum() or chr(c) in "_-" for c in job) and job.isascii()


def _remove_mailboxes(jobs) -> None:
    for job in jobs:
        prefix = f"dynamix.{job}."
        try:
            names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and n[len(prefix):].isdigit()]
        except OSError:
            return
        for name in names:
            try:
                if os.lstat(f"/dev/shm/{name}").st_uid == os.geteuid():
                    os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass


def valid_scratch(path: bytes) -> bool:
    """Whether ``path`` (file-system bytes) may be a scratch directory: absolute, named ``dynamix-*``,
    on one line of the guardian's input."""
    return os.path.isabs(path) and os.path.basename(path).startswith(b"dynamix-") and b"\n" not in path


def _remove_scratch(paths) -> None:
    for path in paths:
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    grace_s = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    pgids, jobs, scratch, users = [], set(), set(), set()
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == b"exit":
            return 0
        if line.isdigit() and int(line) > 1:
            pgids.append(int(line))
        elif line.startswith(b"mailboxes ") and _valid_job(line[len(b"mailboxes "):]):
            jobs.add(line[len(b"mailboxes "):].decode())
        elif line.startswith(b"scratch ") and valid_scratch(line[len(b"scratch "):]):
            scratch.add(line[len(b"scratch "):])
        elif line.startswith(b"users ") and valid_scratch(line[len(b"users "):]):
            users.add(line[len(b"users "):])
    # The launcher is gone without saying goodbye: tear the job down.
    _stop(pgids, users, grace_s)
    _remove_mailboxes(jobs)
    _remove_scratch(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
