"""Throughput-proportional batch sizes (LB-BSP style) and the step-time model the policies share.

Source: Chen, Weng, Wang, Li, Li, *Semi-Dynamic Load Balancing: Efficient Distributed Learning
in Non-Dedicated Environments*, ACM SoCC 2020 (arXiv 1806.02508). LB-BSP re-sizes each worker's
sample batch at the synchronisation barrier so that workers of different speed finish their
computation together; the global batch is kept. With compute time modelled as linear in the
local batch, ``t_i = b_i / θ_i`` (``θ_i``: the worker's measured compute throughput, samples/s),
equal times mean ``b_i ∝ θ_i``.

Step-time model used here (and by :mod:`.goodput` and :mod:`.guardrails`)::

    T(b) = max_i c_i(b_i) + T_comm
    c_i(b_i) = b_i / θ_i                      (θ_i valid)
             = compute_s_i · b_i / b_i_now     (θ_i missing: scale the measured time; 0 if unknown)

``T_comm`` is the pure push_pull time. By default it is estimated as the *smallest* reported
``push_pull_s``: in synchronous training a fast worker's push_pull includes waiting at the
barrier for the straggler, so only the last worker to arrive (the straggler, smallest wait)
measures the network alone. ``comm="mean"`` uses the mean instead, which double counts the wait
the policy is trying to remove (pessimistic predicted gains).

**Parameter servers** (``state.engine == "ps"``, every worker reporting ``exposed_comm_s``): each
worker moves its own gradient over its own link and the round ends when the last push arrives, so
a worker's share of the step is its compute plus the part of its own communication that backward
did not hide, ``m_i = exposed_comm_s_i`` (the seconds of its wait during which its own pushes or
pulls were in flight, which leaves out its wait for the others)::

    T(b) = max_i (c_i(b_i) + m_i)

and the policy equalises ``b_i/θ_i + m_i`` instead of ``b_i/θ_i``: ``b_i = θ_i·(T − m_i)``
(clamped to the bounds) with ``T`` such that ``Σ b_i`` is the global batch (LB-BSP's equal
finishing time with the communication of each worker added, Chen et al. 2020, §4). A worker
behind a slow link gets a smaller batch, so its transfer starts earlier. Pushes start from the
backward hooks, so the whole transfer ``push_s + pull_s`` is the wrong offset: it counts what
backward hid, and can exceed the whole step (measured on a 100 Mbit/s link: 346 ms of push and
pull in a 293-ms step, 256 ms of it exposed; 41 ms against 5 ms exposed on the fast links). A
smaller batch hides less of the transfer, so ``m_i`` grows after a cut and the next decision,
measured again, corrects for it. Under a ring every rank moves the same bytes at the
slowest link's pace, so communication is a common term and the split stays ``b_i ∝ θ_i``; equal
``m_i`` under ``ps`` give that split too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dynamix_byteps.policy.base import ClusterState, Decision, Policy, WorkerState, float_or_nan

__all__ = [
    "ProportionalPolicy",
    "bounded_split",
    "comm_time",
    "own_comm_times",
    "step_time",
    "throughput",
    "proportional_sizes",
]

_COMM_MODES = ("min", "mean")


def _finite_positive(x) -> bool:
    try:
        return x is not None and math.isfinite(float(x)) and float(x) > 0.0
    except (TypeError, ValueError):
        return False


def throughput(worker: WorkerState) -> float | None:
    """θ_i in samples/s, or None when missing, zero, negative or non-finite."""
    return float(worker.samples_per_s) if _finite_positive(worker.samples_per_s) else None


def bounded_split(
    total: int,
    weights: Sequence[float],
    lower: Sequence[int],
    upper: Sequence[float],
    offsets: Sequence[float] | None = None,
) -> list[int]:
    """Split ``total`` samples into integers ``b_i ∝ weights_i`` within ``[lower_i, upper_i]``,
    or, with ``offsets``, ``b_i = weights_i·(λ − offsets_i)``: equal ``b_i/w_i + offsets_i``.

    The continuous solution is ``x_i = clamp(w_i·(λ − o_i), lo_i, hi_i)`` (``o_i = 0`` without
    offsets) with ``λ`` chosen so that ``Σx_i = total`` ("water filling": what clamping removes
    from one worker is spread over the unclamped ones in proportion to their weights); ``λ`` is
    found exactly on the piecewise-linear ``Σ clamp(w_i·(λ − o_i))``. Integers come from
    largest-remainder rounding, which keeps each ``b_i`` within its bounds and the sum exactly ``total``.

    Args:
        total: samples to split.
        weights: positive finite weights, one per worker.
        lower: integer lower bounds (>= 0).
        upper: upper bounds (``math.inf`` = unbounded), ``upper_i >= lower_i``.
        offsets: finite numbers, one per worker (e.g. seconds of communication when the weights
            are throughputs in samples/s); None: all 0.

    Returns:
        One int per worker. When ``total < Σlower`` every worker gets its lower bound, when
        ``total > Σupper`` its upper bound (the closest feasible answer); otherwise the sum is
        exactly ``total``.

    Raises:
        ValueError: on mismatched lengths, a non-positive / non-finite weight or a non-finite offset.
    """
    n = len(weights)
    off = [0.0] * n if offsets is None else [float(x) for x in offsets]
    if not (len(lower) == len(upper) == len(off) == n):
        raise ValueError("weights, lower, upper and offsets must have the same length")
    if not all(math.isfinite(x) for x in off):
        raise ValueError(f"offsets must be finite, got {offsets!r}")
    if n == 0:
        return []
    w = [float(x) for x in weights]
    if not all(math.isfinite(x) and x > 0 for x in w):
        raise ValueError(f"weights must be positive and finite, got {weights!r}")
    lo = [int(x) for x in lower]
    hi = [float(x) for x in upper]
    total = int(total)
    if total <= sum(lo):
        return list(lo)
    if total >= sum(hi):
        return [int(x) for x in hi]

    def f(lam: float) -> float:
        return sum(min(max(wi * (lam - oi), li), hi_i) for wi, oi, li, hi_i in zip(w, off, lo, hi))

    breaks = sorted({oi + li / wi for li, wi, oi in zip(lo, w, off)}
                    | {oi + h / wi for h, wi, oi in zip(hi, w, off) if math.isfinite(h)})
    # f is non-decreasing; f(breaks[0]) == Σlo < total. Find the segment holding the solution.
    k_lo, k_hi = 1, len(breaks)  # smallest k >= 1 with f(breaks[k]) >= total, else len(breaks)
    while k_lo < k_hi:
        mid = (k_lo + k_hi) // 2
        if f(breaks[mid]) >= total:
            k_hi = mid
        else:
            k_lo = mid + 1
    k = k_lo
    lam_lo = breaks[k - 1]
    lam_hi = breaks[k] if k < len(breaks) else math.inf
    x = [0.0] * n
    free = []
    for i, (wi, oi, li, hi_i) in enumerate(zip(w, off, lo, hi)):
        if oi + li / wi >= lam_hi:
            x[i] = li
        elif oi + hi_i / wi <= lam_lo:
            x[i] = hi_i
        else:
            free.append(i)
    # A free worker's share w_i·(λ − o_i) with λ = (total − fixed + Σw_j·o_j) / Σw_j, written with
    # offset differences: a huge λ (a worker reporting seconds like 1e300) would otherwise cancel
    # catastrophically against o_i.
    free_w = sum(w[j] for j in free)
    rest = total - sum(x)
    for i in free:
        x[i] = w[i] * (rest + sum(w[j] * (off[j] - off[i]) for j in free)) / free_w
    # Whatever floating point did with extreme inputs (overflow to inf or nan), every share stays
    # within its bounds and within what the others' lower bounds leave; rounding then fixes the sum.
    room = total - sum(lo)
    x = [min(max(xi, li), hi_i, li + room) if math.isfinite(xi) else li for xi, li, hi_i in zip(x, lo, hi)]
    return _round_to_total(x, lo, hi, total)


def _round_to_total(x: list[float], lo: list[int], hi: list[float], total: int) -> list[int]:
    """Largest-remainder rounding of ``x`` (each within its bounds) to integers summing to
    ``total`` (``Σlo < total < Σhi``); any larger float slack is moved in bulk, so the cost is O(n)."""
    out = [max(li, math.floor(xi)) for xi, li in zip(x, lo)]
    out = [min(b, int(h)) if math.isfinite(h) else b for b, h in zip(out, hi)]
    order = sorted(range(len(x)), key=lambda i: (-(x[i] - out[i]), i))
    deficit = total - sum(out)
    for i in order:  # one sample each to the largest remainders
        if deficit > 0 and out[i] + 1 <= hi[i]:
            out[i] += 1
            deficit -= 1
    for i in order:  # what float error left over, in bulk to whoever has room
        if deficit > 0:
            give = deficit if not math.isfinite(hi[i]) else min(deficit, int(hi[i]) - out[i])
            out[i] += give
            deficit -= give
    for i in reversed(order):  # float slack the other way: take from the smallest remainders
        if deficit < 0:
            take = min(-deficit, out[i] - lo[i])
            out[i] -= take
            deficit += take
    return out


def comm_time(state: ClusterState, mode: str = "min") -> float:
    """Estimated pure push_pull seconds per step (see the module docstring); 0 when unknown."""
    values = [
        float(w.push_pull_s)
        for w in state.workers
        if w.push_pull_s is not None and math.isfinite(float(w.push_pull_s)) and w.push_pull_s >= 0
    ]
    if not values:
        return 0.0
    if mode == "mean":
        return sum(values) / len(values)
    return min(values)


def own_comm_times(state: ClusterState) -> list[float] | None:
    """Each worker's exposed communication ``exposed_comm_s`` (seconds per step) when the state is
    of a ``ps`` job and every worker reported it as a finite number >= 0; None otherwise (a ring
    engine, whose communication is common to all workers, or a measurement missing)."""
    if state.engine != "ps" or not state.workers:
        return None
    out = [float_or_nan(w.exposed_comm_s) for w in state.workers]
    if not all(math.isfinite(x) and x >= 0 for x in out):
        return None
    return out


def _compute_time(worker: WorkerState, size: int) -> float:
    theta = throughput(worker)
    if theta is not None:
        return size / theta
    c = worker.compute_s
    if c is not None and math.isfinite(float(c)) and c >= 0 and worker.batch_size > 0:
        return float(c) * size / worker.batch_size
    return 0.0


def step_time(state: ClusterState, sizes: Sequence[int], comm_s: float, own_comm: Sequence[float] | None = None) -> float:
    """Predicted seconds per synchronous step (module docstring): ``max_i c_i(b_i) + comm_s``, or
    with each worker's own communication ``own_comm`` (``ps``), ``max_i (c_i(b_i) + own_comm_i)``."""
    if own_comm is not None:
        return max((_compute_time(w, b) + m for w, b, m in zip(state.workers, sizes, own_comm)), default=0.0)
    compute = max((_compute_time(w, b) for w, b in zip(state.workers, sizes)), default=0.0)
    return compute + comm_s


