"""Fit the training simulator to a real run: ``dynamix sim fit RUN_DIR``.

Input: ``RUN_DIR/decisions.jsonl``, written by the scheduler of ``bpslaunch --policy ...
--log-dir RUN_DIR`` (one :class:`~dynamix_byteps.control.decision_record.DecisionRecord` per line). Each line
holds, per worker, the means over the decision interval just ended of ``compute_s`` and
``push_pull_s`` (seconds per step), and the scheduler's smoothed throughput ``samples_per_s``.

**The batch that produced a line's timings.** ``state.workers.batch_size`` is the assignment in
force when the decision was taken, not necessarily the batch the interval ran: workers switch at
their next report boundary, after prefetching, typically one or two intervals later. The batch
actually used is recovered from ``samples_per_s``, the exponentially weighted mean
``θ̄_t = α·θ_t + (1 − α)·θ̄_{t−1}`` (α = :data:`~dynamix_byteps.control.cluster.THROUGHPUT_SMOOTHING`,
the first line and the first after a scheduler restart unsmoothed): ``θ_t = (θ̄_t − (1 − α)·θ̄_{t−1}) / α``
is the interval's raw ``samples / compute seconds``, so ``b̂_t = θ_t · compute_s_t`` is its mean
local batch (samples per step). When a rank sent several reports in one interval (the first
decision waits for every rank) or the value cannot be right (not finite, not positive), the
logged assignment is used instead.

What is fitted (units: seconds, samples):

* per worker, compute ``c = a_i + b/θ_i`` by least squares over the intervals' ``(b̂, compute_s)``
  (the first interval, warm-up, left out when enough remain), pooled with those of runs of the
  same job at other batches where given (``dynamix sim fit RUN_DIR --timings-from DIR``). When a worker's batch hardly
  varied (spread < :data:`MIN_BATCH_SPREAD` of its mean) or the slope is not clearly positive
  (below twice its standard error), ``a_i``
  and ``θ_i`` cannot be told apart; such a worker takes the fixed share ``φ = median_j a_j/c̄_j``
  of the workers that could be fitted (``a_i = φ·c̄_i``, ``θ_i = b̄_i/((1 − φ)·c̄_i)``), or
  ``φ = 0`` when none could. An intercept not above twice its standard error (negative, or
  indistinguishable from 0) is refitted through the origin (``a_i = 0``);
* ``jitter_i``: standard deviation of ``ln(c_t/ĉ_t)``, the interval means' residuals (a lower
  bound of the per-step jitter, which averaging over K steps damps);
* communication: ``C_t = min_i push_pull_s`` (the slowest worker does not wait, so its
  push_pull is the transfer; ``C_t = mean_k T_k − max_i mean_k c_ik``). Only the sum
  ``latency + 2·model_bytes/bandwidth`` is identifiable from one model size: ``model_bytes`` and
  ``latency_s`` keep their reference values (latency at most ``C̄/2``) and the bandwidth is the
  effective one, ``2·model_bytes/(C̄ − latency)``; comm jitter = sd of ``ln(C_t/C̄)``;
* **per-worker links**, for a run of the ``ps`` engine (``state.engine == "ps"`` and every worker's
  ``exposed_comm_s`` logged in the fitted intervals): each worker's own communication
  ``m̄_i`` = mean of ``exposed_comm_s``, its link ``bandwidth_i = 2·model_bytes/(m̄_i − latency)``
  (latency at most ``min_i m̄_i/2``), comm jitter = sd of ``ln(m_ti/m̄_i)`` over workers and
  intervals, and ``engine="ps"``. The simulator puts the whole transfer after the compute, so the
  fitted link is the effective one of the part backward did not hide, not the wire's rate
  (``push_s + pull_s`` overlap backward and would count the hidden part too);
* job: initial batches, the bounds common to all workers (largest minimum, smallest maximum;
  unbounded: the reference maximum), K (median step gap between decisions), dataset size,
  whether node-agent metrics were present;
* the target loss, where an episode ends: where the runs ended (:func:`end_loss`), so a policy
  trained on the fit sees the whole horizon it will serve (a target above the runs' last losses
  ends episodes early: fitted to 50-s runs, the example's target 0.4 came 21 s into a 150-s run,
  whose remaining 130 s the policy had never been trained on); without losses, the reference's;
* statistics, with ``L0``, ``L_min`` and the accuracy proxy at reference values
  (widened only if the run's losses fall outside them): ``B_noise(L) = B0·x^γ``,
  ``x = (L0 − L_min)/(L − L_min)``, by least squares on ``ln B_noise`` (``noise_scale``, ``noise_growth``;
  ``noise_scale_noise`` from the residuals), and the loss curve ``ln x = −ln remaining(E)``
  (``StatParams.remaining``): τ (``steps_scale``) for each tail α of :data:`LOSS_TAILS`
  (``loss_tail``; None the exponential ``ln x = E/τ``) by least squares through the origin on the
  law made linear, and the α whose curve misses ln x least, ``E`` the noise-free steps
  ``Σ Δsteps·M/(M + B_noise)``. The tail matters: an exponential is too steep late in training
  for real curves, and a calibration (below) then makes B_noise grow too fast to slow it down
  (on ten of the example's runs γ' 3.0 with the exponential against 2.0 with α 1.5, whose error
  is 35% lower; on four, 2.75 against 1.25 with α 1). Too few usable points keep the reference
  value; losses <= 0 (a loss this positive, cross-entropy-like model cannot hold) and spikes (more
  than :data:`SPIKE_FACTOR` × the median of the losses around them) are left out;
* **noise-scale calibration**, from several runs of the same model and data (``dynamix sim fit
  RUN_DIR MORE_RUN_DIRS...``, e.g. static runs at 2× and ½× the global batch): the measured
  B_noise (B_simple of arXiv 1812.06162, an estimate from gradient norms) need not be the batch
  size at which larger batches stop paying. Progress then uses its own law ``c·B0·x^γ'``, the
  ``(c, γ')`` of :data:`NOISE_SCALE_FACTORS` × :data:`NOISE_GROWTHS` that puts every run's losses
  on one loss curve (τ and α refitted for each candidate); the measured law is
  kept as ``measured_noise_scale``/``measured_noise_growth``, what the scheduler is shown. One run,
  or runs whose median global batches differ by less than :data:`MIN_GLOBAL_BATCH_SPREAD`, cannot
  tell the law from τ: progress uses the measured law. Only the extra runs' losses are used;
  timings (with ``--timings-from``'s), bounds and K come from ``RUN_DIR``. A run that never learned (:func:`learned`: one
  that diverged or stalled) is left out of the statistics, target loss included; when none
  learned, the statistics keep their reference values.

Not fitted: slowdowns that vary in time (they widen the jitter instead), per-worker links of a
ring run (every rank moves at the slowest link's pace, so they cannot be told apart), the
generalisation gap and the loss noise. The fitted file suits ``dynamix policy train --scenario
homogeneous --sim-params FILE`` (other scenarios add their slowdowns on top of the fitted speeds).
"""

