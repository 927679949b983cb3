"""The process's batch plan: the assignment schedule, and the batches this worker drew.

The dynamic sampler installs an :class:`AssignmentSchedule` here and logs the size of each
batch it hands out; ``DistributedOptimizer`` takes those sizes in order to weight gradients
without the user calling ``set_local_batch_size``. ``set_batch_sizes`` is the collective that
changes the schedule on every worker at once.
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Iterable, Sequence

from dynamix_byteps import engine as _engine
from dynamix_byteps.assignment import Assignment, AssignmentSchedule, InvalidAssignmentError
from dynamix_byteps.data.gradient_noise import GradientNoiseScale
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.negotiation import negotiate, round_lock

_lock = threading.Lock()
_schedule: AssignmentSchedule | None = None
# (step, samples, epoch, epoch samples drawn through this step); bounded when nobody consumes
_draws: collections.deque[tuple[int, int, int, int]] = collections.deque(maxlen=4096)
_trained: tuple[int, int] | None = None  # (epoch, samples) of the newest draw the optimizer took
_consumed = False  # an optimizer takes the draws: unconsumed ones are prefetched, not trained on
_noise: GradientNoiseScale | None = None


def install(schedule: AssignmentSchedule) -> None:
    """Make ``schedule`` the process's schedule (the sampler does this) and forget old draws.

    One DynamicBatchSampler drives a job: a newer one replaces an older one that has drawn
    batches, with a warning (use a plain DataLoader for validation).
    """
    global _schedule, _consumed, _trained
    with _lock:
        if _schedule is not None and _consumed:
            warnings.warn("a new DynamicBatchSampler replaces the one training has used so far: set_batch_sizes "
                          "and DistributedOptimizer now follow the new one; use a plain DataLoader for "
                          "validation data", stacklevel=3)
        _schedule = schedule
        _draws.clear()
        _consumed, _trained = False, None


def schedule() -> AssignmentSchedule | None:
    return _schedule


def record_draw(step: int, samples: int, epoch: int = 0, epoch_samples: int = 0) -> None:
    """The sampler handed out ``samples`` indices for global ``step``, in ``epoch``, whose
    global batches through this step hold ``epoch_samples`` samples."""
    with _lock:
        _draws.append((step, samples, epoch, epoch_samples))


def forget_draws() -> int | None:
    """Drop draws not yet trained on (a new pass over the loader discards prefetched batches);
    returns the step of the oldest one, which the sampler then draws again, or None."""
    with _lock:
        oldest = _draws[0][0] if _draws and _consumed else None
        _draws.clear()
        return oldest


def training_started() -> bool:
    """True once an optimizer took a draw of the installed sampler (its first step)."""
    return _consumed


def take_draw() -> tuple[int, int] | None:
    """The oldest ``(step, samples)`` not yet consumed by the optimizer, or None."""
    global _consumed, _trained
    with _lock:
        _consumed = True
        if not _draws:
            return None
        step, samples, epoch, epoch_samples = _draws.popleft()
        _trained = (epoch, epoch_samples)
        return step, samples


def trained_position() -> tuple[int, int] | None:
    """``(epoch, samples)`` of the newest step the optimizer took from the sampler: the epoch and
    how many of its samples (all workers together) were drawn through that step; None before."""
    return _trained


def register_noise(noise: GradientNoiseScale) -> None:
    """The gradient statistics that :func:`gradient_noise_scale` reports (the newest optimizer's)."""
    global _noise
    _noise = noise


def gradient_noise_scale() -> float | None:
    """B_noise = tr(Σ)/|G|² (McCandlish et al. 2018), smoothed; None before the first estimate.

    Estimated by ``DistributedOptimizer`` from every worker's local squared gradient norm at
    its batch b_i and the aggregated norm at B = Σ b_i (:mod:`dynamix_byteps.data.gradient_noise`).
    """
    return None if _noise is None else _noise.noise_scale


def gradient_statistics() -> dict:
    """The smoothed terms behind :func:`gradient_noise_scale`: ``grad_sq`` (|G|²), ``trace_cov``
    (tr(Σ), per sample), ``noise_scale``, and the counts of used and skipped steps."""
    if _noise is None:
        return {"grad_sq": None, "trace_cov": None, "noise_scale": None, "steps": 0, "skipped": 0}
    return {"grad_sq": _noise.grad_sq, "trace_cov": _noise.trace_cov, "noise_scale": _noise.noise_scale,
            "steps": _noise.steps, "skipped": _noise.skipped}


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


def set_batch_sizes(batch_sizes: Sequence[int], at_step: int | None = None) -> Assignment:
    """Switch every worker to ``batch_sizes`` (one per rank) at global step ``at_step``.

    A collective: every worker must call it with the same arguments; the workers check that
    they agree before anything changes. ``at_step`` defaults to the first step not yet drawn
    by this worker's sampler (which must then agree across workers too).

    Returns:
        The new :class:`Assignment`.

    Raises:
        ConfigurationError: no ``DynamicBatchSampler`` exists yet.
        InvalidAssignmentError: ``batch_sizes`` is not a sequence (a list, tuple, NumPy array or
            integer tensor), a size is not an integer >= 1, out of bounds, the wrong count,
            larger than the dataset in total, or ``at_step`` was already drawn; the previous
            assignment stays in force.
        TensorMismatchError: the workers passed different arguments.
    """
    current = _schedule
    if current is None:
        raise ConfigurationError("set_batch_sizes needs a DynamicBatchSampler; create one before changing batch sizes")
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
