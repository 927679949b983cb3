"""Synchronous data-parallel training, simulated one decision interval (K steps) at a time.

Timing, per step k and worker i (``b_i`` local batch, ``f`` progress fraction)::

    c_ik = (a_i + b_i / θ_i) · slowdown_i(f) · J_ik            J lognormal, mean 1, sd = jitter_i
    ring:  T_k = max_i c_ik + C_k,   C_k = (latency + 2·model_bytes / min_i bw_i) · J'_k
    ps:    T_k = max_i (c_ik + 2·m_ik),  m_ik = (latency/2 + model_bytes / bw_i) · J'_k
    push_pull_ik = T_k − c_ik                                  (barrier wait + communication)

Under a ring every rank moves the same bytes at the slowest link's pace. Under parameter servers
(``SimParams.engine == "ps"``) each worker pushes its gradient over its own link after its compute,
overlapped with the others' compute; the round ends when the last push arrives, and a worker
starts its next step once it has pulled the sum over its own link, so its cycle is
``pull_i + c_i + push_i`` with ``push_i = pull_i = m_i``. The state then carries each worker's
``push_s`` and ``pull_s`` (``m_i``), ``exposed_comm_s`` (``2·m_i``: nothing is hidden behind
backward here) and ``engine="ps"``, as the scheduler's would.

Progress follows the gradient-noise-scale model of McCandlish, Kaplan, Amodei et al., *An
Empirical Model of Large-Batch Training* (arXiv 1812.06162, eq. 2.11 ``S = S_min(1 + B_noise/B)``):
one step at global batch ``M`` is worth ``M / (M + B_noise)`` noise-free steps ``E`` (B_noise is
taken at the start of each interval and held for its K steps), and::

    L(E)       = L_min + (L0 − L_min) · exp(−E / τ)         or, with a loss tail α,
    L(E)       = L_min + (L0 − L_min) · (1 + E/(α·τ))^−α    (→ the exponential as α → ∞)
    B_noise(L) = B0 · ((L0 − L_min) / (L − L_min))^γ       B_noise grows as the loss falls

The scheduler is shown the workers' estimate, which follows a law of the same form with its own
``B0`` and ``γ`` (``measured_noise_*``, by default the law above), lognormal noise added.

Generalisation (after Keskar et al., *On Large-Batch Training for Deep Learning: Generalization
Gap and Sharp Minima*, ICLR 2017): a gap ``G`` follows the batch in use, weighted by progress,
so only the batches of the last ``τ_g`` noise-free steps matter at the end::

    g*(M) = gap_per_doubling · max(0, log2(M / (gap_free_ratio · M0)))
    G    += (g*(M) − G) · min(1, dE / τ_g)
    accuracy proxy = chance + (max − chance) · (L0 − L) / (L0 − L_min) − G

Large batches late in training therefore cost final accuracy; early ones are forgotten. The
episode ends when ``L <= target_loss`` (``f = 1``) or after ``max_decisions`` decisions.

:class:`Simulator` is plain numpy and independent of gymnasium, so the environment, the
evaluation of any :class:`~dynamix_byteps.policy.base.Policy` and the benchmarks share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dynamix_byteps.control.cluster import LOSS_HISTORY_LEN
from dynamix_byteps.policy.base import ClusterState, WorkerState
from dynamix_byteps.policy.ppo.mdp import RewardWeights, reward
from dynamix_byteps.policy.sim.params import SimParams

__all__ = ["Interval", "Simulator"]


@dataclass
class Interval:
    """What one decision interval produced (the decision taken before it included)."""

    reward: float
    terms: dict
    seconds: float
    steps: int
    terminated: bool
    truncated: bool
    info: dict = field(default_factory=dict)


class Simulator:
    """One simulated job (module docstring for the model).

    Args:
        params: the job.
        weights: reward weights (:class:`RewardWeights`).
        rng: numpy ``Generator``; every random draw comes from it (deterministic given its seed).

    Use: ``state = sim.reset()`` runs the first interval at the initial sizes and returns the
    first :class:`ClusterState`; then ``sim.step(sizes)`` per decision until ``done``.
    """

    def __init__(self, params: SimParams, weights: RewardWeights | None = None, rng: np.random.Generator | None = None):
        self.params = params
        self.weights = weights or RewardWeights()
        self.rng = rng if rng is not None else np.random.default_rng()
        p = params
        self._a = np.array([w.fixed_s for w in p.workers])
        self._theta = np.array([w.samples_per_s for w in p.workers])
        self._jitter = np.array([w.jitter for w in p.workers])
        bw = [w.bandwidth_bytes_per_s or p.comm.bandwidth_bytes_per_s for w in p.workers]
        self._bw = np.array(bw, dtype=np.float64)
        self._ps = p.engine == "ps"
        # ps: each worker's push (and its pull), seconds, shape (N,); ring: one round for all
        self._own_s = p.comm.latency_s / 2.0 + p.comm.model_bytes / self._bw
        self._comm_s = p.comm.latency_s + 2.0 * p.comm.model_bytes / float(self._bw.min())
        self._m0 = float(sum(p.initial_batch))
        self._has_windows = any(w.slowdowns for w in p.workers)
        self.reset_state()

    # -- model pieces ---------------------------------------------------------------------
    def noise_scale(self, loss: float) -> float:
        """B_noise(L) in samples, the one that sets progress."""
        s = self.params.stats
        return s.noise_scale * self._loss_ratio(loss) ** s.noise_growth

    def measured_noise_scale(self, loss: float) -> float:
        """The workers' B_noise estimate at ``loss`` without its noise (samples)."""
        s = self.params.stats
        if s.measured_noise_scale is None:
            return self.noise_scale(loss)
        growth = s.noise_growth if s.measured_noise_growth is None else s.measured_noise_growth
        return s.measured_noise_scale * self._loss_ratio(loss) ** growth

    def _loss_ratio(self, loss: float) -> float:
        s = self.params.stats
        return (s.initial_loss - s.min_loss) / max(loss - s.min_loss, 1e-9)

    def fraction(self) -> float:
        """Progress fraction f: 0 at the initial loss, 1 at the target."""
        s = self.params.stats
        return min(1.0, max(0.0, (s.initial_loss - self.loss) / (s.initial_loss - s.target_loss)))

    def accuracy(self) -> float:
        """Accuracy proxy of the current loss and gap (module docstring)."""
        s = self.params.stats
        fit = (s.initial_loss - self.loss) / (s.initial_loss - s.min_loss)
        return s.chance_accuracy + (s.max_accuracy - s.chance_accuracy) * fit - self.gap

    def target_accuracy(self) -> float:
        """Accuracy proxy at the target loss without a gap (acc* of the terminal reward)."""
        s = self.params.stats
        fit = (s.initial_loss - s.target_loss) / (s.initial_loss - s.min_loss)
        return s.chance_accuracy + (s.max_accuracy - s.chance_accuracy) * fit

    def slowdowns(self, fraction: float) -> np.ndarray:
        if not self._has_windows:
            return np.ones(self.params.num_workers)
        return np.array([w.slowdown_at(fraction) for w in self.params.workers])

    def nominal_step_s(self, sizes, fraction: float = 0.0) -> float:
        """Step time without jitter (seconds): ``max_i (a_i + b_i/θ_i)·slowdown_i + comm`` under a
        ring, ``max_i ((a_i + b_i/θ_i)·slowdown_i + 2·m_i)`` under ``ps`` (module docstring)."""
        b = np.asarray(sizes, dtype=np.float64)
        compute = (self._a + b / self._theta) * self.slowdowns(fraction)
        if self._ps:
            return float((compute + 2.0 * self._own_s).max())
        return float(compute.max() + self._comm_s)

    # -- episode --------------------------------------------------------------------------
    def reset_state(self) -> None:
        p = self.params
        self.batch = np.array(p.initial_batch, dtype=np.int64)
        self.loss = p.stats.initial_loss
        self.effective_steps = 0.0
        self.gap = 0.0
        self.time_s = 0.0
        self.steps = 0
        self.decisions = 0
        self.time_to_target: float | None = None
        self.loss_history: list[float] = []
        self.last: dict = {}
        self.ref_interval_s = p.decision_interval * self.nominal_step_s(self.batch)
        self.done = False

    def reset(self) -> ClusterState:
        """Start an episode: run the first interval at the initial sizes; return its state."""
        self.reset_state()
        self._run_interval()
        return self.cluster_state()

    def step(self, sizes) -> Interval:
        """Apply ``sizes`` (clamped to the bounds) for one interval; return its reward and status."""
        if self.done:
            raise RuntimeError("the episode is over; call reset()")
        before = self.batch.copy()
        new = np.clip(np.asarray(sizes, dtype=np.int64).reshape(-1), self.params.min_batch, self.params.max_batch)
        if new.shape != before.shape:
            raise ValueError(f"{new.size} batch sizes for {before.size} workers")
        self.batch = new
        self.decisions += 1
        loss_before = self.loss
        seconds, steps = self._run_interval()
        s = self.params.stats
        progress = (loss_before - self.loss) / (s.initial_loss - s.target_loss)
        terminated = self.loss <= s.target_loss
        truncated = not terminated and self.decisions >= self.params.max_decisions
        self.done = terminated or truncated
        final = self.accuracy() - self.target_accuracy() if self.done else None
        r, terms = reward(self.weights, progress, seconds, self.ref_interval_s, before, new, final)
        info = {"time_s": self.time_s, "loss": self.loss, "accuracy": self.accuracy(), "gap": self.gap,
                "global_batch": int(new.sum()), "time_to_target_s": self.time_to_target}
        return Interval(r, terms, seconds, steps, terminated, truncated, info)

    def _run_interval(self) -> tuple[float, int]:
        p, s, rng = self.params, self.params.stats, self.rng
        k_steps, n = p.decision_interval, p.num_workers
        b = self.batch.astype(np.float64)
        m = float(b.sum())
        frac = self.fraction()
        slow = self.slowdowns(frac)
        base = (self._a + b / self._theta) * slow
        z = rng.standard_normal((k_steps, n))
        compute = base * np.exp(self._jitter * z - 0.5 * self._jitter ** 2)
        cj = p.comm.jitter
        comm_jitter = np.exp(cj * rng.standard_normal(k_steps) - 0.5 * cj * cj)
        own = self._own_s[None, :] * comm_jitter[:, None]  # (K, N): each push, and each pull
        step_s = (compute + 2.0 * own).max(axis=1) if self._ps else compute.max(axis=1) + self._comm_s * comm_jitter
        # B_noise is held at its value at the start of the interval for its K steps.
        d_eff = m / (m + self.noise_scale(self.loss))
        eff = self.effective_steps + d_eff * np.arange(1, k_steps + 1)
        losses = s.min_loss + (s.initial_loss - s.min_loss) * s.remaining(eff)
        reached = np.flatnonzero(losses <= s.target_loss)
        done_steps = int(reached[0]) + 1 if reached.size else k_steps
        target_gap = s.gap_per_doubling * max(0.0, math.log2(m / (s.gap_free_ratio * self._m0)))
        keep = (1.0 - min(1.0, d_eff / s.gap_steps)) ** done_steps
        self.gap = target_gap + (self.gap - target_gap) * keep
        self.effective_steps = float(eff[done_steps - 1])
        self.loss = float(losses[done_steps - 1])
        self.time_s += float(step_s[:done_steps].sum())
        if reached.size:
            self.time_to_target = self.time_s
        self.steps += done_steps
        compute, step_s, losses, own = compute[:done_steps], step_s[:done_steps], losses[:done_steps], own[:done_steps]
        noise_sd = s.loss_noise * math.sqrt(self._m0 / m)
        reported = float(np.mean(losses)) * (1.0 + noise_sd * float(rng.standard_normal()))
        self.loss_history.append(reported)
        del self.loss_history[:-LOSS_HISTORY_LEN]
        c_mean = compute.mean(axis=0)
        pp_mean = (step_s[:, None] - compute).mean(axis=0)
        sn = s.noise_scale_noise
        self.last = {
            "compute_s": c_mean,
            "push_pull_s": pp_mean,
            "own_comm_s": own.mean(axis=0) if self._ps else None,
            "noise_scale": self.measured_noise_scale(self.loss) * math.exp(sn * float(rng.standard_normal()) - 0.5 * sn * sn),
            "node": self._node_metrics(c_mean, pp_mean, slow) if p.node_metrics else [{} for _ in range(n)],
        }
        return float(step_s.sum()), done_steps

    def _node_metrics(self, compute: np.ndarray, push_pull: np.ndarray, slow: np.ndarray) -> list[dict]:
        """Crude node-agent readings: host CPU busy (interference fills idle time), RTT, no loss."""
        busy = compute / (compute + push_pull)
        util = np.clip(busy + (1.0 - 1.0 / slow) * (1.0 - busy) + 0.05 * self.rng.standard_normal(busy.size), 0.0, 1.0)
        rtt = 2.0 * self.params.comm.latency_s + 65536.0 / self._bw
        return [{"cpu_util": float(u), "rtt_s": float(r), "retransmits": 0} for u, r in zip(util, rtt)]

    def cluster_state(self) -> ClusterState:
        """What the scheduler would see now: interval averages (under ``ps`` each worker's push and
        pull time), bounds, loss history, B_noise."""
        p, last = self.params, self.last
        workers = tuple(
            WorkerState(
                rank=i,
                batch_size=int(self.batch[i]),
                compute_s=float(last["compute_s"][i]),
                push_pull_s=float(last["push_pull_s"][i]),
                samples_per_s=float(self.batch[i] / last["compute_s"][i]),
                min_batch=p.min_batch,
                max_batch=p.max_batch,
                node=last["node"][i],
                push_s=None if last["own_comm_s"] is None else float(last["own_comm_s"][i]),
                pull_s=None if last["own_comm_s"] is None else float(last["own_comm_s"][i]),
                exposed_comm_s=None if last["own_comm_s"] is None else 2.0 * float(last["own_comm_s"][i]),
            )
            for i in range(p.num_workers)
        )
        return ClusterState(
            step=self.steps,
            workers=workers,
            initial_batch_sizes=tuple(int(b) for b in p.initial_batch),
            loss_history=tuple(self.loss_history),
            grad_sq=1.0,
            trace_cov=float(last["noise_scale"]),
            dataset_size=p.dataset_size,
            engine="ps" if self._ps else "",
        )
