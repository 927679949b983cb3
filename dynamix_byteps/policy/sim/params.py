"""Parameters of the training simulator: one frozen dataclass tree, serialisable to JSON.

:class:`SimParams` holds everything :class:`~dynamix_byteps.policy.sim.dynamics.Simulator` needs:

* per worker (:class:`WorkerParams`): compute time per step ``(a_i + b_i/θ_i) · slowdown_i(f)``
  with lognormal jitter, and an optional own link bandwidth;
* communication (:class:`CommParams`): under a ring (``engine="ring"``),
  ``latency + 2 · model_bytes / min_i bandwidth_i`` per step (push then pull; a synchronous round
  waits for the slowest link); under parameter servers (``engine="ps"``), each worker's own
  ``latency/2 + model_bytes / bandwidth_i`` to push and as much to pull, over its own link;
* the statistical model (:class:`StatParams`, formulas in :mod:`.dynamics`);
* the job: initial local batches, bounds, decision interval K, episode cap, dataset size.

``f`` in a slowdown window is the fraction of the way from the initial loss to the target loss,
the simulator's "budget" (scenario windows are fractions of a run's budget, see
:mod:`dynamix_byteps.scenarios`). ``to_json``/``from_json`` round-trip exactly; ``from_dict``
rejects unknown keys so a fitted file from a newer version fails loudly, and a number outside its
field's range (``metadata["range"]``, e.g. ``noise_growth`` in [0, 10]) naming the field and the range.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.env import MAX_BATCH
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.scenarios import Scenario

__all__ = ["ENGINES", "CommParams", "SimParams", "StatParams", "Window", "WorkerParams", "from_scenario", "loss_remaining",
           "reference", "scaled_start", "starting_at"]

SCHEMA_VERSION = 1
#: Communication topologies the simulator models: a ring all-reduce, or parameter servers.
ENGINES = ("ring", "ps")


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ConfigurationError(f"simulator parameter {what}")


def _positive(x, name: str) -> None:
    _check(isinstance(x, (int, float)) and math.isfinite(x) and x > 0, f"{name}={x!r} must be a finite number > 0")


def _non_negative(x, name: str) -> None:
    _check(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0, f"{name}={x!r} must be a finite number >= 0")


def _ranged(low: float, high: float, default=None, *, low_open: bool = False, optional: bool = False):
    """A number field whose value in a parameters file (:meth:`SimParams.from_dict`) must lie in
    ``[low, high]`` (``(low, high]`` with ``low_open``; None too with ``optional``): bounds far
    beyond any real job, inside which the simulator's arithmetic stays finite, also after
    :func:`~dynamix_byteps.policy.sim.randomise.randomised` scales a value by up to 5."""
    spec = {"metadata": {"range": (low, high, low_open, optional)}}
    return field(**spec) if default is None and not optional else field(default=default, **spec)


def _check_range(cls, data: dict) -> None:
    """ConfigurationError naming the first field of ``data`` outside its ``cls`` field's range."""
    for f in fields(cls):
        if "range" not in f.metadata or f.name not in data:
            continue
        low, high, low_open, optional = f.metadata["range"]
        x = data[f.name]
        if optional and x is None:
            continue
        number = isinstance(x, (int, float)) and not isinstance(x, bool)
        _check(number and (low < x if low_open else low <= x) and x <= high,
               f"{f.name}={x!r} must be a number in {'(' if low_open else '['}{low:g}, {high:g}]"
               + (" or null" if optional else ""))


def _whole(x, name: str, high: int | None = None) -> None:
    """An integer >= 1 (numpy's too), at most ``high`` when given; a bool or 32.9 is refused."""
    _check(isinstance(x, numbers.Integral) and not isinstance(x, bool) and 1 <= x <= (high or x),
           f"{name}={x!r} must be an integer >= 1" + (f" and <= {high}" if high else ""))


@dataclass(frozen=True)
class Window:
    """Compute ``factor`` (>= 1) times slower while the progress fraction is in ``[start, end)``."""

    factor: float = _ranged(1.0, 1e6)
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self):
        _check(math.isfinite(self.factor) and self.factor >= 1.0, f"slowdown factor={self.factor!r} must be >= 1")
        _check(0.0 <= self.start < self.end <= 1.0, f"slowdown window [{self.start}, {self.end}) must satisfy 0 <= start < end <= 1")


