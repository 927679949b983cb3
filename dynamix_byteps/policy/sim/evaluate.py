"""Run any :class:`~dynamix_byteps.policy.base.Policy` through simulated episodes.

Policies are wrapped in :class:`~dynamix_byteps.policy.guardrails.Guarded` with the scheduler's
defaults (``dynamix scheduler --max-change 2 --hysteresis 0.05``), so the simulator judges them
as the scheduler would run them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from dynamix_byteps.policy.base import Policy
from dynamix_byteps.policy.guardrails import Guarded
from dynamix_byteps.policy.ppo.mdp import RewardWeights
from dynamix_byteps.policy.sim.dynamics import Simulator
from dynamix_byteps.policy.sim.params import SimParams

__all__ = ["EpisodeResult", "run_episode", "summarise"]


@dataclass(frozen=True)
class EpisodeResult:
    """One episode.

    Attributes:
        episode_return: sum of rewards.
        time_to_target_s: simulated seconds until the target loss, None if not reached.
        time_s: simulated seconds of the episode.
        accuracy: final accuracy proxy (0–1).
        gap: final generalisation gap (accuracy units).
        decisions: decisions taken.
        mean_global_batch: global batch averaged over decisions.
        global_batches: the global batch after each decision.
    """

    episode_return: float
    time_to_target_s: float | None
    time_s: float
    accuracy: float
    gap: float
    decisions: int
    mean_global_batch: float
    global_batches: tuple[int, ...]


def run_episode(policy: Policy, params: SimParams, seed: int, weights: RewardWeights | None = None,
                guarded: bool = True) -> EpisodeResult:
    """One episode of ``policy`` on ``params`` with a ``numpy`` RNG seeded by ``seed``."""
    sim = Simulator(params, weights, np.random.default_rng(seed))
    decider = Guarded(policy) if guarded else policy
    state = sim.reset()
    total = 0.0
    batches = []
    while not sim.done:
        decision = decider.decide(state)
        out = sim.step(decision.batch_sizes)
        total += out.reward
        batches.append(int(sim.batch.sum()))
        state = sim.cluster_state()
    return EpisodeResult(total, sim.time_to_target, sim.time_s, sim.accuracy(), sim.gap, sim.decisions,
                         statistics.fmean(batches), tuple(batches))


def summarise(results: list[EpisodeResult]) -> dict:
    """Means over episodes: return, time to target (over the episodes that reached it, None if
    none did), accuracy, gap, global batch."""
    reached = [r.time_to_target_s for r in results if r.time_to_target_s is not None]
    return {
        "episodes": len(results),
        "mean_return": statistics.fmean(r.episode_return for r in results),
        "reached_target": len(reached) / len(results),
        "mean_time_to_target_s": statistics.fmean(reached) if reached else None,
        "mean_accuracy": statistics.fmean(r.accuracy for r in results),
        "mean_gap": statistics.fmean(r.gap for r in results),
        "mean_global_batch": statistics.fmean(r.mean_global_batch for r in results),
    }


def compare(policies: dict, jobs: list[SimParams], episodes: int, seed: int = 0,
            weights: RewardWeights | None = None, randomise: bool = False) -> list[dict]:
    """Every policy on every job, ``episodes`` each, with common random numbers.

    Episode ``e`` of every policy on a job uses the same seed (``seed + e``) and, with
    ``randomise``, the same perturbed job (:func:`~dynamix_byteps.policy.sim.randomise.randomised`),
    so differences come from the policies, not the draws.

    Args:
        policies: display name -> :class:`Policy` (each is wrapped in :class:`Guarded`).
        jobs: simulated jobs (``SimParams.scenario`` names the row).

    Returns:
        One dict per (job, policy): ``scenario``, ``workers``, ``policy`` and :func:`summarise`'s keys.
    """
    from dynamix_byteps.policy.sim.randomise import randomised

    rows = []
    for job in jobs:
        draws = [randomised(job, np.random.default_rng([seed, e])) if randomise else job for e in range(episodes)]
        for name, policy in policies.items():
            results = [run_episode(policy, p, seed + e, weights) for e, p in enumerate(draws)]
            rows.append({"scenario": job.scenario, "workers": job.num_workers, "policy": name, **summarise(results)})
    return rows
