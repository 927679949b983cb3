"""TensorBoard scalars of a run: event files in TensorBoard's format, written without torch or TensorFlow.

The run directory is ``bpslaunch --log-dir DIR`` (workers get it as ``DYNAMIX_LOG_DIR``, the
scheduler as ``--run-dir``). Layout::

    DIR/tensorboard/worker-<rank>/events.out.tfevents.*    one directory per worker
    DIR/tensorboard/scheduler/events.out.tfevents.*        the scheduler's decisions

View it with ``tensorboard --logdir DIR/tensorboard`` (each worker is a run, so one chart
overlays all workers), or draw PNGs with ``dynamix report DIR``. Without a run directory
nothing is created and every call returns at once.

Worker tags, one value per report interval (``decision_interval`` steps), x = global step (steps
completed), wall time = end of the interval (see :data:`WORKER_TAGS`). Users add their own with
:func:`log_scalar` (e.g. ``test/accuracy``). Scheduler tags, one value per decision, x = the
decision's step: ``batch_size/worker-<rank>`` (assigned local batch), ``global_batch``,
``lr_scale``, ``predicted_gain``, ``noise_scale``, ``reward/<term>`` and ``terms/<term>`` (the
policy's numeric terms; nested dicts joined with ``/``, lists left out).

Writing: tensorboard's own ``RecordWriter`` (the TFRecord framing with CRCs) and ``Event``
protos, synchronously, one event per interval or decision, flushed to the operating system at
once, so a crashed process loses nothing it had written (no fsync: a power cut may). Not
tensorboardX: its ``SummaryWriter`` imports torch when installed (the scheduler grew from 48 to
234 MB and took 2.6 s more to start) and its ``flush`` fsyncs but leaves queued events
unwritten; not tensorboard's ``EventFileWriter``: it imports TensorFlow when installed.
Writers are closed by ``bps.shutdown()``, the scheduler's stop, or at exit.
"""

from __future__ import annotations

import atexit
import itertools
import math
import numbers
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

from dynamix_byteps.extras import MissingExtraError, import_extra

LOG_DIR_ENV = "DYNAMIX_LOG_DIR"
TENSORBOARD_DIR = "tensorboard"
SCHEDULER_RUN = "scheduler"
WORKER_RUN_PREFIX = "worker-"
FILE_VERSION = "brain.Event:2"  # first event of every TensorBoard event file
_file_ids = itertools.count()

WORKER_TAGS = {
    "batch_size": "mean local batch size over the interval, samples",
    "samples_per_s": "compute-only throughput θ_i = samples / compute seconds, samples/s",
    "compute_s": "mean compute time per step (forward, backward, data), seconds",
    "push_pull_s": "mean push_pull (gradient aggregation) time per step, seconds",
    "step_s": "mean step time = compute_s + push_pull_s, seconds",
    "loss": "mean of the losses given to bps.report_loss in the interval",
    "lr_scale": "learning-rate factor DistributedOptimizer applied at the interval's last step",
    "noise_scale": "gradient noise scale B_noise (McCandlish et al. 2018), samples; once estimated",
}


def worker_logdir(run_dir: str | os.PathLike, rank: int) -> Path:
    """``<run_dir>/tensorboard/worker-<rank>``."""
    return Path(run_dir) / TENSORBOARD_DIR / f"{WORKER_RUN_PREFIX}{rank}"


def scheduler_logdir(run_dir: str | os.PathLike) -> Path:
    """``<run_dir>/tensorboard/scheduler``."""
    return Path(run_dir) / TENSORBOARD_DIR / SCHEDULER_RUN


def _tensorboard(submodule: str):
    return import_extra(f"tensorboard.{submodule}", "scheduler", "writing TensorBoard scalars (--log-dir)")


class ScalarWriter:
    """Scalars into one TensorBoard run directory, in a new event file
    ``events.out.tfevents.<unix time>.<host>.<pid>.<n>`` created on :meth:`open` or the first
    :meth:`add` (``<n>`` zero-padded: TensorBoard reads a directory's files in name order, so a
    process's files of one second sort in the order they were made). Thread-safe; each :meth:`add` is written and flushed before it returns (about
    0.07 ms for the 8 worker tags here, most of it tensorboard's pure-Python CRC).
    """

    def __init__(self, logdir: str | os.PathLike):
        self.logdir = Path(logdir)
        self._records = None
        self._lock = threading.Lock()
        self._before_close: list[weakref.WeakMethod] = []

    def open(self) -> None:
        """Create the event file now; its first event records the wall time of this call.

        Raises:
            OSError: the directory or file cannot be created.
        """
        with self._lock:
            if self._records is None:
                Event = _tensorboard("compat.proto.event_pb2").Event
                RecordWriter = _tensorboard("summary.writer.record_writer").RecordWriter

                self.logdir.mkdir(parents=True, exist_ok=True)
                now = time.time()
                name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{next(_file_ids):06d}"
                self._records = RecordWriter(open(self.logdir / name, "wb"))
                self._write(Event(wall_time=now, file_version=FILE_VERSION))
                atexit.register(self.close)

    def add(self, scalars: Mapping[str, float | None], step: int, walltime: float | None = None) -> None:
        """One event holding every value of ``scalars`` (tag -> value) at global ``step`` and
        ``walltime`` (seconds since the Unix epoch, default now). None and non-finite values are
        left out: TensorBoard draws no point for them."""
        Event = _tensorboard("compat.proto.event_pb2").Event
        Summary = _tensorboard("compat.proto.summary_pb2").Summary

        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()
                  if value is not None and math.isfinite(value)]
        if not values:
            return
        self.open()
        with self._lock:
            if self._records is not None:  # closed meanwhile
                self._write(Event(wall_time=time.time() if walltime is None else walltime, step=int(step),
                                  summary=Summary(value=values)))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def before_close(self, method: Callable[[], None]) -> None:
        """Call the bound ``method`` (held weakly) each time an open file is about to close, so its
        object can still :meth:`add` what it holds (a worker's unfinished decision interval)."""
        self._before_close.append(weakref.WeakMethod(method))

    def close(self) -> None:
        """Close the event file (a later :meth:`add` starts a new one); safe to call twice."""
        if self._records is not None:
            for ref in self._before_close:
                method = ref()
                if method is not None:
                    method()
        with self._lock:
            records, self._records = self._records, None
        if records is not None:
            records.close()
            atexit.unregister(self.close)


