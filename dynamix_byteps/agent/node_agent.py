"""The node agent: one per host, it adds network, CPU and GPU metrics of the workers on its host.

It finds the workers of job ``job`` through their shared-memory mailboxes
(``/dev/shm/dynamix.<job>.<rank>``, whose header names the worker's pid), samples a network
collector (eBPF when it can load, else TCP_INFO and /proc) every ``interval_s`` seconds, turns
cumulative counters into rates, and sends them to the scheduler with ``ReportNode``. It never
blocks a worker: a slow or absent scheduler only costs a warning.

Privileges: the agent needs no root, only these capabilities (e.g. ``setpriv --inh-caps
+bpf,+perfmon,+sys_ptrace --ambient-caps +bpf,+perfmon,+sys_ptrace dynamix agent ...``, or
``AmbientCapabilities=`` in a systemd unit):

* ``CAP_BPF`` + ``CAP_PERFMON`` (Linux >= 5.8; ``CAP_SYS_ADMIN`` on older kernels): load the eBPF
  programs and attach them to tracepoints (``--monitor ebpf``/``auto``);
* ``CAP_SYS_PTRACE``: ``pidfd_getfd`` on the workers' sockets for the TCP_INFO collector
  (``--monitor proc``), when the workers run as another user or ``kernel.yama.ptrace_scope`` >= 1;
* ``CAP_DAC_READ_SEARCH``: list ``/proc/<pid>/fd`` of another user's workers (same user: not needed).

The mailboxes in ``/dev/shm`` need only read access, and the gRPC client no privilege. With a TLS
scheduler pass ``tls_ca`` (``--tls-ca``/``DYNAMIX_TLS_CA``), with a token ``DYNAMIX_TOKEN``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import grpc

from dynamix_byteps.agent.base import CollectorUnavailable, NetworkCollector, ProcessNetStats
from dynamix_byteps.agent.gpu import GpuMonitor
from dynamix_byteps.agent.procfs import HostMonitor, ProcCollector
from dynamix_byteps.argtypes import dial_address
from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.client import CHANNEL_OPTIONS, RPC_TIMEOUT_S, TOKEN_METADATA_KEY
from dynamix_byteps.control.cluster import Rejected, validate_node
from dynamix_byteps.control.mailbox import SHM_DIR, Mailbox, job_mailboxes, mailbox_name
from dynamix_byteps.control.security import open_channel
from dynamix_byteps.env import MAX_WORKERS

log = logging.getLogger(__name__)

NO_WORKER_WARNING_S = 60.0
"""Seconds an agent finds no worker of its job before it says so, once (workers create their
mailboxes in ``bps.init``, after their imports)."""


def make_collector(monitor: str) -> NetworkCollector | None:
    """The collector for ``--monitor``: ``auto`` tries eBPF, then falls back to /proc (saying why once).

    Raises:
        CollectorUnavailable: ``ebpf`` or ``proc`` was asked for and cannot run here.
    """
    if monitor == "off":
        return None
    if monitor in ("auto", "ebpf"):
        try:
            from dynamix_byteps.agent.ebpf import EbpfCollector

            return EbpfCollector()
        except CollectorUnavailable as why:
            if monitor == "ebpf":
                raise
            log.warning("eBPF monitoring unavailable (%s); using TCP_INFO and /proc instead", why)
    return ProcCollector()


def _process_uid(pid: int) -> int | None:
    """The real uid of process ``pid``, None when it does not run."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


def discover_workers(job: str) -> dict[int, int]:
    """``{rank: pid}`` of the live workers of ``job`` on this host, from their mailboxes.

    A segment counts only while the worker that created it runs (a SIGKILLed worker leaves its
    segment behind, and its pid may go to another process, whose traffic would be measured as the
    rank's), and only when its file belongs to the user its ``owner_pid`` runs as: anyone who can
    write a segment could otherwise point the agent at another user's process. A rank beyond
    :data:`~dynamix_byteps.env.MAX_WORKERS` is no job's.
    """
    workers = {}
    for path in job_mailboxes(job):
        rank = int(path.name.rpartition(".")[2])
        if rank >= MAX_WORKERS:
            continue
        try:
            file_uid = path.stat().st_uid
            with Mailbox.open(path.name) as box:
                pid, alive = box.owner_pid, box.owner_alive
        except (OSError, ValueError):
            continue  # being created or removed right now
        if alive and _process_uid(pid) == file_uid:
            workers[rank] = pid
    return workers


