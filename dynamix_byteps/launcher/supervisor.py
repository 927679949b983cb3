"""Process supervisor of ``bpslaunch``: spawn, prefix output, propagate failure, tear down.

Each child runs in its own process group (so a signal to the group reaches its own children
too) with ``PR_SET_PDEATHSIG=SIGTERM`` (so it dies with the launcher even when the launcher
is SIGKILLed). A small guardian process (:mod:`._guardian`) watches the launcher and kills
the children's groups, grandchildren included, if the launcher dies without cleaning up. While
:meth:`Supervisor.run` runs, the launcher is a child subreaper (Linux, :mod:`._subreaper`): a
descendant that left its child's group (``setsid``, ``Popen(start_new_session=True)``, a daemon)
becomes the launcher's child once its parent exits, instead of init's; it is reaped every
``REAP_EVERY_S`` if it has exited, and stopped and reaped when the job ends, as the groups are
(SIGTERM, SIGKILL after ``grace_s``, at once on a signal to the launcher); so are the orphans of
those. One still running ``NOTE_AFTER_S`` after SIGTERM is announced; one still running
``AFTER_KILL_S`` after SIGKILL (uninterruptible sleep) is named and left. Only processes whose
environment carries the run's mark (``DYNAMIX_LAUNCH_RUN``, set for every child and inherited) are
stopped: one that clears its environment is not. What a SIGKILLed launcher leaves in sessions of
their own, the guardian does not reach.

Each line a child writes to stdout or stderr is copied to the launcher's stdout or stderr
with a ``[label] `` prefix (:mod:`.output`), and raw to the child's log file when one is
given. The first child to exit non-zero decides the exit code; the workers still running get
``settle_s`` (half of ``grace_s``, at most ``SETTLE_S``) to exit by themselves, so that workers
failing the same way a moment apart are each seen failing on their own rather than stopped by the
launcher; the caller's ``settled`` ends that wait early. Then what still runs gets SIGTERM, and
SIGKILL after ``grace_s`` seconds. SIGINT, SIGTERM or SIGHUP to the launcher is forwarded to
every worker's group at once (during ``settle_s``, it is SIGTERM to every group) and the launcher
returns ``128 + signal``; the services are stopped once the workers have exited, as at the end of a
job (ps workers leave through their servers, and report to the scheduler until they exit), or at
SIGKILL with the rest. A child whose exit the launcher has not seen ``AFTER_KILL_S`` after its SIGKILL
(uninterruptible sleep on a hung file system or device, or a debugger attached to it that does not
reap it) is named in a warning and left; the job's exit code stands (a worker is SIGKILLed only
once the job has failed or been signalled, so that code is never 0).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Mapping, Sequence

from dynamix_byteps.env import JOB_ID_ENV
from dynamix_byteps.launcher._guardian import Guardian, group_alive, valid_scratch
from dynamix_byteps.launcher._subreaper import (
    AFTER_KILL_S,
    MARK_ENV,
    PRCTL,
    adopting,
    children,
    new_mark,
    reap_exited,
    stop_adopted,
)
from dynamix_byteps.launcher.output import Output
from dynamix_byteps.launcher.stop_signals import StopSignals

_PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 60.0
SETTLE_S = 5.0  # the longest wait, after a failure, for the other workers to exit by themselves
REAP_EVERY_S = 1.0  # how often the job's exited orphans are reaped while it runs (a scan of /proc)


@dataclass(frozen=True)
class ChildSpec:
    """One process to supervise.

    Attributes:
        label: the output prefix without brackets, e.g. ``"0"`` for global rank 0.
        argv: the command and its arguments; ``argv[0]`` is looked up on ``PATH``.
        env: the complete environment of the child.
        log_path: file that receives the child's raw stdout and stderr, or ``None``.
        service: a helper the job can run without (the scheduler): started before the
            workers, stopped once they have all exited, and its own exit never ends the job.
        ready_file: the next child starts only once this file exists (the service writes it
            when it is ready), within ``READY_TIMEOUT_S``; removed once seen.
        append_log: append to ``log_path`` instead of truncating it (a restarted job).
        ends_with_workers: a service that exits by itself, with code 0, once the workers have
            shut down (a ps summation server): that exit is not reported.
        essential: a service the workers cannot go on without (a ps summation server): its
            failure (a code > 0, or a signal the launcher did not send) ends the job as a worker's
            would, and is ``failed_service``.
        stopped_code: an essential service's exit code for "a worker stopped me, the job failed":
            not a cause; the workers' exits end the job and say why (if they all exit 0, the job
            still fails with this code).
    """

    label: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path | None = None
    service: bool = False
    ready_file: Path | None = None
    append_log: bool = False
    ends_with_workers: bool = False
    essential: bool = False
    stopped_code: int | None = None


class SpawnError(Exception):
    """A command could not be executed; ``exit_code`` is 127 (not found) or 126, as in a shell."""

    def __init__(self, argv0: str, error: OSError):
        self.exit_code = 127 if isinstance(error, FileNotFoundError) else 126
        reason = "command not found" if self.exit_code == 127 else (error.strerror or str(error))
        super().__init__(f"cannot run {argv0!r}: {reason}")


def exit_code_of(returncode: int) -> int:
    """Shell-style exit code of a ``Popen.returncode``: ``-N`` (killed by signal N) → ``128 + N``."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _preexec(parent_pid: int) -> None:
    """Runs in the child between fork and exec: new process group, die with the launcher."""
    os.setpgid(0, 0)
    if PRCTL is not None:  # elsewhere children still get their own group and the guardian
        PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)