# ---- the worker process's writer ----------------------------------------------------------------


def open_writer(logdir: str | os.PathLike) -> ScalarWriter | None:
    """A :class:`ScalarWriter` into ``logdir``, opened; None, with a warning naming the extra to
    install, when tensorboard is missing (the scalars are monitoring: training and the decision
    log go on without them).

    Raises:
        OSError: the directory or file cannot be created.
    """
    writer = ScalarWriter(logdir)
    try:
        writer.open()
    except MissingExtraError as missing:
        warnings.warn(f"{missing}; going on without TensorBoard scalars in {logdir}", stacklevel=2)
        return None
    return writer


# Resolved when a frontend builds its step monitor (TrainingStep hands the writer to it) or at a
# log_scalar call, and reset by bps.shutdown(); a training step itself only uses the monitor's writer.
_lock = threading.Lock()
_writer: ScalarWriter | None = None
_resolved = False  # DYNAMIX_LOG_DIR was looked at (None writer: no run directory)


def _rank() -> int:
    from dynamix_byteps import engine
    from dynamix_byteps.env import WorkerEnv

    return engine.current().rank if engine.is_started() else WorkerEnv.from_environ().rank


def worker_writer() -> ScalarWriter | None:
    """This process's writer into ``<DYNAMIX_LOG_DIR>/tensorboard/worker-<rank>``, opened on first
    use; None when ``DYNAMIX_LOG_DIR`` is unset."""
    global _writer, _resolved
    if not _resolved:
        with _lock:
            if not _resolved:
                run_dir = os.environ.get(LOG_DIR_ENV)
                if run_dir:
                    _writer = open_writer(worker_logdir(run_dir, _rank()))
                _resolved = True
    return _writer


def log_scalar(tag: str, value, step: int | None = None, default_step: int = 0) -> None:
    """The checks and the write behind :func:`dynamix_byteps.log_scalar`: ``value`` under ``tag``
    in this worker's TensorBoard run at ``step``, or ``default_step`` when ``step`` is None; a
    no-op (after checking the arguments) when the job has no log directory.

    Raises:
        ValueError: ``tag`` is empty or not a string, ``value`` is not a real number, or
            ``step`` is not an integer >= 0.
    """
    if not isinstance(tag, str) or not tag.strip():
        raise ValueError(f"log_scalar needs a non-empty string tag, got {tag!r}")
    try:
        if isinstance(value, (str, bytes, bool)) or getattr(value, "ndim", 0) != 0:
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"log_scalar({tag!r}, ...) needs a real number (or a 0-dim tensor), got {value!r}") from None
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0):
        raise ValueError(f"log_scalar({tag!r}, ...) needs step=None or an integer >= 0, got {step!r}")
    writer = worker_writer()
    if writer is not None:
        writer.add({tag: number}, default_step if step is None else step)


def close() -> None:
    """Flush and close this process's writer (``bps.shutdown`` calls it); a later scalar reopens one."""
    global _writer, _resolved
    with _lock:
        writer, _writer, _resolved = _writer, None, False
    if writer is not None:
        writer.close()


# ---- the scheduler's scalars --------------------------------------------------------------------


def _numbers(prefix: str, values, out: dict[str, float], depth: int = 0) -> None:
    """Numeric leaves of nested dicts as ``prefix/key/...`` (bools, strings and lists left out)."""
    if isinstance(values, Mapping) and depth < 4:
        for key, value in values.items():
            _numbers(f"{prefix}/{key}", value, out, depth + 1)
    elif isinstance(values, numbers.Real) and not isinstance(values, bool) and math.isfinite(values):
        out[prefix] = float(values)


def decision_scalars(record: Mapping) -> dict[str, float]:
    """Scalars of one decision-log record, as
    :meth:`~dynamix_byteps.control.decision_record.DecisionRecord.to_dict` gives it."""
    out: dict[str, float] = {}
    sizes = record.get("batch_sizes") or []
    for rank, size in enumerate(sizes):
        out[f"batch_size/{WORKER_RUN_PREFIX}{rank}"] = float(size)
    if sizes:
        out["global_batch"] = float(sum(sizes))
    for key in ("lr_scale", "predicted_gain"):
        _numbers(key, record.get(key), out)
    _numbers("noise_scale", (record.get("state") or {}).get("noise_scale"), out)
    _numbers("reward", record.get("reward") or {}, out)
    _numbers("terms", record.get("terms") or {}, out)
    return out
