"""The scheduler's view of the job: registered workers, their reports, the assignment in force.

Pure Python, no gRPC: :class:`Cluster` validates incoming messages (``WorkerInfo``, ``Report``
from ``protos/dynamix.proto``), keeps per-rank running sums of the current decision interval,
and says when every rank has reported so a decision is due. The caller holds ``Cluster.lock``
around every method named ``*_locked``; everything else is lock-free and side-effect free.

Validation raises :class:`Rejected` *before* any state changes, so a bad message never leaves
the state half-updated.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dynamix_byteps.agent.base import NODE_METRICS_MAX_AGE_S
from dynamix_byteps.env import MAX_BATCH, MAX_WORKERS
from dynamix_byteps.policy.base import ClusterState, WorkerState

MAX_WORLD_SIZE = MAX_WORKERS
MAX_HOST_LEN = 255
MAX_NAME_LEN = 64
MAX_STEP = 2**53  # steps; a larger one would make every later real report look old
# Physical ranges of every number the scheduler accepts. Generous, but small enough that sums
# over any number of reports and workers stay finite (a 1e308 timing made an interval's sum inf,
# and inf cannot be written to the JSON decision log).
MAX_SECONDS = 1e6  # a per-step time, RTT or any other duration (11 days), seconds
MAX_RATE = 1e15  # samples/s or bytes/s
MAX_BYTES = 2.0**60  # memory in use, bytes
MAX_COUNT = 2**53  # dataset size, retransmits and other counts
MAX_LOSS = 1e30  # |loss| beyond this is divergence, recorded as ±inf
MAX_STATISTIC = 1e30  # grad_sq, trace_cov beyond this are recorded as unknown
MAX_VERSION = 2**53  # assignment versions, so that version + 1 always fits the proto's uint64
# A registered rank that has sent nothing for this long may come back from another host or
# with other bounds (a restarted job); before that, such a re-registration is refused.
LIVE_RANK_S = 60.0
LOSS_HISTORY_LEN = 256  # decision intervals kept for ClusterState.loss_history
# Batch-size vectors of the current job remembered (its initial one and its newest changes): every
# rank coming back from a restart with one of them, past the job's first change, is the same job
# resumed from a checkpoint; with any other vector it is a new job (see Cluster.register_locked).
SIZES_HISTORY_LEN = 64
# Weight of the newest interval in each worker's throughput θ_i (an exponentially weighted mean
# over decision intervals). One interval's θ on a shared machine varies by ±20%; with 0.3 the
# spread falls to about ±8% (variance × α/(2-α)), so the policies stop chasing noise (measured:
# proportional re-split the fast workers nearly every decision without it), and a real speed
# change is 83% followed after 5 intervals. LB-BSP likewise predicts each worker's next speed
# from its recent history rather than from the last iteration alone (Chen et al., SoCC 2020).
THROUGHPUT_SMOOTHING = 0.3

#: The scheduler's decision log in a run directory: one JSON line per decision (scheduler.py).
DECISION_LOG = "decisions.jsonl"

INVALID_ARGUMENT = "INVALID_ARGUMENT"
FAILED_PRECONDITION = "FAILED_PRECONDITION"

_NODE_FRACTIONS = ("cpu_util", "gpu_util")
_NODE_LIMITS = {"memory_used_bytes": MAX_BYTES, "gpu_memory_used_bytes": MAX_BYTES, "rtt_s": MAX_SECONDS,
                "tx_bytes_per_s": MAX_RATE, "rx_bytes_per_s": MAX_RATE, "delivery_rate_bytes_per_s": MAX_RATE}


class Rejected(Exception):
    """A request the scheduler refuses; ``code`` is a gRPC status code name, ``message`` names the field."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> Rejected:
    return Rejected(INVALID_ARGUMENT, message)


def _check_text(value: str, name: str, limit: int) -> str:
    if len(value) > limit:
        raise _invalid(f"{name} is {len(value)} characters long; at most {limit} are accepted")
    if not value.isprintable():
        raise _invalid(f"{name}={value!r} contains control characters")
    return value


def _check_amount(value: float, name: str, limit: float) -> float:
    """A measured quantity in ``[0, limit]``; NaN and ±inf are refused too."""
    if not 0.0 <= value <= limit:
        raise _invalid(f"{name}={value!r} must be a number between 0 and {limit:g}")
    return value


