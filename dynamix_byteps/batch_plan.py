"""The batch plan of a training run: its assignment schedule and the batches its sampler drew.

A :class:`BatchPlan` is what a ``DynamicBatchSampler`` and the frontend that trains on its
batches (``DistributedOptimizer``, ``DistributedDataParallel``, TensorFlow's
``DistributedGradientTape`` and Keras ``DistributedOptimizer``) share about each step: the
:class:`~dynamix_byteps.assignment.AssignmentSchedule` (each worker's assigned batch at every
step, their sum Σb, the assignment version), the size of every batch the sampler handed out and
no step has trained on yet, and the position training has reached. The sampler owns its plan
(``sampler.batch_plan``) and a frontend is handed it::

    sampler = bps.DynamicBatchSampler(train_set, batch_size=64)
    optimizer = bps.DistributedOptimizer(opt, model.named_parameters(), batch_plan=sampler.batch_plan)

The process keeps one default plan (:func:`default`), for the BytePS API's module functions
(:func:`set_batch_sizes`, :func:`gradient_noise_scale`, ``bps.step_statistics()``, ...) and for
frontends given no plan, as scripts written for BytePS are: the newest sampler's plan, or an
empty one while no sampler exists (batch sizes then come from ``set_local_batch_size``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence

from dynamix_byteps import engine as _engine
from dynamix_byteps.assignment import Assignment, AssignmentSchedule, InvalidAssignmentError
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.negotiation import negotiate, round_lock

MAX_UNTRAINED_DRAWS = 4096  # draws kept when no frontend takes them (a sampler used without training)


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """What fixes the permutations a ``DynamicBatchSampler`` draws and their cut between workers:
    fixed at its construction (a resume or a new assignment changes the sizes in force on every
    worker alike). With ``num_replicas > 1`` (:attr:`shared`) every worker's must be the same.

    Attributes:
        dataset_size: samples in the dataset.
        seed: the permutations' seed; None without shuffling, where every seed gives one order.
        shuffle: whether each epoch is a new permutation.
        drop_last: whether an epoch's last partial global batch is skipped.
        num_replicas: workers sharing each epoch's permutation; 1: the independent-shard mode.
        batch_size: the per-rank batch sizes the sampler was built with, one per replica.
    """

    dataset_size: int
    seed: int | None
    shuffle: bool
    drop_last: bool
    num_replicas: int
    batch_size: tuple[int, ...]

    @property
    def shared(self) -> bool:
        """Whether other workers draw their slices of the same permutations (``num_replicas > 1``)."""
        return self.num_replicas > 1

    def to_json(self) -> str:
        """The canonical text of these settings: equal settings give equal texts (and digests)."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SamplerSettings:
        """The settings :meth:`to_json` wrote as ``text``."""
        fields = json.loads(text)
        return cls(**{**fields, "batch_size": tuple(fields["batch_size"])})

    def describe(self, name: str) -> str:
        """Field ``name`` as ``'name value'`` (``'seed 42'``, ``'batch_size [8,12]'``; ``'no seed'``
        when it is None)."""
        value = getattr(self, name)
        if value is None:
            return f"no {name}"
        if isinstance(value, tuple):
            value = "[" + ",".join(map(str, value)) + "]"
        return f"{name} {value}"


