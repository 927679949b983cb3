"""Batch-size assignments: which local batch size each worker uses, from which step on.

An :class:`Assignment` is ``(version, effective_step, batch_sizes)``: from global step
``effective_step`` on, rank r draws ``batch_sizes[r]`` samples per step. The
:class:`AssignmentSchedule` holds the assignments in force and to come; the sampler, the
batch-weighted aggregation and the LR scaling all read it, so they can never disagree.

A step is one batch drawn from the sampler (one optimizer step when
``backward_passes_per_step`` is 1), counted from 0 across epochs.
"""

from __future__ import annotations

import argparse
import bisect
import numbers
import os
import threading
from dataclasses import dataclass
from typing import Sequence

from dynamix_byteps.env import env_batch_sizes as env_batch_sizes  # re-exported: samplers and scripts read them here
from dynamix_byteps.env import parse_batch_sizes, quoted
from dynamix_byteps.errors import ConfigurationError, InvalidAssignmentError
from dynamix_byteps.scaling.lr_scaling import RULES


@dataclass(frozen=True)
class Assignment:
    """Per-worker local batch sizes in force from ``effective_step`` on.

    Attributes:
        batch_sizes: samples per step for each rank, ``len == size``.
        effective_step: first global step that uses these sizes.
        version: increases with every new assignment of a job.
    """

    batch_sizes: tuple[int, ...]
    effective_step: int = 0
    version: int = 0

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    def to_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "effective_step": self.effective_step, "version": self.version}

    @classmethod
    def from_dict(cls, data: dict) -> "Assignment":
        return cls(tuple(int(b) for b in data["batch_sizes"]), int(data["effective_step"]), int(data["version"]))


def _per_worker(value: int | Sequence[int] | None, size: int, what: str, default: int | None) -> tuple:
    if value is None:
        return (default,) * size
    if not _not_int(value):
        return (value,) * size
    values = tuple(value)
    if len(values) != size:
        raise ConfigurationError(f"{what} has {len(values)} entries for {size} workers; give one per worker or one for all")
    return values


@dataclass(frozen=True)
class BatchBounds:
    """Inclusive per-worker limits on the local batch size (``max_batch`` None = no limit)."""

    min_batch: tuple[int, ...]
    max_batch: tuple[int | None, ...]

    @classmethod
    def build(cls, size: int, min_batch: int | Sequence[int] = 1,
              max_batch: int | Sequence[int] | None = None) -> "BatchBounds":
        """Bounds for ``size`` workers from one value for all or one per worker.

        Raises:
            ConfigurationError: wrong length, a bound below 1, or min above max.
        """
        lows = _per_worker(min_batch, size, "min_batch", 1)
        highs = _per_worker(max_batch, size, "max_batch", None)
        for rank, (low, high) in enumerate(zip(lows, highs)):
            if _not_int(low) or low < 1:
                raise ConfigurationError(f"min_batch for rank {rank} must be an integer >= 1, got {low!r}")
            if high is not None and (_not_int(high) or high < low):
                raise ConfigurationError(f"max_batch for rank {rank} must be an integer >= min_batch={low}, got {high!r}")
        return cls(tuple(int(x) for x in lows), tuple(None if x is None else int(x) for x in highs))


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Integral)