from __future__ import annotations

import logging
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dynamix_byteps.control.cluster import DECISION_LOG, MAX_RATE, MAX_SECONDS, THROUGHPUT_SMOOTHING
from dynamix_byteps.control.decision_record import newest_at_each_step, read_decisions
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.sim.dynamics import Simulator
from dynamix_byteps.policy.sim.params import (
    CommParams,
    SimParams,
    StatParams,
    WorkerParams,
    loss_remaining,
    reference,
)
from dynamix_byteps.regular_files import NotRegularFileError

log = logging.getLogger(__name__)

__all__ = ["LOSS_TAILS", "MIN_BATCH_SPREAD", "MIN_GLOBAL_BATCH_SPREAD", "MIN_INTERVALS", "NOISE_GROWTHS", "NOISE_SCALE_FACTORS",
           "RunLog", "WorkerFit", "fit_compute", "fit_log", "fit_run", "fitted_rows", "global_batch_spread", "learned", "load_log",
           "replay"]

#: A worker's batches must span at least this fraction of their mean for a_i and θ_i to be separated.
MIN_BATCH_SPREAD = 0.1
#: Fewest decision records with timings a fit accepts.
MIN_INTERVALS = 3
#: Runs whose median global batches differ by at least this ratio calibrate the noise scale.
MIN_GLOBAL_BATCH_SPREAD = 1.5
#: Candidates for the law of the B_noise that sets progress (module docstring): its B0 over the
#: measured B0, and its growth γ.
NOISE_SCALE_FACTORS = np.geomspace(1 / 16, 64.0, 41)
NOISE_GROWTHS = np.linspace(0.0, 3.0, 13)
#: Candidate loss tails α (:class:`~dynamix_byteps.policy.sim.params.StatParams`); None = exponential.
LOSS_TAILS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, None)
#: The target loss is where the runs ended: each run's mean over this many last intervals, median over runs.
END_INTERVALS = 5
#: A run learned if its smoothed loss ended at least this fraction below where it started (:func:`learned`).
LEARNED_DROP = 0.25
#: An interval's loss more than this many times the median of its :data:`END_INTERVALS` neighbours
#: is a spike (a diverging step, a corrupted record), not the learning curve (:func:`usable_losses`).
SPIKE_FACTOR = 10.0
_REF = reference(1)


