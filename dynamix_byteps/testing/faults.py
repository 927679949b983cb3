"""Fault schedules against a test-bed job: a declarative list of (step or time, action).

:func:`run_with_faults` runs one ``bpslaunch`` job across a :class:`~.netns.Testbed` (through
:func:`~.netns.run_job`, on a background thread), fires each :class:`Fault` when the job's
progress reaches ``at_step`` (or ``at_s`` seconds after the start), and returns what happened:
the job's result, when each fault fired and what it hit, and the processes of the job still
alive after it ended (orphans: there must be none; any found are killed and reported).

Every process of the job carries ``DYNAMIX_FAULT_TAG`` in its environment; faults find their
targets by it: a worker by its global rank, the scheduler and a host's node agent by their
command line and network namespace.

Defined outcomes (what the tests in ``tests/test_faults.py`` check, each within 15 s of the fault;
"host h" = its ``bpslaunch``):

=================  ========================================  ==================================================================
action             what it does                              outcome
=================  ========================================  ==================================================================
kill_worker        SIGKILL the worker of rank ``target``     its host exits 137 (128 + SIGKILL) and logs ``[r] was killed by
                                                             SIGKILL; stopping ...``; the other hosts' workers fail their
                                                             collective and exit non-zero; no process is left
kill_agent         SIGKILL host ``target``'s node agent      training goes on; the host logs ``[agent] exited with code -9;
                                                             the workers go on without it``; every host exits 0
kill_scheduler     SIGKILL the scheduler                     training goes on with the last assignment; host 0 logs
                                                             ``[scheduler] exited with code -9``, workers log ``scheduler ...
                                                             is unreachable``; every host exits 0
pause_scheduler    SIGSTOP the scheduler, SIGCONT after      training goes on (reports time out after 2 s, workers log
                   ``duration_s``                            ``unreachable`` then ``reachable again``); every host exits 0
cut_link           drop every packet in and out of host      collectives wait ``--timeout`` seconds (gloo: ``Timed out waiting
                   ``target`` (nft, in its namespace)        ...ms``), then the workers raise CommunicationError and exit 1;
                                                             every host exits non-zero
slow_link          tbf at ``rate_mbit`` on host              training goes on, slower; every host exits 0
                   ``target``'s link, both directions
lossy_link         drop a ``loss`` share of the packets      training goes on, slower (TCP retransmits them); the node agents
                   host ``target`` receives (nft, in its     report ``retransmits`` > 0 for the workers talking to that host;
                   namespace; ``Testbed.set_loss``)          every host exits 0
fill_disk          fill the file system of ``path``          rank 0's next ``bps.save_checkpoint`` raises OSError ENOSPC (``No
                   (the run directory) to ENOSPC             space left on device`` on the console); host 0 exits 1, the
                                                             others are stopped; the last complete checkpoint is kept (atomic
                                                             write); log lines that no longer fit are dropped
=================  ========================================  ==================================================================

Requirements: those of the test bed (root, iproute2), plus ``nft`` for ``cut_link`` and
``lossy_link``, and ``mount`` for :func:`small_tmpfs`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dynamix_byteps.testing.netns import JobResult, Testbed, _run, _tbf, nft, run_job

__all__ = ["ACTIONS", "FAULT_TAG_ENV", "Fault", "FaultRun", "job_processes", "run_with_faults", "small_tmpfs"]

FAULT_TAG_ENV = "DYNAMIX_FAULT_TAG"
ACTIONS = ("kill_worker", "kill_agent", "kill_scheduler", "pause_scheduler", "cut_link", "slow_link", "lossy_link",
           "fill_disk")
POLL_S = 0.1
TARGET_WAIT_S = 30.0  # longest a fault waits for its target process to appear


@dataclass(frozen=True)
class Fault:
    """One scheduled fault.

    Attributes:
        action: one of :data:`ACTIONS` (see the module docstring's table).
        at_step: fire once ``progress()`` returns a step >= this; or
        at_s: fire this many seconds after the job started (exactly one of the two).
        target: the worker's global rank (``kill_worker``) or the host's index (``kill_agent``,
            ``cut_link``, ``slow_link``, ``lossy_link``; host 0 is the root namespace and cannot be
            cut, slowed or made lossy).
        rate_mbit: ``slow_link``'s rate, Mbit/s.
        loss: ``lossy_link``'s probability of dropping each received packet, in (0, 1).
        duration_s: ``pause_scheduler``: seconds until SIGCONT.
        path: ``fill_disk``: a directory on the file system to fill.
    """

    action: str
    at_step: int | None = None
    at_s: float | None = None
    target: int | None = None
    rate_mbit: float | None = None
    loss: float | None = None
    duration_s: float = 3.0
    path: str | None = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"fault action {self.action!r} is not one of {', '.join(ACTIONS)}")
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError(f"fault {self.action}: give exactly one of at_step and at_s")
        needs = {"kill_worker": "target", "kill_agent": "target", "cut_link": "target", "slow_link": "rate_mbit",
                 "lossy_link": "loss", "fill_disk": "path"}.get(self.action)
        if needs is not None and getattr(self, needs) is None:
            raise ValueError(f"fault {self.action} needs {needs}")
        if self.action == "lossy_link" and not 0 < self.loss < 1:
            raise ValueError(f"fault lossy_link: loss must be a probability in (0, 1), not {self.loss}")
        if self.action in ("cut_link", "slow_link", "lossy_link") and not (self.target or 0) >= 1:
            raise ValueError(f"fault {self.action}: target must be a namespaced host (>= 1), not {self.target}")


@dataclass
class FaultRun:
    """What :func:`run_with_faults` saw.

    Attributes:
        job: the job's :class:`~.netns.JobResult`.
        fired: ``(fault, seconds since the start, what it hit)`` for each fault that fired.
        ended_s: seconds from the start until every launcher had exited.
        orphans: ``"pid cmdline"`` of the job's processes alive after it ended (then killed).
    """

    job: JobResult
    fired: list[tuple[Fault, float, str]] = field(default_factory=list)
    ended_s: float = 0.0
    orphans: list[str] = field(default_factory=list)

    def output(self, host: int = 0) -> str:
        return self.job.outputs[host]


def job_processes(tag: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment has ``DYNAMIX_FAULT_TAG=tag``."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get(FAULT_TAG_ENV) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _host_inodes(bed: Testbed) -> dict[int, int]:
    """Network-namespace inode -> host index."""
    inodes = {os.stat("/proc/self/ns/net").st_ino: 0}
    for host in bed.hosts[1:]:
        inodes[os.stat(f"/run/netns/{host.namespace}").st_ino] = host.index
    return inodes


def _find(bed: Testbed, tag: str, fault: Fault) -> psutil.Process | None:
    """The process ``fault`` hits, or None while it is not running."""
    hosts = _host_inodes(bed)
    for proc in job_processes(tag):
        try:
            cmdline, env = proc.cmdline(), proc.environ()
            parent_env = proc.parent().environ() if proc.parent() else {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        command = " ".join(cmdline)
        if fault.action == "kill_worker":
            # the worker itself, not a DataLoader child of it (which inherits the same variables)
            if "BYTEPS_LOCAL_RANK" in env and "BYTEPS_LOCAL_RANK" not in parent_env:
                rank = int(env.get("DYNAMIX_RANK_OFFSET", "0")) + int(env["BYTEPS_LOCAL_RANK"])
                if rank == fault.target:
                    return proc
        elif ((fault.action in ("kill_scheduler", "pause_scheduler") and "dynamix_byteps.cli scheduler" in command)
              or (fault.action == "kill_agent" and "dynamix_byteps.cli agent" in command
                  and hosts.get(_netns_inode(proc.pid)) == fault.target)):
            return proc
    return None


def _cut(bed: Testbed, host: int) -> str:
    nft(bed.hosts[host].namespace,
        "add table inet dxtbcut\n"
        "add chain inet dxtbcut in { type filter hook input priority 0; policy drop; }\n"
        "add chain inet dxtbcut out { type filter hook output priority 0; policy drop; }\n"
        'add rule inet dxtbcut in iifname "lo" accept\n'
        'add rule inet dxtbcut out oifname "lo" accept\n')
    return f"host {host} ({bed.hosts[host].address}) cut"


def _slow(bed: Testbed, host: int, rate_mbit: float) -> str:
    namespace, outer, inner = bed._names(host)
    for netns_args, device in (((), outer), (("-n", namespace), inner)):
        _run("tc", *netns_args, "qdisc", "replace", "dev", device, "root", *_tbf(rate_mbit))
    return f"host {host} slowed to {rate_mbit:g} Mbit/s"


def _fill(path: str) -> str:
    filler = Path(path) / ".dxtb-fill"
    written = 0
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * (1 << 20)
        while True:
            try:
                written += f.write(chunk)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    return f"{path} filled ({written} bytes)"


def _fire(bed: Testbed, tag: str, fault: Fault, deadline: float) -> str:
    if fault.action == "cut_link":
        return _cut(bed, fault.target)
    if fault.action == "slow_link":
        return _slow(bed, fault.target, fault.rate_mbit)
    if fault.action == "lossy_link":
        bed.set_loss(fault.target, fault.loss)
        return f"host {fault.target} receives with {fault.loss:.1%} loss"
    if fault.action == "fill_disk":
        return _fill(fault.path)
    while (proc := _find(bed, tag, fault)) is None:
        if time.monotonic() > deadline:
            return "target not found"
        time.sleep(POLL_S)
    if fault.action == "pause_scheduler":
        proc.suspend()
        threading.Timer(fault.duration_s, _resume, args=(proc,)).start()
        return f"pid {proc.pid} stopped for {fault.duration_s:g} s"
    proc.kill()
    return f"pid {proc.pid} killed"


def _resume(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.resume()


def run_with_faults(bed: Testbed, slots: Sequence[int], command: Sequence[str], launcher_args: Sequence[str],
                    faults: Sequence[Fault], *, progress: Callable[[], int | None] | None = None,
                    env: Mapping[str, str] | None = None, timeout_s: float = 300.0,
                    grace_s: float = 5.0) -> FaultRun:
    """Run a job (as :func:`~.netns.run_job`) and fire ``faults`` on schedule.

    Args:
        progress: returns the job's current step (e.g. from the workers' own logs), or None
            before it has one; needed by faults with ``at_step``.
        timeout_s, grace_s, env: as for :func:`~.netns.run_job`.

    Raises:
        ValueError: a fault has ``at_step`` but no ``progress`` is given.
    """
    if any(f.at_step is not None for f in faults) and progress is None:
        raise ValueError("faults with at_step need progress=, a function returning the job's step")
    tag = secrets.token_hex(6)
    env = dict(os.environ if env is None else env, **{FAULT_TAG_ENV: tag})
    box: dict[str, JobResult] = {}
    thread = threading.Thread(target=lambda: box.setdefault("job", run_job(
        bed, slots, command, launcher_args, env=env, timeout_s=timeout_s, grace_s=grace_s)), daemon=True)
    start = time.monotonic()
    thread.start()
    run = FaultRun(job=None)  # type: ignore[arg-type]
    pending = list(faults)
    while thread.is_alive() and pending:
        step = progress() if progress is not None else None
        now = time.monotonic() - start
        for fault in list(pending):
            due = (fault.at_s is not None and now >= fault.at_s) or (
                fault.at_step is not None and step is not None and step >= fault.at_step)
            if due:
                pending.remove(fault)
                what = _fire(bed, tag, fault, time.monotonic() + TARGET_WAIT_S)
                run.fired.append((fault, time.monotonic() - start, what))
        thread.join(POLL_S)
    thread.join(timeout_s + 60)
    run.ended_s = time.monotonic() - start
    run.job = box["job"]
    time.sleep(0.5)  # processes killed by their launcher's clean-up are reaped by now
    for proc in job_processes(tag):
        with contextlib.suppress(psutil.Error):
            run.orphans.append(f"{proc.pid} {' '.join(proc.cmdline())}")
            proc.kill()
    return run


@contextlib.contextmanager
def small_tmpfs(size_kib: int) -> Iterator[Path]:
    """A fresh tmpfs of ``size_kib`` KiB mounted on a temporary directory (root), unmounted after."""
    directory = Path(tempfile.mkdtemp(prefix="dxtb-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=1777", "dxtb-disk", str(directory)],
                   check=True, capture_output=True, timeout=20)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True, timeout=20)
        directory.rmdir()
