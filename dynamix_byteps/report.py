"""``dynamix report RUN_DIR``: PNG plots and a summary table from a run's TensorBoard events.

Reads ``RUN_DIR/tensorboard/worker-<rank>/`` and ``RUN_DIR/tensorboard/scheduler/`` (written
by :mod:`dynamix_byteps.tensorboard_scalars` when the job ran with ``bpslaunch --log-dir RUN_DIR``, or
its workers with ``DYNAMIX_LOG_DIR=RUN_DIR`` and its scheduler with ``--run-dir RUN_DIR`` under torchrun) with
tensorboard's ``EventAccumulator`` and writes, with matplotlib's Agg canvas:

- ``batch_size.png``: each worker's local batch size against wall time, and the global batch
  (the sum over workers of their reported means, and the one each decision assigned); each
  decision of the scheduler's log (``RUN_DIR/decisions.jsonl``, when the run had a ``--policy``)
  is a tick at the top of both panels, and one that changed the assignment also a dotted
  vertical line;
- ``loss_accuracy.png``: training loss per worker, and the ``*loss`` / ``*accuracy`` tags the
  script logged with ``bps.log_scalar`` (e.g. ``test/accuracy``), against wall time;
- ``step_time.png``: each worker's step time (solid) and push_pull time (dashed).

Wall time is seconds since the earliest event of the run (a worker's event file is created
when its ``DistributedOptimizer`` is). The table gives per worker the means over report
intervals of the local batch, the compute-only throughput θ_i, the step time and the push_pull
time, and for the job its wall time, steps, and the final logged accuracy and losses; with a
decision log, the number of decisions and changes and the mean global batch assigned over the
first and the last third of the decisions (did the policy go large early and small late, or the
reverse?).

Where a series' steps go back (a restart from a checkpoint, or a --log-dir that holds an earlier
run too), the report keeps the newest event at each step and warns, as TensorBoard purges the
events a restart orphaned; the wall time still spans every event file. Where the decisions' number
of workers changes (``bpslaunch --restart-on-failure`` going on with fewer workers), each decision
keeps its own, both plots of ``batch_size.png`` draw a solid line labelled 'N → M workers' at the
first decision of the new size, the table says so, and the reported global batch sums the workers
of the job at each step.

A worker's first interval is warm-up: its first step's compute time also holds what ran between
creating the optimizer and that step (the parameter broadcast, the loader's start), so the step
time plot and the table's means leave it out when there are later intervals.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dynamix_byteps.atomic import atomic_write
from dynamix_byteps.control.cluster import DECISION_LOG
from dynamix_byteps.control.decision_record import newest_at_each_step, read_decisions_lenient
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.extras import import_extra
from dynamix_byteps.regular_files import NotRegularFileError, check_regular
from dynamix_byteps.tensorboard_scalars import SCHEDULER_RUN, TENSORBOARD_DIR, WORKER_RUN_PREFIX

log = logging.getLogger(__name__)


class RunDirError(ConfigurationError):
    """RUN_DIR holds no readable per-worker TensorBoard scalars; the message says how to record them."""


@dataclass(frozen=True)
class Series:
    """One tag's events, in file order: ``step`` int64, ``wall`` float64 (seconds since the
    run's start) and ``value`` float64 arrays of equal length."""

    step: np.ndarray
    wall: np.ndarray
    value: np.ndarray


@dataclass(frozen=True)
class Decisions:
    """The scheduler's decisions, in log order: ``wall`` float64 (seconds since the run's start),
    ``step`` int64 (the step decided at), ``batch`` int64 (T, N) local batches assigned (N: the
    most workers any decision had; 0 for the ranks a decision of fewer workers does not have),
    ``workers`` int64 (T,) each decision's number of workers, ``changed`` bool (the assignment
    differs from the one before)."""

    wall: np.ndarray
    step: np.ndarray
    batch: np.ndarray
    workers: np.ndarray
    changed: np.ndarray

    @property
    def global_batch(self) -> np.ndarray:
        """(T,) global batch each decision assigned (samples)."""
        return self.batch.sum(axis=1)

    @property
    def resized(self) -> np.ndarray:
        """Indices of the decisions whose number of workers differs from the one before (an elastic
        restart on fewer workers, or a run dir that holds a run of another size too)."""
        return np.flatnonzero(np.diff(self.workers)) + 1

    def workers_at(self, steps: np.ndarray) -> np.ndarray:
        """(S,) the number of workers at each of ``steps`` (int64, increasing): that of the newest
        decision at or before the step, of the first decision before it."""
        newest = np.searchsorted(self.step, steps, side="right") - 1
        return self.workers[np.maximum(newest, 0)]


