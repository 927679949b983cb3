"""``DynamicBatchSampler``: per-worker batch sizes that may change at any step (framework-neutral).

Iterating it yields this worker's list of dataset indices for each step of one epoch. The
frontends feed models from it: a torch ``DataLoader`` takes it as ``batch_sampler``
(:mod:`dynamix_byteps.torch.sampler`), TensorFlow through
:func:`dynamix_byteps.tensorflow.dynamic_batch_dataset`::

    sampler = bps.DynamicBatchSampler(len(train_set), batch_size=64, seed=42)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for indices in sampler:
            ...

The epoch plan is :mod:`dynamix_byteps.data.partition` (every index once per epoch, the
same step count on every worker, the end-of-epoch rule); the sizes come from the job's
:class:`~dynamix_byteps.assignment.AssignmentSchedule`, changed with ``bps.set_batch_sizes``.
The sampler logs every batch it hands out in its :class:`~dynamix_byteps.batch_plan.BatchPlan`
(``sampler.batch_plan``), from which the optimizer learns each step's local batch size; hand
it to the optimizer (``DistributedOptimizer(..., batch_plan=sampler.batch_plan)``) or let the
optimizer follow the process's default plan, which is the newest sampler's.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized

from dynamix_byteps import batch_plan as _batch_plan
from dynamix_byteps import engine as _engine
from dynamix_byteps.assignment import (
    Assignment,
    AssignmentSchedule,
    BatchBounds,
    env_batch_sizes,
)
from dynamix_byteps.data.partition import (
    Position,
    permutation,
    plan_step,
    rank_indices,
    tail_sizes,
)
from dynamix_byteps.errors import ConfigurationError

_HISTORY_STEPS = 4096
# Batches handed out with no frontend ever taking one before the sampler says that none trains on
# them: far more than any DataLoader prefetches.
UNTAKEN_DRAWS_WARNING = 64
MAX_EPOCH = 2**53 - 1  # epochs travel in the float64 gradient trailer, exact up to 2**53
#: What a checkpoint's sampler must share with the one resuming it: each sets which samples an epoch
#: draws, in which order, or where it ends (drop_last: its last partial global batch). The number of
#: workers may differ (the global batch in force is split again).
_SETTINGS_OF_THE_EPOCH = ("dataset_size", "seed", "shuffle", "drop_last")


def _initial_sizes(batch_size, num_replicas: int) -> list[int]:
    """``batch_size`` as one size per worker: one integer (also numpy's, or a 0-dim integer tensor)
    for every worker, or a sequence of them; ConfigurationError for anything else (bools too)."""
    def size(value) -> int:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)

    try:
        return [size(batch_size)] * num_replicas
    except TypeError:
        pass
    try:
        if isinstance(batch_size, (str, bytes, Mapping)) or not isinstance(batch_size, Iterable):
            raise TypeError
        return [size(value) for value in batch_size]
    except TypeError:
        raise ConfigurationError(f"batch_size must be an integer or one integer per worker, got {batch_size!r}") from None


def _epoch_number(epoch) -> int:
    """``epoch`` as a Python int for ``set_epoch``; ValueError naming set_epoch when it is not an
    integer in ``[0, 2**53)``."""
    try:
        if isinstance(epoch, bool):
            raise TypeError
        number = operator.index(epoch)
    except TypeError:
        number = None
    if number is None or not 0 <= number <= MAX_EPOCH:
        raise ValueError(f"set_epoch takes an integer epoch >= 0 (below 2**53), the same on every worker; got "
                         f"{epoch!r} ({type(epoch).__name__})")
    return number


class DynamicBatchSampler:
    """Yields this worker's list of dataset indices for each step.

    A new pass (``iter``) draws again the batches no optimizer step trained on: those a
    prefetching loader drew ahead, and, before the first step, every batch of a pass left
    unfinished (``next(iter(loader))`` to peek at shapes), so no sample of the epoch is lost.

    With ``num_replicas > 1`` the workers cut one shared permutation per epoch. Every worker must
    then build its sampler with the same dataset length, ``seed`` (when shuffling), ``shuffle``,
    ``drop_last``, ``num_replicas`` and ``batch_size`` (the per-rank sizes it resolves to), since
    they fix that permutation and its cut, and with its own ``rank`` (the default, ``bps.rank()``),
    which picks its slice: otherwise the first optimizer step raises TensorMismatchError on every
    worker, naming each rank's value of what differs.

    With ``num_replicas=1, rank=0`` in a job of several workers, each worker draws its own dataset
    independently (the independent-shard mode: every worker shuffles its own pre-sharded data,
    e.g. with ``seed=bps.rank()``); nothing is compared between workers then, but every worker
    must use it: a job where some workers share a sampler and others draw their own shard raises
    TensorMismatchError on every worker at the first optimizer step, naming the ranks of each.

    Args:
        dataset: the dataset (or its length); every worker must pass the same length.
        batch_size: local batch size, one for all workers or one per rank.
        num_replicas: number of workers sharing each epoch's permutation (default ``bps.size()``;
            any other number above 1 is refused once ``bps.init()`` ran); 1: this worker draws the
            whole dataset alone (the independent-shard mode).
        rank: this worker's rank (default ``bps.rank()``), the slice of the permutation it draws;
            with ``num_replicas > 1`` it must be the worker's rank in the job.
        shuffle: reshuffle every epoch with a permutation seeded by ``(seed, epoch)``.
        seed: an integer >= 0, identical on every worker (with ``num_replicas > 1``).
        drop_last: skip an epoch's last partial global batch instead of sharing it out. Without it, a
            global batch larger than the dataset is one step per epoch that shares the dataset out
            (every rank gets at least one sample, as ``DistributedSampler`` pads); with it, such a
            batch is refused.
        min_batch: inclusive lower per-worker bound every assignment must respect (default:
            ``bpslaunch --min-batch`` through ``DYNAMIX_MIN_BATCH``, else 1).
        max_batch: inclusive upper per-worker bound (default: ``bpslaunch --max-batch`` through
            ``DYNAMIX_MAX_BATCH``, else unbounded).

    Attributes:
        schedule: the :class:`~dynamix_byteps.assignment.AssignmentSchedule` of per-worker batch sizes.
        batch_plan: the :class:`~dynamix_byteps.batch_plan.BatchPlan` this sampler owns (its
            schedule and the batches it drew), to hand to the optimizer; it becomes the
            process's default plan.

    Raises:
        ConfigurationError: bad sizes, bounds, rank, seed, an empty dataset, or a
            ``num_replicas`` above 1 that is not the job's number of workers.
        InvalidAssignmentError: ``batch_size`` breaks the bounds, or exceeds the dataset with ``drop_last``.
    """

    def __init__(self, dataset: Sized | int, batch_size: int | Sequence[int], *, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 min_batch: int | Sequence[int] | None = None, max_batch: int | Sequence[int] | None = None):
        self.dataset_size = len(dataset) if isinstance(dataset, Sized) else operator.index(dataset)
        if self.dataset_size < 1:
            raise ConfigurationError("DynamicBatchSampler needs a dataset with at least one sample")
        self.num_replicas = _engine.current().size if num_replicas is None else num_replicas
        if self.num_replicas > 1 and _engine.is_started() and self.num_replicas != _engine.current().size:
            raise ConfigurationError(
                f"num_replicas={self.num_replicas} but the job has {_engine.current().size} workers: the slices of "
                "the workers that do not exist would never be trained. Leave num_replicas out (it defaults to "
                "bps.size()), or give num_replicas=1, rank=0 for a worker that samples its own shard")
        self.rank = _engine.current().rank if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ConfigurationError(f"rank {self.rank} is not in [0, num_replicas={self.num_replicas})")
        if isinstance(seed, float) or operator.index(seed) < 0:
            raise ConfigurationError(f"seed must be an integer >= 0 (numpy seeds the permutations with it), got {seed!r}")
        self.shuffle, self.seed, self.drop_last = bool(shuffle), operator.index(seed), bool(drop_last)
        if min_batch is None:
            min_batch = env_batch_sizes("DYNAMIX_MIN_BATCH", self.num_replicas) or 1
        if max_batch is None:
            max_batch = env_batch_sizes("DYNAMIX_MAX_BATCH", self.num_replicas)
        bounds = BatchBounds.build(self.num_replicas, min_batch, max_batch)
        initial = _initial_sizes(batch_size, self.num_replicas)
        if len(initial) != self.num_replicas:
            raise ConfigurationError(f"batch_size has {len(initial)} entries but the job has {self.num_replicas} "
                                     "workers; give one size, or one per worker")
        self.schedule = AssignmentSchedule(initial, bounds, self.dataset_size, drop_last=self.drop_last)
        self._position = Position()
        self._history: dict[int, Position] = {}
        # Where the iterator in progress began; None once it ran to the epoch's end.
        self._unfinished_from: Position | None = None
        self._epoch_asked: int | None = None  # set_epoch's since the last pass began
        self._draws_handed_out = 0
        self.batch_plan = _batch_plan.BatchPlan(self.schedule, self._settings(initial), self.rank)
        _batch_plan.make_default(self.batch_plan)

    def _settings(self, initial_sizes: Sequence[int]) -> _batch_plan.SamplerSettings:
        """What fixes this sampler's permutations and their cut, with the per-rank ``initial_sizes``;
        no seed without shuffling, where every seed gives the same order."""
        return _batch_plan.SamplerSettings(self.dataset_size, self.seed if self.shuffle else None, self.shuffle,
                                           self.drop_last, self.num_replicas, tuple(initial_sizes))

    @property
    def epoch(self) -> int:
        return self._position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the epoch in progress (so resuming
        mid-epoch keeps its place). Epochs also advance by themselves when one is exhausted.

        The epoch seeds the permutation, so every worker must call it with the same epoch at the
        same point (or none may call it): workers that train the same step of different epochs
        raise TensorMismatchError on every worker, naming each rank's epoch and step.

        Raises:
            ValueError: ``epoch`` is not an integer in ``[0, 2**53)`` (numpy and 0-dim torch
                integers are integers; floats and bools are not); the sampler is unchanged.
        """
        epoch = _epoch_number(epoch)
        self._epoch_asked = epoch
        if epoch != self._position.epoch:
            self._position = Position(epoch, 0, self._position.step)
            self._unfinished_from = None

    def __iter__(self) -> Iterator[list[int]]:
        self._rewind_untrained_draws()
        self._unfinished_from = self._position
        order_epoch = self._position.epoch
        order = permutation(self.dataset_size, self.seed, order_epoch, self.shuffle)
        while True:
            position = self._position
            if position.epoch != order_epoch:  # set_epoch during the pass: draw the new epoch's order
                order_epoch = position.epoch
                order = permutation(self.dataset_size, self.seed, order_epoch, self.shuffle)
            planned = plan_step(position, self.schedule.at(position.step).batch_sizes,
                                self.dataset_size, self.drop_last)
            if planned is None:
                break
            sizes, self._position = planned
            self.schedule.freeze_through(position.step)
            self._remember(position)
            indices = rank_indices(order, position, sizes, self.rank)
            self.batch_plan.record_draw(position.step, len(indices), position.epoch, self._position.offset)
            self._draws_handed_out += 1
            if self._draws_handed_out == UNTAKEN_DRAWS_WARNING:
                self._say_if_no_frontend_trains(self.schedule.at(position.step).batch_sizes)
            yield indices.tolist()
        self._position = Position(self._position.epoch + 1, 0, self._position.step)
        self._unfinished_from = None

    def _say_if_no_frontend_trains(self, sizes: Sequence[int]) -> None:
        """Warn when the job trains on this sampler's batches without a dynamix_byteps frontend (torch's
        own DistributedDataParallel on the process group ``bps.init()`` set up, or a plain optimizer):
        nothing then weights the workers' gradients by their batches, nor reports to the scheduler. A
        sampler no frontend takes from while one exists (validation data) is left alone."""
        plan = self.batch_plan
        if plan.training_started() or _batch_plan.frontend_attached() or not _engine.is_started():
            return
        engine = _engine.current()
        problems = []  # none with equal batches and no scheduler: they need no weights, no policy changes them
        if len(set(sizes)) > 1:
            problems.append(f"the workers' gradients are averaged without weighting them by their batch sizes "
                            f"{list(sizes)}")
        if engine.env.scheduler is not None:
            problems.append(f"the scheduler at {engine.env.scheduler} gets no reports, so its policy never changes "
                            "the batch sizes")
        if engine.size < 2 or not problems:
            return
        warnings.warn(f"this DynamicBatchSampler has handed out {self._draws_handed_out} batches and no "
                      "dynamix_byteps frontend has trained on any: with torch.nn.parallel.DistributedDataParallel "
                      f"or a plain optimizer {' and '.join(problems)}. Wrap the model in "
                      "bps.DistributedDataParallel, or the optimizer in bps.DistributedOptimizer (TensorFlow: "
                      "bps.DistributedGradientTape or the Keras DistributedOptimizer)", stacklevel=3)

    def _rewind_untrained_draws(self) -> None:
        """Draw again, with the same indices, the batches no optimizer step trained on.

        Once the optimizer takes draws, those it has not taken were prefetched and are drawn
        again, unless ``set_epoch`` asked for another epoch since: that epoch then starts from
        its beginning at their step. Before its first step nothing was trained: an iterator left before the epoch's end
        (``next(iter(loader))`` to peek at shapes, or a prefetching loader dropped) is started
        over from where it began, as a new pass over torch's ``DistributedSampler`` would.
        """
        untrained = self.batch_plan.forget_draws()
        asked, self._epoch_asked = self._epoch_asked, None
        if untrained is None and not self.batch_plan.training_started() and self._unfinished_from is not None:
            self._position = self._unfinished_from
            self.schedule.rewind(self._position.step)
        elif untrained is not None and untrained in self._history:
            drawn = self._history[untrained]
            # Left behind for another epoch (a loop that breaks after N steps, then set_epoch):
            # that epoch starts from its beginning, at the first step not trained on.
            self._position = drawn if asked in (None, drawn.epoch) else Position(asked, 0, untrained)
            self.schedule.rewind(untrained)

    def __len__(self) -> int:
        """Steps left in the current epoch under the assignments known now (all of the epoch
        when it has not started)."""
        position, steps = self._position, 0
        while (planned := plan_step(position, self.schedule.at(position.step).batch_sizes,
                                    self.dataset_size, self.drop_last)) is not None:
            position, steps = planned[1], steps + 1
        return steps

    def _remember(self, position: Position) -> None:
        self._history[position.step] = position
        self._history.pop(position.step - _HISTORY_STEPS, None)

    def state_dict(self, step: int | None = None) -> dict:
        """Everything needed to continue: position, assignments and configuration.

        Args:
            step: save the position *before* global step ``step`` (the first step not yet
                trained on, which lags the sampler when a DataLoader prefetches); default: the
                step after the newest one a frontend (``DistributedOptimizer``,
                ``DistributedDataParallel``, a gradient tape) took from this sampler's
                ``batch_plan``, else, with no frontend taking its draws, the sampler's own position.

        Raises:
            ValueError: ``step`` is older than the remembered history or not drawn yet.
        """
        position = self._position
        if step is None:
            step = self.batch_plan.next_trained_step()
        if step is not None and step != position.step:
            if step not in self._history:
                raise ValueError(f"step {step} is not among the last {_HISTORY_STEPS} steps drawn "
                                 f"(next step to draw: {position.step})")
            position = self._history[step]
        return {"position": dataclasses.asdict(position), "schedule": self.schedule.state_dict(),
                "num_replicas": self.num_replicas, "dataset_size": self.dataset_size,
                "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``, also with a different number of workers: then the global
        batch in force is kept and split evenly over the new workers (clamped to the bounds).
        Saved sizes outside this sampler's ``min_batch``/``max_batch`` (bounds changed since,
        e.g. a lower ``--max-batch`` after an out-of-memory) are clamped to them, with a warning.

        Raises:
            ConfigurationError: the dataset size, seed, shuffling or drop_last differs from the saved run, or
                ``state`` is not a valid :meth:`state_dict` (a missing key, a value of the wrong
                type or range); the sampler is then unchanged.
        """
        position, schedule_state, out_of_bounds = self._planned_load(state)
        if out_of_bounds is not None:
            warnings.warn(f"the checkpoint's batch sizes {list(out_of_bounds)} are outside this sampler's "
                          f"min_batch/max_batch; resuming with {schedule_state['assignments'][0]['batch_sizes']}",
                          stacklevel=2)
        self.schedule.load_state_dict(schedule_state)
        self._position = position
        self._unfinished_from = None
        self._history.clear()
        self.schedule.rewind(position.step)
        self.batch_plan.resume_at(position.step)

    def check_state_dict(self, state: dict) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing."""
        self._planned_load(state)

    def _planned_load(self, state) -> tuple[Position, dict, tuple[int, ...] | None]:
        """The position and schedule state ``load_state_dict`` would install, and the saved sizes
        in force when they were clamped to this sampler's bounds (else None); ConfigurationError
        when ``state`` is not a valid state of a sampler this one may continue."""
        try:
            for key in _SETTINGS_OF_THE_EPOCH:
                if state[key] != getattr(self, key):
                    raise ConfigurationError(f"checkpoint was taken with {key}={state[key]!r}, this sampler has "
                                             f"{key}={getattr(self, key)!r}; they must match to resume the epoch: "
                                             f"build the sampler with {key}={state[key]!r}, or start a new run "
                                             "without loading the sampler's state")
            position = self._saved_position(state["position"])
            saved = [Assignment.from_dict(a) for a in state["schedule"]["assignments"]]
            num_replicas = state["num_replicas"]
        except ConfigurationError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ConfigurationError(f"invalid sampler state ({type(error).__name__}: {error})") from None
        in_force = [a for a in saved if a.effective_step <= position.step]
        if not in_force or any(len(a.batch_sizes) != num_replicas or min(a.batch_sizes, default=0) < 1
                               for a in saved):
            raise ConfigurationError(f"invalid sampler state: its {len(saved)} assignments are not all sizes >= 1 for "
                                     f"{num_replicas!r} workers, or none is in force at step {position.step}")
        current, out_of_bounds = in_force[-1], None
        if num_replicas == self.num_replicas:
            out_of_bounds = next((a.batch_sizes for a in saved if a.effective_step >= current.effective_step
                                  and self._within_bounds(a.batch_sizes) != a.batch_sizes), None)
            if out_of_bounds is None:
                return position, {"assignments": [a.to_dict() for a in saved]}, None
            sizes = self._within_bounds(current.batch_sizes)
        else:
            sizes = self._within_bounds(tail_sizes(current.global_batch_size, [1] * self.num_replicas))
        return position, {"assignments": [Assignment(sizes, position.step, current.version + 1).to_dict()]}, out_of_bounds

    def _saved_position(self, saved: dict) -> Position:
        fields = {name: saved[name] for name in ("epoch", "offset", "step")}
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in fields.values()):
            raise ValueError(f"position {fields} is not three integers >= 0")
        if fields["epoch"] > MAX_EPOCH:
            raise ValueError(f"position epoch {fields['epoch']} is not below 2**53")
        if fields["offset"] > self.dataset_size:
            raise ValueError(f"position offset {fields['offset']} is past the dataset's {self.dataset_size} samples")
        return Position(**fields)

    def _within_bounds(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """``sizes`` (one per rank) each clamped to its rank's ``min_batch``/``max_batch``."""
        bounds = self.schedule.bounds
        return tuple(max(low, b if high is None else min(b, high))
                     for b, low, high in zip(sizes, bounds.min_batch, bounds.max_batch))