@dataclass(frozen=True)
class RunLog:
    """The usable content of one decision log; arrays are float64, one row per decision.

    Attributes:
        path: the ``decisions.jsonl`` read.
        steps: (T,) int, the step of each decision.
        batch: (T, N) mean local batch each interval actually ran (samples, module docstring).
        compute_s, push_pull_s: (T, N) per-step means over each interval (seconds).
        loss: (T,) mean worker loss of each interval, NaN when none was reported.
        noise_scale: (T,) B_noise (samples), NaN when unknown.
        initial_batch: (N,) int, the job's initial local batches.
        min_batch, max_batch: bounds common to all workers (max None: unbounded).
        dataset_size: samples per epoch, None when not reported.
        node_metrics: whether a node agent reported cpu_util or rtt_s.
        exposed_comm_s: (T, N) each worker's exposed communication per step (``ps`` engine:
            ``WorkerState.exposed_comm_s``, seconds), NaN where not logged.
        engine: the run's engine as logged (``state.engine``; empty when not logged).
    """

    path: Path
    steps: np.ndarray
    batch: np.ndarray
    compute_s: np.ndarray
    push_pull_s: np.ndarray
    loss: np.ndarray
    noise_scale: np.ndarray
    initial_batch: tuple[int, ...]
    min_batch: int
    max_batch: int | None
    dataset_size: int | None
    node_metrics: bool
    exposed_comm_s: np.ndarray | None = None
    engine: str = ""

    @property
    def step_s(self) -> np.ndarray:
        """(T, N) recorded step time per worker, compute + push_pull (seconds)."""
        return self.compute_s + self.push_pull_s


@dataclass(frozen=True)
class WorkerFit:
    """One worker's compute model: ``fixed_s`` a (seconds) + batch / ``samples_per_s`` θ (samples/s);
    ``jitter`` relative sd of an interval's compute; ``method``: least-squares, through-origin or
    shared-fraction (module docstring)."""

    fixed_s: float
    samples_per_s: float
    jitter: float
    method: str


_NOT_A_DECISION_LOG_HINT = ("; the file is damaged or not a dynamix decision log: point `dynamix sim fit` at the "
                            "--log-dir of a bpslaunch --policy run")


def _corrupt(path: Path, line: int, why: str) -> ConfigurationError:
    return ConfigurationError(f"{path} line {line} is not a decision record ({why}){_NOT_A_DECISION_LOG_HINT}")


def _beyond_range(compute, push_pull, smoothed) -> str | None:
    """What breaks the physical range of a decision's timings (the scheduler's limits), or None."""
    for name, values, limit in (("compute_s", compute, MAX_SECONDS), ("push_pull_s", push_pull, MAX_SECONDS),
                                ("samples_per_s", smoothed, MAX_RATE)):
        for rank, x in enumerate(values):
            if abs(x) > limit:
                return f"{name} {x:g} of rank {rank} is beyond {limit:g}"
    return None