@dataclass
class RunData:
    """A run's scalars: ``workers[rank][tag]``, ``scheduler[tag]``; ``start``: wall time (seconds
    since the Unix epoch) of its workers' earliest event; ``end``: seconds from ``start`` to its last event;
    ``decisions``: the scheduler's decision log, None without one."""

    workers: dict[int, dict[str, Series]] = field(default_factory=dict)
    scheduler: dict[str, Series] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    decisions: Decisions | None = None

    @property
    def size(self) -> int:
        """The job's workers as far as the run shows them: its highest rank with scalars + 1, or
        the decisions' worker count when larger."""
        seen = [rank + 1 for rank in self.workers] + ([self.decisions.batch.shape[1]] if self.decisions else [])
        return max(seen, default=0)

    @property
    def missing_workers(self) -> list[int]:
        """Ranks of the job (:attr:`size`) without a ``batch_size`` series."""
        return [rank for rank in range(self.size) if "batch_size" not in self.workers.get(rank, {})]


def _event_accumulator():
    """tensorboard's event reader. tensorboard imports TensorFlow (seconds, and log noise) when it
    is installed; unless the process already has it, select tensorboard's TF-free stub the way
    its own ``no_tensorflow`` build does: a ``tensorboard.compat.notf`` module (see
    ``tensorboard.compat.tf``)."""
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    event_accumulator = import_extra("tensorboard.backend.event_processing.event_accumulator", "report",
                                     "reading a run's TensorBoard scalars")

    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # one INFO line per file read

    return event_accumulator


def _is_run(folder: Path) -> bool:
    """Whether ``folder`` holds a recorded run (its ``tensorboard`` directory)."""
    return (folder / TENSORBOARD_DIR).is_dir()


def _tensorboard_dir(run_dir: Path) -> Path:
    """``RUN_DIR/tensorboard``, or RUN_DIR itself when it is that directory."""
    return run_dir / TENSORBOARD_DIR if _is_run(run_dir) else run_dir


def _runs_below(folder: Path) -> str:
    """`` (runs below it: A, B)`` naming the subfolders that hold a recorded run (a benchmark's
    configuration folder holds one run per seed), else empty."""
    runs = sorted(p.name for p in folder.iterdir() if _is_run(p)) if folder.is_dir() else []
    return f" (runs below it: {', '.join(runs[:8])}{', ...' if len(runs) > 8 else ''}; report one of them)" if runs else ""


def _no_events(run_dir: Path, why: str) -> RunDirError:
    return RunDirError(
        f"{run_dir} {why}; expected TensorBoard event files in "
        f"{run_dir / TENSORBOARD_DIR / (WORKER_RUN_PREFIX + '<rank>')}/events.out.tfevents.*. "
        f"Record a run with `bpslaunch --log-dir {run_dir} ... -- python train.py`, or under torchrun with "
        f"DYNAMIX_LOG_DIR={run_dir} in the workers' environment (and `dynamix scheduler --run-dir {run_dir}` "
        "for the decisions); the workers write their scalars every --decision-interval steps and when training ends. Then run "
        "`dynamix report` on it"
    )


