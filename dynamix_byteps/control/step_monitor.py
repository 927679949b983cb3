"""The worker's half of the control loop, driven once per step by the frontend that owns it.

Every step it measures push_pull time (the seconds the worker waited for gradient
communication that backward did not hide) and compute time (the rest of the step). Every
``decision_interval`` steps, on every worker at the same step, it

1. lets rank 0 broadcast the newest assignment it got from the scheduler (the answer to an
   earlier report), and applies it on all workers from the first step none of them has drawn
   yet (``set_batch_sizes``), so all switch at the same step: a decision taken at boundary s
   applies from s + K (its ``effective_step``) when loaders do not draw ahead;
2. sends this worker's averages to the scheduler without waiting (:class:`SchedulerClient`).

A scheduler that is slow or gone changes nothing.

The frontend (``DistributedOptimizer``, ``DistributedDataParallel``, TensorFlow's tape and Keras
optimizer, through :class:`~dynamix_byteps.training_step.TrainingStep`) builds its monitor and
hands it, every step, the :class:`~dynamix_byteps.batch_plan.BatchPlan` it trains on; the
BytePS API's module functions reach the monitor of the process's default plan.

With ``DYNAMIX_JOB_ID`` set (``bpslaunch --monitor``), the worker also publishes each step's
compute time, push_pull time and samples to a shared-memory mailbox, where the node agent of its
host finds it (and its pid) to add network and GPU metrics.

``DYNAMIX_SLOWDOWN`` (set by ``bpslaunch --slowdown RANK=FACTOR``) emulates a straggler: before
each gradient bucket leaves, the worker sleeps (FACTOR - 1) × the compute time since the last
one, so its compute time grows in proportion to its batch. It is an emulation for benchmarks and tests.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch

from dynamix_byteps import batch_plan, progress, timing
from dynamix_byteps.assignment import InvalidAssignmentError
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.negotiation import negotiate, round_lock

log = logging.getLogger(__name__)


def report_loss(loss) -> None:
    """Add a training loss (float or 0-dim tensor) to this interval's mean sent to the scheduler,
    by the step monitor of the default plan's newest frontend; dropped before any frontend exists."""
    monitor = batch_plan.default().monitor
    if monitor is not None:
        monitor.report_loss(loss)


@dataclass
class StepStatistics:
    """Sums over steps of one worker: since the last report, or since the job started.

    Attributes:
        steps: optimizer steps.
        compute_s: seconds computing (forward, backward, data loading, straggler emulation),
            without push_pull and without :func:`untimed` sections.
        push_pull_s: seconds in gradient aggregation.
        samples: local samples trained on.
        push_s, pull_s: seconds of this worker's own pushes and pulls (``ps`` engine; timing ring).
        exposed_comm_s: seconds of push_pull during which this worker's own pushes or pulls were in
            flight (``ps`` engine; :attr:`~dynamix_byteps.timing.StepComm.exposed_s`).
    """

    steps: int = 0
    compute_s: float = 0.0
    push_pull_s: float = 0.0
    samples: int = 0
    push_s: float = 0.0
    pull_s: float = 0.0
    exposed_comm_s: float = 0.0

    def add(self, compute_s: float, push_pull_s: float, samples: int, comm: timing.StepComm = timing.NO_COMM) -> None:
        self.steps += 1
        self.compute_s += compute_s
        self.push_pull_s += push_pull_s
        self.samples += samples
        self.push_s += comm.push_s
        self.pull_s += comm.pull_s
        self.exposed_comm_s += comm.exposed_s

    @property
    def samples_per_s(self) -> float:
        """Compute-only throughput θ_i = samples / compute_s (samples/s); 0 before any compute."""
        return self.samples / self.compute_s if self.compute_s > 0 else 0.0


def _interval_scalars(iv: StepStatistics, loss: float | None, lr_scale: float, noise) -> dict:
    """One interval's per-step means, by :data:`~dynamix_byteps.tensorboard_scalars.WORKER_TAGS` name."""
    compute_s, push_pull_s = iv.compute_s / iv.steps, iv.push_pull_s / iv.steps
    known = iv.samples > 0  # samples come from the sampler or set_local_batch_size
    return {"batch_size": iv.samples / iv.steps if known else None,
            "samples_per_s": iv.samples_per_s if known else None,
            "compute_s": compute_s, "push_pull_s": push_pull_s, "step_s": compute_s + push_pull_s,
            "loss": loss, "lr_scale": lr_scale, "noise_scale": getattr(noise, "noise_scale", None)}