def proportional_sizes(state: ClusterState, total: int) -> tuple[list[int], list[int]]:
    """Split ``total`` over the workers ∝ θ_i within bounds, or, in a ``ps`` job whose workers
    reported their exposed communication (:func:`own_comm_times`), so that ``b_i/θ_i + m_i`` is equal.

    Workers without a valid θ keep their current size (clamped to their bounds); the rest of
    ``total`` goes to the others. Returns ``(sizes, ranks_kept)``; when no worker has a valid θ
    every worker keeps its (clamped) size.
    """
    own = own_comm_times(state)
    thetas = [throughput(w) for w in state.workers]
    lows, highs = state.bounds
    sizes = [int(min(max(w.batch_size, lo), hi)) for w, lo, hi in zip(state.workers, lows.tolist(), highs.tolist())]
    kept = [w.rank for w, t in zip(state.workers, thetas) if t is None]
    idx = [i for i, t in enumerate(thetas) if t is not None]
    if idx:
        rest = int(total) - sum(sizes[i] for i, t in enumerate(thetas) if t is None)
        split = bounded_split(
            rest,
            [thetas[i] for i in idx],
            lows[idx].tolist(),
            highs[idx].tolist(),
            None if own is None else [own[i] for i in idx],
        )
        for i, b in zip(idx, split):
            sizes[i] = b
    return sizes, kept