def _check_event_files(folder: Path) -> None:
    """Refuse a FIFO or a device in ``folder`` named as an event file, which tensorboard would open
    and read until a writer closed it (for ever without one); a folder so named is left to
    tensorboard, which finds no event in it."""
    for path in folder.iterdir():
        if "tfevents" in path.name and not path.is_dir():
            try:
                check_regular(path)
            except NotRegularFileError as error:
                raise RunDirError(f"{error}: remove it; the report reads TensorBoard event files") from None


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read every scalar of the run, and its decision log (:func:`load_decisions`).

    Raises:
        RunDirError: ``run_dir`` is not a directory or has no per-worker scalars; an event file or
            the decision log is not a regular file (a FIFO) or cannot be read.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise _no_events(run_dir, "is not a directory")
    tb_dir = _tensorboard_dir(run_dir)
    ea = _event_accumulator()
    raw: dict[str, tuple[float, dict[str, list]]] = {}
    unreadable = []  # worker/scheduler folders without a readable event (no event file, empty or damaged)
    for path in sorted(tb_dir.iterdir()):
        name = path.name
        is_worker = name.startswith(WORKER_RUN_PREFIX) and name[len(WORKER_RUN_PREFIX):].isdigit()
        if not path.is_dir() or not (is_worker or name == SCHEDULER_RUN):
            continue
        _check_event_files(path)
        acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0})
        try:
            acc.Reload()
            first = acc.FirstEventTimestamp()
        except (ValueError, OSError):  # an empty or damaged event file, or a folder in its place
            unreadable.append(path.name)
            continue
        raw[name] = (first, {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]})
    if not any(name.startswith(WORKER_RUN_PREFIX) and tags for name, (_, tags) in raw.items()):
        why = ("has no TensorBoard scalars of any worker yet"
               + (f" (no readable event in {', '.join(unreadable)}: missing, empty or damaged)" if unreadable else "")
               if raw else
               f"has no readable TensorBoard event in {', '.join(unreadable)} (event files missing, empty or damaged)"
               if unreadable else
               "has no TensorBoard event files" + _runs_below(run_dir))
        raise _no_events(run_dir, why)
    if unreadable:
        log.warning("%s: no readable TensorBoard event in %s (event files missing, empty or damaged); the report "
                    "leaves them out", run_dir, ", ".join(unreadable))
    # The job starts with its first worker: a scheduler started by hand earlier opened its event
    # file at its own start, which would count the wait for the workers as the job's time.
    start = min(first for name, (first, tags) in raw.items() if name.startswith(WORKER_RUN_PREFIX) and tags)
    data = RunData(start=start)
    went_back = []
    for name, (_, tags) in raw.items():
        newest = {tag: newest_at_each_step(events) for tag, events in tags.items()}
        if any(len(kept) < len(tags[tag]) for tag, kept in newest.items()) and name != SCHEDULER_RUN:
            went_back.append(name[len(WORKER_RUN_PREFIX):])
        series = {tag: Series(np.array([e.step for e in events], dtype=np.int64),
                              np.array([e.wall_time - start for e in events], dtype=np.float64),
                              np.array([e.value for e in events], dtype=np.float64))
                  for tag, events in newest.items() if events}
        data.end = max([data.end] + [float(s.wall[-1]) for s in series.values()])
        if name == SCHEDULER_RUN:
            data.scheduler = series
        else:
            data.workers[int(name[len(WORKER_RUN_PREFIX):])] = series
    data.workers = dict(sorted(data.workers.items()))
    if went_back:
        log.warning("%s: the steps of worker %s go back: the job restarted from a checkpoint, or this --log-dir "
                    "holds an earlier run too; the report keeps the newest events at each step, as TensorBoard "
                    "does after a restart (give each run its own --log-dir)", run_dir, ", ".join(sorted(went_back, key=int)))
    data.decisions = load_decisions(run_dir, start)
    if missing := data.missing_workers:
        log.warning("%s: no batch sizes of worker %s (of %d workers; a multi-host run keeps each host's scalars in "
                    "its own --log-dir unless that folder is shared: copy their tensorboard/worker-<rank> folders "
                    "here); the report leaves them out and draws no reported global batch", run_dir,
                    ", ".join(map(str, missing)), data.size)
    return data


def load_decisions(run_dir: str | os.PathLike, start: float) -> Decisions | None:
    """``RUN_DIR/decisions.jsonl`` relative to ``start`` (seconds since the Unix epoch, see
    :class:`RunData`); None when the run has no decision log (no ``--policy``) or no decision
    with a time and batch sizes. Damaged lines are skipped with a warning (a run still going
    may end with half a line). Each decision keeps its own number of workers (an elastic restart
    goes on with fewer, see :attr:`Decisions.resized`).

    Raises:
        RunDirError: the log is not a regular file (a FIFO, a folder) or cannot be read.
    """
    path = Path(run_dir) / DECISION_LOG
    try:
        logged = read_decisions_lenient(path)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise RunDirError(f"cannot read the decision log: {error}") from None
    records = newest_at_each_step([r for r in logged if r.time is not None and r.batch_sizes])
    if not records:
        return None
    workers = np.array([len(r.batch_sizes) for r in records], dtype=np.int64)
    batch = np.zeros((len(records), workers.max()), dtype=np.int64)
    for row, record in zip(batch, records):
        row[:len(record.batch_sizes)] = record.batch_sizes
    before = [r.batch_sizes_before or r.batch_sizes for r in records]
    changed = np.array([list(b) != list(r.batch_sizes) for b, r in zip(before, records)], dtype=bool)
    return Decisions(np.array([r.time - start for r in records], dtype=np.float64),
                     np.array([r.step for r in records], dtype=np.int64), batch, workers, changed)


