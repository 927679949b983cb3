"""Guardrails shared by every policy: fallback, bounds, maximum change, hysteresis.

:class:`Guarded` wraps any :class:`~dynamix_byteps.policy.base.Policy` and is itself one. The
rules, applied in this order:

1. **Fallback.** If the newest entry of ``state.loss_history`` is NaN/inf, or the loss rose in
   each of the last ``w = divergence_window`` intervals (``w + 1`` finite values, strictly
   increasing) *and* the mean of the last ``w`` values exceeds the mean of the (up to) ``w``
   values before them by more than ``DIVERGENCE_TOLERANCE`` (20%), answer
   ``state.initial_batch_sizes`` (clamped to the bounds) at once; the wrapped
   policy is not consulted and rules 2–5 do not apply (getting back to a known-good allocation
   must not be slowed down).
2. **Settling.** If some worker's measurements are of a batch other than the one in force
   (``batch_size_ran`` off ``batch_size`` by more than ``SETTLE_TOLERANCE``: the last
   assignment has not taken effect on every worker for a whole interval yet), keep the current
   sizes without consulting the policy, at most ``settle_limit`` decisions in a row. Workers
   switch at their next interval boundary, so the interval right after a change still ran the
   old sizes; a policy that read those timings as the new sizes' would correct a change that
   has not happened (the served PPO policy oscillated every decision on real runs).
3. **Bounds.** Each proposed ``b_i`` is clamped to ``[max(1, min_batch_i), max_batch_i]``; a
   missing, non-integer or non-finite proposal (or one with the wrong length, or a policy that
   raised) keeps the current size.
4. **Maximum change.** Each ``b_i`` stays within ``[ceil(now_i / max_change),
   floor(now_i × max_change)]`` (and >= 1), widened to at least one sample each way when
   ``max_change > 1`` (else a size below about ``1 / (max_change - 1)`` could never move),
   intersected with the bounds (bounds win when the two
   do not overlap). With ``preserve_global_batch`` (default) what clipping removes or adds is
   spread over the workers that still have room, in proportion to their proposed sizes, so the
   proposal's global batch is kept when the windows allow it (the proportional policy's promise
   "the global batch is unchanged" survives the clip).
5. **Hysteresis.** A change is made only when the sizes the policy aims for (its proposal within
   the bounds, rule 3) are predicted to gain at least ``hysteresis`` and the step rule 4 allows
   towards them is predicted to gain something (> 0). Each gain is the policy's
   ``predicted_gain`` for its own proposal, else re-evaluated with the policy's
   ``predict_gain(state, sizes)`` if it has one. Judging the target rather than the step keeps a
   small ``max_change`` from freezing the sizes: every step towards a target worth 30 % may
   itself gain less than the threshold. Otherwise the current sizes are kept, with a reason
   saying so and ``predicted_gain = 0``; the decision reports the step's gain. Policies that
   make no prediction (``reports_gain = False``, e.g. ``static``) skip this rule.

The threshold rule follows AdaptDL, which changes the batch size only when the predicted goodput
speed-up exceeds a threshold (petuum/adaptdl issue #27, ``_speedup_threshold``); the maximum
change bounds how far a single noisy measurement can move the allocation.

Every answer is a tuple of Python ints >= 1, one per worker, within the bounds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from dynamix_byteps.env import MAX_BATCH
from dynamix_byteps.policy.base import ClusterState, Decision, Policy, as_floats, integer_option
from dynamix_byteps.policy.proportional import bounded_split

__all__ = ["Guarded"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ranks(ranks: list[int]) -> str:
    """``ranks [1, 3]``, or a count when the list is long (reasons stay one short line)."""
    return f"ranks {ranks}" if len(ranks) <= 8 else f"{len(ranks)} ranks"


def _clamp(sizes: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """``sizes`` within ``[low, high]`` element-wise, float64 (``high`` may be inf)."""
    return np.minimum(np.maximum(sizes, low), high)


def _ints(sizes: np.ndarray) -> tuple[int, ...]:
    return tuple(int(b) for b in sizes.tolist())


def _as_list(proposal) -> list:
    try:
        return list(proposal)
    except TypeError:
        return []


# Relative rise of the windowed mean loss that counts as divergence. Interval means of a healthy
# run on Fashion-MNIST wobble by ~10%, so three rises in a row happen by chance every few dozen
# decisions; on the recorded straggler runs a 10% rise from the window's first value tripped the
# fallback 1-4 times per run, a 20% rise of the mean never did.
DIVERGENCE_TOLERANCE = 0.20
# Relative gap between the batch that ran and the batch in force below which an interval counts
# as measured at the assignment in force (the last partial batch of an epoch lowers the mean a bit).
SETTLE_TOLERANCE = 0.10
SETTLING = "settling"  # key of a rule-2 wait in ``terms["guard"]`` (readers of the decision log look for it)

class Guarded(Policy):
    """A policy with guardrails (module docstring); ``name`` is the wrapped policy's.

    Args:
        policy: the policy to guard.
        max_change: largest factor by which one worker's size may grow or shrink per decision
            (>= 1; 1 freezes every size, ``math.inf`` disables the rule); any factor above 1 lets a
            size move by at least one sample.
        hysteresis: minimum relative predicted gain for a change (>= 0; 0.05 = 5 %).
        divergence_window: consecutive loss increases that trigger the fallback (0 disables the
            rising-loss test; a non-finite loss always triggers it).
        preserve_global_batch: keep the proposal's global batch through rule 4 when feasible.
        settle_limit: most decisions in a row rule 2 may skip (0 disables the rule).

    Raises:
        ValueError: on an invalid option.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        max_change: float = 2.0,
        hysteresis: float = 0.05,
        divergence_window: int = 3,
        preserve_global_batch: bool = True,
        settle_limit: int = 2,
    ):
        if not isinstance(policy, Policy):
            raise ValueError(f"Guarded wraps a Policy, got {type(policy).__name__}")
        if not (float(max_change) >= 1.0):
            raise ValueError(f"max_change must be >= 1, got {max_change!r}")
        if not (math.isfinite(float(hysteresis)) and float(hysteresis) >= 0.0):
            raise ValueError(f"hysteresis must be a finite number >= 0, got {hysteresis!r}")
        self.policy = policy
        self.name = policy.name
        self.max_change = float(max_change)
        self.hysteresis = float(hysteresis)
        self.divergence_window = integer_option("divergence_window", divergence_window, 0)
        self.preserve_global_batch = bool(preserve_global_batch)
        self.settle_limit = integer_option("settle_limit", settle_limit, 0)
        self._settle_waits = 0  # decisions skipped in a row by rule 2

    # -- rule 1 ------------------------------------------------------------------------------
    def divergence(self, loss_history: Sequence[float]) -> str | None:
        """Why training looks diverged, or None (rule 1)."""
        if not loss_history:
            return None
        try:
            last = float(loss_history[-1])
        except (TypeError, ValueError):
            return "latest loss is not a number"
        if not math.isfinite(last):
            return f"latest loss is {last}"
        w = self.divergence_window
        if w > 0 and len(loss_history) >= w + 1:
            window = [float(x) for x in loss_history[-2 * w:]]
            before, last = window[:-w], window[-w:]
            rising = [window[-w - 1], *last]
            if not (all(math.isfinite(x) for x in window) and all(b > a for a, b in itertools.pairwise(rising))):
                return None
            mean_before, mean_last = sum(before) / len(before), sum(last) / w
            if mean_last - mean_before > DIVERGENCE_TOLERANCE * abs(mean_before):
                return (f"loss rose in each of the last {w} intervals ({rising[0]:.4g} → {rising[-1]:.4g}, "
                        f"mean {mean_before:.4g} → {mean_last:.4g})")
        return None

    # -- rule 2 ------------------------------------------------------------------------------
    @staticmethod
    def unsettled(state: ClusterState) -> list[int]:
        """Ranks whose last interval ran a batch other than the one in force (rule 2)."""
        return [w.rank for w in state.workers
                if w.batch_size_ran is not None and abs(w.batch_size_ran - w.batch_size) > SETTLE_TOLERANCE * w.batch_size]

    # -- rules 3 and 4 -----------------------------------------------------------------------
    def _windows(self, current: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rule 4's window ``[lo, hi]`` per worker around ``current``, intersected with the bounds."""
        if math.isfinite(self.max_change):
            c_lo = np.ceil(current / self.max_change - 1e-9)
            c_hi = np.floor(current * self.max_change + 1e-9)
            if self.max_change > 1.0:
                c_lo, c_hi = np.minimum(c_lo, current - 1), np.maximum(c_hi, current + 1)
            c_lo = np.maximum(1.0, c_lo)
            c_hi = np.maximum(c_lo, c_hi)
        else:
            c_lo, c_hi = np.ones(len(current)), np.full(len(current), math.inf)
        lo, hi = np.maximum(low, c_lo), np.minimum(high, c_hi)
        miss = lo > hi  # the change window misses the bounds: bounds win, nearest edge
        if miss.any():
            edge = np.where(c_hi < low, low, high)
            lo, hi = np.where(miss, edge, lo), np.where(miss, edge, hi)
        return lo, hi

    @staticmethod
    def _sanitise(state: ClusterState, raw: list, current: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """float64 integers from the proposal ``raw``; a bad entry (or a bad proposal) keeps the current size."""
        if len(raw) != len(current):
            return current, [f"proposal has {len(raw)} sizes for {len(current)} workers; keeping current sizes"]
        values = as_floats(raw)
        if values.shape != current.shape:  # every entry is itself a sequence
            values = np.full(current.shape, math.nan)
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(values) & (values == np.trunc(values))
        if ok.all():
            return values, []
        bad = [state.workers[i].rank for i in np.flatnonzero(~ok)]
        return np.where(ok, values, current), [f"{_ranks(bad)}: invalid proposal, kept current size"]

    def _gain(self, state: ClusterState, decision: Decision, raw: list, sizes: tuple[int, ...]) -> float:
        """Predicted relative gain of ``sizes``: the policy's own for its unchanged proposal ``raw``
        (also when it cannot re-evaluate other sizes), else its ``predict_gain`` (nan if that raised)."""
        if list(sizes) == raw or not hasattr(self.policy, "predict_gain"):
            return decision.predicted_gain
        try:
            return float(self.policy.predict_gain(state, list(sizes)))
        except Exception:  # noqa: BLE001 - the control plane must never stop training
            return float("nan")

    # -- the policy ----------------------------------------------------------------------------
    def decide(self, state: ClusterState) -> Decision:
        workers = state.workers
        if not workers:
            return Decision((), f"{self.name}: no workers")
        low, high = state.bounds
        current = np.maximum(np.array([int(w.batch_size) for w in workers], dtype=np.float64), 1.0)
        now = _ints(_clamp(current, low, high))

        # 1. fallback
        why = self.divergence(state.loss_history)
        if why is not None:
            initial = list(state.initial_batch_sizes)
            if len(initial) != len(workers):
                initial = [int(w.batch_size) for w in workers]
            sizes = _clamp(np.maximum(np.array([int(b) for b in initial], dtype=np.float64), 1.0), low, high)
            return Decision(_ints(sizes), f"{self.name}: fallback to the initial allocation: {why}", 0.0,
                            {"guard": {"fallback": why}})

        # 2. settling
        pending = self.unsettled(state)
        if pending and self._settle_waits < self.settle_limit:
            self._settle_waits += 1
            ran = [workers[r].batch_size_ran for r in pending[:8]]
            return Decision(now, f"{self.name}: waiting for the assignment in force to take effect "
                            f"({_ranks(pending)} ran {ran} per step in the last interval)", 0.0,
                            {"guard": {SETTLING: pending}})
        self._settle_waits = 0

        try:
            d = self.policy.decide(state)
        except Exception as exc:  # noqa: BLE001 - the control plane must never stop training
            return Decision(now, f"{self.name}: policy failed ({type(exc).__name__}: {exc}); keeping sizes",
                            0.0, {"guard": {"error": repr(exc)}})
        raw = _as_list(d.batch_sizes)
        proposal, notes = self._sanitise(state, raw, current)

        # 3. bounds (MAX_BATCH also where a worker has no upper bound, so sums stay finite)
        bounded = _clamp(np.clip(proposal, 1.0, MAX_BATCH), low, high)
        if (clipped := np.flatnonzero(bounded != proposal)).size:
            notes.append(f"{_ranks([workers[i].rank for i in clipped])} clamped to their bounds")

        # 4. maximum change
        lows, highs = self._windows(current, low, high)
        sizes = _clamp(bounded, lows, highs)
        if (clipped := np.flatnonzero(sizes != bounded)).size:
            notes.append(f"{_ranks([workers[i].rank for i in clipped])} limited to ×{self.max_change:g} change")
            if self.preserve_global_batch:
                sizes = np.array(bounded_split(int(bounded.sum()), bounded.tolist(), lows.astype(np.int64).tolist(),
                                               highs.tolist()), dtype=np.float64)
        final = _ints(sizes)

        # 5. hysteresis
        target = _ints(bounded)
        target_gain = self._gain(state, d, raw, target)
        gain = target_gain if final == target else self._gain(state, d, raw, final)
        guard = {"proposed": _ints(proposal), "notes": notes, "predicted_gain_after_guard": gain}
        if final != target:
            guard["predicted_gain_of_target"] = target_gain
        terms = dict(d.terms, guard=guard)
        reason = d.reason + ("; guard: " + "; ".join(notes) if notes else "")
        if final != now and getattr(self.policy, "reports_gain", True):
            if not (_finite(target_gain) and target_gain >= self.hysteresis):
                return Decision(now, f"{reason}; hysteresis: predicted gain {target_gain:.3g} < {self.hysteresis:g}, "
                                "keeping current sizes", 0.0, terms)
            if not (_finite(gain) and gain > 0.0):
                return Decision(now, f"{reason}; hysteresis: the step the maximum change allows towards a gain of "
                                f"{target_gain:.3g} is predicted to gain {gain:.3g}, keeping current sizes", 0.0, terms)
        if final == now:
            gain = 0.0
        return Decision(final, reason, float(gain) if math.isfinite(gain) else 0.0, terms)
