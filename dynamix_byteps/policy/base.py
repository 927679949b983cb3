"""What a batch-size policy sees and what it returns.

The scheduler builds a :class:`ClusterState` from the workers' reports every decision interval
and asks the job's :class:`Policy` for a :class:`Decision`. Everything here is plain data
(framework-neutral, no torch), so policies are testable without a cluster.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


def integer_option(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """A policy's whole-number option ``name`` as an ``int`` (numpy integers, and floats such as
    ``2.0`` or ``1e3`` that are whole, too).

    Raises:
        ValueError: ``value`` is not a whole number (a bool, a fraction such as 100.7, text) or
            is outside ``[minimum, maximum]``; ``int()`` would silently truncate the first two.
    """
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a whole number {bound}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class WorkerState:
    """One worker, averaged over the last decision interval.

    Attributes:
        rank: global rank.
        batch_size: local batch size in force (samples).
        batch_size_ran: mean local batch per step over the interval the measurements come from
            (samples); it differs from ``batch_size`` while a new assignment is still taking effect
            (workers switch at their next interval boundary). None: the same as ``batch_size``.
        compute_s: seconds per step spent computing (forward, backward, data), excluding push_pull.
        push_pull_s: seconds per step waiting for gradient aggregation.
        samples_per_s: compute-only throughput θ_i = batch_size / compute_s (samples/s); the
            scheduler passes an exponentially weighted mean over decision intervals
            (``control.cluster.THROUGHPUT_SMOOTHING``), the other fields are the last interval's.
        min_batch, max_batch: inclusive bounds for this worker (``max_batch`` None = unbounded).
        node: node-agent metrics (e.g. ``cpu_util`` 0–1, ``rtt_s``, ``retransmits``,
            ``tx_bytes_per_s``, ``gpu_util``); absent keys mean unavailable.
        push_s, pull_s: ``ps`` engine only, seconds per step of this worker's own pushes and pulls
            over its own link (the pull without the wait for the other workers); None with a ring
            engine, whose every rank moves the same bytes, or when not reported.
        exposed_comm_s: ``ps`` engine only, seconds per step of ``push_pull_s`` during which this
            worker's own pushes or pulls were in flight: the part of its communication backward did
            not hide, without its wait for the other workers (never more than ``push_pull_s``,
            often much less than ``push_s + pull_s``, which overlap backward and each other).
    """

    rank: int
    batch_size: int
    compute_s: float
    push_pull_s: float
    samples_per_s: float
    min_batch: int = 1
    max_batch: int | None = None
    node: dict = field(default_factory=dict)
    batch_size_ran: int | None = None
    push_s: float | None = None
    pull_s: float | None = None
    exposed_comm_s: float | None = None


@dataclass(frozen=True)
class ClusterState:
    """The job as the scheduler sees it at a decision boundary.

    Attributes:
        step: global step of the newest reports.
        workers: one :class:`WorkerState` per rank, ordered by rank.
        initial_batch_sizes: the job's starting allocation (the static policy's answer).
        loss_history: mean training loss per past decision interval, oldest first (may hold
            NaN/inf when training diverged).
        grad_sq: smoothed |G|² of the gradient noise estimator, None when unknown.
        trace_cov: smoothed tr(Σ) (per-sample gradient covariance trace), None when unknown.
        dataset_size: samples per epoch, None when unknown.
        engine: the workers' communication engine (``gloo``, ``nccl``, ``ps``, ``byteps``; empty
            when unknown or mixed). Under ``ps`` each worker's communication is its own
            (``WorkerState.push_s``, ``pull_s``, ``exposed_comm_s``), under a ring it is the same for
            every worker.
    """

    step: int
    workers: tuple[WorkerState, ...]
    initial_batch_sizes: tuple[int, ...]
    loss_history: tuple[float, ...] = ()
    grad_sq: float | None = None
    trace_cov: float | None = None
    dataset_size: int | None = None
    engine: str = ""

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(w.batch_size for w in self.workers)

    @cached_property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Each worker's inclusive batch bounds as read-only columns ``(low, high)`` of shape (N,):
        ``low`` int64 >= 1, ``high`` float64 >= ``low`` (inf = unbounded). Bounds are truncated to
        integers; a missing, non-numeric or non-finite one is no bound. Computed once per state."""
        low = np.maximum(_truncated([w.min_batch for w in self.workers], 1.0), 1.0)
        high = np.maximum(_truncated([w.max_batch for w in self.workers], math.inf), low)
        low = low.astype(np.int64)
        low.flags.writeable = high.flags.writeable = False
        return low, high

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @property
    def noise_scale(self) -> float | None:
        """B_noise = tr(Σ)/|G|² (McCandlish et al. 2018), None when unknown or |G|² <= 0."""
        if self.grad_sq is None or self.trace_cov is None or self.grad_sq <= 0:
            return None
        return max(self.trace_cov, 0.0) / self.grad_sq


def float_or_nan(v) -> float:
    """``float(v)``, or NaN when ``v`` is None or not a number."""
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def as_floats(values) -> np.ndarray:
    """float64 array of a sequence of numbers, shape (N,), or of equal-length rows of numbers,
    shape (N, K); None and anything that is not a number become NaN (in a sequence that is not
    all rows, a row too)."""
    try:
        return np.array(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        if all(isinstance(row, (tuple, list)) for row in values):
            return np.array([[float_or_nan(v) for v in row] for row in values], dtype=np.float64)
        return np.array([float_or_nan(v) for v in values], dtype=np.float64)


def _truncated(values: list, missing: float) -> np.ndarray:
    """float64 column of the values truncated to integers; ``missing`` where one is None, not a
    number, or not finite."""
    column = np.trunc(as_floats(values))
    column[~np.isfinite(column)] = missing
    return column


@dataclass(frozen=True)
class Decision:
    """A policy's answer.

    Attributes:
        batch_sizes: proposed local batch size per rank.
        reason: one line for the decision log and the assignment's ``reason`` field.
        predicted_gain: relative improvement of the policy's objective over keeping the current
            sizes (0.1 = 10% better); hysteresis compares it with a threshold.
        terms: numbers behind the decision (predicted step time, goodput, ...), for the log.
    """

    batch_sizes: tuple[int, ...]
    reason: str
    predicted_gain: float = 0.0
    terms: dict = field(default_factory=dict)


class Policy(abc.ABC):
    """Chooses per-worker batch sizes; ``name`` is what ``--policy`` accepts."""

    name: str

    @abc.abstractmethod
    def decide(self, state: ClusterState) -> Decision:
        """Propose batch sizes for ``state``; must not raise on odd but valid input."""