# ---- the table ----------------------------------------------------------------------------------


def _after_warmup(s: Series) -> Series:
    """``s`` without its first interval (see the module docstring), unless that is all it has."""
    return Series(s.step[1:], s.wall[1:], s.value[1:]) if len(s.value) > 1 else s


def _mean(series: dict[str, Series], tag: str) -> float:
    s = series.get(tag)
    return float(np.mean(_after_warmup(s).value)) if s is not None and len(s.value) else math.nan


def _last_logged(data: RunData, keyword: str, exclude: str | None = None) -> tuple[str, float] | None:
    """The newest value of the first tag containing ``keyword`` (rank 0 first), and its tag."""
    for rank in data.workers:
        for tag in sorted(data.workers[rank]):
            if keyword in tag and tag != exclude:
                return f"{tag} (worker {rank})", float(data.workers[rank][tag].value[-1])
    return None


def summary(data: RunData) -> tuple[list[dict], dict]:
    """Per-worker rows (``rank, batch_size, samples_per_s, step_s, push_pull_s, intervals``: means over
    report intervals after the first, in samples, samples/s and seconds) and the job's figures (``wall_s``,
    ``steps``, ``final_train_loss``: the mean of the workers' last ``loss``, and the newest
    logged accuracy and test loss when any; ``rhythm``: :func:`rhythm` of the decisions, or None)."""
    rows = []
    for rank, series in data.workers.items():
        rows.append({"rank": rank, "batch_size": _mean(series, "batch_size"),
                     "samples_per_s": _mean(series, "samples_per_s"), "step_s": _mean(series, "step_s"),
                     "push_pull_s": _mean(series, "push_pull_s"),
                     "intervals": max((len(s.value) for s in series.values()), default=0)})
    steps = max((int(s.step.max()) for series in data.workers.values() for s in series.values()), default=0)
    last_losses = [float(s["loss"].value[-1]) for s in data.workers.values() if "loss" in s]
    job = {"wall_s": data.end, "steps": steps,
           "final_train_loss": float(np.mean(last_losses)) if last_losses else None,
           "accuracy": _last_logged(data, "accuracy"), "test_loss": _last_logged(data, "loss", exclude="loss"),
           "rhythm": rhythm(data.decisions) if data.decisions is not None else None}
    return rows, job