def _check_count(value: int, name: str, limit: int = MAX_COUNT) -> int:
    if value > limit:
        raise _invalid(f"{name}={value} is beyond any real run (limit {limit})")
    return value


def _optional_stat(value: float) -> float | None:
    """grad_sq / trace_cov: NaN (the proto's 'unknown'), ±inf (a diverging run) and values beyond
    :data:`MAX_STATISTIC` become None."""
    return value if abs(value) <= MAX_STATISTIC else None


def _bounded_loss(value: float) -> float:
    """A loss beyond ±:data:`MAX_LOSS` is a diverged run: ±inf (NaN stays NaN)."""
    return value if not abs(value) > MAX_LOSS else math.copysign(math.inf, value)


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker said when it registered. ``max_batch`` None = unbounded."""

    rank: int
    world_size: int
    host: str
    engine: str
    min_batch: int
    max_batch: int | None
    batch_size: int
    dataset_size: int | None
    model_family: str
    optimizer_family: str
    step: int

    def within_bounds(self, batch: int) -> bool:
        return self.min_batch <= batch and (self.max_batch is None or batch <= self.max_batch)

    def clamp(self, batch: int) -> int:
        batch = max(self.min_batch, batch)
        return batch if self.max_batch is None else min(self.max_batch, batch)

    def job_signature(self) -> tuple:
        """What a restart of the same job keeps: the engine, the bounds, the dataset, the model and
        the optimizer (not the host: a restarted worker may run elsewhere)."""
        return (self.engine, self.min_batch, self.max_batch, self.dataset_size, self.model_family,
                self.optimizer_family)


@dataclass(frozen=True)
class ReportRecord:
    """One validated ``Report``; ``node`` holds only the node metrics that were present."""

    rank: int
    step: int
    batch_size: int
    compute_s: float
    push_pull_s: float
    samples_per_s: float
    loss: float | None  # None: the worker reported no loss this interval
    grad_sq: float | None
    trace_cov: float | None
    node: dict
    push_s: float | None = None  # ps engine only: the worker's own push and pull seconds per step
    pull_s: float | None = None
    exposed_comm_s: float | None = None  # ps engine only: the part of push_pull_s its own transfers took


@dataclass(frozen=True)
class AssignmentRecord:
    """Mirror of the proto ``Assignment``; empty ``batch_sizes`` = not every rank has registered yet."""

    version: int
    effective_step: int
    batch_sizes: tuple[int, ...]
    lr_scale: float
    policy: str
    reason: str


def validate_worker_info(info, world_size: int | None) -> WorkerRecord:
    """Check a ``WorkerInfo`` against the job; raises :class:`Rejected` naming the bad field."""
    if not 1 <= info.world_size <= MAX_WORLD_SIZE:
        raise _invalid(f"world_size={info.world_size} must be between 1 and {MAX_WORLD_SIZE}")
    if world_size is not None and info.world_size != world_size:
        raise _invalid(f"world_size={info.world_size} does not match the job's world_size={world_size}: this "
                       f"scheduler serves a job of {world_size} workers; start another scheduler (or restart this "
                       f"one) for a job of {info.world_size}")
    if info.rank >= info.world_size:
        raise _invalid(f"rank={info.rank} must be < world_size={info.world_size}")
    min_batch = info.min_batch or 1  # proto3 default 0 = not set
    if min_batch > MAX_BATCH:
        raise _invalid(f"min_batch={info.min_batch} must be <= {MAX_BATCH}")
    max_batch = info.max_batch or None  # 0 = no limit
    if max_batch is not None and not min_batch <= max_batch <= MAX_BATCH:
        raise _invalid(f"max_batch={info.max_batch} must be 0 (no limit) or between min_batch={min_batch} and {MAX_BATCH}")
    if not 1 <= info.batch_size <= MAX_BATCH:
        raise _invalid(f"batch_size={info.batch_size} must be between 1 and {MAX_BATCH}")
    if info.batch_size < min_batch or (max_batch is not None and info.batch_size > max_batch):
        raise _invalid(f"batch_size={info.batch_size} is outside [min_batch={min_batch}, max_batch={max_batch or 'unbounded'}]")
    return WorkerRecord(
        rank=info.rank,
        world_size=info.world_size,
        host=_check_text(info.host, "host", MAX_HOST_LEN),
        engine=_check_text(info.engine, "engine", MAX_NAME_LEN),
        min_batch=min_batch,
        max_batch=max_batch,
        batch_size=info.batch_size,
        dataset_size=_check_count(info.dataset_size, "dataset_size") or None,
        model_family=_check_text(info.model_family, "model_family", MAX_NAME_LEN),
        optimizer_family=_check_text(info.optimizer_family, "optimizer_family", MAX_NAME_LEN),
        step=_check_count(info.step, "step", MAX_STEP),
    )


def validate_node(msg) -> dict:
    """The fields of a ``NodeMetrics`` message that are present, checked; raises :class:`Rejected`."""
    node = {}
    for name in _NODE_FRACTIONS:
        if msg.HasField(name):
            value = getattr(msg, name)
            if not 0.0 <= value <= 1.0:  # also rejects NaN
                raise _invalid(f"node.{name}={value!r} must be between 0 and 1")
            node[name] = value
    for name, limit in _NODE_LIMITS.items():
        if msg.HasField(name):
            node[name] = _check_amount(getattr(msg, name), f"node.{name}", limit)
    if msg.HasField("retransmits"):
        node["retransmits"] = _check_count(msg.retransmits, "node.retransmits")
    return node


def validate_report(report, worker: WorkerRecord) -> ReportRecord:
    """Check a ``Report`` from the registered ``worker``; raises :class:`Rejected` naming the bad field.

    Every number must lie in its physical range (``MAX_SECONDS``, ``MAX_RATE``, ...), so sums
    over reports stay finite. ``loss`` may be NaN or ±inf (a diverging run; the guardrails act
    on it; beyond ±``MAX_LOSS`` it counts as ±inf); ``grad_sq`` and ``trace_cov`` that are not
    finite or beyond ``MAX_STATISTIC`` are recorded as unknown.
    """
    _check_count(report.step, "step", MAX_STEP)
    b = report.local_batch_size
    if b < 1 or b > MAX_BATCH or not worker.within_bounds(b):
        raise _invalid(
            f"local_batch_size={b} is outside rank {worker.rank}'s registered bounds "
            f"[{worker.min_batch}, {worker.max_batch or 'unbounded'}]"
        )
    node = validate_node(report.node) if report.HasField("node") else {}
    return ReportRecord(
        rank=report.rank,
        step=report.step,
        batch_size=b,
        compute_s=_check_amount(report.compute_s, "compute_s", MAX_SECONDS),
        push_pull_s=_check_amount(report.push_pull_s, "push_pull_s", MAX_SECONDS),
        samples_per_s=_check_amount(report.samples_per_s, "samples_per_s", MAX_RATE),
        loss=_bounded_loss(report.loss) if report.HasField("loss") else None,
        grad_sq=_optional_stat(report.grad_sq),
        trace_cov=_optional_stat(report.trace_cov),
        node=node,
        push_s=_check_amount(report.push_s, "push_s", MAX_SECONDS) if report.HasField("push_s") else None,
        pull_s=_check_amount(report.pull_s, "pull_s", MAX_SECONDS) if report.HasField("pull_s") else None,
        exposed_comm_s=(_check_amount(report.exposed_comm_s, "exposed_comm_s", MAX_SECONDS)
                        if report.HasField("exposed_comm_s") else None),
    )


@dataclass
class _Interval:
    """Running sums of one rank's reports since the last decision (bounded memory)."""

    count: int = 0
    compute_s: float = 0.0
    push_pull_s: float = 0.0
    samples_per_s: float = 0.0
    loss: float = 0.0
    loss_count: int = 0
    push_s: float = 0.0
    pull_s: float = 0.0
    comm_count: int = 0  # reports that carried push_s and pull_s
    exposed_comm_s: float = 0.0
    exposed_count: int = 0  # reports that carried exposed_comm_s
    last: ReportRecord | None = None

    def add(self, r: ReportRecord) -> None:
        self.count += 1
        self.compute_s += r.compute_s
        self.push_pull_s += r.push_pull_s
        self.samples_per_s += r.samples_per_s
        if r.push_s is not None and r.pull_s is not None:
            self.push_s += r.push_s
            self.pull_s += r.pull_s
            self.comm_count += 1
        if r.exposed_comm_s is not None:
            self.exposed_comm_s += r.exposed_comm_s
            self.exposed_count += 1
        if r.loss is not None:
            self.loss += r.loss  # NaN/inf propagate: the interval diverged
            self.loss_count += 1
        self.last = r