def _finite(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else math.nan


def _newest_run(path: Path, rows: list[dict]) -> list[dict]:
    """``rows`` without those a later decision at the same or an earlier step supersedes, with a
    warning when there were any (a restart from a checkpoint, or a log holding an earlier run)."""
    back = next(((earlier, later) for earlier, later in zip(rows, rows[1:]) if later["step"] <= earlier["step"]), None)
    if back is not None:
        log.warning("%s: its steps go back at line %d (step %d after %d): the job restarted from a checkpoint, or "
                    "this --log-dir holds an earlier run too; the fit keeps the newest decision at each step (give "
                    "each run its own --log-dir)", path, back[1]["line"], back[1]["step"], back[0]["step"])
    return newest_at_each_step(rows, step=operator.itemgetter("step"))


def load_log(run_dir) -> RunLog:
    """Read ``run_dir/decisions.jsonl`` (or that file itself) into a :class:`RunLog`.

    Raises:
        ConfigurationError: the file is missing, is not a regular file (a FIFO, a device), is empty
            or not JSON lines, holds a line that is not a decision record (a field of the wrong type
            or range, bytes that are not UTF-8), a non-finite number (NaN, Infinity, 1e400) or a
            timing beyond the scheduler's physical limits, lacks the per-worker fields, or changes
            its number of workers; the message names the file, the line and the fix.
    """
    path = Path(run_dir)
    try:
        if path.is_dir():  # raises PermissionError for a path in a folder without search permission
            path = path / DECISION_LOG
        numbered = list(read_decisions(path, hint=_NOT_A_DECISION_LOG_HINT))
    except NotRegularFileError as error:  # a FIFO would be read until its writer closed it, /dev/zero without end
        raise ConfigurationError(f"{path} is {error.kind}, not a decision log file: give a run's --log-dir or its "
                                 f"{DECISION_LOG} (save a stream to a file first)") from None
    except FileNotFoundError:
        raise ConfigurationError(
            f"{path} does not exist: record a run with `bpslaunch --policy proportional --log-dir DIR ...` "
            "(any --policy; without one no scheduler writes decisions) and pass DIR") from None
    except OSError as error:
        raise ConfigurationError(f"cannot read {path}: {error}") from None
    rows, previous, last_decision, untimed = [], None, None, set()
    for number, record in numbered:
        try:
            state, w = record.state, record.state["workers"]
            sizes = [int(b) for b in w["batch_size"]]
            compute = [_finite(x) for x in w["compute_s"]]
            push_pull = [_finite(x) for x in w["push_pull_s"]]
            smoothed = [_finite(x) for x in w["samples_per_s"]]
            reports = [int(x) for x in w.get("reports") or [1] * len(sizes)]
            step, decision = record.step, record.decision
            losses = [_finite(x) for x in w.get("loss") or [] if x is not None]
            exposed = [_finite(x) for x in w.get("exposed_comm_s") or [None] * len(sizes)]
            nodes = any(isinstance(node, dict) and ("cpu_util" in node or "rtt_s" in node) for node in w.get("node") or [])
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise _corrupt(path, number, f"missing or malformed field {error}") from None
        n = len(sizes)
        if n == 0 or not len(compute) == len(push_pull) == len(smoothed) == len(reports) == len(exposed) == n:
            raise _corrupt(path, number, "the per-worker lists are empty or of different lengths")
        if (beyond := _beyond_range(compute, push_pull, smoothed)) is not None:
            raise _corrupt(path, number, beyond)
        if rows and n != rows[0]["n"]:
            raise ConfigurationError(f"{path} line {number}: the job changed from {rows[0]['n']} to {n} workers "
                                     "(an elastic run); fit a stretch with a fixed number of workers")
        fresh = previous is None or decision != (last_decision or 0) + 1
        raw = smoothed if fresh else [(t - (1 - THROUGHPUT_SMOOTHING) * p) / THROUGHPUT_SMOOTHING
                                      for t, p in zip(smoothed, previous)]
        # One report per rank: b̂ = θ·compute is exact; several: a mean of ratios, so the assignment.
        batch = [r * c if k == 1 and 0 < r * c < math.inf else b for r, c, b, k in zip(raw, compute, sizes, reports)]
        previous, last_decision = smoothed, decision if isinstance(decision, int) else None
        if not (all(x > 0 for x in compute) and all(x >= 0 for x in push_pull)):  # NaN fails both
            untimed.update(r for r, (c, t) in enumerate(zip(compute, push_pull)) if not (c > 0 and t >= 0))
            continue  # an interval without real timings (a worker that did not compute)
        losses = [x for x in losses if math.isfinite(x)]
        rows.append({"n": n, "line": number, "step": step, "batch": batch, "compute": compute, "push_pull": push_pull,
                     "exposed": exposed, "engine": state.get("engine") or "",
                     "loss": sum(losses) / len(losses) if losses else math.nan,
                     "noise": _finite(state.get("noise_scale")), "nodes": nodes, "record": record})
    rows = _newest_run(path, rows)
    if len(rows) < MIN_INTERVALS:
        raise ConfigurationError(
            f"{path} holds {len(rows)} decision(s) with timings, at least {MIN_INTERVALS} are needed: record a "
            f"longer run (more than {MIN_INTERVALS} x --decision-interval steps) or a smaller --decision-interval"
            + (f"; decisions without a compute time > 0 of rank(s) {sorted(untimed)} were left out" if untimed else ""))
    first = rows[0]["record"]
    w = first.state["workers"]
    try:
        mins = [int(b) for b in w.get("min_batch") or [1]]
        maxes = [int(b) for b in w.get("max_batch") or [] if b]
        initial = first.state.get("initial_batch_sizes") or first.batch_sizes_before or w["batch_size"]
        initial = tuple(int(b) for b in initial)
    except (TypeError, ValueError, OverflowError) as error:
        raise _corrupt(path, rows[0]["line"], f"malformed batch bounds or initial batch sizes ({error})") from None
    datasets = [r["record"].state.get("dataset_size") for r in rows]
    datasets = [int(d) for d in datasets if isinstance(d, int) and d > 0]
    return RunLog(
        path=path,
        steps=np.array([r["step"] for r in rows], dtype=np.int64),
        batch=np.array([r["batch"] for r in rows], dtype=np.float64),
        compute_s=np.array([r["compute"] for r in rows], dtype=np.float64),
        push_pull_s=np.array([r["push_pull"] for r in rows], dtype=np.float64),
        loss=np.array([r["loss"] for r in rows], dtype=np.float64),
        noise_scale=np.array([r["noise"] if r["noise"] > 0 else math.nan for r in rows], dtype=np.float64),
        initial_batch=initial,
        min_batch=max(mins),
        max_batch=min(maxes) if maxes else None,
        dataset_size=max(datasets) if datasets else None,
        node_metrics=any(r["nodes"] for r in rows),
        exposed_comm_s=np.array([r["exposed"] for r in rows], dtype=np.float64),
        engine=rows[-1]["engine"] if len({r["engine"] for r in rows}) == 1 else "",
    )


def _log_sd(residuals: np.ndarray, default: float, params: int = 0) -> float:
    """Standard deviation of log residuals with ``params`` degrees of freedom used; default if < 3 points."""
    r = residuals[np.isfinite(residuals)]
    if r.size < 3:
        return default
    return float(np.sqrt(np.sum((r - r.mean()) ** 2) / max(r.size - max(params, 1), 1)))


def fit_compute(batch, compute_s) -> WorkerFit | None:
    """Least-squares ``compute_s = a + batch/θ`` for one worker (module docstring).

    Args:
        batch: (T,) mean local batches (samples); compute_s: (T,) per-step compute (seconds).

    Returns:
        the fit (``method`` least-squares or through-origin), or None when there are fewer than
        3 points, the batches span less than :data:`MIN_BATCH_SPREAD` of their mean, or the slope
        is below twice its standard error (a and θ not separable; :func:`fit_log` then applies
        the shared fixed share).
    """
    b, c = np.asarray(batch, dtype=np.float64), np.asarray(compute_s, dtype=np.float64)
    if b.size < 3 or (b.max() - b.min()) < MIN_BATCH_SPREAD * b.mean():
        return None
    try:
        slope, intercept = np.polyfit(b, c, 1)
    except np.linalg.LinAlgError:  # timings too extreme for least squares (e.g. 1e308 s)
        return None
    method = "least-squares"
    spread = np.sum((b - b.mean()) ** 2)
    standard_error = math.sqrt(np.sum((c - intercept - slope * b) ** 2) / (b.size - 2) / spread)
    if slope <= 2.0 * standard_error:  # not clearly positive: the batch's effect is lost in the noise
        return None
    # The intercept must be clearly positive too: extrapolated from a narrow span of batches it is
    # mostly noise (±25 ms on a real run whose batches spanned 56-74), so refit through the origin.
    intercept_error = standard_error * math.sqrt(spread / b.size + b.mean() ** 2)
    if intercept <= 2.0 * intercept_error:
        slope, intercept, method = float(np.dot(b, c) / np.dot(b, b)), 0.0, "through-origin"
    fitted = intercept + slope * b
    jitter = _log_sd(np.log(c / fitted), _REF.workers[0].jitter, 1 if method == "through-origin" else 2)
    return WorkerFit(float(intercept), float(1.0 / slope), jitter, method)


def _fit_workers(logs: Sequence[RunLog]) -> list[WorkerFit]:
    b = np.concatenate([log.batch[fitted_rows(log)] for log in logs])
    c = np.concatenate([log.compute_s[fitted_rows(log)] for log in logs])
    fits = [fit_compute(b[:, i], c[:, i]) for i in range(b.shape[1])]
    shares = [f.fixed_s / c[:, i].mean() for i, f in enumerate(fits) if f is not None]
    share = float(np.median(shares)) if shares else 0.0
    out = []
    for i, f in enumerate(fits):
        if f is None:
            mean_c, mean_b = float(c[:, i].mean()), float(b[:, i].mean())
            a, theta = share * mean_c, mean_b / ((1.0 - share) * mean_c)
            jitter = _log_sd(np.log(c[:, i] / (a + b[:, i] / theta)), _REF.workers[0].jitter, 1)
            f = WorkerFit(a, theta, jitter, "shared-fraction")
        out.append(f)
    return out


def own_links(log: RunLog, rows: slice) -> np.ndarray | None:
    """(T, N) each worker's ``exposed_comm_s`` over ``rows`` when ``log`` is of a ``ps`` run that
    logged them all (finite, >= 0, not all zero), else None (module docstring)."""
    if log.engine != "ps" or log.exposed_comm_s is None:
        return None
    own = log.exposed_comm_s[rows]
    if own.size == 0 or not np.all(np.isfinite(own) & (own >= 0)) or not np.all(own.mean(axis=0) > 0):
        return None
    return own


def _fit_links(own: np.ndarray) -> tuple[CommParams, list[float]]:
    """The comm parameters and each worker's link bandwidth (bytes/s) from ``own`` of :func:`own_links`."""
    ref = _REF.comm
    mean = own.mean(axis=0)
    latency = min(ref.latency_s, float(mean.min()) / 2.0)
    jitter = _log_sd(np.log(np.maximum(own, 1e-9) / mean).ravel(), ref.jitter, own.shape[1])
    bandwidths = [2.0 * ref.model_bytes / (m - latency) for m in mean.tolist()]
    return replace(ref, latency_s=latency, bandwidth_bytes_per_s=float(np.median(bandwidths)), jitter=jitter), bandwidths


def _fit_comm(log: RunLog, rows: slice) -> CommParams:
    transfer = log.push_pull_s[rows].min(axis=1)
    mean = max(float(transfer.mean()), 1e-6)
    ref = _REF.comm
    latency = min(ref.latency_s, mean / 2.0)
    jitter = _log_sd(np.log(np.maximum(transfer, 1e-9) / mean), ref.jitter, 1)
    return replace(ref, latency_s=latency, bandwidth_bytes_per_s=2.0 * ref.model_bytes / (mean - latency), jitter=jitter)


def global_batch_spread(logs: Sequence[RunLog]) -> float:
    """Largest over smallest of the runs' median global batches (samples; 1.0 for one run)."""
    medians = [float(np.median(log.batch.sum(axis=1))) for log in logs]
    return max(medians) / min(medians)


def end_loss(losses: Sequence[np.ndarray]) -> float:
    """Where runs ended: each run's mean loss over its last :data:`END_INTERVALS` finite interval
    losses, median over the runs (NaN when no run has a loss). ``losses``: one array per run."""
    ends = [float(np.mean(loss[np.isfinite(loss)][-END_INTERVALS:])) for loss in losses if np.isfinite(loss).any()]
    return float(np.median(ends)) if ends else math.nan


def usable_losses(log: RunLog) -> np.ndarray:
    """``log.loss`` (T,) with NaN where a loss cannot be a point of the learning curve: not finite,
    <= 0 (this positive, cross-entropy-like model cannot hold it), or a spike, more than
    :data:`SPIKE_FACTOR` times the median of the :data:`END_INTERVALS` losses centred on it (one
    record of 1e30 would otherwise set the initial loss of the fit to 1e30)."""
    loss = np.where(np.isfinite(log.loss) & (log.loss > 0), log.loss, np.nan)
    half = END_INTERVALS // 2
    padded = np.pad(loss, half, constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(padded, END_INTERVALS)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN window: no neighbours, no spike
        local = np.nanmedian(windows, axis=1)
        return np.where(loss > SPIKE_FACTOR * local, np.nan, loss)


def learned(logs: Sequence[RunLog]) -> list[bool]:
    """Per run, whether it learned: its positive losses, averaged over :data:`END_INTERVALS`
    consecutive logged intervals, ended at least :data:`LEARNED_DROP` below their first average.
    A run that did not (one that stalled or diverged, from the start or after learning for a
    while, or that logged fewer than ``END_INTERVALS`` positive losses) says nothing of the job's
    learning curve. Each run is judged on its own losses, so one odd run cannot disqualify the
    others."""
    out = []
    for log in logs:
        loss = usable_losses(log)
        loss = loss[np.isfinite(loss)]
        if loss.size < END_INTERVALS:
            out.append(False)
            continue
        smoothed = np.convolve(loss, np.ones(END_INTERVALS) / END_INTERVALS, mode="valid")
        out.append(bool(smoothed[-1] <= (1.0 - LEARNED_DROP) * smoothed[0]))
    return out


def _fit_stats(logs: Sequence[RunLog]) -> StatParams:
    ref = _REF.stats
    logs = [log for log, kept in zip(logs, learned(logs)) if kept]
    if not logs:
        return ref
    losses = [usable_losses(log) for log in logs]
    loss_seen = np.concatenate([loss[np.isfinite(loss)] for loss in losses])
    l0, lmin, target = ref.initial_loss, ref.min_loss, ref.target_loss
    if loss_seen.size:
        l0 = max(l0, float(loss_seen.max()) * 1.05)
        lmin = min(lmin, float(loss_seen.min()) * 0.5)
        target = end_loss(losses)  # within (lmin, l0): a mean of losses seen, inside the margins above
    stats = replace(ref, initial_loss=l0, min_loss=lmin, target_loss=target)
    xs = [np.log((l0 - lmin) / (loss - lmin)) for loss in losses]  # NaN where no loss
    x, noise = np.concatenate(xs), np.concatenate([log.noise_scale for log in logs])
    ok = np.isfinite(x) & np.isfinite(noise)
    if ok.sum() >= 1:
        gamma = ref.noise_growth
        if ok.sum() >= 3 and np.ptp(x[ok]) > 0.05:
            gamma = float(np.clip(np.polyfit(x[ok], np.log(noise[ok]), 1)[0], 0.0, 3.0))
        log_b0 = float(np.mean(np.log(noise[ok]) - gamma * x[ok]))
        spread = _log_sd(np.log(noise[ok]) - gamma * x[ok] - log_b0, ref.noise_scale_noise, 2)
        stats = replace(stats, noise_scale=math.exp(log_b0), noise_growth=gamma, noise_scale_noise=spread)

    # Per run: steps in each interval, global batch, ln x without NaN (what every candidate law reuses).
    runs = [(log, np.diff(log.steps, prepend=0).astype(np.float64), log.batch.sum(axis=1), x_log, np.nan_to_num(x_log))
            for log, x_log in zip(logs, xs)]

    def progress(factor: float, growth: float, measured: bool) -> tuple[np.ndarray, np.ndarray]:
        """Noise-free steps E at each interval's middle and ln x, pooled over the runs, when the
        B_noise that sets progress is ``factor · B0 · x^growth`` (B0 of the measured law), or the
        measurement itself where there is one (``measured``)."""
        e_all, x_all = [], []
        for log, gaps, m, x_log, x_known in runs:
            b_noise = factor * stats.noise_scale * np.exp(growth * x_known)
            if measured:
                b_noise = np.where(np.isfinite(log.noise_scale), log.noise_scale, b_noise)
            d_eff = gaps * m / (m + b_noise)
            e_mid = np.cumsum(d_eff) - d_eff / 2.0  # a line's loss is its interval's mean
            use = np.isfinite(x_log) & (x_log > 0) & (e_mid > 0)
            e_all.append(e_mid[use])
            x_all.append(x_log[use])
        return np.concatenate(e_all), np.concatenate(x_all)

    # ln x = E/τ through the origin; runs at different global batches also choose the law of the
    # B_noise that sets progress: the one that puts all their losses on that line.
    calibrate = global_batch_spread(logs) >= MIN_GLOBAL_BATCH_SPREAD
    laws = [(float(f), float(g)) for f in NOISE_SCALE_FACTORS for g in NOISE_GROWTHS] if calibrate \
        else [(1.0, stats.noise_growth)]
    best = None
    for factor, growth in laws:
        e, x_use = progress(factor, growth, measured=not calibrate)
        if e.size < 2:
            continue
        for tail in LOSS_TAILS:
            curve = _loss_curve(e, x_use, tail)
            if curve is not None and (best is None or curve[0] < best[0]):
                best = (curve[0], factor, growth, tail, curve[1])
    if best is None:
        return stats
    _, factor, growth, tail, tau = best
    if not calibrate:
        return replace(stats, steps_scale=tau, loss_tail=tail)
    return replace(stats, steps_scale=tau, loss_tail=tail, noise_scale=factor * stats.noise_scale, noise_growth=growth,
                   measured_noise_scale=stats.noise_scale, measured_noise_growth=stats.noise_growth)


def _loss_curve(e: np.ndarray, log_x: np.ndarray, tail: float | None) -> tuple[float, float] | None:
    """``(squared error of ln x, τ)`` of the loss law with ``tail`` through the points ``(E, ln x)``;
    None when no positive τ fits. τ by least squares through the origin on the law made linear,
    ``z = E/τ`` with ``z = ln x`` (exponential) or ``α·(x^(1/α) − 1)``; every law is then judged
    by its error in ln x, so that the tails compare."""
    z = log_x if tail is None else tail * np.expm1(log_x / tail)
    inverse_tau = float(np.dot(e, z) / np.dot(e, e))
    if not inverse_tau > 0:
        return None
    predicted = -np.log(loss_remaining(e * inverse_tau, tail))
    return float(np.sum((log_x - predicted) ** 2)), 1.0 / inverse_tau


def fitted_rows(log: RunLog) -> slice:
    """The intervals fitted and replayed: all but the first (warm-up) when at least 4 were recorded."""
    return slice(1, None) if len(log.steps) >= 4 else slice(None)


def check_same_job(log: RunLog, timings: Sequence[RunLog]) -> None:
    """Raise :class:`ConfigurationError` unless every log of ``timings`` is another run of ``log``'s
    job: the same worker count and engine, and neither ``log`` itself nor a log given twice (its
    intervals would count twice in the compute fit)."""
    seen = {log.path.resolve()}
    for other in timings:
        if other.path.resolve() in seen:
            raise ConfigurationError(f"{other.path} is given twice (or is RUN_DIR's own log); give each other run once")
        seen.add(other.path.resolve())
        workers, engine = other.batch.shape[1], other.engine
        if workers != log.batch.shape[1] or engine != log.engine:
            raise ConfigurationError(f"{other.path} is a run of another job ({workers} workers, engine "
                                     f"{engine or 'not logged'}; {log.path}: {log.batch.shape[1]} workers, engine "
                                     f"{log.engine or 'not logged'}); give runs of the same job")


def fit_log(log: RunLog, calibration: Sequence[RunLog] = (),
            timings: Sequence[RunLog] = ()) -> tuple[SimParams, list[WorkerFit]]:
    """The fitted :class:`SimParams` of ``log`` and the per-worker fits (module docstring).

    ``calibration``: decision logs of the same model and data at other global batches; their losses
    join ``log``'s in the noise-scale and loss model (the timings come from ``log`` alone).
    ``timings``: decision logs of the same job (workers, scenario) at other batches; their
    intervals join ``log``'s in each worker's compute fit, so batches that span more separate
    ``a_i`` from ``θ_i`` (a ``proportional`` run alone moved a fast worker only between 56 and 74).

    Raises:
        ConfigurationError: ``timings`` that :func:`check_same_job` refuses.
    """
    check_same_job(log, timings)
    rows = fitted_rows(log)
    workers = _fit_workers([log, *timings])
    ref = _REF
    min_batch = max(1, min(log.min_batch, *log.initial_batch))  # per-worker bounds may not hold every start
    max_batch = max(log.max_batch or ref.max_batch, *log.initial_batch)
    gaps = np.diff(log.steps)
    k = int(np.median(gaps)) if gaps.size and np.median(gaps) >= 1 else ref.decision_interval
    own = own_links(log, rows)
    comm, links = _fit_links(own) if own is not None else (_fit_comm(log, rows), [None] * len(workers))
    params = SimParams(
        workers=tuple(WorkerParams(fixed_s=f.fixed_s, samples_per_s=f.samples_per_s, jitter=f.jitter,
                                   bandwidth_bytes_per_s=link) for f, link in zip(workers, links)),
        initial_batch=log.initial_batch,
        min_batch=min_batch,
        max_batch=max_batch,
        decision_interval=k,
        max_decisions=ref.max_decisions,
        dataset_size=log.dataset_size or ref.dataset_size,
        node_metrics=log.node_metrics,
        comm=comm,
        stats=_fit_stats([log, *calibration]),
        scenario=f"fit:{log.path.parent.name}",
        engine="ps" if own is not None else "ring",
    )
    return params, workers


def fit_run(run_dir, *calibration_dirs) -> SimParams:
    """:class:`SimParams` fitted to the run in ``run_dir`` (module docstring), the statistics
    calibrated with the runs in ``calibration_dirs`` too.

    Raises:
        ConfigurationError: no usable ``decisions.jsonl`` (see :func:`load_log`).
    """
    return fit_log(load_log(run_dir), [load_log(d) for d in calibration_dirs])[0]


def replay(params: SimParams, log: RunLog) -> list[dict]:
    """Replay the recorded batches through ``params`` without jitter; per-worker comparison.

    For each recorded interval t the simulator's nominal times at the batches actually run,
    ``ĉ_ti = a_i + b̂_ti/θ_i`` and ``T̂_t = Simulator.nominal_step_s(b̂_t)`` (``max_i ĉ_ti`` + comm),
    are compared with the recorded interval means: compute ``c_ti`` and step ``c_ti + push_pull_ti``
    (every worker's step lasts the whole synchronous step, waiting included, so all are compared
    with the one simulated ``T̂_t``). Means are over the intervals of :func:`fitted_rows`.

    Returns:
        one dict per rank: ``rank``, ``fixed_s``, ``samples_per_s``, ``recorded_compute_s``,
        ``simulated_compute_s``, ``recorded_step_s``, ``simulated_step_s`` (seconds) and
        ``step_error``, ``compute_error`` (simulated / recorded − 1).
    """
    if log.batch.shape[1] != params.num_workers:
        raise ConfigurationError(f"{log.path} has {log.batch.shape[1]} workers, the parameters {params.num_workers}")
    rows = fitted_rows(log)
    batch, compute, step = log.batch[rows], log.compute_s[rows], log.step_s[rows]
    sim = Simulator(params)
    sim_t = float(np.mean([sim.nominal_step_s(b) for b in batch]))
    out = []
    for i, w in enumerate(params.workers):
        sim_c = float(np.mean(w.fixed_s + batch[:, i] / w.samples_per_s))
        rec_c, rec_t = float(compute[:, i].mean()), float(step[:, i].mean())
        out.append({"rank": i, "fixed_s": w.fixed_s, "samples_per_s": w.samples_per_s,
                    "recorded_compute_s": rec_c, "simulated_compute_s": sim_c, "compute_error": sim_c / rec_c - 1.0,
                    "recorded_step_s": rec_t, "simulated_step_s": sim_t, "step_error": sim_t / rec_t - 1.0})
    return out