class _Child:
    def __init__(self, spec: ChildSpec, proc: subprocess.Popen, log: BinaryIO | None):
        self.spec = spec
        self.proc = proc
        self.pgid = proc.pid  # leader of its own group, see _preexec
        self.log = log
        self.returncode: int | None = None
        self.signalled = False  # the launcher sent it a signal (its exit code may be ours)
        self.given_up = False  # still there AFTER_KILL_S after SIGKILL: no longer waited for


class Supervisor:
    """Runs a set of child processes as one job; see the module docstring for the rules.

    Args:
        specs: the processes to start, in order.
        grace_s: seconds between SIGTERM and SIGKILL when stopping children (> 0); half of it,
            at most ``SETTLE_S``, is ``settle_s``, the wait after a failure before the SIGTERM.
        stdout, stderr: binary streams that receive the prefixed lines; default the
            launcher's own ``sys.stdout.buffer`` / ``sys.stderr.buffer``.
        poll_s: seconds between checks of the children's state.
        write_guard: returns a context manager held around each write to ``stdout``/``stderr``
            (the console progress bar clears and redraws itself there); default none.
        on_child_bar: called once when a child draws its own progress bar (see ``Output``).
        scratch_dirs: the caller's temporary directories (absolute paths named ``dynamix-*``),
            removed by the guardian if the launcher dies without cleaning up; the caller removes
            them itself otherwise.
        settled: asked while the others get ``settle_s`` after a failure; True stops them at once
            (whether they fail on their own no longer matters); default never.
        signals: the caller's :class:`~.stop_signals.StopSignals`, caught by the caller for longer
            than :meth:`run` (between the runs of an elastic job); default: :meth:`run` catches its own.

    After :meth:`run`, ``failed_worker`` is the label of the worker whose own failure ended
    the job (None when all succeeded, or a signal or a service ended it), ``failed_at`` the wall-clock
    time (``time.time()``) its failure was seen, ``self_failed`` maps each worker that exited
    with a code > 0 by itself (before the launcher signalled it: within ``settle_s`` of the first
    failure) to that code, and ``killed`` lists the workers that died of a signal the launcher did
    not send; ``failed_service`` is the label of the essential service whose failure ended the job
    instead (then ``failed_worker`` is None).

    While :meth:`run` runs, this whole process is a child subreaper (the flag's previous value is
    restored at the end): it adopts the orphans of every process below it, the job's and the embedding
    program's. Those with the run's mark in their environment (the job's) are stopped when the job
    ends; the others (a daemon that a child the program started before :meth:`run` detaches meanwhile)
    are left running, and reaped if they exit before :meth:`run` returns; after it they remain this
    process's children. A program that embeds the launcher runs one Supervisor at a time and starts no
    other process meanwhile (from another thread): if that process exits during :meth:`run`, it is
    reaped as an orphan and its ``Popen`` never learns its exit status.
    """

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        grace_s: float = 5.0,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        poll_s: float = 0.05,
        write_guard: Callable[[], ContextManager] = contextlib.nullcontext,
        on_child_bar: Callable[[], None] | None = None,
        scratch_dirs: Sequence[Path] = (),
        settled: Callable[[], bool] = lambda: False,
        signals: StopSignals | None = None,
    ):
        if not specs:
            raise ValueError("Supervisor needs at least one ChildSpec")
        if grace_s <= 0:
            raise ValueError(f"grace_s={grace_s} must be > 0 seconds")
        for folder in scratch_dirs:
            if not valid_scratch(os.fsencode(folder)):
                raise ValueError(f"scratch directory {str(folder)!r} must be an absolute path named dynamix-*")
        self.specs = list(specs)
        self.grace_s = grace_s
        self.settle_s = min(SETTLE_S, grace_s / 2)
        self.settled = settled
        self.poll_s = poll_s
        self.output = Output(stdout, stderr, write_guard, on_child_bar)
        self.scratch_dirs = list(scratch_dirs)
        self._children: list[_Child] = []
        self._pumps: list[threading.Thread] = []
        self._guardian = Guardian(grace_s)
        self._not_orphans: set[int] = set()  # children of this process that are not the job's: see _run
        self._mark = ""  # run() draws one: in the environment of every process of the job, see _subreaper
        self._signals = StopSignals() if signals is None else signals
        self._own_signals = signals is None
        # Signals the launcher has acted on (forwarded, or ended a wait with); one beyond means "now".
        # Counted when acted on, not when a stop begins: a signal that comes while the launcher sees
        # the job end must still end the clean-up's wait. Signals within one poll count as one.
        self._answered = 0
        self._killed_on_request = False  # a signal brought SIGKILL: the clean-up does not wait either
        self.failed_worker: str | None = None
        self.failed_service: str | None = None
        self.failed_at: float | None = None
        self.self_failed: dict[str, int] = {}
        self.killed: list[str] = []

    # ---- signals ------------------------------------------------------------------------

    def _now_requested(self) -> bool:
        return self._killed_on_request or self._signals.count > self._answered

    # ---- process groups -----------------------------------------------------------------

    def _killpg(self, child: _Child, sig: int) -> None:
        """``sig`` to ``child``'s process group, by its id alone: the group outlives its leader once that
        is reaped, and the leader's pid may then be another process's (so no fallback to ``os.kill``)."""
        try:
            os.killpg(child.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _spawn(self, spec: ChildSpec) -> _Child:
        log = None
        if spec.log_path is not None:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_path, "ab" if spec.append_log else "wb")
        parent = os.getpid()
        try:
            proc = subprocess.Popen(
                list(spec.argv),
                env={**spec.env, MARK_ENV: self._mark},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=lambda: _preexec(parent),
            )
        except OSError as error:
            if log is not None:
                log.close()
            raise SpawnError(spec.argv[0], error) from error
        child = _Child(spec, proc, log)
        self._guardian.tell(str(child.pgid))
        if spec.env.get(JOB_ID_ENV):
            self._guardian.tell(f"mailboxes {spec.env[JOB_ID_ENV]}")
        return child

    # ---- the job ------------------------------------------------------------------------

    def run(self) -> int:
        """Start every child, wait for the job to end, clean up; returns the exit code.

        Returns:
            0 when every child exits 0; else the shell-style code of the first child that
            failed (``128 + N`` if it was killed by signal N); ``128 + N`` when the launcher
            got signal N; 126/127 when a command could not be executed.
        """
        self._mark = new_mark()
        with self._signals.caught() if self._own_signals else contextlib.nullcontext(), adopting() as not_adopting:
            try:
                return self._run(not_adopting)
            finally:
                self._cleanup()

    def _run(self, not_adopting: str | None) -> int:
        self._not_orphans.update(children())  # the embedding program's own
        if not_adopting is not None:
            self.output.note(f"warning: the launcher cannot adopt orphaned processes ({not_adopting}); a process "
                             "a worker starts in a session of its own (setsid) outlives the job")
        try:
            self._guardian.start()
            self._not_orphans.add(self._guardian.pid)
        except OSError as error:  # pragma: no cover - python itself cannot start
            self.output.note(f"warning: guardian process not started ({error}); "
                             "a SIGKILLed launcher may leave grandchildren")
        for folder in self.scratch_dirs:
            self._guardian.tell(f"scratch {folder}")
        try:
            for spec in self.specs:
                if self._signals.received():
                    break
                self._children.append(self._spawn(spec))
                self._start_pumps(self._children[-1])  # a service's startup error must be shown
                if spec.ready_file is not None and not self._await_ready(self._children[-1]):
                    if self._signals.received():
                        break  # _wait reports the signal and stops what started
                    self._stop_all(signal.SIGTERM)
                    return 1
        except SpawnError as error:
            self.output.note(str(error))
            self._stop_all(signal.SIGTERM)
            return error.exit_code
        return self._wait()

    def _start_pumps(self, child: _Child) -> None:
        for pipe, sink in ((child.proc.stdout, self.output.out), (child.proc.stderr, self.output.err)):
            thread = threading.Thread(target=self.output.pump, args=(pipe, sink, child.spec.label, child.log),
                                      daemon=True)
            thread.start()
            self._pumps.append(thread)

    def _await_ready(self, child: _Child) -> bool:
        """Whether ``child`` wrote its ready file; False, with a note, when it exited or ran past
        ``READY_TIMEOUT_S`` first, and False, without one, when the launcher got a signal."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not child.spec.ready_file.exists():
            if self._signals.received():
                return False
            if child.proc.poll() is not None or time.monotonic() > deadline:
                self.output.note(f"[{child.spec.label}] did not become ready "
                                 + (f"(exited with code {child.proc.returncode})" if child.proc.returncode is not None
                                    else f"within {READY_TIMEOUT_S:g} s"))
                return False
            time.sleep(self.poll_s)
        child.spec.ready_file.unlink(missing_ok=True)  # read once; it would outlive the job in --log-dir
        return True

    def _wait(self) -> int:
        exit_code: int | None = None
        services_stopping = False
        stopping_since: float | None = None
        settle_until: float | None = None  # after a failure: the workers may still exit by themselves until then
        killed_at: float | None = None
        stopped_by_a_worker: _Child | None = None
        reap_at = time.monotonic() + REAP_EVERY_S
        while True:
            # Decisions below come from this count, never the live one: a signal that comes after it is
            # answered on the next pass, one before it on this pass, and none twice.
            seen = self._signals.count
            if seen > self._answered and exit_code is None and not services_stopping:
                exit_code = 128 + self._signals.first
                self.output.note(f"received {_signal_name(self._signals.first)}; stopping {self._count_live()} process(es)")
                self._signal_live(self._signals.first, services=False)
                stopping_since, self._answered = time.monotonic(), seen
            # Workers first: a server a lost worker's peers stopped (abort) exits right after it.
            for child in sorted(self._children, key=lambda c: c.spec.service):
                if child.returncode is not None:
                    continue
                rc = child.proc.poll()
                if rc is None:
                    continue
                child.returncode = rc
                if child.spec.service and child.spec.essential and rc != 0 and not child.signalled \
                        and exit_code is None:
                    if rc == child.spec.stopped_code:
                        stopped_by_a_worker = child
                        continue
                    exit_code = self._fail(child, rc, "; the workers cannot go on without it")
                    self.failed_service = child.spec.label
                    settle_until = time.monotonic() + self.settle_s
                    continue
                if child.spec.service:
                    expected = rc == 0 and child.spec.ends_with_workers
                    if not (services_stopping or expected) and exit_code is None:  # not while the launcher stops the job
                        self.output.note(f"[{child.spec.label}] exited with code {rc}; the workers go on without it")
                    continue
                if rc > 0 and not child.signalled:
                    self.self_failed[child.spec.label] = rc
                elif rc < 0 and not child.signalled:
                    self.killed.append(child.spec.label)
                if rc != 0 and exit_code is None:
                    exit_code = self._fail(child, rc)
                    self.failed_worker = child.spec.label
                    settle_until = time.monotonic() + self.settle_s
            if self._count_live() == 0:
                return self._end_code(exit_code, stopped_by_a_worker)
            if not services_stopping and all(c.returncode is not None for c in self._children if not c.spec.service):
                services_stopping, settle_until = True, None
                self._signal_live(signal.SIGTERM)
                if stopping_since is None:
                    stopping_since = time.monotonic()
            # A signal to the launcher ends the wait as well: it means "stop now".
            if settle_until is not None and (time.monotonic() >= settle_until or seen > self._answered
                                             or self.settled()):
                if seen > self._answered:
                    self.output.note(f"received {_signal_name(self._signals.first)}; stopping {self._count_live()} "
                                     f"process(es) (SIGTERM, SIGKILL after {self.grace_s:g} s)")
                settle_until = None
                self._signal_live(signal.SIGTERM)
                stopping_since, self._answered = time.monotonic(), seen
            elif killed_at is None and stopping_since is not None:
                # A (further) signal while stopping means "now": do not wait out the grace period.
                if seen > self._answered or time.monotonic() - stopping_since > self.grace_s:
                    if seen > self._answered:
                        self.output.note(f"received a signal while stopping; killing {self._count_live()} "
                                         "process(es) now (SIGKILL)")
                    self._signal_live(signal.SIGKILL)
                    self._killed_on_request = self._killed_on_request or seen > self._answered
                    killed_at, self._answered = time.monotonic(), seen
            elif killed_at is not None and time.monotonic() - killed_at >= AFTER_KILL_S:
                self._give_up([c for c in self._children if c.returncode is None])
                return self._end_code(exit_code, stopped_by_a_worker)
            if time.monotonic() >= reap_at:
                reap_exited(self._not_orphans | {c.proc.pid for c in self._children if c.proc.returncode is None})
                reap_at = time.monotonic() + REAP_EVERY_S
            time.sleep(self.poll_s)

    def _end_code(self, exit_code: int | None, stopped_by_a_worker: _Child | None) -> int:
        """The job's exit code once :meth:`_wait` is done: ``exit_code``, or when nothing failed, the
        failure of the essential service ``stopped_by_a_worker`` (if any), else 0."""
        if exit_code is None and stopped_by_a_worker is not None:
            return self._fail(stopped_by_a_worker, stopped_by_a_worker.returncode,
                              "; a worker stopped it after a collective failed")
        return 0 if exit_code is None else exit_code

    def _give_up(self, stuck: Sequence[_Child]) -> None:
        """Name the children of ``stuck`` (SIGKILLed ``AFTER_KILL_S`` ago, exit not seen) in a warning;
        the clean-up leaves them alone from now on."""
        if not stuck:
            return
        for child in stuck:
            child.given_up = True
        named = ", ".join(f"[{c.spec.label}] {c.proc.pid} {shlex.join(c.spec.argv)[:60]}" for c in stuck)
        self.output.note(f"warning: {len(stuck)} process(es) of the job still run {AFTER_KILL_S:g} s after SIGKILL "
                         f"(in uninterruptible sleep? held by a debugger?), left as they are: {named}")

    def _fail(self, child: _Child, rc: int, why: str = "") -> int:
        """``child``'s exit ``rc`` ends the job: say so; returns the job's exit code (:meth:`_wait`
        stops the others after ``settle_s``)."""
        self.failed_at = time.time()
        how = f"was killed by {_signal_name(-rc)}" if rc < 0 else f"exited with code {rc}"
        others = self._count_live()
        self.output.note(f"[{child.spec.label}] {how}{why}" + (f"; stopping {others} other process(es)" if others else ""))
        return exit_code_of(rc)

    def _count_live(self) -> int:
        return sum(1 for c in self._children if c.returncode is None)

    def _signal_live(self, sig: int, services: bool = True) -> None:
        for child in self._children:
            if child.returncode is None and (services or not child.spec.service):
                # One that already exited keeps its own code (it is reaped by the next pass of _wait).
                child.signalled = child.signalled or child.proc.poll() is None
                self._killpg(child, sig)

    def _stop_all(self, sig: int) -> None:
        """Send ``sig`` to every group with a live member; SIGKILL whatever outlives the grace period, or
        at once when a signal to the launcher asks for "now" (as in :meth:`_wait`)."""
        groups = [c for c in self._children if not c.given_up and group_alive(c.pgid)]
        for child in groups:
            self._killpg(child, sig)
        deadline = time.monotonic() + self.grace_s
        while groups and time.monotonic() < deadline and not self._now_requested():
            for child in self._children:
                if child.returncode is None:
                    child.returncode = child.proc.poll()
            groups = [c for c in groups if group_alive(c.pgid)]
            if groups:
                time.sleep(self.poll_s)
        for child in groups:
            self._killpg(child, signal.SIGKILL)

    def _reap_children(self) -> None:
        """Reap the children not given up on: :meth:`_stop_all` has SIGKILLed what outlived the grace
        period, so the ones not gone ``AFTER_KILL_S`` later are given up on."""
        deadline = time.monotonic() + AFTER_KILL_S
        for child in self._children:
            if not child.given_up:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._give_up([c for c in self._children if not c.given_up and c.proc.returncode is None])

    def _cleanup(self) -> None:
        # A signal not answered yet, or one that brought SIGKILL in _wait, means "now" for all of it.
        # Grandchildren left behind by a child that already exited (or a half-started job).
        self._stop_all(signal.SIGTERM)
        self._reap_children()
        # The job's children are reaped or given up on, so the other children left are adopted
        # orphans (the workers' are adopted once the workers are gone), apart from _not_orphans;
        # those with the run's mark are the job's.
        given_up = {c.proc.pid for c in self._children if c.given_up}
        stop_adopted(self._not_orphans | given_up, self._mark, self.grace_s, self.poll_s, self.output.note,
                     self._now_requested)
        # One deadline for all: a daemonised grandchild may hold every pipe open.
        deadline = time.monotonic() + self.grace_s
        for thread in self._pumps:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for child in self._children:
            if child.log is not None:
                with self.output.lock, contextlib.suppress(OSError):  # a full disk: what it could not write is lost
                    child.log.close()
        self._guardian.stop()