class StepMonitor:
    """Per-step timing and the decision boundary of one worker (see the module docstring).

    Args:
        engine: the communication engine (rank, size, name, ``broadcast``, ``timing``: its
            :class:`~dynamix_byteps.timing.CommTiming`, whose steps this monitor closes).
        env: the worker's environment (scheduler address, decision interval, slowdown).
        optimizer_family: ``"sgd"`` or ``"adam"``, told to the scheduler.
        scalars: the worker's TensorBoard :class:`~dynamix_byteps.tensorboard_scalars.ScalarWriter`, or
            None (no ``--log-dir``): each interval's scalars go there.

    Attributes:
        plan: the :class:`~dynamix_byteps.batch_plan.BatchPlan` of the newest step
            (:meth:`after_step`); None before the first.
    """

    def __init__(self, engine, env: WorkerEnv, optimizer_family: str, scalars=None):
        self.engine = engine
        self.env = env
        self.optimizer_family = optimizer_family
        self.plan: batch_plan.BatchPlan | None = None
        self.steps = 0
        self.global_step = 0  # steps completed in the job (across restarts when a sampler knows them)
        self._start = self._last_end = self._stretched_until = time.perf_counter()
        self._untimed_s = 0.0
        self._untimed_depth = 0
        self._comm_before_untimed = timing.NO_COMM  # the step's transfers before an untimed section
        self._interval = StepStatistics()
        self.totals = StepStatistics()
        self._scheduler_version_seen = -1
        self._declared_batch = 0  # samples per step of the last interval, without a sampler; 0 = unknown
        self._said_unapplied = self._said_unknown_batch = False
        self._loss_seen = False  # a report carried a loss, or this worker was told that none did
        self._client = None
        self._mailbox = None
        self._losses_lock = threading.Lock()
        self._loss_sum = 0.0  # of the losses reported since the last report (NaN/inf propagate: divergence)
        self._loss_count = 0
        job = os.environ.get("DYNAMIX_JOB_ID")
        if job:
            from dynamix_byteps.control.mailbox import Mailbox, mailbox_name

            self._mailbox = Mailbox.create(mailbox_name(job, engine.rank))
        self._progress = progress.writer_from_env()
        self._scalars = scalars
        self._last_noise, self._last_lr_scale = None, 1.0  # of the last step, for an unfinished interval's scalars
        if scalars is not None:
            scalars.before_close(self._write_unfinished_interval)

    def report_loss(self, loss) -> None:
        """Add a training loss (float or 0-dim tensor) to this interval's mean sent to the scheduler."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        with self._losses_lock:
            self._loss_sum += value
            self._loss_count += 1

    def _take_mean_loss(self) -> float | None:
        with self._losses_lock:
            total, count, self._loss_sum, self._loss_count = self._loss_sum, self._loss_count, 0.0, 0
        return total / count if count else None

    def training_seconds(self) -> float:
        """Seconds since this monitor started, without :meth:`untimed` sections."""
        return time.perf_counter() - self._start - self._untimed_s

    @contextlib.contextmanager
    def untimed(self):
        """Leave the enclosed code (evaluation, checkpointing) out of step and training times, and
        its transfers (a metric's average) out of the step's push and pull time.

        Nested sections count once: only the outermost one is subtracted.
        """
        self._untimed_depth += 1
        begin = time.perf_counter()
        if self._untimed_depth == 1:
            # The ring's span runs from the step's first transfer to its last: without this cut it
            # would reach across the section.
            self._comm_before_untimed += self.engine.timing.step_comm()
        try:
            yield
        finally:
            self._untimed_depth -= 1
            if self._untimed_depth == 0:
                spent = time.perf_counter() - begin
                self._last_end += spent
                self._stretched_until += spent
                self._untimed_s += spent
                self.engine.timing.step_comm()  # the section's own transfers

    def stretch(self) -> None:
        """Called before each gradient bucket leaves: the straggler emulation stretches the
        compute since the previous call (or the step's start) by the slowdown factor."""
        start, end = self.env.slowdown_window
        if self.env.slowdown > 1.0 and start <= self.training_seconds() < end:
            time.sleep((self.env.slowdown - 1.0) * max(time.perf_counter() - self._stretched_until, 0.0))
        self._stretched_until = time.perf_counter()

    def close(self) -> None:
        """Stop reporting to the scheduler: the client's thread ends and its channel closes, later
        reports are dropped (``bps.shutdown``). Safe to call twice."""
        if self._client is not None:
            self._client.close()

    def after_step(self, samples: int | None, noise, lr_scale: float = 1.0, step: int | None = None,
                   push_pull_s: float = 0.0, plan: batch_plan.BatchPlan | None = None,
                   wait_ns: tuple[int, int] | None = None) -> None:
        """Called when a step ends, on every worker, with this step's local samples, the
        gradient noise statistics, the learning-rate factor of the step, the global step completed
        (None: this monitor's count of steps), the seconds spent waiting for the gradients'
        communication (the rest of the step counts as compute), the batch plan it trained on
        (None: unknown, treated as a plan without a sampler) and when that wait began and ended
        (:func:`~dynamix_byteps.timing.now_ns` nanoseconds; None: unknown, no exposed
        communication is measured)."""
        self.plan, self._last_noise, self._last_lr_scale = plan, noise, lr_scale
        end = time.perf_counter()
        compute_s = max(end - self._last_end - push_pull_s, 0.0)
        comm = self._comm_before_untimed + self.engine.timing.step_comm(wait_ns)
        self._comm_before_untimed = timing.NO_COMM
        self._interval.add(compute_s, push_pull_s, samples or 0, comm)
        self.totals.add(compute_s, push_pull_s, samples or 0, comm)
        self._last_end = self._stretched_until = end
        self.steps += 1
        self.global_step = self.steps if step is None else step
        if self._mailbox is not None:
            self._mailbox.publish_metrics(self.steps, (compute_s, push_pull_s, samples or 0))
        if self._progress is not None:
            schedule = self._schedule()
            self._progress.update(self.global_step, None if plan is None else plan.trained_position(),
                                  None if schedule is None else schedule.dataset_size)
        if self.steps % self.env.decision_interval == 0:
            self._end_interval(noise, lr_scale)

    def _end_interval(self, noise, lr_scale: float) -> None:
        """The report boundary: TensorBoard scalars, then the assignment round, then the report."""
        iv, self._interval = self._interval, StepStatistics()
        loss = self._take_mean_loss()
        if self._scalars is not None:
            self._scalars.add(_interval_scalars(iv, loss, lr_scale, noise), self.global_step)
        if self.env.scheduler is not None:
            # The assignment first: an answer to this boundary's report then always applies at the
            # next boundary, the decision's effective_step (a fast answer sometimes applied at once).
            self._apply_newest_assignment()
            self._report(iv, loss, noise)
        self._last_end = self._stretched_until = time.perf_counter()  # the boundary's collectives and logging are not compute
        self.engine.timing.step_comm()  # nor are their pushes and pulls part of the next step's

    def _write_unfinished_interval(self) -> None:
        """The steps since the last decision boundary, as one more interval of TensorBoard scalars,
        when the writer closes (``bps.shutdown()`` or the process's exit): the run's record then ends
        where training did, not up to ``decision_interval - 1`` steps earlier."""
        iv = self._interval
        if iv.steps:
            self._interval = StepStatistics()
            self._scalars.add(_interval_scalars(iv, self._take_mean_loss(), self._last_lr_scale, self._last_noise),
                              self.global_step)

    def _schedule(self):
        return None if self.plan is None else self.plan.schedule

    def _reported_batch(self, iv: StepStatistics) -> int:
        """The batch size this interval reports: the mean over its steps of the batch the schedule
        assigned this rank, which lies within the registered bounds even when the epoch's last,
        partial step drew fewer samples (the throughput still counts the samples really drawn),
        and shows the guardrails an assignment that took effect during the interval.
        Without a sampler: the mean declared by ``set_local_batch_size``; 0 when nothing was declared."""
        schedule = self._schedule()
        if schedule is not None:
            steps = range(max(self.global_step - iv.steps, 0), max(self.global_step, 1))
            assigned = [schedule.at(step).batch_sizes[self.engine.rank] for step in steps]
            return round(sum(assigned) / len(assigned))
        if iv.samples > 0:
            self._declared_batch = max(round(iv.samples / iv.steps), 1)
        return self._declared_batch

    def _report(self, iv: StepStatistics, loss: float | None, noise) -> None:
        from dynamix_byteps.control import dynamix_pb2

        batch = self._reported_batch(iv)
        if batch == 0:
            self._say_batch_unknown()
            return
        report = dynamix_pb2.Report(
            rank=self.engine.rank, step=self._step_index(), local_batch_size=batch,
            compute_s=iv.compute_s / iv.steps, push_pull_s=iv.push_pull_s / iv.steps,
            samples_per_s=iv.samples_per_s, loss=loss,
            grad_sq=math.nan if noise.grad_sq is None else noise.grad_sq,
            trace_cov=math.nan if noise.trace_cov is None else noise.trace_cov,
        )
        self._say_if_no_loss(loss)
        if self.engine.name == "ps":
            report.push_s, report.pull_s = iv.push_s / iv.steps, iv.pull_s / iv.steps
            report.exposed_comm_s = iv.exposed_comm_s / iv.steps
        if self._client is None:
            from dynamix_byteps.control.client import SchedulerClient

            self._client = SchedulerClient(self.env.scheduler, self.env.token, self._worker_info, self.env.tls_ca)
        self._client.submit(report)

    def _say_batch_unknown(self) -> None:
        if not self._said_unknown_batch:
            log.error("the scheduler's policy needs this worker's batch size, and nothing declares it: "
                      "draw batches with a DynamicBatchSampler (TensorFlow and Keras model.fit: through "
                      "bps.dynamic_batch_dataset), or declare the batch every step (PyTorch: "
                      "optimizer.set_local_batch_size(n); TensorFlow: bps.DistributedGradientTape(tape, "
                      "local_batch_size=n)); until then this worker sends the scheduler no reports")
            self._said_unknown_batch = True

    def _say_if_no_loss(self, loss: float | None) -> None:
        if loss is None and not self._loss_seen:
            log.warning("this worker reported no training loss in a whole report interval, so the scheduler's policy "
                        "sees none: its divergence guardrail cannot act, the PPO policy's loss features read 0, and "
                        "dynamix report shows no loss. Call bps.report_loss(loss) every step (Keras model.fit: add "
                        "dynamix_byteps.tensorflow.keras.callbacks.BatchSizeCallback(), which reports it)")
        self._loss_seen = True

    def _step_index(self) -> int:
        schedule = self._schedule()
        return schedule.next_open_step if schedule is not None else self.steps

    def _worker_info(self):
        from dynamix_byteps.control import dynamix_pb2

        schedule = self._schedule()
        rank = self.engine.rank
        info = dynamix_pb2.WorkerInfo(rank=rank, world_size=self.engine.size, host=socket.gethostname(),
                                      engine=self.engine.name, optimizer_family=self.optimizer_family,
                                      step=self._step_index())
        if schedule is not None:
            info.min_batch = schedule.bounds.min_batch[rank]
            info.max_batch = schedule.bounds.max_batch[rank] or 0
            info.batch_size = schedule.latest.batch_sizes[rank]
            info.dataset_size = schedule.dataset_size or 0
        else:  # set_local_batch_size only: no bounds, the declared size
            info.batch_size = self._declared_batch
        return info

    def _say_unapplied(self, newest, joined_version: int | None) -> None:
        """Without a sampler nothing can change the batch sizes: say so once, when the policy first
        publishes a version newer than the one this worker joined with (its first registration's,
        not the first it read: on a loaded machine that may already be the policy's)."""
        if newest is None or joined_version is None or self._said_unapplied or newest.version == joined_version:
            return
        log.error("the scheduler's policy assigned batch sizes %s, but this job has no DynamicBatchSampler, so "
                  "they are NOT applied and every worker keeps its own; draw batches with "
                  "a DynamicBatchSampler (TensorFlow and Keras model.fit: through bps.dynamic_batch_dataset) to let "
                  "the policy change them", list(newest.batch_sizes))
        self._said_unapplied = True

    def _apply_newest_assignment(self) -> None:
        with round_lock:
            self._agree_on_assignment()

    def _agree_on_assignment(self) -> None:
        size = self.engine.size
        proposal = torch.zeros(2 + size, dtype=torch.int64)
        schedule = self._schedule()
        if self.engine.rank == 0 and self._client is not None and schedule is None:
            self._say_unapplied(self._client.latest(), self._client.joined_version)
        if self.engine.rank == 0 and self._client is not None and schedule is not None:
            newest = self._client.latest()
            if (newest is not None and newest.version != self._scheduler_version_seen
                    and len(newest.batch_sizes) == size and tuple(newest.batch_sizes) != schedule.latest.batch_sizes):
                proposal[0], proposal[1] = 1, newest.version
                proposal[2:] = torch.tensor(list(newest.batch_sizes), dtype=torch.int64)
        self.engine.broadcast(proposal, 0, "dynamix.assignment")
        if not proposal[0] or schedule is None:
            return
        self._scheduler_version_seen = int(proposal[1])
        sizes = [int(b) for b in proposal[2:]]
        # Prefetching loaders may have drawn ahead: start where no worker has drawn yet.
        drawn_until = negotiate(self.engine, "assignment boundary", f"scheduler assignment {proposal[1]}",
                                schedule.next_open_step)[:, 0]
        try:
            self.plan.set_batch_sizes(sizes, at_step=int(drawn_until.max()))
        except InvalidAssignmentError as exc:
            log.warning("scheduler assignment %s rejected, the previous one stays in force: %s", sizes, exc)