@dataclass(frozen=True)
class _CameBack:
    """A rank that registered behind the step it had reached: its worker process started again."""

    previous: WorkerRecord  # its registration before it came back (the current job's)
    reached: int  # the newest step it had registered or reported before
    answer: AssignmentRecord  # what it is told meanwhile: no batch sizes


@dataclass(frozen=True)
class Snapshot:
    """Everything a decision needs, taken out of the state under the lock."""

    step: int
    workers: tuple[WorkerRecord, ...]
    intervals: tuple[_Interval, ...]
    current: AssignmentRecord
    initial_batch_sizes: tuple[int, ...]
    loss_history: tuple[float, ...]
    dataset_size: int | None
    node_metrics: dict = field(default_factory=dict)
    throughput: tuple[float, ...] = ()
    job: int = 1  # Cluster.jobs when it was taken: a decision on an earlier job is never installed


@dataclass
class Cluster:
    """Registered workers, the current interval's reports and the assignment in force.

    Args:
        num_workers: job size if known in advance (``--num-workers``), else taken from the
            first registration.
        decision_interval: K, steps between decisions.
        policy_name: written into assignments.
        base_version: version of the newest assignment already published by an earlier
            scheduler of this run (read from its decision log), so versions never go back.
        clock: seconds, monotonic; when each rank was last heard from (:data:`LIVE_RANK_S`) and
            when its node metrics arrived (:data:`NODE_METRICS_MAX_AGE_S`).

    One scheduler may serve several jobs one after the other (a standalone ``dynamix scheduler``
    under torchrun): a rank that registers behind the step it had reached (its process started
    again) gets no batch sizes until every rank has come back or it is seen training in step
    with the others; when every rank has come back, either the same job resumed from a
    checkpoint (it goes on with the assignment in force) or a new job began, and the state starts
    over from the new workers' own batch sizes (:meth:`register_locked`).
    """

    num_workers: int | None
    decision_interval: int
    policy_name: str
    base_version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        self.world_size = self.num_workers
        self.workers: dict[int, WorkerRecord] = {}
        self.last_step: dict[int, int] = {}
        self.last_report: dict[int, ReportRecord] = {}  # the report of last_step, to carry into an interval
        self.last_heard: dict[int, float] = {}  # rank -> clock() of its last registration or report
        self.intervals: dict[int, _Interval] = {}
        self.ready: set[int] = set()
        self.next_step: int | None = None  # decision due when every rank reported a step >= this
        self.initial_batch_sizes: tuple[int, ...] | None = None
        self.throughput: dict[int, float] = {}  # θ_i smoothed over intervals (THROUGHPUT_SMOOTHING)
        self.loss_history: list[float] = []
        self.node_metrics: dict[int, tuple[float, dict]] = {}  # rank -> (clock() on arrival, its agent's newest metrics)
        self.registered_step: dict[int, int] = {}  # rank -> the step of its newest registration
        self.came_back: dict[int, _CameBack] = {}  # ranks restarted behind the job; told no sizes meanwhile
        self.sizes_history: deque[tuple[int, ...]] = deque(maxlen=SIZES_HISTORY_LEN)  # this job's vectors
        self.first_change_step: int | None = None  # effective step of this job's first published change
        self.jobs = 1  # jobs this scheduler has served: one more each time it starts over for a new job
        self.notice: str | None = None  # what the last registration changed about the job, for the log
        self.decisions = 0
        self.current = self._partial_assignment()

    # ---- queries ------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self.world_size is not None and len(self.workers) == self.world_size

    def awaits_others(self, rank: int) -> bool:
        """``rank`` has reported for the next decision and other ranks have not yet."""
        return rank in self.ready and len(self.ready) < (self.world_size or 0)

    def assignment_for_locked(self, rank: int) -> AssignmentRecord:
        """The assignment to answer ``rank`` with: the one in force, or none (no batch sizes) while
        the rank came back from a restart and it is not known yet whether a new job began."""
        held = self.came_back.get(rank)
        return self.current if held is None else held.answer

    def worker(self, rank: int) -> WorkerRecord:
        """The registered worker ``rank``; raises :class:`Rejected` if out of range or unknown."""
        if self.world_size is not None and rank >= self.world_size:
            raise _invalid(f"rank={rank} must be < world_size={self.world_size}")
        record = self.workers.get(rank)
        if record is None:
            raise Rejected(FAILED_PRECONDITION, f"rank {rank} is not registered; register first")
        return record

    def _partial_assignment(self) -> AssignmentRecord:
        """Before every rank has registered: no sizes (a list shorter than world_size is never applied)."""
        n = self.world_size or 0
        missing = [r for r in range(n) if r not in self.workers]
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        return AssignmentRecord(
            version=self.base_version,
            effective_step=0,
            batch_sizes=(),
            lr_scale=1.0,
            policy=self.policy_name,
            reason=f"waiting for {len(missing)} of {n} workers to register (ranks {shown})" if n else "waiting for workers to register",
        )

    # ---- mutations (hold self.lock) -----------------------------------------------------

    def _check_takeover(self, record: WorkerRecord) -> None:
        """Refuse a re-registration that moves a live rank to another host or other bounds."""
        known = self.workers.get(record.rank)
        if known is None or (known.host, known.min_batch, known.max_batch) == (record.host, record.min_batch, record.max_batch):
            return
        silent_s = self.clock() - self.last_heard.get(record.rank, -math.inf)
        if silent_s < LIVE_RANK_S:
            raise _invalid(
                f"rank {record.rank} is registered from host {known.host!r} with bounds "
                f"[{known.min_batch}, {known.max_batch or 'unbounded'}] and was heard from {silent_s:.1f} s ago; "
                f"a registration from host {record.host!r} with bounds [{record.min_batch}, "
                f"{record.max_batch or 'unbounded'}] is accepted once it has been silent for {LIVE_RANK_S:g} s")

    def register_locked(self, info) -> AssignmentRecord:
        """Record a (re-)registration; returns the assignment the worker should start from.

        A worker registers at its first report and again whenever its client lost the scheduler,
        always further on than before. A registration *behind* the step its rank had reached
        (a step > 0 that is older than the rank's last registration, or not newer than its last
        report) comes from a worker process that started again: the whole job restarted (from a
        checkpoint, or from scratch) or a new job uses this scheduler. Such a rank is answered
        without batch sizes until the cases can be told apart: once every rank has come back,

        * the same job resumed from a checkpoint (the same engine, bounds, dataset, model and
          optimizer, the batch sizes of one of its assignments, past its first change of sizes)
          goes on with the assignment in force, as before;
        * anything else (other sizes, other bounds, or a start before the job's first change: a
          rerun from scratch) is a new job: the assignment, the initial sizes, the throughput and
          loss history and the decision step start over from the new workers' own batch sizes,
          and :attr:`notice` says so.

        A rank that came back alone and then trains in step with the others (a bogus registration)
        is answered as before from the next decision on. A registration without a step (0, the
        proto's default) gives no evidence and is taken as before.

        Raises:
            Rejected: an invalid ``WorkerInfo``, or one that changes the host or bounds of a rank
                heard from in the last :data:`LIVE_RANK_S` seconds.
        """
        record = validate_worker_info(info, self.world_size)
        rank = record.rank
        self._check_takeover(record)
        previous = self.workers.get(rank)
        reached = max(self.registered_step.get(rank, 0), self.last_step.get(rank, 0))
        behind = record.step > 0 and (record.step < self.registered_step.get(rank, 0)
                                      or record.step <= self.last_step.get(rank, -1))
        self.world_size = record.world_size
        self.workers[rank] = record
        self.registered_step[rank] = record.step
        self.last_heard[rank] = self.clock()
        self.last_step.pop(rank, None)  # a restarted worker may resume from an earlier step
        self.last_report.pop(rank, None)
        self.intervals.pop(rank, None)
        if previous is not None:  # its node metrics described the process that registered before
            self.node_metrics.pop(rank, None)
            if previous.host != record.host:  # another machine: its speed is measured anew (Pollux re-profiles per placement)
                self.throughput.pop(rank, None)
        self.ready.discard(rank)
        self.notice = None
        if self.initial_batch_sizes is None:
            if self.complete:
                self._start_job("initial allocation: the workers' own batch sizes")
            else:
                self.current = self._partial_assignment()
        elif previous is not None:
            # Worker restarted (or the job rewound to a checkpoint): do not wait for steps it will not report.
            self.next_step = min(self.next_step, record.step + self.decision_interval)
            self._ready_from_last_reports()
            if behind and rank not in self.came_back:
                self.came_back[rank] = _CameBack(previous, reached, self._held_answer(rank, record.step, reached))
            if len(self.came_back) == self.world_size:
                self._every_rank_came_back()
        return self.assignment_for_locked(rank)

    def _held_answer(self, rank: int, step: int, reached: int) -> AssignmentRecord:
        return AssignmentRecord(
            version=self.current.version,
            effective_step=0,
            batch_sizes=(),
            lr_scale=1.0,
            policy=self.policy_name,
            reason=(f"rank {rank} came back at step {step}, behind step {reached} it had reached: no batch sizes "
                    "until the other ranks show whether a new job began (it then starts from its own sizes)"),
        )

    def _start_job(self, reason: str) -> None:
        """Every rank has registered: the job starts from the workers' own batch sizes."""
        self.initial_batch_sizes = tuple(self.workers[r].batch_size for r in range(self.world_size))
        start = min(w.step for w in self.workers.values())  # one bogus huge step cannot stall decisions
        self.next_step = start + self.decision_interval
        self.current = AssignmentRecord(
            version=self.base_version,
            effective_step=start,
            batch_sizes=self.initial_batch_sizes,
            lr_scale=1.0,
            policy=self.policy_name,
            reason=reason,
        )
        self.sizes_history.clear()
        self.sizes_history.append(self.initial_batch_sizes)
        self.first_change_step = None
        self._ready_from_last_reports()

    def _every_rank_came_back(self) -> None:
        """Every rank registered behind the step it had reached: the same job resumed, or a new job."""
        n = self.world_size
        sizes = tuple(self.workers[r].batch_size for r in range(n))
        step = min(self.workers[r].step for r in range(n))
        changed = [r for r in range(n) if self.workers[r].job_signature() != self.came_back[r].previous.job_signature()]
        if changed:
            why = (f"rank{'s' if len(changed) > 1 else ''} {', '.join(map(str, changed[:8]))} registered another "
                   "engine, batch bounds, dataset size, model or optimizer")
        elif sizes not in self.sizes_history:
            why = f"batch sizes {list(sizes)}, which the previous job never ran"
        elif self.first_change_step is None:
            why = f"from step {step}, and the previous job never changed its batch sizes"
        elif step < self.first_change_step:
            why = f"from step {step}, before the previous job's first change of batch sizes (step {self.first_change_step})"
        else:
            self.came_back.clear()
            self.notice = (f"every rank registered again from step {step} with the batch sizes {list(sizes)} of an "
                           f"earlier assignment: the same job resumed from a checkpoint; it goes on with version "
                           f"{self.current.version} {list(self.current.batch_sizes)}")
            return
        old = self.current
        self.jobs += 1
        self.base_version = old.version  # versions never go back
        self.last_step.clear()
        self.last_report.clear()
        self.intervals = {}
        self.ready = set()
        self.throughput = {}
        self.loss_history = []
        self.node_metrics = {}
        self.came_back.clear()
        self._start_job(f"a new job registered: its own batch sizes ({why})")
        bounds = sorted({(w.min_batch, w.max_batch) for w in self.workers.values()}, key=str)
        shown = ", ".join(f"[{lo}, {hi if hi is not None else '-'}]" for lo, hi in bounds[:4])
        self.notice = (f"a new job registered ({n} workers, {why}; bounds {shown}): starting over from its batch "
                       f"sizes {list(sizes)} at step {step}; the previous job's assignment (version {old.version}, "
                       f"{list(old.batch_sizes)}), initial sizes, throughput and loss history are dropped")

    def _ready_from_last_reports(self) -> None:
        """Mark ready every rank whose last report already reaches ``next_step``, that report
        opening its interval when it has none (a ready rank always has an interval to decide on)."""
        self.ready = set()
        for rank, last in self.last_report.items():
            if last.step >= self.next_step:
                self.ready.add(rank)
                if rank not in self.intervals:
                    self.intervals[rank] = _Interval()
                    self.intervals[rank].add(last)

    def _decision_due(self, rank: int) -> tuple[AssignmentRecord, Snapshot | None]:
        """The answer to ``rank`` and, when every rank is ready, a snapshot to decide on. A rank that
        came back from a restart alone and has caught up with the others (the newest step of the
        slowest of them) trains in step with them: it is the job's again. While another stays apart,
        nothing is decided (its interval may be another job's)."""
        if self.world_size is None or self.next_step is None or len(self.ready) < self.world_size:
            return self.assignment_for_locked(rank), None
        if self.came_back:
            others = [step for r, step in self.last_step.items() if r not in self.came_back]
            for r in list(self.came_back):
                if others and self.last_step.get(r, -1) >= min(others):
                    del self.came_back[r]
            if self.came_back:
                return self.assignment_for_locked(rank), None
        return self.current, self._take_snapshot()

    def node_report_locked(self, report) -> list[int]:
        """Store a node agent's metrics for the ranks of this job (all entries checked before any is
        kept); decisions use them for :data:`NODE_METRICS_MAX_AGE_S` seconds.

        Returns the ranks left out because they registered from another host than the agent's:
        an agent given another job's ``--job`` or ``--scheduler`` would have its host's workers
        measured as this job's ranks (both sides name the host by ``socket.gethostname()``; an
        unnamed host is not compared). The others' metrics are kept.

        Raises:
            Rejected: INVALID_ARGUMENT for a rank outside the job (beyond :data:`MAX_WORLD_SIZE` while
                its size is unknown) or a metric out of range; FAILED_PRECONDITION when every rank
                it reports registered from another host.
        """
        checked = {}
        now = self.clock()
        # Before the first registration (workers register at their first report, an interval after
        # their mailboxes appear) any rank a job may have is taken; decisions read only the job's.
        ranks = self.world_size if self.world_size is not None else MAX_WORLD_SIZE
        for entry in report.workers:
            if entry.rank >= ranks:
                raise _invalid(f"workers[].rank={entry.rank} is not a rank of this job")
            checked[entry.rank] = (now, validate_node(entry.node))
        elsewhere = [rank for rank in checked if self._registered_elsewhere(rank, report.host)]
        if elsewhere and len(elsewhere) == len(checked):
            rank = elsewhere[0]
            raise Rejected(FAILED_PRECONDITION,
                           f"the node agent on host {report.host[:MAX_HOST_LEN]!r} reports rank {rank}, which registered "
                           f"from host {self.workers[rank].host!r}: the agent measures another job's workers; give it "
                           "the --job its host's workers got in DYNAMIX_JOB_ID and this job's --scheduler")
        for rank in elsewhere:
            del checked[rank]
        self.node_metrics.update(checked)
        return elsewhere

    def _registered_elsewhere(self, rank: int, agent_host: str) -> bool:
        worker = self.workers.get(rank)
        return worker is not None and bool(worker.host) and bool(agent_host) and worker.host != agent_host

    def _fresh_node_metrics(self) -> dict[int, dict]:
        """``{rank: metrics}`` that a node agent sent in the last :data:`NODE_METRICS_MAX_AGE_S` seconds."""
        oldest = self.clock() - NODE_METRICS_MAX_AGE_S
        return {rank: dict(node) for rank, (received, node) in self.node_metrics.items() if received >= oldest}

    def report_locked(self, report) -> tuple[AssignmentRecord, Snapshot | None]:
        """Store a report; returns the current assignment and, when a decision is due, a snapshot.

        A report whose step is not newer than that rank's last one, by at most one interval, is
        ignored (a retry or a late duplicate), not an error. One further back means the rank went
        back (a restart from a checkpoint, or the step recorded before was bogus): its interval
        starts again from this report, so a single huge step cannot make every later report stale.
        """
        worker = self.worker(report.rank)
        record = validate_report(report, worker)
        rank = record.rank
        self.last_heard[rank] = self.clock()
        last = self.last_step.get(rank)
        if last is not None and record.step <= last:
            if record.step + self.decision_interval >= last:
                return self.assignment_for_locked(rank), None
            self.intervals.pop(rank, None)
            self.ready.discard(rank)
            if self.next_step is not None:
                # The step it had reported was bogus (or it rewound): the next decision is due at this
                # report, not at one the rank reports far in the future (forged 2**53 steps from every
                # rank stopped the decisions for good).
                self.next_step = min(self.next_step, record.step)
        self.last_step[rank] = record.step
        self.last_report[rank] = record
        self.intervals.setdefault(rank, _Interval()).add(record)
        if self.next_step is None or record.step < self.next_step:
            return self.assignment_for_locked(rank), None
        self.ready.add(rank)
        return self._decision_due(rank)

    def _take_snapshot(self) -> Snapshot:
        n = self.world_size
        intervals = tuple(self.intervals[r] for r in range(n))
        # The lowest of the ranks' steps: a bogus huge one must not push the next decision out of reach.
        step = min(self.last_step[r] for r in range(n))
        losses = [iv.loss / iv.loss_count for iv in intervals if iv.loss_count]
        if losses:
            self.loss_history.append(sum(losses) / len(losses))
            del self.loss_history[:-LOSS_HISTORY_LEN]
        datasets = [w.dataset_size for w in self.workers.values() if w.dataset_size]
        for rank, iv in enumerate(intervals):
            theta, previous = iv.samples_per_s / iv.count, self.throughput.get(rank)
            if math.isfinite(theta) and theta > 0:
                fresh = previous is None
                self.throughput[rank] = theta if fresh else THROUGHPUT_SMOOTHING * theta + (1 - THROUGHPUT_SMOOTHING) * previous
        snap = Snapshot(
            step=step,
            workers=tuple(self.workers[r] for r in range(n)),
            intervals=intervals,
            current=self.current,
            initial_batch_sizes=self.initial_batch_sizes,
            loss_history=tuple(self.loss_history),
            dataset_size=max(datasets) if datasets else None,
            node_metrics=self._fresh_node_metrics(),
            throughput=tuple(self.throughput.get(r, iv.samples_per_s / iv.count) for r, iv in enumerate(intervals)),
            job=self.jobs,
        )
        self.intervals = {}
        self.next_step = step + self.decision_interval
        self._ready_from_last_reports()  # a rank already past the next boundary has reported for it
        return snap

    def publish_locked(self, snap: Snapshot, batch_sizes: tuple[int, ...], reason: str, lr_scale: float) -> AssignmentRecord:
        """Install a decision taken on ``snap``; a new version only when the sizes change.

        Its ``effective_step`` is ``snap.step + K``: rank 0 reads the answer to its report of
        ``snap.step`` at its next report boundary, one interval later, and every worker switches
        at the first step none of them has drawn by then (later when loaders prefetch more deeply).
        """
        self.decisions += 1
        if snap.job != self.jobs:  # a new job registered while the policy decided for the previous one
            return snap.current
        if batch_sizes == self.current.batch_sizes:
            return self.current
        if batch_sizes in self.sizes_history:
            self.sizes_history.remove(batch_sizes)
        self.sizes_history.append(batch_sizes)
        self.current = AssignmentRecord(
            version=self.current.version + 1,
            effective_step=snap.step + self.decision_interval,
            batch_sizes=batch_sizes,
            lr_scale=lr_scale,
            policy=self.policy_name,
            reason=reason,
        )
        if self.first_change_step is None:
            self.first_change_step = self.current.effective_step
        return self.current