@dataclass(frozen=True)
class WorkerParams:
    """One worker.

    Attributes:
        fixed_s: a_i, seconds per step that do not depend on the batch (framework, data loading).
        samples_per_s: θ_i, throughput of the batch-dependent part (samples/s).
        jitter: relative standard deviation of one step's compute time (lognormal, mean 1).
        slowdowns: time-varying slowdown windows (factors multiply where they overlap).
        bandwidth_bytes_per_s: this worker's link, None = :attr:`CommParams.bandwidth_bytes_per_s`.
    """

    fixed_s: float = _ranged(0.0, 1e6, 0.01)
    samples_per_s: float = _ranged(1e-6, 1e12, 2000.0)
    jitter: float = _ranged(0.0, 10.0, 0.05)
    slowdowns: tuple[Window, ...] = ()
    bandwidth_bytes_per_s: float | None = _ranged(1.0, 1e15, optional=True)

    def __post_init__(self):
        _non_negative(self.fixed_s, "fixed_s")
        _positive(self.samples_per_s, "samples_per_s")
        _non_negative(self.jitter, "jitter")
        if self.bandwidth_bytes_per_s is not None:
            _positive(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s")

    def slowdown_at(self, fraction: float) -> float:
        """Product of the factors of the windows containing ``fraction``."""
        out = 1.0
        for w in self.slowdowns:
            if w.start <= fraction < w.end:
                out *= w.factor
        return out


@dataclass(frozen=True)
class CommParams:
    """Push/pull per step: ``latency_s + 2 · model_bytes / bandwidth`` (slowest link; under ``ps``
    each worker's own link), jittered.

    Attributes:
        model_bytes: gradient bytes per step (4 × parameters for float32).
        bandwidth_bytes_per_s: default link bandwidth (bytes/s).
        latency_s: fixed per-step latency (all collective rounds together), seconds.
        jitter: relative standard deviation per step (lognormal, mean 1).
    """

    model_bytes: float = _ranged(0.0, 1e15, 1.7e6)
    bandwidth_bytes_per_s: float = _ranged(1.0, 1e15, 1.25e8)
    latency_s: float = _ranged(0.0, 1e6, 5e-4)
    jitter: float = _ranged(0.0, 10.0, 0.05)

    def __post_init__(self):
        _non_negative(self.model_bytes, "model_bytes")
        _positive(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s")
        _non_negative(self.latency_s, "latency_s")
        _non_negative(self.jitter, "comm jitter")


@dataclass(frozen=True)
class StatParams:
    """Statistical efficiency, loss and accuracy model (formulas in :mod:`.dynamics`).

    Attributes:
        initial_loss, min_loss, target_loss: L0 > target > L_min (the episode ends at the target).
        steps_scale: τ, noise-free optimiser steps per e-fold of ``L − L_min`` (at the start,
            with a ``loss_tail``).
        loss_tail: α of a power-law tail, ``L − L_min ∝ (1 + E/(α·τ))^−α``, which tends to
            ``exp(−E/τ)`` as α grows; None: the exponential. Real loss curves fall fast, then
            slowly (α ≈ 1–1.5 for the example's CNN, fitted by ``dynamix sim fit``).
        noise_scale: B_noise at the initial loss (samples).
        noise_growth: γ in ``B_noise(L) = noise_scale · ((L0 − L_min)/(L − L_min))^γ``.
        gap_per_doubling: accuracy lost per doubling of the global batch above
            ``gap_free_ratio × M0``, once the gap has settled.
        gap_free_ratio: global batch (relative to the initial M0) without generalisation penalty.
        gap_steps: τ_g, noise-free steps over which the gap follows the batch size in use.
        chance_accuracy, max_accuracy: accuracy proxy at L0 and at L_min.
        loss_noise: relative standard deviation of one reported interval loss at M0.
        noise_scale_noise: relative (lognormal) standard deviation of the reported B_noise.
        measured_noise_scale, measured_noise_growth: the law (B0, γ) of the gradient noise scale
            the workers measure and the scheduler is shown; None: the law above. The measured
            estimate, B_simple of McCandlish et al. (arXiv 1812.06162, eq. 2.9), can be far from the
            B_noise at which larger batches stop paying; ``dynamix sim fit`` calibrates both laws
            from runs at several global batches.
    """

    initial_loss: float = _ranged(0.0, 1e6, 2.3)
    min_loss: float = _ranged(0.0, 1e6, 0.15)
    target_loss: float = _ranged(0.0, 1e6, 0.4)
    steps_scale: float = _ranged(0.0, 1e12, 120.0, low_open=True)
    noise_scale: float = _ranged(0.0, 1e12, 200.0, low_open=True)
    noise_growth: float = _ranged(0.0, 10.0, 1.0)
    gap_per_doubling: float = _ranged(0.0, 1.0, 0.02)
    gap_free_ratio: float = _ranged(1e-6, 1e6, 1.0)
    gap_steps: float = _ranged(0.0, 1e12, 50.0, low_open=True)
    chance_accuracy: float = _ranged(0.0, 1.0, 0.1)
    max_accuracy: float = _ranged(0.0, 1.0, 0.92)
    loss_noise: float = _ranged(0.0, 10.0, 0.02)
    noise_scale_noise: float = _ranged(0.0, 10.0, 0.2)
    measured_noise_scale: float | None = _ranged(0.0, 1e12, low_open=True, optional=True)
    measured_noise_growth: float | None = _ranged(0.0, 10.0, optional=True)
    loss_tail: float | None = _ranged(0.0, 1e6, low_open=True, optional=True)

    def __post_init__(self):
        optional = ("measured_noise_scale", "measured_noise_growth", "loss_tail")
        for f in fields(self):
            if f.name not in optional or getattr(self, f.name) is not None:
                _non_negative(getattr(self, f.name), f.name)
        for name in ("steps_scale", "noise_scale", "gap_free_ratio", "gap_steps"):
            _positive(getattr(self, name), name)
        _check(self.initial_loss > self.target_loss > self.min_loss,
               f"losses must satisfy initial_loss > target_loss > min_loss, got {self.initial_loss}, "
               f"{self.target_loss}, {self.min_loss}")
        _check(self.max_accuracy > self.chance_accuracy, "max_accuracy must exceed chance_accuracy")
        if self.measured_noise_scale is not None:
            _positive(self.measured_noise_scale, "measured_noise_scale")
        if self.loss_tail is not None:
            _positive(self.loss_tail, "loss_tail")

    def remaining(self, effective_steps):
        """``(L − L_min)/(L0 − L_min)`` after ``effective_steps`` noise-free steps E (float or
        array, >= 0): :func:`loss_remaining` of ``E/τ`` and the ``loss_tail``."""
        return loss_remaining(np.asarray(effective_steps, dtype=np.float64) / self.steps_scale, self.loss_tail)


def loss_remaining(scaled_steps, tail: float | None):
    """``exp(−s)`` for ``tail`` None, else ``(1 + s/α)^−α`` (α = ``tail`` > 0), of ``s = E/τ`` >= 0
    (float or array): the fraction of ``L0 − L_min`` left (:class:`StatParams`)."""
    if tail is None:
        return np.exp(-scaled_steps)
    return (1.0 + scaled_steps / tail) ** -tail


@dataclass(frozen=True)
class SimParams:
    """A simulated job (module docstring). ``len(workers) == len(initial_batch)``.

    Attributes:
        workers: one :class:`WorkerParams` per rank.
        initial_batch: starting local batch per rank (samples).
        min_batch, max_batch: bounds of every local batch.
        decision_interval: K, optimiser steps per decision.
        max_decisions: episode cap (truncation) in decisions.
        dataset_size: samples per epoch (reported to policies).
        node_metrics: whether node-agent metrics (cpu_util, rtt_s, retransmits) are reported.
        comm, stats: :class:`CommParams`, :class:`StatParams`.
        scenario: the scenario it was built from, for reports.
        engine: ``"ring"`` (the slowest link paces every worker) or ``"ps"`` (each worker pushes and
            pulls over its own link; :mod:`.dynamics` has both step-time laws).
    """

    workers: tuple[WorkerParams, ...]
    initial_batch: tuple[int, ...]
    min_batch: int = 8
    max_batch: int = 1024
    decision_interval: int = 20
    max_decisions: int = 250
    dataset_size: int = 60000
    node_metrics: bool = True
    comm: CommParams = field(default_factory=CommParams)
    stats: StatParams = field(default_factory=StatParams)
    scenario: str = ""
    engine: str = "ring"

    def __post_init__(self):
        _check(len(self.workers) >= 1, "workers must hold at least one worker")
        for name in ("min_batch", "max_batch"):
            _whole(getattr(self, name), name, MAX_BATCH)
        for batch in self.initial_batch:
            _whole(batch, "initial_batch entry", MAX_BATCH)
        for name in ("decision_interval", "max_decisions", "dataset_size"):
            _whole(getattr(self, name), name)
        _check(isinstance(self.node_metrics, bool), f"node_metrics={self.node_metrics!r} must be true or false")
        _check(len(self.initial_batch) == len(self.workers),
               f"initial_batch has {len(self.initial_batch)} entries for {len(self.workers)} workers")
        _check(1 <= self.min_batch <= self.max_batch, f"bounds [{self.min_batch}, {self.max_batch}] must satisfy 1 <= min <= max")
        _check(all(self.min_batch <= b <= self.max_batch for b in self.initial_batch),
               f"initial_batch {list(self.initial_batch)} must lie within [{self.min_batch}, {self.max_batch}]")
        _check(self.decision_interval >= 1 and self.max_decisions >= 1 and self.dataset_size >= 1,
               "decision_interval, max_decisions and dataset_size must be >= 1")
        _check(self.engine in ENGINES, f"engine={self.engine!r} must be one of {', '.join(ENGINES)}")

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    # -- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> SimParams:
        """Inverse of :meth:`to_dict`. Raises :class:`ConfigurationError` on unknown or bad fields."""
        if not isinstance(data, dict):
            raise ConfigurationError(f"simulator parameters must be a JSON object, not {type(data).__name__}")
        data = dict(data)
        version = data.pop("schema_version", SCHEMA_VERSION)
        _check(version == SCHEMA_VERSION, f"schema_version={version!r}; this version reads {SCHEMA_VERSION}")
        try:
            workers = tuple(
                _build(WorkerParams, dict(w, slowdowns=tuple(_build(Window, s) for s in w.get("slowdowns", ()))))
                for w in data.pop("workers")
            )
            comm = _build(CommParams, data.pop("comm", {}))
            stats = _build(StatParams, data.pop("stats", {}))
            data["initial_batch"] = tuple(data.pop("initial_batch"))
        except (KeyError, TypeError, AttributeError) as error:
            raise ConfigurationError(f"simulator parameters are malformed: {error!r}") from None
        return _build(cls, dict(data, workers=workers, comm=comm, stats=stats))

    def to_json(self, path: str | os.PathLike) -> None:
        """Write atomically (:func:`dynamix_byteps.atomic.write_atomic`); raises OSError."""
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> SimParams:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as error:
            raise ConfigurationError(f"cannot read simulator parameters {path}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise ConfigurationError(f"simulator parameters {path} are not JSON: {error}") from None
        try:
            return cls.from_dict(data)
        except ConfigurationError as error:
            raise ConfigurationError(f"{path}: {error}") from None


def _build(cls, data: dict):
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    _check(not unknown, f"{cls.__name__} has no field(s) {sorted(unknown)}; known: {sorted(names)}")
    _check_range(cls, data)
    return cls(**data)


def reference(workers: int = 4) -> SimParams:
    """The reference job: ``workers`` equal workers at 32 samples each, the field defaults.

    It stands for a small CNN (1.7 MB of float32 gradients, like ``examples/torch_fashion_mnist.py``)
    on CPUs behind 1 Gbit/s links; ``dynamix sim fit`` replaces it with a run's own numbers.
    """
    return SimParams(workers=(WorkerParams(),) * workers, initial_batch=(32,) * workers)


def from_scenario(scenario: Scenario, workers: int | None = None, base: SimParams | None = None) -> SimParams:
    """``base`` (default: :func:`reference`) shaped by a named scenario.

    With ``workers`` larger than the scenario's, rank ``r`` takes the role of scenario rank
    ``r mod scenario.workers`` (the pattern is tiled); ``base.workers[r mod len(base.workers)]``
    gives its speed. Slowdowns become :class:`Window`\\ s; a link's ``rate_mbit`` becomes
    that worker's ``bandwidth_bytes_per_s`` (rate × 10⁶ / 8).
    """
    n = int(workers or scenario.workers)
    _check(n >= 1, f"workers={workers!r} must be >= 1")
    base = base or reference()
    links = {link.rank: link.rate_mbit * 1e6 / 8.0 for link in scenario.links}
    out = []
    for r in range(n):
        role = r % scenario.workers
        w = base.workers[r % base.num_workers]
        windows = tuple(Window(s.factor, s.start, s.end) for s in scenario.slowdowns if s.rank == role)
        out.append(replace(w, slowdowns=w.slowdowns + windows,
                           bandwidth_bytes_per_s=links.get(role, w.bandwidth_bytes_per_s)))
    initial = tuple(base.initial_batch[r % base.num_workers] for r in range(n))
    return replace(base, workers=tuple(out), initial_batch=initial, scenario=scenario.name)


def starting_at(params: SimParams, initial_batch: tuple[int, ...]) -> SimParams:
    """``params`` with the job starting at ``initial_batch`` (samples per rank, shape (N,)).

    What a user's choice of starting batch changes is only where the run starts: the job's
    gap-free global batch and its loss noise stay where they were. Both are stated relative to the
    initial global batch M0 (``gap_free_ratio·M0``, ``loss_noise·√(M0/M)``), so they are rescaled
    by ``M0_old/M0_new`` and its square root.

    Raises:
        ConfigurationError: ``initial_batch`` has another length than the job's workers, or an
            entry outside ``[min_batch, max_batch]``.
    """
    initial = tuple(int(b) for b in initial_batch)
    ratio = sum(params.initial_batch) / max(1, sum(initial))
    stats = replace(params.stats, gap_free_ratio=params.stats.gap_free_ratio * ratio,
                    loss_noise=params.stats.loss_noise * math.sqrt(ratio))
    return replace(params, initial_batch=initial, stats=stats)


def scaled_start(params: SimParams, factor: float) -> SimParams:
    """:func:`starting_at` every rank's initial batch times ``factor``, rounded and clipped to the
    job's bounds."""
    return starting_at(params, tuple(min(max(round(b * factor), params.min_batch), params.max_batch)
                                     for b in params.initial_batch))