class ProportionalPolicy(Policy):
    """Keep the global batch B, give each worker ``b_i ∝ θ_i`` so compute times equalise (LB-BSP);
    under ``ps``, so that compute plus each worker's exposed communication equalises (module docstring).

    Args:
        comm: how to estimate the pure push_pull time, ``"min"`` (default) or ``"mean"`` of the
            workers' ``push_pull_s`` (see the module docstring).

    ``decide`` returns integer sizes summing exactly to ``state.global_batch`` whenever that is
    feasible within the workers' bounds, and ``predicted_gain = (T(now) − T(new)) / T(now)`` with
    ``T`` the step-time model above. Workers whose ``samples_per_s`` is missing, zero or
    non-finite keep their size.

    Raises:
        ValueError: (constructor) on an unknown ``comm`` mode.
    """

    name = "proportional"

    def __init__(self, *, comm: str = "min"):
        if comm not in _COMM_MODES:
            raise ValueError(f"comm must be one of {_COMM_MODES}, got {comm!r}")
        self.comm = comm

    def predict_gain(self, state: ClusterState, batch_sizes: Sequence[int]) -> float:
        """Relative step-time reduction of ``batch_sizes`` over the current sizes (0 if unknown)."""
        comm, own = comm_time(state, self.comm), own_comm_times(state)
        t_now = step_time(state, state.batch_sizes, comm, own)
        t_new = step_time(state, batch_sizes, comm, own)
        if not (math.isfinite(t_now) and t_now > 0 and math.isfinite(t_new)):
            return 0.0
        return (t_now - t_new) / t_now

    def decide(self, state: ClusterState) -> Decision:
        if not state.workers:
            return Decision((), "proportional: no workers")
        total = state.global_batch
        sizes, kept = proportional_sizes(state, total)
        comm, own = comm_time(state, self.comm), own_comm_times(state)
        t_now = step_time(state, state.batch_sizes, comm, own)
        t_new = step_time(state, sizes, comm, own)
        gain = self.predict_gain(state, sizes)
        terms = {
            "global_batch": total,
            "samples_per_s": [throughput(w) for w in state.workers],
            "comm_s": comm,
            "own_comm_s": own,
            "step_time_now_s": t_now,
            "step_time_predicted_s": t_new,
            "ranks_without_throughput": kept,
        }
        if len(kept) == len(state.workers):
            return Decision(tuple(sizes), "proportional: no valid throughput measurement; keeping sizes", 0.0, terms)
        rule = "b_i/θ_i + exposed comm equal (ps)" if own is not None else "b_i ∝ θ_i"
        reason = f"proportional: {rule} at global batch {sum(sizes)} (step {t_now:.4g}s → {t_new:.4g}s)"
        if kept:
            reason += f"; ranks {kept} keep their size (no throughput)"
        if sum(sizes) != total:
            reason += f"; global batch {total} infeasible within bounds"
        return Decision(tuple(int(b) for b in sizes), reason, gain, terms)
