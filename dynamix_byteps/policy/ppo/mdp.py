"""The agent's actions and reward (the MDP of DYNAMIX, arXiv 2510.08522 §III), shared by the
simulator and the scheduler's ``ppo`` policy. numpy only.

**Action.** One index per worker into a geometric ladder of factors, by default :data:`LADDER`
(÷2, ÷1.4, keep, ×1.4, ×2); a policy is trained with one of :data:`LADDERS` and records it in its
``features.json``. The new local batch is ``round(b_i · factor)``, kept within
``[ceil(b_i/2), floor(2·b_i)]`` (the guardrails' default maximum change, so they never clip a
ladder step) and then within the worker's ``[min_batch, max_batch]``; see :func:`apply_ladder`.
The default's rungs are 1.4 apart: on the straggler job of ``benchmarks/time_to_accuracy.py`` a
fast worker at 64 beside a straggler held at the lower bound can only go to 90 (slower than the
straggler) or stay idle a fifth of each step, where the heuristics settle at ~80. The ``fine``
ladder (÷1.4, ÷1.18, keep, ×1.18, ×1.4) reaches the sizes between, and ``full`` (÷2, ÷1.4, ÷1.18,
keep, ×1.18, ×1.4, ×2: seven actions, so a network of its own) keeps the large steps too.

**Reward** per decision interval (:func:`reward`)::

    r = w_progress · ΔP − λ · Δt / t_ref − μ · mean_i |log2(b_i' / b_i)|   (+ w_acc · (acc − acc*) at the end)

* ``ΔP``: training progress in the interval, the loss decrease as a fraction of the way from
  the initial loss to the target loss (sums to 1 over an episode that reaches the target);
* ``Δt / t_ref``: the interval's wall-clock seconds over the reference interval (the initial
  allocation's step time × K at the start of the run), so ``λ`` is the cost of one
  static-speed interval;
* ``mean |log2 change|``: batch churn (each change costs a re-partition and an LR jump);
* terminal: ``acc`` the final accuracy proxy, ``acc*`` the proxy at the target loss without
  generalisation gap, so the term is ≈ −w_acc · gap when the target is reached.

The accuracy term stays terminal on purpose: paying the gap as it accrues (potential-based
shaping) made growing the batch early look costly until the agent had learnt to shrink it
later, and training settled on never growing it (measured: mean return −2.3 against −1.9
after 150 iterations).

Weights are :class:`RewardWeights`. Defaults: λ = 0.03 per reference interval, μ = 0.02,
w_acc = 30, so one point of final accuracy (0.3) weighs as much as 10 reference intervals, about
10 % of the reference job's time to target; with them, neither "never change the global batch"
nor "maximise goodput" is the best schedule of the simulator's reference job.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.base import ClusterState

__all__ = ["KEEP", "LADDER", "LADDERS", "LADDER_LENGTHS", "MAX_FACTOR", "RewardWeights", "apply_actions", "apply_ladder", "check_ladder",
           "keep_index", "ladder_actions", "ladder_factors", "reward"]

#: Batch-size factors an action index selects (index :data:`KEEP` = no change): the default ladder.
LADDER = (0.5, 1.0 / 1.4, 1.0, 1.4, 2.0)
#: The ladders ``dynamix policy train --ladder NAME`` offers (module docstring).
LADDERS = {"coarse": LADDER, "fine": (1.0 / 1.4, 1.0 / math.sqrt(1.4), 1.0, math.sqrt(1.4), 1.4),
           "full": (0.5, 1.0 / 1.4, 1.0 / math.sqrt(1.4), 1.0, math.sqrt(1.4), 1.4, 2.0)}
KEEP = 2
MAX_FACTOR = 2.0
#: The numbers of steps a ladder may have (odd: "keep" in the middle).
LADDER_LENGTHS = (3, 5, 7, 9)


def ladder_factors(name: str) -> tuple[float, ...]:
    """The factors of the ladder called ``name`` in :data:`LADDERS`.

    Raises:
        ConfigurationError: an unknown name (the message lists the known ones).
    """
    if name not in LADDERS:
        raise ConfigurationError(f"unknown action ladder {name!r}; known: {', '.join(LADDERS)}")
    return LADDERS[name]


def keep_index(steps: int) -> int:
    """The index of "keep" (factor 1) in a ladder of ``steps`` factors (:func:`check_ladder`): its middle."""
    return steps // 2


def check_ladder(factors, where: str = "ladder") -> tuple[float, ...]:
    """``factors`` as a ladder tuple: an odd number (3 to 9) of finite factors, increasing, 1 in
    the middle (:func:`keep_index`), within ``[1/MAX_FACTOR, MAX_FACTOR]``.

    Raises:
        ConfigurationError: anything else (``where`` names the source, e.g. a features.json).
    """
    try:
        ladder = tuple(float(f) for f in factors)
    except (TypeError, ValueError):
        ladder = ()
    ok = (len(ladder) in LADDER_LENGTHS and all(math.isfinite(f) for f in ladder)
          and all(a < b for a, b in itertools.pairwise(ladder)) and math.isclose(ladder[keep_index(len(ladder))], 1.0)
          and 1.0 / MAX_FACTOR - 1e-9 <= ladder[0] and ladder[-1] <= MAX_FACTOR + 1e-9)
    if not ok:
        raise ConfigurationError(f"{where}: {factors!r} is not an action ladder: 3, 5, 7 or 9 increasing factors "
                                 f"with 1 in the middle, within [1/{MAX_FACTOR:g}, {MAX_FACTOR:g}] (e.g. "
                                 f"{[round(f, 4) for f in LADDER]})")
    return ladder


@dataclass(frozen=True)
class RewardWeights:
    """Reward weights (module docstring). All >= 0.

    Attributes:
        progress: w_progress, per unit of normalised progress ΔP.
        step_time: λ, per reference interval of wall-clock time.
        batch_change: μ, per unit of mean |log2 batch change| across workers.
        accuracy: w_acc, per unit (1.0 = 100 points) of final accuracy proxy.
    """

    progress: float = 1.0
    step_time: float = 0.03
    batch_change: float = 0.02
    accuracy: float = 30.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigurationError(f"reward weight {f.name}={v!r} must be a finite number >= 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> RewardWeights:
        """Build from a (possibly partial) dict of name -> number (None: the defaults).

        Raises:
            ConfigurationError: ``data`` is no dict, a key is unknown, or a value is no finite number >= 0.
        """
        if data is not None and not isinstance(data, dict):
            raise ConfigurationError(f"reward weights must be an object of name: number, not {type(data).__name__}")
        data = data or {}
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigurationError(f"unknown reward weight(s) {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        # anything but a number is left to __post_init__, which refuses it naming the weight
        return cls(**{k: float(v) if isinstance(v, (int, float)) else v for k, v in data.items()})


def apply_ladder(batch: np.ndarray, actions: np.ndarray, low: np.ndarray, high: np.ndarray,
                 ladder: tuple[float, ...] = LADDER) -> np.ndarray:
    """New local batch sizes for ladder ``actions``.

    Args:
        batch: current sizes, int array (N,), each >= 1.
        actions: ladder indices, int array (N,), each in ``[0, len(ladder))``.
        low, high: inclusive bounds, arrays (N,) (``high`` may hold ``inf``).
        ladder: the factors (:func:`check_ladder`).

    Returns:
        int64 array (N,) (module docstring for the rule).

    Raises:
        ValueError: on mismatched shapes or an index outside the ladder.
    """
    batch = np.asarray(batch, dtype=np.int64)
    actions = np.asarray(actions, dtype=np.int64)
    if batch.shape != actions.shape or batch.shape != np.shape(low) or batch.shape != np.shape(high):
        raise ValueError(f"batch {batch.shape}, actions {actions.shape}, bounds {np.shape(low)}/{np.shape(high)} differ")
    if actions.size and (actions.min() < 0 or actions.max() >= len(ladder)):
        raise ValueError(f"action indices must be in 0..{len(ladder) - 1}, got {actions.tolist()}")
    factors = np.asarray(ladder)[actions]
    b = batch.astype(np.float64)
    new = np.rint(b * factors)
    new = np.clip(new, np.ceil(b / MAX_FACTOR - 1e-9), np.floor(b * MAX_FACTOR + 1e-9))
    new = np.minimum(np.maximum(new, np.asarray(low, dtype=np.float64)), np.asarray(high, dtype=np.float64))
    return np.maximum(new, 1).astype(np.int64)


def ladder_actions(batch: np.ndarray, target: np.ndarray, low: np.ndarray, high: np.ndarray,
                   ladder: tuple[float, ...] = LADDER, deadband: float = 0.0) -> np.ndarray:
    """The ladder indices that bring ``batch`` nearest to ``target``: the inverse of :func:`apply_ladder`.

    Per worker, the index whose :func:`apply_ladder` result is closest to the target in
    ``|log(result / target)|`` (ties go to the index nearer "keep"); "keep" outright when the
    target is within ``deadband`` of the current size (``|target / b − 1|`` below it in either
    direction, i.e. ``|log(target / b)| < log(1 + deadband)``).

    Args:
        batch, target: current and wanted local sizes, arrays (N,), each >= 1.
        low, high: inclusive bounds, arrays (N,) (``high`` may hold ``inf``).
        ladder: the factors (:func:`check_ladder`).
        deadband: relative change, >= 0, below which "keep" is chosen.

    Returns:
        int64 array (N,) of indices into ``ladder``.

    Raises:
        ValueError: mismatched shapes, a size below 1 or a negative dead band.
    """
    batch = np.asarray(batch, dtype=np.int64)
    target = np.asarray(target, dtype=np.float64)
    if batch.shape != target.shape or batch.ndim != 1:
        raise ValueError(f"batch {batch.shape} and target {target.shape} must be equal 1-d shapes")
    if batch.size and (batch.min() < 1 or target.min() < 1):
        raise ValueError(f"sizes must be >= 1, got batch {batch.tolist()} and target {target.tolist()}")
    if not deadband >= 0:
        raise ValueError(f"deadband {deadband!r} must be >= 0")
    keep = keep_index(len(ladder))
    results = np.stack([apply_ladder(batch, np.full(batch.shape, a), low, high, ladder) for a in range(len(ladder))])
    distance = np.abs(np.log(results / target)) + 1e-9 * np.abs(np.arange(len(ladder)) - keep)[:, None]
    actions = distance.argmin(axis=0)
    actions[np.abs(np.log(target / batch)) < math.log1p(deadband)] = keep
    return actions.astype(np.int64)


def apply_actions(state: ClusterState, actions, ladder: tuple[float, ...] = LADDER) -> tuple[int, ...]:
    """:func:`apply_ladder` on a :class:`ClusterState` (bounds: ``state.bounds``)."""
    low, high = state.bounds
    batch = np.maximum(np.array([int(w.batch_size) for w in state.workers], dtype=np.int64), 1)
    new = apply_ladder(batch, np.asarray(actions, dtype=np.int64).reshape(-1), low, high, ladder)
    return tuple(new.tolist())


def reward(weights: RewardWeights, progress: float, interval_s: float, ref_interval_s: float,
           before: np.ndarray, after: np.ndarray, terminal_accuracy: float | None = None) -> tuple[float, dict]:
    """One decision's reward and its terms (module docstring).

    Args:
        progress: ΔP, dimensionless.
        interval_s: the interval's wall-clock seconds; ``ref_interval_s`` the reference (> 0).
        before, after: local batch sizes before and after the decision, arrays (N,).
        terminal_accuracy: ``acc − acc*`` at the end of an episode, else None.

    Returns:
        ``(r, terms)`` with ``terms`` holding each weighted part (``progress``, ``step_time``,
        ``batch_change``, ``accuracy``) for the decision log.
    """
    change = float(np.mean(np.abs(np.log2(np.asarray(after, float) / np.asarray(before, float))))) if len(before) else 0.0
    terms = {
        "progress": weights.progress * progress,
        "step_time": -weights.step_time * interval_s / ref_interval_s,
        "batch_change": -weights.batch_change * change,
        "accuracy": weights.accuracy * terminal_accuracy if terminal_accuracy is not None else 0.0,
    }
    return sum(terms.values()), terms