def cluster_state(snap: Snapshot) -> ClusterState:
    """The policy's view of ``snap``: per-worker interval averages (push and pull time where the
    workers reported them), bounds, history, noise stats, and the engine when every worker runs
    the same one."""
    workers = []
    grad_sq, trace_cov = [], []
    for w, iv in zip(snap.workers, snap.intervals):
        last = iv.last
        in_force = snap.current.batch_sizes  # what was published, not the reported averages
        workers.append(
            WorkerState(
                rank=w.rank,
                batch_size=in_force[w.rank] if len(in_force) == len(snap.workers) else last.batch_size,
                compute_s=iv.compute_s / iv.count,
                push_pull_s=iv.push_pull_s / iv.count,
                samples_per_s=snap.throughput[w.rank] if snap.throughput else iv.samples_per_s / iv.count,
                min_batch=w.min_batch,
                max_batch=w.max_batch,
                node={**last.node, **snap.node_metrics.get(w.rank, {})},
                batch_size_ran=last.batch_size,
                push_s=iv.push_s / iv.comm_count if iv.comm_count else None,
                pull_s=iv.pull_s / iv.comm_count if iv.comm_count else None,
                exposed_comm_s=iv.exposed_comm_s / iv.exposed_count if iv.exposed_count else None,
            )
        )
        if last.grad_sq is not None:
            grad_sq.append(last.grad_sq)
        if last.trace_cov is not None:
            trace_cov.append(last.trace_cov)
    return ClusterState(
        step=snap.step,
        workers=tuple(workers),
        initial_batch_sizes=snap.initial_batch_sizes,
        loss_history=snap.loss_history,
        grad_sq=sum(grad_sq) / len(grad_sq) if grad_sq else None,
        trace_cov=sum(trace_cov) / len(trace_cov) if trace_cov else None,
        dataset_size=snap.dataset_size,
        engine=engines.pop() if len(engines := {w.engine for w in snap.workers}) == 1 else "",
    )