def jobs_with_mailboxes() -> list[str]:
    """The job names of the worker mailboxes on this host (``/dev/shm/dynamix.<job>.<rank>``), sorted."""
    jobs = set()
    for path in SHM_DIR.glob("dynamix.*.*"):
        parts = path.name.split(".")  # a job name has no dot
        if len(parts) == 3 and parts[2].isdigit():
            jobs.add(parts[1])
    return sorted(jobs)


def _rates(now: ProcessNetStats, before: ProcessNetStats | None, dt: float) -> dict:
    metrics = {}
    if before is not None and dt > 0:
        metrics["tx_bytes_per_s"] = max(now.bytes_sent - before.bytes_sent, 0) / dt
        metrics["rx_bytes_per_s"] = max(now.bytes_received - before.bytes_received, 0) / dt
        metrics["retransmits"] = max(now.retransmits - before.retransmits, 0)
    if now.srtt_s is not None:
        metrics["rtt_s"] = now.srtt_s
    if now.delivery_rate_bytes_per_s is not None:
        metrics["delivery_rate_bytes_per_s"] = now.delivery_rate_bytes_per_s
    return metrics


def node_metrics(rank: int, metrics: dict, refused: set[tuple[int, str]]) -> dynamix_pb2.NodeMetrics:
    """``metrics`` as a ``NodeMetrics`` message without the values the scheduler refuses
    (:func:`~dynamix_byteps.control.cluster.validate_node`: NaN, infinite, negative, beyond any real
    machine): it refuses the whole report for one, which would drop every worker's metrics of this
    host each interval. Each left-out field is logged once per rank (``refused`` keeps which)."""
    kept = {}
    for name, value in metrics.items():
        try:
            validate_node(dynamix_pb2.NodeMetrics(**{name: value}))
        except Rejected as why:
            if (rank, name) not in refused:
                refused.add((rank, name))
                log.warning("rank %d: %s; left out of the node reports while it lasts", rank, why.message)
            continue
        kept[name] = value
    return dynamix_pb2.NodeMetrics(**kept)