class AssignmentSchedule:
    """The assignments of one job, ordered by ``effective_step``.

    Args:
        initial: batch sizes from step 0.
        bounds: per-worker limits every assignment must respect.
        dataset_size: samples per epoch (reported to the policies).
        drop_last: the sampler skips an epoch's last partial global batch, so a global batch larger
            than ``dataset_size`` is rejected (no epoch would have a step); without, a step of such
            a batch is a whole epoch, its samples shared out.

    Raises:
        InvalidAssignmentError: ``initial`` breaks a rule.
    """

    def __init__(self, initial: Sequence[int], bounds: BatchBounds | None = None, dataset_size: int | None = None,
                 *, drop_last: bool = True):
        self.size = len(tuple(initial))
        self.bounds = bounds or BatchBounds.build(self.size)
        if len(self.bounds.min_batch) != self.size:
            raise ConfigurationError(f"bounds are for {len(self.bounds.min_batch)} workers, the assignment for {self.size}")
        self.dataset_size = dataset_size
        self.drop_last = drop_last
        self._lock = threading.Lock()
        self._assignments: list[Assignment] = []
        self._planned_until = 0  # steps < this were already drawn by the sampler: frozen
        self.apply(Assignment(tuple(initial), 0, 0))

    def validate(self, assignment: Assignment) -> None:
        """Raise :class:`InvalidAssignmentError` naming the first broken rule."""
        sizes = assignment.batch_sizes
        if len(sizes) != self.size:
            raise InvalidAssignmentError(f"assignment has {len(sizes)} batch sizes for {self.size} workers")
        for rank, b in enumerate(sizes):
            if _not_int(b) or b < 1:
                raise InvalidAssignmentError(f"batch size for rank {rank} must be an integer >= 1, got {b!r}")
            low, high = self.bounds.min_batch[rank], self.bounds.max_batch[rank]
            if b < low or (high is not None and b > high):
                raise InvalidAssignmentError(
                    f"batch size {b} for rank {rank} is outside its bounds [{low}, {'inf' if high is None else high}]")
        if self.drop_last and self.dataset_size is not None and sum(sizes) > self.dataset_size:
            raise InvalidAssignmentError(
                f"global batch {sum(sizes)} is larger than the dataset ({self.dataset_size} samples): with "
                f"drop_last=True no epoch would have a step. Give batch sizes of at most {self.dataset_size} in "
                "total, or drop_last=False to share the dataset out in one step per epoch")
        if _not_int(assignment.effective_step):
            raise InvalidAssignmentError(f"at_step must be an integer step, got {assignment.effective_step!r}")
        if assignment.effective_step < self._planned_until:
            raise InvalidAssignmentError(
                f"assignment for step {assignment.effective_step} comes too late: steps up to "
                f"{self._planned_until - 1} were already drawn; use at_step >= {self._planned_until}")
        if self._assignments and assignment.version <= self._assignments[-1].version:
            raise InvalidAssignmentError(
                f"assignment version {assignment.version} is not newer than {self._assignments[-1].version}")

    def apply(self, assignment: Assignment) -> None:
        """Validate and schedule ``assignment``; it replaces any later-starting pending ones.

        Raises:
            InvalidAssignmentError: the schedule is left unchanged.
        """
        assignment = Assignment(tuple(assignment.batch_sizes), assignment.effective_step, assignment.version)
        with self._lock:
            self.validate(assignment)
            kept = [a for a in self._assignments if a.effective_step < assignment.effective_step]
            self._assignments = kept + [assignment]

    def at(self, step: int) -> Assignment:
        """The assignment in force at global ``step``."""
        with self._lock:
            index = bisect.bisect_right([a.effective_step for a in self._assignments], step) - 1
            return self._assignments[max(index, 0)]

    @property
    def latest(self) -> Assignment:
        with self._lock:
            return self._assignments[-1]

    @property
    def next_open_step(self) -> int:
        """The first step whose batch has not been drawn yet; assignments may start here or later."""
        return self._planned_until

    def rewind(self, step: int) -> None:
        """Steps from ``step`` on are drawn again (a resume or an abandoned prefetch), so open them."""
        with self._lock:
            self._planned_until = step

    def freeze_through(self, step: int) -> Assignment:
        """Mark ``step`` as drawn (no later assignment may change it) and return its assignment."""
        with self._lock:
            self._planned_until = max(self._planned_until, step + 1)
        return self.at(step)

    def state_dict(self) -> dict:
        with self._lock:
            return {"assignments": [a.to_dict() for a in self._assignments]}

    def load_state_dict(self, state: dict) -> None:
        """Restore assignments saved by :meth:`state_dict` for the same number of workers."""
        assignments = [Assignment.from_dict(a) for a in state["assignments"]]
        if any(len(a.batch_sizes) != self.size for a in assignments):
            raise ConfigurationError(f"saved assignments are not for {self.size} workers")
        with self._lock:
            self._assignments = assignments


def parse_batch_schedule(text: str, size: int) -> list[tuple[int, tuple[int, ...]]]:
    """A manual schedule ``"STEP:SIZES;STEP:SIZES"``, e.g. ``"0:32,64;500:48,48"``: from global
    step STEP on, the sizes of :func:`parse_batch_sizes`. Returns ``[(step, sizes)]`` by step.

    Raises:
        ConfigurationError: malformed entries or sizes (:func:`parse_batch_sizes`), negative or repeated steps.
    """
    entries = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        step_text, sep, sizes_text = part.partition(":")
        step = step_text.strip()
        if not sep or not (step.isascii() and step.isdigit()):
            raise ConfigurationError(f"schedule entry {quoted(part)} is not STEP:SIZES (e.g. 500:32,64)")
        entries.append((int(step), parse_batch_sizes(sizes_text, size)))
    steps = [step for step, _ in entries]
    if len(set(steps)) != len(steps):
        raise ConfigurationError(f"schedule {quoted(text)} names a step twice")
    return sorted(entries)


def add_batch_arguments(parser: argparse.ArgumentParser, *, batch_size: int = 64, lr_scaling: str = "linear") -> None:
    """Add the flags of a training script whose batch sizes ``bpslaunch`` sets through the environment.

    ``--batch-size`` (text for :func:`parse_batch_sizes`; default ``$DYNAMIX_BATCH_SIZE``, which
    ``bpslaunch --batch-size`` sets, else ``batch_size``), ``--batch-schedule`` (text for
    :func:`parse_batch_schedule`, default empty) and ``--lr-scaling`` (a rule of
    :data:`~dynamix_byteps.scaling.lr_scaling.RULES`; default ``$DYNAMIX_LR_SCALING``, else
    ``lr_scaling``). Both texts are parsed once the number of workers is known.
    """
    parser.add_argument("--batch-size", default=os.environ.get("DYNAMIX_BATCH_SIZE") or str(batch_size),
                        help="samples per worker per step, one for all or one per worker: 64 or 32,48,80,96 "
                             f"(default: $DYNAMIX_BATCH_SIZE or {batch_size})")
    parser.add_argument("--batch-schedule", default="", metavar="STEP:SIZES;...",
                        help='change the batch sizes at given global steps, e.g. "300:64;600:96,96,32,32"')
    parser.add_argument("--lr-scaling", default=os.environ.get("DYNAMIX_LR_SCALING") or lr_scaling, choices=sorted(RULES),
                        help="how the learning rate follows the global batch when it changes "
                             f"(default: $DYNAMIX_LR_SCALING or {lr_scaling})")
