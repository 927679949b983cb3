"""Elastic restart: ``bpslaunch --restart-on-failure N --checkpoint PATH`` runs the job again, with
the workers that are left, when one is lost (:func:`run`).

On one host, a failed worker's run is followed by one with a worker fewer (ranks 0..size-2, a
fresh scheduler for the new size, logs appended to), up to N times; every child sees
``DYNAMIX_RESTART`` (0, 1, 2, ...) and ``DYNAMIX_CHECKPOINT``. A run that failed before any worker
got through ``bps.init``, or in which every worker failed on its own, is an error in the command,
not a lost worker: it is not restarted, unless it is a restarted run in which a worker was killed
by a signal the launcher did not send (the OOM killer between the restart and the rendezvous). A
worker failed on its own when it exited with a code > 0 by itself (the others get a moment for it
after the first failure, see :mod:`.supervisor`) and no collective of it had failed (it raised no
CommunicationError, which a peer's failure causes).

Across hosts, the ``bpslaunch`` of every host agrees on the next run.
With ``--hosts ... --restart-on-failure N``, node 0's launcher serves the gRPC restart rendezvous
(:mod:`.rendezvous`) on ``--restart-port`` of the first of ``--hosts`` for the whole job. After
each run (a round), every other launcher sends it its :class:`RunReport` and waits for the
decision; node 0 adds its own report, calls :func:`decide`, and answers every host with the same one:

* ``{"exit": code, "reason": ...}``: the job ends; every launcher exits with ``code``;
* ``{"slots": [S0, S1, ...], "port": P, "scheduler_port": Q, "lost": [ranks]}``: the next run
  has ``Si`` workers on host ``i`` (ranks in host order, as always), rendezvous on the fresh
  ``port`` and a scheduler for the new size on ``scheduler_port``; a host given 0 slots leaves
  the job (its launcher exits 0).

Which workers are lost: those killed by a signal their launcher did not send (SIGKILL, the OOM
killer); when none was, the worker of the earliest failure (the others are the collectives it
broke; wall-clock times, so the hosts' clocks should agree to well under a second), unless that
failure was a summation server's (``--engine ps``): then no worker is lost. Each lost
worker takes one slot from its host. The job ends instead when every report is 0 (done), when no
restart is left, when no worker got through ``bps.init`` or every worker failed on its own (an
error in the command, not a lost worker), when host 0 (the rendezvous and the scheduler) would be left without a worker, or when
a launcher was stopped by a signal (during a run, or while it waits for the decision): a stopped
host only reports (``Leave``) and exits; a stopped node 0 answers the hosts that reported with
``exit``, and a host that reports later gives up after ``REFUSED_S`` of it being unreachable.
Locally, too, a failed run is not restarted once the launcher got a signal.

Every call carries ``DYNAMIX_TOKEN`` (required, as for a multi-host scheduler) and uses the
scheduler's TLS (``--tls-cert/--tls-key`` on node 0, ``--tls-ca`` on the others); a call with
another token is refused (UNAUTHENTICATED) and not counted. Node 0 waits ``REPORT_TIMEOUT_S``
for the other hosts' reports: a host that is gone by then ends the job (``exit`` with the first
failure's code).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dynamix_byteps.control.mailbox import remove_job_mailboxes
from dynamix_byteps.env import COLLECTIVE_FAILED_SUFFIX, STARTED_DIR_ENV
from dynamix_byteps.launcher.config import PER_RANK_SIZES, PROG, LaunchConfig
from dynamix_byteps.launcher.rendezvous import REPORT_TIMEOUT_S, RendezvousServer, RunReport, end_round, leave
from dynamix_byteps.launcher.stop_signals import StopSignals
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
from dynamix_byteps.launcher.topology import LOCAL_HOST, Topology, free_port
from dynamix_byteps.progress import PROGRESS_ENV, PROGRESS_FILE, ConsoleProgress

__all__ = ["RunReport", "decide", "run"]

ALL_SUCCEEDED = "every worker succeeded"


def decide(slots: list[int], reports: list[RunReport], restarts_left: int) -> dict:
    """The next step of the job from every host's report (``reports[i]`` is host ``i``'s).

    Returns ``{"exit": code, "reason": text}`` or ``{"slots": new_slots, "lost": ranks}`` (see the
    module docstring; the caller adds the ports). A report that no launcher of this job can send
    (:meth:`RunReport.problem`, or workers other than its host's ``slots``) ends the job with exit 1.
    """
    for r in reports:
        problem = r.problem() or (None if len(r.workers) == slots[r.node] else
                                  f"workers {r.workers} of a host with {slots[r.node]} slot(s)")
        if problem is not None:
            return {"exit": 1, "reason": f"host {r.node}'s report of run {r.run} is malformed ({problem}); not restarting"}
    failures = sorted((r for r in reports if r.code != 0), key=lambda r: (r.failed_at or float("inf"), r.node))
    if not failures:
        return {"exit": 0, "reason": ALL_SUCCEEDED}
    first = failures[0].code
    if any(r.failed is None and not r.server_failed for r in failures):
        return {"exit": first, "reason": "a launcher was stopped; not restarting"}
    if restarts_left <= 0:
        return {"exit": first, "reason": "no restart left"}
    killed = [rank for r in reports for rank in r.killed]
    if not any(r.started for r in reports) and not _lost_before_init(reports[0].run, killed):
        return {"exit": first, "reason": "the job failed before it started (no worker got through bps.init): an "
                "error in the command or its environment, not a lost worker; not restarting"}
    workers = {w for r in reports for w in r.workers}
    if {w for r in reports for w in r.self_failed} == workers and not any(r.server_failed for r in reports):
        return {"exit": first, "reason": "every worker failed on its own: an error in the command, not a lost worker; "
                "not restarting"}
    lost = [(r.node, rank) for r in reports for rank in r.killed]
    if not lost and not failures[0].server_failed:  # a lost server costs no worker
        lost = [(failures[0].node, failures[0].failed)]
    new = list(slots)
    for node, _ in lost:
        new[node] -= 1
    if new[0] <= 0:
        return {"exit": first, "reason": "host 0 (the rendezvous and scheduler) lost its last worker; not restarting"}
    return {"slots": new, "lost": sorted(rank for _, rank in lost)}


def _lost_before_init(run: int, killed: Sequence) -> bool:
    """Whether a run in which no worker got through ``bps.init`` lost a worker rather than failed
    on an error in its command: a restarted run (an earlier one got through ``bps.init`` with the
    same command) in which a worker was killed by a signal its launcher did not send (the OOM
    killer, a ``kill -9``), as between the restart and the rendezvous. In the first run such a
    death may be the command's own (a crash at import), and it is not restarted."""
    return run > 0 and bool(killed)


# ---- the restart loop -----------------------------------------------------------------------------

Build = Callable[[LaunchConfig], "list[ChildSpec] | int"]


def run(config: LaunchConfig, env: Mapping[str, str], build: Build, specs: list[ChildSpec],
        coordinator: RendezvousServer | None, signals: StopSignals) -> int:
    """Run the job of ``specs``, restarting it as ``config.restart_on_failure`` allows; returns the exit code.

    ``build`` makes the next run's specs from its config (or returns the exit code after printing
    why it cannot); ``coordinator`` is node 0's in a multi-host elastic job, else None; ``signals``
    are caught by the caller for the whole job: a failed run after one of them is not restarted.
    """
    while True:
        started = time.monotonic()
        code, supervisor, started_workers, self_failed = _supervise(config, specs, signals)
        if config.multi_host_elastic:
            decision = _coordinate(config, env, supervisor, code, coordinator, started_workers, self_failed,
                                   signals)
            if "exit" in decision:
                # said for a 0 too when not node 0's verdict (it could not be reached): this host's workers
                # succeeded, but whether the job did is not known here
                if decision["exit"] != 0 or decision["reason"] != ALL_SUCCEEDED:
                    print(f"{PROG}: {decision['reason']}", file=sys.stderr, flush=True)
                return decision["exit"]
            config = _apply_decision(config, env, decision, started, code)
            if config is None:
                return 0
        else:
            failed, server = supervisor.failed_worker, supervisor.failed_service
            if code == 0 or (failed is None and server is None) or config.run >= config.restart_on_failure:
                return code
            if signals.received():
                print(f"{PROG}: stopped by {signal.Signals(signals.first).name}; not restarting", file=sys.stderr,
                      flush=True)
                return code
            workers = [s.label for s in specs if not s.service]
            if not started_workers and not _lost_before_init(config.run, supervisor.killed):
                print(f"{PROG}: the job failed before it started (no worker got through bps.init; exit codes "
                      f"{_exit_codes(self_failed, workers)}): an error in the command or its environment, not a lost "
                      "worker; not restarting", file=sys.stderr, flush=True)
                return code
            if server is not None:
                config = dataclasses.replace(config, run=config.run + 1)
                print(f"{PROG}: {server} failed with code {code} after {time.monotonic() - started:.1f} s; restart "
                      f"{config.run} of {config.restart_on_failure} with {len(workers)} workers and fresh servers from "
                      f"{config.checkpoint}", file=sys.stderr, flush=True)
            elif set(self_failed) == set(workers):
                print(f"{PROG}: every worker failed on its own at once (exit codes "
                      f"{', '.join(f'[{w}] {self_failed[w]}' for w in workers)}): an error in the command, not a lost "
                      "worker; not restarting", file=sys.stderr, flush=True)
                return code
            elif config.num_workers <= 1:
                print(f"{PROG}: worker {failed} failed and none survives; not restarting", file=sys.stderr, flush=True)
                return code
            else:
                config = _one_worker_fewer(config, env, failed, code, started)
        specs = build(config)
        if isinstance(specs, int):
            return code
        specs = [dataclasses.replace(s, append_log=True) for s in specs]


def _one_worker_fewer(config: LaunchConfig, env: Mapping[str, str], failed: str, code: int,
                      started: float) -> LaunchConfig:
    """The next local run after worker ``failed`` was lost: one worker fewer (ranks 0..size-2), the
    last rank's slowdown, per-worker batch size and bounds (given or inherited) dropped."""
    restarts, left = config.run + 1, config.num_workers - 1
    print(f"{PROG}: worker {failed} failed with code {code} after {time.monotonic() - started:.1f} s; restart "
          f"{restarts} of {config.restart_on_failure} with {left} workers {_resuming_from(config.checkpoint)}",
          file=sys.stderr, flush=True)
    return dataclasses.replace(config, run=restarts, num_workers=left, **_per_rank_settings(config, env, range(left)))


def _kept_ranks(old_slots: Sequence[int], new_slots: Sequence[int]) -> list[int]:
    """The ranks of the run of ``old_slots`` workers per host whose settings the run of ``new_slots`` takes:
    the first ``new_slots[i]`` ranks of each host ``i``, in host order (ranks are numbered in host order,
    and a host's local ranks are its devices)."""
    firsts = [sum(old_slots[:host]) for host in range(len(old_slots))]
    return [first + local for first, n in zip(firsts, new_slots) for local in range(n)]


def _per_rank_settings(config: LaunchConfig, env: Mapping[str, str], kept: Sequence[int]) -> dict:
    """The ``slowdown``, ``batch_size``, ``min_batch`` and ``max_batch`` fields for a run whose rank ``j``
    takes the settings of rank ``kept[j]`` of this one. A size is the flag's value, else the
    ``DYNAMIX_BATCH_SIZE``/... the workers inherit from ``env``; a list of one per rank keeps the kept
    ranks' values, one value stays. An inherited list becomes the flag's, so that it replaces the
    inherited one in the restarted workers' environment."""
    new_rank = {old: new for new, old in enumerate(kept)}
    fields: dict = {"slowdown": tuple((new_rank[r], spec) for r, spec in config.slowdown if r in new_rank)}
    for flag, variable in PER_RANK_SIZES.items():
        text = getattr(config, flag) if getattr(config, flag) is not None else env.get(variable) or None
        if text is not None and "," in text:
            values = text.split(",")
            text = ",".join(values[old] for old in kept)
        fields[flag] = text
    return fields


def _resuming_from(checkpoint) -> str:
    """Where the next run resumes: the checkpoint, or, when the job saved none before it failed
    (or it was removed), the start, said so that a retraining from scratch is never a surprise."""
    if Path(checkpoint).is_file():
        return f"from {checkpoint}"
    return f"from scratch: {checkpoint} does not exist (no checkpoint was saved before the failure)"


def _exit_codes(self_failed: Mapping[str, int], workers: Sequence[str]) -> str:
    """``[0] 3, [1] 3, [2] signalled`` for a message: each worker's own exit code, when it had one."""
    return ", ".join(f"[{w}] {self_failed[w]}" if w in self_failed else f"[{w}] stopped" for w in workers)


def _coordinate(config: LaunchConfig, env: Mapping[str, str], supervisor: Supervisor, code: int,
                coordinator: RendezvousServer | None, started_workers: bool, self_failed: Mapping[str, int],
                signals: StopSignals) -> dict:
    """Report how run ``config.run`` ended on this host and get the job's next step (see the module
    docstring): node 0 collects every host's report, decides and answers; the others ask node 0. A
    signal to this launcher, before or while they agree, makes it a stopped host."""
    topology = Topology.of(config.hosts, config.node_rank, config.num_workers)
    report = RunReport(node=topology.node_rank, run=config.run, code=code,
                       failed=None if supervisor.failed_worker is None else int(supervisor.failed_worker),
                       failed_at=supervisor.failed_at, killed=[int(label) for label in supervisor.killed],
                       self_failed=[int(label) for label in self_failed],
                       workers=[int(s.label) for s in supervisor.specs if not s.service], started=started_workers,
                       server_failed=supervisor.failed_service is not None)
    # the launcher was signalled (or could not start the job)
    stopped = code != 0 and (signals.received() or (report.failed is None and not report.server_failed))

    def as_stopped(exit_code: int) -> RunReport:  # what node 0's decide reads as a stopped launcher
        return dataclasses.replace(report, code=exit_code, failed=None, failed_at=None, server_failed=False)

    if stopped:
        report = as_stopped(code)
    node0, token = (topology.hosts[0], config.restart_port), env["DYNAMIX_TOKEN"]
    tls_ca = None if config.tls_ca is None else str(config.tls_ca)
    if coordinator is None:
        if not stopped:
            decision = end_round(node0, report, token, tls_ca, stopped=signals.received)
            if not signals.received():
                return decision
            report = as_stopped(code or 128 + signals.first)
        leave(node0, report, token, tls_ca)
        return {"exit": report.code, "reason": "stopped; not restarting"}
    peers = {} if stopped else coordinator.collect(config.run, len(topology.hosts) - 1, stopped=signals.received)
    missing = [i for i in range(1, len(topology.hosts)) if i not in peers]
    reports = [report] + [peers[i] for i in sorted(peers)]
    if signals.received():  # the others are told at once, rather than left to wait for node 0
        decision = {"exit": code or 128 + signals.first, "reason": "node 0 was stopped; not restarting"}
    elif missing:
        first = next((r.code for r in reports if r.code != 0), 1)
        decision = {"exit": first, "reason": f"host(s) {', '.join(map(str, missing))} sent no report of run "
                    f"{config.run} within {REPORT_TIMEOUT_S:g} s; not restarting"}
    else:
        decision = decide(topology.slots, reports, config.restart_on_failure - config.run)
    if "slots" in decision:
        address = topology.hosts[0] if sum(1 for n in decision["slots"] if n) > 1 else LOCAL_HOST
        decision["port"] = free_port(address)
        if config.policy is not None:
            decision["scheduler_port"] = free_port(address)
    coordinator.answer(config.run, decision)
    return decision


def _apply_decision(config: LaunchConfig, env: Mapping[str, str], decision: dict, started: float,
                    code: int) -> LaunchConfig | None:
    """The config of the next run of ``decision`` (each host's first ranks keep their slowdown, batch
    size and bounds); None when this host has no worker left in it."""
    topology = Topology.of(config.hosts, config.node_rank, config.num_workers)
    slots, mine = decision["slots"], decision["slots"][topology.node_rank]
    total, restarts = sum(slots), config.run + 1
    lost = f"worker(s) {', '.join(map(str, decision['lost']))}" if decision["lost"] else "a summation server"
    print(f"{PROG}: {lost} lost (code {code} here) after "
          f"{time.monotonic() - started:.1f} s; restart {restarts} of {config.restart_on_failure} with {total} workers "
          f"({', '.join(f'{h}:{n}' for h, n in zip(topology.hosts, slots))}) {_resuming_from(config.checkpoint)}",
          file=sys.stderr, flush=True)
    if mine == 0:
        print(f"{PROG}: no worker of this host is left in the job; leaving it", file=sys.stderr, flush=True)
        return None
    kept = tuple((host, n) for host, n in zip(topology.hosts, slots) if n)
    if len(kept) == 1:  # the job shrank onto this host: a local job from now on
        hosts, node_rank, num_workers = None, None, mine
    else:
        hosts, node_rank, num_workers = kept, sum(1 for n in slots[: topology.node_rank] if n), None
    return dataclasses.replace(
        config, run=restarts, hosts=hosts, node_rank=node_rank, num_workers=num_workers, port=decision["port"],
        scheduler_port=decision.get("scheduler_port", config.scheduler_port),
        **_per_rank_settings(config, env, _kept_ranks(topology.slots, slots)))


def _supervise(config: LaunchConfig, specs: list[ChildSpec],
               signals: StopSignals) -> tuple[int, Supervisor, bool, dict[str, int]]:
    """Run the job once; returns its exit code, the Supervisor (which worker's failure ended it and
    when), whether any worker got through ``bps.init``, and the exit code of each worker that failed
    on its own (the Supervisor's ``self_failed`` less those in which a collective had failed).

    Whatever ends the run (success, a worker's death, SIGTERM/SIGINT/SIGHUP to the launcher), the
    job's mailboxes left in /dev/shm are removed afterwards: a worker killed by a signal cannot."""
    started = Path(tempfile.mkdtemp(prefix="dynamix-started-"))
    specs = [spec if spec.service else dataclasses.replace(spec, env={**spec.env, STARTED_DIR_ENV: str(started)})
             for spec in specs]
    try:
        scratch = [started] + ([config.temporary_run_dir] if config.temporary_run_dir is not None else [])
        # Once a collective failed, the failure spread: the others need no time to fail on their own.
        code, supervisor = _supervise_once(config, specs, scratch, lambda: bool(_collective_failures(started)),
                                           signals)
        victims = _collective_failures(started)
        own = {w: c for w, c in supervisor.self_failed.items() if w not in victims}
        return code, supervisor, any(started.iterdir()), own
    finally:
        shutil.rmtree(started, ignore_errors=True)
        remove_job_mailboxes(config.job_id)


def _collective_failures(started: Path) -> set[str]:
    """The workers that told the launcher a collective of theirs failed (see :mod:`dynamix_byteps.engine`)."""
    return {p.name.removesuffix(COLLECTIVE_FAILED_SUFFIX) for p in started.glob(f"*{COLLECTIVE_FAILED_SUFFIX}")}


def _supervise_once(config: LaunchConfig, specs: list[ChildSpec], scratch: list[Path],
                    settled: Callable[[], bool], signals: StopSignals) -> tuple[int, Supervisor]:
    if not (sys.stderr.isatty() and any(spec.label == "0" for spec in specs)):
        supervisor = Supervisor(specs, grace_s=config.grace_period, scratch_dirs=scratch, settled=settled,
                                signals=signals)
        return supervisor.run(), supervisor
    # A terminal shows a progress bar fed by rank 0 (dynamix_byteps.progress).
    with ConsoleProgress(config.run_dir / PROGRESS_FILE) as bar:
        specs = [dataclasses.replace(s, env={**s.env, PROGRESS_ENV: str(bar.path)}) if s.label == "0" else s
                 for s in specs]
        supervisor = Supervisor(specs, grace_s=config.grace_period, write_guard=bar.write_guard,
                                on_child_bar=bar.give_way, scratch_dirs=scratch, settled=settled, signals=signals)
        return supervisor.run(), supervisor