class BatchPlan:
    """The batches of one training run, shared by its sampler and the frontend training on them.

    Thread-safe: a DataLoader may draw in another thread while the frontend takes draws.

    Args:
        schedule: the sampler's assignment schedule; None for a plan without a sampler (its
            frontends use the batch sizes declared by ``set_local_batch_size``).
        sampler_settings: the sampler's :class:`SamplerSettings`; every worker's must be the same
            when they are :attr:`~SamplerSettings.shared`. None: no sampler.
        sampler_rank: the slice of the permutations this worker's sampler draws, which must be
            the worker's rank when shared (0 for one drawing its own shard); None with
            ``sampler_settings``.

    Attributes:
        schedule: the :class:`~dynamix_byteps.assignment.AssignmentSchedule`, or None.
        sampler_settings: as given.
        sampler_rank: as given.
        monitor: the :class:`~dynamix_byteps.control.step_monitor.StepMonitor` of the newest frontend
            training on this plan (the one ``bps.step_statistics``, ``bps.untimed``,
            ``bps.report_loss`` and ``bps.log_scalar`` reach); None before one exists.
        gradient_noise: that frontend's :class:`~dynamix_byteps.scaling.gradient_noise.GradientNoiseScale`.
    """

    def __init__(self, schedule: AssignmentSchedule | None = None, sampler_settings: SamplerSettings | None = None,
                 sampler_rank: int | None = None):
        self.schedule = schedule
        self.sampler_settings, self.sampler_rank = sampler_settings, sampler_rank
        self.monitor = None
        self.gradient_noise = None
        self._lock = threading.Lock()
        # (step, samples, epoch, epoch samples drawn through this step), oldest first
        self._draws: collections.deque[tuple[int, int, int, int]] = collections.deque(maxlen=MAX_UNTRAINED_DRAWS)
        self._trained: tuple[int, int] | None = None  # (epoch, samples) of the newest draw taken
        self._next_trained_step: int | None = None  # the step after the newest draw taken
        self._consumed = False  # a frontend takes the draws: those not taken were prefetched, not trained on
        self._followed = False  # a frontend given no plan took draws from it as the process default
        self._takers: weakref.WeakSet = weakref.WeakSet()  # the frontends' step paths that took draws
        self._last_taker: weakref.ref | None = None
        self._shared: dict[Hashable, tuple[object, bool]] = {}  # key -> (object, moves with the default)
        self._replaced: weakref.ref | None = None  # the default plan this one replaced, until a follower took

    def attach(self, monitor, gradient_noise) -> None:
        """Make ``monitor`` and ``gradient_noise`` (a frontend's) the ones the module functions report."""
        global _frontend_attached
        self.monitor, self.gradient_noise = monitor, gradient_noise
        _frontend_attached = _frontend_attached or monitor is not None

    def record_draw(self, step: int, samples: int, epoch: int = 0, epoch_samples: int = 0) -> None:
        """The sampler handed out ``samples`` indices for global ``step``, in ``epoch``, whose
        global batches through this step hold ``epoch_samples`` samples."""
        with self._lock:
            self._draws.append((step, samples, epoch, epoch_samples))

    def forget_draws(self) -> int | None:
        """Drop draws not yet trained on (a new pass over the loader discards prefetched batches);
        returns the step of the oldest one, which the sampler then draws again, or None."""
        with self._lock:
            oldest = self._draws[0][0] if self._draws and self._consumed else None
            self._draws.clear()
            return oldest

    def training_started(self) -> bool:
        """True once a frontend took a draw of this plan (its first step)."""
        return self._consumed

    def take_draws(self, count: int = 1, as_default: bool = False, taker: object = None) -> list[tuple[int, int]]:
        """The oldest ``count`` ``(step, samples)`` draws no step has trained on yet (fewer when
        fewer exist), removed from the plan; marks training as started.

        Args:
            count: draws to take (one per backward pass of the step).
            as_default: the caller was given no plan and follows the process default.
            taker: the frontend's step path taking them; None: an anonymous caller.

        Raises:
            ConfigurationError: this plan's sampler feeds two frontends that take its draws in
                turn (a GAN's two optimizers): each draw can weight one step of one of them only.
        """
        taken = []
        with self._lock:
            self._check_one_taker(taker)
            self._consumed = True
            self._followed = self._followed or as_default
            for _ in range(min(count, len(self._draws))):
                step, samples, epoch, epoch_samples = self._draws.popleft()
                self._trained, self._next_trained_step = (epoch, epoch_samples), step + 1
                taken.append((step, samples))
        if as_default:
            self._warn_if_batches_come_from_the_replaced_plan(taken)
        return taken

    def _warn_if_batches_come_from_the_replaced_plan(self, taken: list) -> None:
        """Warn, once, when a frontend following this default plan finds no batch here while the
        sampler this one replaced handed out batches nobody took: the script built a second sampler
        (a validation set's, both before ``model.fit``), and training follows it instead of the
        sampler whose batches it trains on, so its gradients would be weighted by the wrong sizes."""
        replaced, self._replaced = (self._replaced() if self._replaced is not None else None), None
        if taken or replaced is None or replaced._consumed or not replaced._draws:
            return
        warnings.warn(
            "DistributedOptimizer (or DistributedGradientTape, DistributedDataParallel), given no batch_plan, "
            "follows the newest DynamicBatchSampler, but the batches come from the one built before it (a second "
            "sampler for validation data?): the gradients are not weighted by the batches they came from. Use plain "
            "tf.data (a DataLoader) for validation, or hand the frontend its sampler's plan: "
            "batch_plan=sampler.batch_plan", stacklevel=3)

    def _check_one_taker(self, taker: object) -> None:
        if taker is None:
            return
        last = self._last_taker() if self._last_taker is not None else None
        # A frontend that took before taking again after another's take: they alternate. A new
        # frontend replacing an old one takes from then on alone, which is fine.
        if self.sampler_settings is not None and last is not None and last is not taker and taker in self._takers:
            raise ConfigurationError(
                "two training frontends (DistributedOptimizer, DistributedDataParallel or gradient tape) take their "
                "batch sizes from one DynamicBatchSampler in turn, e.g. a GAN's generator and discriminator "
                "optimizers: each batch's size weights one step of one of them, so the other's gradients would be "
                "weighted by another batch's size and the sampler's checkpointed position would run ahead. Train "
                "with one DistributedOptimizer per sampler (one optimizer over both models' parameter groups), or "
                "use torch.utils.data.DistributedSampler with equal batch sizes for alternating optimizers "
                "(equal batches need no weights)")
        self._takers.add(taker)
        self._last_taker = weakref.ref(taker)

    def next_trained_step(self) -> int | None:
        """The global step after the newest one a frontend took from the sampler: the first step
        not trained on yet, which a prefetching loader has already drawn; None before the first."""
        return self._next_trained_step

    def resume_at(self, step: int) -> None:
        """The sampler resumes at global ``step`` (a loaded checkpoint): once a frontend has taken
        draws, ``step`` is the first step not trained on yet."""
        with self._lock:
            if self._next_trained_step is not None:
                self._next_trained_step = step

    def trained_position(self) -> tuple[int, int] | None:
        """``(epoch, samples)`` of the newest step a frontend took from the sampler: the epoch and
        how many of its samples (all workers together) were drawn through that step; None before."""
        return self._trained

    def shared(self, key: Hashable, make: Callable[[], object], follows_default: bool = False) -> object:
        """The object kept under ``key`` for frontends built anew every step (TensorFlow's
        ``DistributedGradientTape`` keeps its step statistics here), made by ``make()`` the first
        time. One kept for frontends that follow the process's default plan (``follows_default``)
        moves to the next default plan, so a new sampler does not restart their statistics."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = (make(), follows_default)
            return self._shared[key][0]

    def _take_followers(self, previous: BatchPlan) -> None:
        """Move ``previous``'s objects kept for followers of the default plan to this plan."""
        with previous._lock:
            moving = {key: kept for key, kept in previous._shared.items() if kept[1]}
            for key in moving:
                del previous._shared[key]
        with self._lock:
            for key, kept in moving.items():
                self._shared.setdefault(key, kept)

    def forget_shared(self) -> None:
        """Drop what :meth:`shared` kept (on ``shutdown``)."""
        with self._lock:
            self._shared.clear()

    def set_batch_sizes(self, batch_sizes: Sequence[int], at_step: int | None = None) -> Assignment:
        """Switch every worker to ``batch_sizes`` (one per rank) at global step ``at_step``.

        A collective: every worker must call it with the same arguments; the workers check that
        they agree before anything changes. ``at_step`` defaults to the first step not yet drawn
        by this worker's sampler (which must then agree across workers too).

        Returns:
            The new :class:`Assignment`.

        Raises:
            ConfigurationError: the plan has no sampler (no ``DynamicBatchSampler`` exists yet).
            InvalidAssignmentError: ``batch_sizes`` is not a sequence (a list, tuple, NumPy array or
                integer tensor), a size is not an integer >= 1, out of bounds, the wrong count,
                larger than the dataset in total under ``drop_last``, or ``at_step`` was already drawn; the previous
                assignment stays in force.
            TensorMismatchError: the workers passed different arguments.
        """
        current = self.schedule
        if current is None:
            raise ConfigurationError("set_batch_sizes needs a DynamicBatchSampler; create one before changing "
                                     "batch sizes")
        step = current.next_open_step if at_step is None else at_step
        sizes: tuple = ()
        try:
            sizes = _sequence(batch_sizes)
            assignment = Assignment(sizes, step, current.latest.version + 1)
            current.validate(assignment)
            problem = None
        except InvalidAssignmentError as exc:
            problem = exc
        # Workers may have drawn different numbers of batches ahead; all accept or all reject.
        with round_lock:
            accepted = negotiate(_engine.current(), "set_batch_sizes",
                                 f"set_batch_sizes {list(sizes)!r} at step {step!r}", int(problem is None))[:, 0]
        if problem is not None:
            raise problem
        if not accepted.all():
            raise InvalidAssignmentError(
                f"ranks {[r for r, ok in enumerate(accepted) if not ok]} rejected the assignment {list(sizes)} "
                f"at step {step}; see their error. The previous assignment stays in force.")
        current.apply(assignment)
        return assignment


