"""Training progress on bpslaunch's console: rank 0 publishes, the launcher draws a tqdm bar.

``bpslaunch`` whose stderr is a terminal gives rank 0 ``DYNAMIX_PROGRESS_FILE``; rank 0's step
monitor then replaces that small JSON file atomically (at most every
:data:`MIN_WRITE_INTERVAL_S`) with::

    {"step": 812, "epoch": 2, "samples": 27000, "dataset_size": 60000}

(``step``: optimizer steps completed; ``epoch`` and ``samples``, the samples of the epoch
trained so far, are known when a ``DynamicBatchSampler`` feeds the model, else null).
:class:`ConsoleProgress` polls it and draws one bar on stderr: the epoch's samples when
known (its ETA stays right while the batch sizes change; labelled from 1, like Keras, while the
sampler counts epochs from 0 like ``set_epoch``), else a step counter. Workers'
prefixed lines are written through :meth:`ConsoleProgress.write_guard`, which clears the bar,
writes and redraws it. Off when stderr is not a terminal (CI logs), or with ``TQDM_DISABLE=1``,
and gone for the rest of the job once a worker draws its own bar in place (Keras's ``verbose=1``, a
tqdm loop): two bars on one terminal line overwrite each other.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from dynamix_byteps.atomic import write_atomic

PROGRESS_ENV = "DYNAMIX_PROGRESS_FILE"
PROGRESS_FILE = "progress.json"
MIN_WRITE_INTERVAL_S = 0.5
POLL_S = 0.25


class ProgressWriter:
    """Rank 0's side: :meth:`update` after each step; writes at most every ``min_interval_s``."""

    def __init__(self, path: str | os.PathLike, min_interval_s: float = MIN_WRITE_INTERVAL_S):
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self._last = -float("inf")

    def update(self, step: int, trained: tuple[int, int] | None = None, dataset_size: int | None = None) -> None:
        """Publish ``step`` (optimizer steps completed) and the sampler's epoch position: ``trained``,
        ``(epoch, samples of it trained so far)``, in a dataset of ``dataset_size`` samples (both
        None without a sampler); throttled, except for an epoch's last step, so the bar reaches 100%."""
        known = trained is not None and bool(dataset_size)
        now = time.monotonic()
        if now - self._last < self.min_interval_s and not (known and trained[1] >= dataset_size):
            return
        self._last = now
        record = {"step": step, "epoch": None, "samples": None, "dataset_size": None}
        if known:
            record.update(epoch=trained[0], samples=trained[1], dataset_size=dataset_size)
        try:
            write_atomic(self.path, json.dumps(record), durable=False)
        except OSError:
            pass  # the console bar is a nicety: a full disk must not stop training


def writer_from_env() -> ProgressWriter | None:
    """A :class:`ProgressWriter` when ``DYNAMIX_PROGRESS_FILE`` is set (rank 0 under a terminal), else None."""
    path = os.environ.get(PROGRESS_ENV)
    return ProgressWriter(path) if path else None


def _width(stream) -> dict:
    """tqdm's size arguments: follow the terminal, or 80x24 where it reports a size of 0 (a
    pseudo-terminal nobody sized, where tqdm would draw nothing)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    return {"dynamic_ncols": True} if min(size) > 0 else {"ncols": 80, "nrows": 24}


def read_progress(path: str | os.PathLike) -> dict | None:
    """The newest progress record, or None when there is none (yet)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class ConsoleProgress:
    """The launcher's side: a thread that follows ``path`` with a tqdm bar on ``stream``.

    Use as a context manager around the job; pass :meth:`write_guard` to whatever writes lines to
    the same terminal.
    """

    def __init__(self, path: str | os.PathLike, stream=None, poll_s: float = POLL_S):
        self.path = Path(path)
        self.stream = stream if stream is not None else sys.stderr
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bpslaunch-progress", daemon=True)
        self._bar = None
        self._epoch = None

    def __enter__(self) -> ConsoleProgress:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a previous run's record
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            self._bar.close()
        self.path.unlink(missing_ok=True)

    def give_way(self) -> None:
        """Clear the bar and draw it no more: a worker draws its own progress bar."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def write_guard(self):
        """Context manager for writing a line to the terminal: the bar is cleared, then redrawn."""
        from tqdm import tqdm

        return tqdm.external_write_mode(file=self.stream)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            record = read_progress(self.path)
            if record is not None:
                self._show(record)

    def _show(self, record: dict) -> None:
        from tqdm import tqdm

        epoch, samples, total = record.get("epoch"), record.get("samples"), record.get("dataset_size")
        by_epoch = None not in (epoch, samples, total)
        if self._bar is None or (by_epoch and epoch != self._epoch):
            if self._bar is not None:
                self._bar.close()
            self._epoch = epoch if by_epoch else None
            self._bar = tqdm(file=self.stream, desc=f"epoch {epoch + 1}" if by_epoch else "training",
                             total=total if by_epoch else None, unit="sample" if by_epoch else "step",
                             unit_scale=by_epoch, leave=False, **_width(self.stream))
        position = samples if by_epoch else record.get("step", 0)
        if by_epoch:
            self._bar.set_postfix_str(f"step {record.get('step')}", refresh=False)
        self._bar.update(max(position - self._bar.n, 0))
