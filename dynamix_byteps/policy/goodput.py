"""Goodput-maximising global batch size (Pollux style), split over workers ∝ throughput.

Sources:

* Qiao et al., *Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning*,
  OSDI 2021 (arXiv 2008.12260), §3: ``GOODPUT(M) = THROUGHPUT(M) × EFFICIENCY(M)``, with the
  statistical efficiency of a global batch ``M`` relative to the initial batch ``M0``::

      E(M) = (B_noise + M0) / (B_noise + M)

  ``E(M0) = 1``; it is the progress per sample at ``M`` relative to ``M0``, from the gradient
  noise scale ``B_noise`` (McCandlish et al., arXiv 1812.06162). The open-source AdaptDL
  (petuum/adaptdl, ``adaptdl/goodput.py``, ``GoodputFunction.efficiency``) writes the same
  quantity as the AdaScale gain divided by the scale ``M/M0``; the two forms are equal
  algebraically. Like AdaptDL's ``optimize``, candidates form a geometric grid (50 points)
  that starts at the initial global batch ``M0``: Pollux only scales the batch *up* from the one
  the user's learning rate was tuned for. (Below ``M0`` the noise-scale model promises more
  progress per sample than linear learning-rate scaling delivers: on the homogeneous Fashion-MNIST
  job it chose ``M = 64`` against ``M0 = 256`` and reached the target 21% later than the static
  batch.) ``scale_down=True`` lifts that floor to ``Σ min_batch``.
* The throughput model is this package's, not Pollux's fitted one: ``THROUGHPUT(M) = M / T(b(M))``
  where ``b(M)`` is the throughput-proportional split of ``M`` (LB-BSP, see :mod:`.proportional`)
  and ``T(b) = max_i b_i/θ_i + T_comm``, or under the ``ps`` engine ``T(b) = max_i (b_i/θ_i + m_i)``
  with ``m_i`` worker i's exposed communication, ``exposed_comm_s`` (the split then equalises
  ``b_i/θ_i + m_i``). Pollux models compute as ``α_c + β_c·b`` and overlap of
  compute with communication (``γ``); here there is one measurement per worker, so compute is
  ``b/θ`` and the push_pull time is the fixed per-step cost. Consequence: with ``T_comm ≈ 0``
  throughput is flat in ``M`` and the efficiency term drives ``M`` to the lower end of the range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dynamix_byteps.policy.base import ClusterState, Decision, Policy, integer_option
from dynamix_byteps.policy.proportional import (
    _COMM_MODES,
    ProportionalPolicy,
    comm_time,
    own_comm_times,
    proportional_sizes,
    step_time,
    throughput,
)

__all__ = ["GoodputPolicy", "efficiency"]

MAX_CANDIDATES = 10_000  # grid points: each decision evaluates every one (50 by default)


def efficiency(global_batch: float, noise_scale: float, initial_batch: float) -> float:
    """Pollux statistical efficiency ``(B_noise + M0) / (B_noise + M)`` (dimensionless, 1 at M0)."""
    return (noise_scale + initial_batch) / (noise_scale + global_batch)


class GoodputPolicy(Policy):
    """Choose the global batch ``M`` maximising goodput, then split it ∝ θ_i (Pollux + LB-BSP).

    Candidates: a geometric grid of ``candidates`` points between ``M_lo = max(M0, Σ min_batch)``
    (``Σ min_batch`` with ``scale_down``) and ``M_hi = min(Σ max_batch, dataset_size,
    max_global_batch)``, rounded to integers, plus the
    current global batch when it lies in that range. Workers without a valid θ keep their size
    (it counts towards ``M``). When every bound and ``max_global_batch`` are absent,
    ``M_hi = unbounded_factor × max(B, M0)``.

    Without a finite gradient noise scale (``state.noise_scale`` None/NaN/inf/negative) it
    answers what :class:`ProportionalPolicy` answers at the current global batch.

    Args:
        candidates: grid points (2 to MAX_CANDIDATES, 10,000).
        max_global_batch: optional cap on ``M`` (samples).
        unbounded_factor: growth cap when nothing else bounds ``M`` (> 1).
        comm: push_pull estimate, ``"min"`` or ``"mean"`` (see :mod:`.proportional`).
        scale_down: also consider global batches below ``M0`` (not Pollux's behaviour).

    ``predicted_gain = goodput(chosen)/goodput(current sizes) − 1``; ``terms`` hold B_noise, M0,
    the range, the chosen and current goodput (samples/s weighted by efficiency), throughput,
    efficiency and predicted step times.

    Raises:
        ValueError: (constructor) on invalid options.
    """

    name = "goodput"

    def __init__(
        self,
        *,
        candidates: int = 50,
        max_global_batch: int | None = None,
        unbounded_factor: float = 16.0,
        comm: str = "min",
        scale_down: bool = False,
    ):
        self.candidates = integer_option("candidates", candidates, 2, MAX_CANDIDATES)
        self.max_global_batch = None if max_global_batch is None else integer_option(
            "max_global_batch", max_global_batch, 1)
        if not (math.isfinite(float(unbounded_factor)) and float(unbounded_factor) > 1.0):
            raise ValueError(f"unbounded_factor must be a finite number > 1, got {unbounded_factor!r}")
        if comm not in _COMM_MODES:
            raise ValueError(f"comm must be one of {_COMM_MODES}, got {comm!r}")
        if scale_down not in (True, False):  # bool("false") would be True
            raise ValueError(f"scale_down must be true or false, got {scale_down!r}")
        self.unbounded_factor = float(unbounded_factor)
        self.comm = comm
        self.scale_down = bool(scale_down)
        self._fallback = ProportionalPolicy(comm=comm)

    # -- model -------------------------------------------------------------------------------
    @staticmethod
    def _noise(state: ClusterState) -> float | None:
        noise = state.noise_scale
        if noise is None or not math.isfinite(noise) or noise < 0:
            return None
        return float(noise)

    @staticmethod
    def _initial_batch(state: ClusterState) -> int:
        m0 = sum(int(b) for b in state.initial_batch_sizes) if state.initial_batch_sizes else 0
        return m0 if m0 > 0 else max(1, state.global_batch)

    def _goodput(self, state: ClusterState, sizes: Sequence[int], noise: float, m0: int, comm: float,
                 own: Sequence[float] | None):
        total = sum(sizes)
        t = step_time(state, sizes, comm, own)
        if not (math.isfinite(t) and t > 0):
            return 0.0, 0.0, 0.0, t
        thr = total / t
        eff = efficiency(total, noise, m0)
        return thr * eff, thr, eff, t

    def feasible_range(self, state: ClusterState) -> tuple[int, int]:
        """``(M_lo, M_hi)`` in samples, both integers, ``M_lo <= M_hi`` (see the class docstring)."""
        lo = hi = 0.0
        for w, b_lo, b_hi in zip(state.workers, *(column.tolist() for column in state.bounds)):
            if throughput(w) is None:  # keeps its (clamped) size
                b = min(max(w.batch_size, b_lo), b_hi)
                lo, hi = lo + b, hi + b
            else:
                lo, hi = lo + b_lo, hi + b_hi
        caps = [hi]
        if state.dataset_size is not None and state.dataset_size > 0:
            caps.append(float(state.dataset_size))
        if self.max_global_batch is not None:
            caps.append(float(self.max_global_batch))
        top = min(caps)
        if not math.isfinite(top):
            top = self.unbounded_factor * max(state.global_batch, self._initial_batch(state), lo)
        m_lo = int(lo) if self.scale_down else max(int(lo), self._initial_batch(state))
        m_lo = min(m_lo, max(int(lo), int(top)))  # bounds and caps win over the M0 floor
        return m_lo, max(m_lo, int(top))

    def _grid(self, m_lo: int, m_hi: int, current: int) -> list[int]:
        n = self.candidates
        pts = {m_lo, m_hi}
        ratio = m_hi / m_lo if m_lo > 0 else 1.0
        for k in range(n):
            pts.add(int(round(m_lo * ratio ** (k / (n - 1)))))
        if m_lo <= current <= m_hi:
            pts.add(current)
        return sorted(p for p in pts if m_lo <= p <= m_hi)

    def predict_gain(self, state: ClusterState, batch_sizes: Sequence[int]) -> float:
        """``goodput(batch_sizes)/goodput(current) − 1``; the proportional gain without B_noise."""
        noise = self._noise(state)
        if noise is None:
            return self._fallback.predict_gain(state, batch_sizes)
        comm, own = comm_time(state, self.comm), own_comm_times(state)
        m0 = self._initial_batch(state)
        g_now = self._goodput(state, state.batch_sizes, noise, m0, comm, own)[0]
        g_new = self._goodput(state, list(batch_sizes), noise, m0, comm, own)[0]
        return g_new / g_now - 1.0 if g_now > 0 and math.isfinite(g_new) else 0.0

    # -- policy ------------------------------------------------------------------------------
    def decide(self, state: ClusterState) -> Decision:
        if not state.workers:
            return Decision((), "goodput: no workers")
        noise = self._noise(state)
        if noise is None or all(throughput(w) is None for w in state.workers):
            d = self._fallback.decide(state)
            why = "no gradient noise estimate" if noise is None else "no throughput measurement"
            terms = dict(d.terms, fallback="proportional", noise_scale=noise)
            return Decision(d.batch_sizes, f"goodput: {why}; {d.reason}", d.predicted_gain, terms)

        comm, own = comm_time(state, self.comm), own_comm_times(state)
        m0 = self._initial_batch(state)
        current = state.global_batch
        m_lo, m_hi = self.feasible_range(state)
        g_now, thr_now, eff_now, t_now = self._goodput(state, state.batch_sizes, noise, m0, comm, own)

        best = None  # (goodput, -distance to current, M, sizes, thr, eff, t)
        for m in self._grid(m_lo, m_hi, current):
            sizes, _ = proportional_sizes(state, m)
            g, thr, eff, t = self._goodput(state, sizes, noise, m0, comm, own)
            key = (g, -abs(sum(sizes) - current))
            if best is None or key > best[0]:
                best = (key, sum(sizes), sizes, thr, eff, t)
        (g_best, _), m_best, sizes, thr, eff, t = best
        gain = g_best / g_now - 1.0 if g_now > 0 else 0.0
        terms = {
            "noise_scale": noise,
            "initial_global_batch": m0,
            "global_batch_now": current,
            "global_batch_chosen": m_best,
            "global_batch_range": [m_lo, m_hi],
            "comm_s": comm,
            "goodput_now": g_now,
            "goodput_chosen": g_best,
            "throughput_now": thr_now,
            "throughput_chosen": thr,
            "efficiency_now": eff_now,
            "efficiency_chosen": eff,
            "step_time_now_s": t_now,
            "step_time_predicted_s": t,
        }
        reason = (
            f"goodput: global batch {current} → {m_best} (B_noise {noise:.4g}, M0 {m0}; "
            f"goodput {g_now:.4g} → {g_best:.4g}), "
            + ("split ∝ θ_i" if own is None else "split to equal compute + own link time (ps)")
        )
        return Decision(tuple(int(b) for b in sizes), reason, gain, terms)