def _sequence(batch_sizes) -> tuple:
    """``batch_sizes`` as a tuple; a tensor or array of integers gives Python ints."""
    if not hasattr(batch_sizes, "tolist") and hasattr(batch_sizes, "numpy"):  # a TensorFlow tensor
        batch_sizes = batch_sizes.numpy()
    if hasattr(batch_sizes, "tolist"):  # a NumPy array or torch tensor
        batch_sizes = batch_sizes.tolist()
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
        raise InvalidAssignmentError(f"set_batch_sizes takes a sequence of integer batch sizes, one per rank, "
                                     f"got {type(batch_sizes).__name__} {batch_sizes!r}")
    return tuple(batch_sizes)


# ---- the process's default plan, behind the BytePS API's module functions -----------------------

_default_lock = threading.Lock()
_default: BatchPlan | None = None
_frontend_attached = False  # a frontend attached its monitor to a plan of this process


def frontend_attached() -> bool:
    """True once a frontend (``DistributedOptimizer``, ``DistributedDataParallel``, a gradient tape)
    was built in this process, whichever plan it trains on."""
    return _frontend_attached


def default() -> BatchPlan:
    """The process's default plan: the newest ``DynamicBatchSampler``'s, else an empty one."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BatchPlan()
        return _default


def checked(plan: BatchPlan | None) -> BatchPlan | None:
    """``plan`` as a frontend's ``batch_plan`` argument: a :class:`BatchPlan` or None (follow the default).

    Raises:
        TypeError: ``plan`` is something else (e.g. the sampler instead of its ``batch_plan``).
    """
    if plan is not None and not isinstance(plan, BatchPlan):
        raise TypeError(f"batch_plan must be a BatchPlan (a DynamicBatchSampler's .batch_plan), got "
                        f"{type(plan).__name__}")
    return plan


def make_default(plan: BatchPlan) -> None:
    """Make ``plan`` the process's default (a new ``DynamicBatchSampler`` does this).

    The newest frontend's monitor and gradient statistics stay reachable through the module
    functions until a frontend attaches to ``plan``. One sampler drives a job whose frontends are
    given no plan: replacing one they have trained on warns (use a plain DataLoader for validation).
    """
    global _default
    with _default_lock:
        previous, _default = _default, plan
    if previous is None or previous is plan:
        return
    if plan.monitor is None:
        plan.attach(previous.monitor, previous.gradient_noise)
    plan._take_followers(previous)
    plan._replaced = weakref.ref(previous)
    if previous.schedule is not None and previous._followed:
        warnings.warn("a new DynamicBatchSampler replaces the one training has used so far: set_batch_sizes "
                      "and DistributedOptimizer now follow the new one; use a plain DataLoader for "
                      "validation data, or hand each optimizer its sampler's batch_plan", stacklevel=3)


def set_batch_sizes(batch_sizes: Sequence[int], at_step: int | None = None) -> Assignment:
    """:meth:`BatchPlan.set_batch_sizes` on the default plan (the newest sampler's); same
    arguments, result and errors."""
    return default().set_batch_sizes(batch_sizes, at_step)


def gradient_noise_scale() -> float | None:
    """B_noise = tr(Σ)/|G|² (McCandlish et al. 2018, arXiv 1812.06162, Section 2.2), smoothed, in
    samples, of the newest frontend on the default plan; None before the first estimate.

    Estimated by ``DistributedOptimizer`` from every worker's local squared gradient norm at
    its batch b_i and the aggregated norm at B = Σ b_i (:mod:`dynamix_byteps.scaling.gradient_noise`).
    """
    noise = default().gradient_noise
    return None if noise is None else noise.noise_scale


def gradient_statistics() -> dict:
    """The smoothed terms behind :func:`gradient_noise_scale`: ``grad_sq`` (|G|²), ``trace_cov``
    (tr(Σ), per sample), ``noise_scale``, and the counts of used and skipped steps."""
    noise = default().gradient_noise
    if noise is None:
        return {"grad_sq": None, "trace_cov": None, "noise_scale": None, "steps": 0, "skipped": 0}
    return {"grad_sq": noise.grad_sq, "trace_cov": noise.trace_cov, "noise_scale": noise.noise_scale,
            "steps": noise.steps, "skipped": noise.skipped}