class NodeAgent:
    """Samples the workers of ``job`` on this host and reports to the scheduler at ``scheduler``.

    Raises:
        ValueError: ``job`` is not a name the workers accept (``[A-Za-z0-9_-]``, see
            :func:`~dynamix_byteps.control.mailbox.mailbox_name`) or ``scheduler`` is not
            ``HOST:PORT`` (:func:`~dynamix_byteps.argtypes.dial_address`).
        CollectorUnavailable: ``monitor`` cannot run here.
    """

    def __init__(self, job: str, scheduler: str, token: str | None = None, monitor: str = "auto",
                 interval_s: float = 1.0, tls_ca: str | None = None):
        mailbox_name(job, 0)  # the workers' rule: they refuse any other job name, so it has nothing to find
        dial_address(scheduler)
        self.job = job
        self.interval_s = interval_s
        self.monitor = monitor
        self.collector = make_collector(monitor)
        self._metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        self._channel = open_channel(scheduler, tls_ca, CHANNEL_OPTIONS)
        self._stub = dynamix_pb2_grpc.SchedulerStub(self._channel)
        self._previous: dict[int, tuple[float, ProcessNetStats]] = {}
        self._failing: grpc.StatusCode | None = None  # how the last report failed (said once per kind)
        self._searching = True  # no worker of the job found yet, and not said so
        self._refused: set[tuple[int, str]] = set()  # (rank, field) left out of a report once already
        self._host = socket.gethostname()
        self.gpu = GpuMonitor()
        self.host = HostMonitor()

    def _network(self, pids: set[int]) -> dict[int, ProcessNetStats]:
        if self.collector is None:
            return {}
        try:
            return self.collector.sample(pids)
        except CollectorUnavailable as why:
            self.collector.close()
            self.collector = self._fallback(self.collector.name, why)
            return {}

    def _fallback(self, failed: str, why: CollectorUnavailable) -> NetworkCollector | None:
        """What measures once collector ``failed`` stopped: TCP_INFO and /proc after eBPF under
        ``--monitor auto`` (as when eBPF cannot load), else nothing."""
        if self.monitor == "auto" and failed == "ebpf":
            try:
                collector = ProcCollector()
            except CollectorUnavailable as proc_why:
                why = f"{why}; TCP_INFO and /proc: {proc_why}"
            else:
                log.warning("eBPF monitoring stopped (%s); using TCP_INFO and /proc instead", why)
                return collector
        log.warning("network monitoring stopped: %s", why)
        return None

    def sample(self) -> dynamix_pb2.NodeReport:
        """One round: every worker of the job on this host with its metrics."""
        workers = discover_workers(self.job)
        net = self._network(set(workers.values()))
        now = time.monotonic()  # when the counters were read: NVML's calls that follow may take long
        gpu = self.gpu.sample(set(workers.values()))
        host_now = self.host.sample()
        host = {"cpu_util": host_now.cpu_util, "memory_used_bytes": float(host_now.mem_used_bytes)}
        report = dynamix_pb2.NodeReport(host=self._host)
        # A pid the collector no longer counts starts over when it comes back (it counts a new process
        # from zero, whose rates against the old one's counters read as an idle interval).
        self._previous = {pid: seen for pid, seen in self._previous.items() if pid in net}
        for rank, pid in sorted(workers.items()):
            metrics = dict(host)
            if pid in net:
                before = self._previous.get(pid)
                metrics.update(_rates(net[pid], before[1] if before else None, now - before[0] if before else 0.0))
                self._previous[pid] = (now, net[pid])
            stats = gpu.get(pid)
            if stats is not None:
                metrics.update({k: v for k, v in (("gpu_util", stats.util), ("gpu_memory_used_bytes", stats.mem_used_bytes))
                                if v is not None})
            report.workers.add(rank=rank, node=node_metrics(rank, metrics, self._refused))
        return report

    def send(self, report: dynamix_pb2.NodeReport) -> None:
        try:
            self._stub.ReportNode(report, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() != self._failing:  # a scheduler that came up may refuse the reports for another reason
                log.warning("scheduler refused or missed a node report (%s: %s); retrying every interval",
                            exc.code().name, exc.details())
            self._failing = exc.code()
        else:
            if self._failing is not None:
                log.warning("scheduler takes this host's node reports again")
            self._failing = None

    def _say_no_worker(self) -> None:
        """An agent given another job than its workers' would otherwise monitor nothing, silently."""
        self._searching = False
        jobs = jobs_with_mailboxes()
        others = [job for job in jobs if job != self.job]
        if self.job in jobs:
            why = ("its mailboxes here belong to no running worker of this dynamix_byteps version (their workers "
                   "exited, or run another version, whose mailbox layout differs)")
        elif others:
            why = (f"the workers here have mailboxes of job{'s' if len(others) > 1 else ''} {', '.join(others[:8])}: "
                   "start the agent with --job set to the workers' DYNAMIX_JOB_ID")
        else:
            why = "no worker on this host has a mailbox (a worker creates one in bps.init when DYNAMIX_JOB_ID is set)"
        log.warning("no worker of job %s found on this host in %g s (looked for %s/dynamix.%s.<rank>); %s",
                    self.job, NO_WORKER_WARNING_S, SHM_DIR, self.job, why)

    def run(self, stop: threading.Event) -> None:
        """Sample and report every ``interval_s`` until ``stop`` is set; warn once when no worker of the
        job shows up within :data:`NO_WORKER_WARNING_S`."""
        started = time.monotonic()
        while not stop.wait(self.interval_s):
            report = self.sample()
            if report.workers:
                self._searching = False
                self.send(report)
            elif self._searching and time.monotonic() - started >= NO_WORKER_WARNING_S:
                self._say_no_worker()

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        self._channel.close()