def rhythm(decisions: Decisions) -> dict:
    """``decisions``, ``changes``, and the mean global batch assigned over the first and the last
    third of the decisions (``early_global_batch``, ``late_global_batch``, samples; a third holds at
    least one decision); ``resized``: ``(step, workers before, workers after)`` of each decision whose
    number of workers changed, when any."""
    g = decisions.global_batch.astype(np.float64)
    third = max(1, len(g) // 3)
    out = {"decisions": len(g), "changes": int(decisions.changed.sum()),
           "early_global_batch": float(g[:third].mean()), "late_global_batch": float(g[-third:].mean())}
    if len(decisions.resized):
        out["resized"] = [(int(decisions.step[i]), int(decisions.workers[i - 1]), int(decisions.workers[i]))
                          for i in decisions.resized]
    return out


def format_summary(rows: list[dict], job: dict) -> str:
    """The table ``dynamix report`` prints."""
    def num(x, fmt):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    lines = [f"{'worker':>6} {'mean batch':>10} {'mean θ (samples/s)':>18} {'mean step (ms)':>14} "
             f"{'mean push_pull (ms)':>19} {'intervals':>9}"]
    for r in rows:
        lines.append(f"{r['rank']:>6} {num(r['batch_size'], '.1f'):>10} {num(r['samples_per_s'], '.1f'):>18} "
                     f"{num(r['step_s'] * 1e3, '.1f'):>14} {num(r['push_pull_s'] * 1e3, '.1f'):>19} "
                     f"{r['intervals']:>9}")
    lines.append("")
    lines.append(f"job: {job['wall_s']:.1f} s wall time, {job['steps']} steps, "
                 f"last training loss (mean of the workers' last logged steps) {num(job['final_train_loss'], '.4f')}")
    for key, what in (("accuracy", "final accuracy"), ("test_loss", "final logged loss")):
        if job[key] is not None:
            tag, value = job[key]
            lines.append(f"{what}: {value:.4f} ({tag})")
        elif key == "accuracy":
            lines.append("final accuracy: not logged (call bps.log_scalar('test/accuracy', value) in the script; "
                         "if it does, rank 0's event file may be cut short)")
    r = job.get("rhythm")
    if r is not None:
        early, late = r["early_global_batch"], r["late_global_batch"]
        trend = "larger late" if late > 1.05 * early else "smaller late" if late < early / 1.05 else "about the same"
        lines.append(f"decisions: {r['decisions']} ({r['changes']} changed the batch sizes); global batch assigned: "
                     f"{early:.0f} over the first third, {late:.0f} over the last ({trend})")
        for step, before, after in r.get("resized", ()):
            lines.append(f"workers: {before} -> {after} from the decision at step {step} (an elastic restart, or "
                         "this --log-dir holds a run of another size too); each decision counts its own workers")
    return "\n".join(lines)


# ---- the plots ----------------------------------------------------------------------------------


def _figure(ncols: int = 1):
    FigureCanvasAgg = import_extra("matplotlib.backends.backend_agg", "report", "drawing the report's plots").FigureCanvasAgg
    Figure = import_extra("matplotlib.figure", "report", "drawing the report's plots").Figure

    fig = Figure(figsize=(6.4 * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _save(fig, path: Path) -> Path:
    """Write the PNG atomically, so a reader never sees half of one."""
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    return path


def _per_worker(ax, data: RunData, tag: str, warmup: bool = True, **style) -> None:
    for rank, series in data.workers.items():
        if tag in series:
            s = series[tag] if warmup else _after_warmup(series[tag])
            ax.plot(s.wall, s.value, label=f"worker {rank}", color=f"C{rank % 10}", **style)


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


#: ``gid`` of the artists marking decisions: every decision, those that changed the assignment, and
#: those whose number of workers differs from the one before (:attr:`Decisions.resized`).
DECISION_TICKS, DECISION_CHANGES, WORKER_COUNT_CHANGES = "decision-ticks", "decision-changes", "worker-count-changes"


def _mark_decisions(ax, decisions: Decisions | None) -> None:
    """A tick at the top of ``ax`` per decision; a dotted vertical line per change; a solid one,
    labelled 'N → M workers', at each decision whose number of workers changed."""
    if decisions is None:
        return
    for i in decisions.resized:
        ax.axvline(decisions.wall[i], color="C3", linewidth=1.2, gid=WORKER_COUNT_CHANGES)
        ax.text(decisions.wall[i], 0.5, f" {decisions.workers[i - 1]} → {decisions.workers[i]} workers ",
                transform=ax.get_xaxis_transform(), rotation=90, va="center", ha="right", fontsize="small", color="C3")
    ax.plot(decisions.wall, np.ones(len(decisions.wall)), linestyle="none", marker="|", markersize=9, color="0.3",
            transform=ax.get_xaxis_transform(), clip_on=False, gid=DECISION_TICKS, label="decision")
    changes = decisions.wall[decisions.changed]
    if len(changes):
        ax.vlines(changes, 0, 1, transform=ax.get_xaxis_transform(), colors="0.5", linestyles=":", linewidth=0.8,
                  gid=DECISION_CHANGES)


def global_batch_reported(data: RunData) -> Series | None:
    """Sum over the job's workers of the reported mean local batch at the report steps every one
    of them has (``wall``: the latest worker's time of that step). The job at a step is ranks
    ``0..n-1``, ``n`` the decisions' number of workers there (:meth:`Decisions.workers_at`; an
    elastic restart goes on with fewer), else every worker. None when a worker has no
    ``batch_size`` scalar (:attr:`RunData.missing_workers`): the others' sum is not the global batch."""
    if not data.workers or data.missing_workers:
        return None
    series = [s["batch_size"] for s in data.workers.values()]  # ranks 0, 1, ...: none is missing
    steps = np.unique(np.concatenate([s.step for s in series]))
    size = data.decisions.workers_at(steps) if data.decisions is not None else np.full(len(steps), len(series))
    in_job = np.arange(len(series))[:, None] < size  # (ranks, steps)
    has = np.array([np.isin(steps, s.step) for s in series])
    every = np.all(has | ~in_job, axis=0)
    steps, in_job = steps[every], in_job[:, every]
    picks = [np.minimum(np.searchsorted(s.step, steps), len(s.step) - 1) for s in series]  # steps increase
    value = np.sum([np.where(job, s.value[i], 0.0) for s, i, job in zip(series, picks, in_job)], axis=0)
    wall = np.max([np.where(job, s.wall[i], -np.inf) for s, i, job in zip(series, picks, in_job)], axis=0)
    return Series(steps, wall, value)


def batch_figure(data: RunData):
    """The figure of ``batch_size.png`` (module docstring): axes 0 local batches, 1 global batch."""
    decisions = data.decisions
    fig, (local, total) = _figure(2)
    _per_worker(local, data, "batch_size", drawstyle="steps-pre", marker=".")
    reported = global_batch_reported(data)
    if reported is not None:
        total.plot(reported.wall, reported.value, drawstyle="steps-pre", marker=".", color="black",
                   label="reported (sum of the workers' means)")
    if decisions is not None:
        total.plot(decisions.wall, decisions.global_batch, drawstyle="steps-post", color="C3", alpha=0.8,
                   label="assigned by the decisions")
    for ax in (local, total):
        _mark_decisions(ax, decisions)
        ax.set_ylim(bottom=0)
    _finish(local, "Local batch size per worker (mean per report interval)", "samples")
    _finish(total, "Global batch over time (ticks: decisions; dotted: changes)", "samples")
    return fig


def plot_batch_sizes(data: RunData, path: Path) -> Path:
    return _save(batch_figure(data), path)


def loss_accuracy_figure(data: RunData):
    """The figure of ``loss_accuracy.png``: axes 0 loss, 1 accuracy; an empty one says what logs it."""
    fig, (loss_ax, acc_ax) = _figure(2)
    _per_worker(loss_ax, data, "loss", alpha=0.7)
    for rank, series in data.workers.items():
        for tag in sorted(series):
            s = series[tag]
            if "loss" in tag and tag != "loss":
                loss_ax.plot(s.wall, s.value, marker="o", color="black", label=f"{tag} (worker {rank})")
            if "accuracy" in tag:
                acc_ax.plot(s.wall, s.value, marker="o", label=f"{tag} (worker {rank})")
    if not loss_ax.lines:
        loss_ax.text(0.5, 0.5, "no loss reported: call bps.report_loss(loss) each step\n"
                     "(Keras model.fit: add callbacks.BatchSizeCallback())",
                     ha="center", va="center", transform=loss_ax.transAxes)
    _finish(loss_ax, "Loss", "loss")
    if not acc_ax.lines:
        acc_ax.text(0.5, 0.5, "no accuracy logged:\ncall bps.log_scalar('test/accuracy', value)",
                    ha="center", va="center", transform=acc_ax.transAxes)
    _finish(acc_ax, "Accuracy", "accuracy")
    return fig


def plot_loss_accuracy(data: RunData, path: Path) -> Path:
    return _save(loss_accuracy_figure(data), path)


def plot_step_times(data: RunData, path: Path) -> Path:
    fig, (ax,) = _figure()
    _per_worker(ax, data, "step_s", warmup=False)
    for rank, series in data.workers.items():
        if "push_pull_s" in series:
            s = _after_warmup(series["push_pull_s"])
            ax.plot(s.wall, s.value, linestyle="--", color=f"C{rank % 10}", alpha=0.7)
    _finish(ax, "Step time per worker (dashed: push_pull; after warm-up)", "seconds per step")
    return _save(fig, path)


PLOTS = {"batch_size.png": plot_batch_sizes, "loss_accuracy.png": plot_loss_accuracy,
         "step_time.png": plot_step_times}


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> tuple[list[Path], str]:
    """Draw :data:`PLOTS` into ``out_dir`` (default ``run_dir``) and return their paths and the table.

    Raises:
        RunDirError: no per-worker scalars in ``run_dir``.
        OSError: ``out_dir`` cannot be created or written.
    """
    data = load_run(run_dir)
    out = Path(out_dir if out_dir is not None else run_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [draw(data, out / name) for name, draw in PLOTS.items()]
    return paths, format_summary(*summary(data))
