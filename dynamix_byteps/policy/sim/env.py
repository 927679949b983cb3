"""The gymnasium environment the PPO agent trains in: one step = one decision interval.

Observation: :func:`dynamix_byteps.policy.ppo.features.observation` of the simulated
:class:`~dynamix_byteps.policy.base.ClusterState`, flattened to ``Box(-CLIP, CLIP,
(workers × NUM_FEATURES,), float32)`` (row-major: worker 0's features first). Action:
``MultiDiscrete([len(LADDER)] × workers)``, applied by :func:`~dynamix_byteps.policy.ppo.mdp.apply_actions`
exactly as the scheduler's ``ppo`` policy applies it. Reward: :func:`~dynamix_byteps.policy.ppo.mdp.reward`.

Config keys (a dict, as RLlib's ``env_config``):

* ``scenarios``: scenario names (default ``["homogeneous"]``); each episode picks one uniformly;
* ``scenario_file``: a TOML file of the same schema as ``scenarios.toml`` (default: the packaged one);
* ``workers``: N (default 4), or a list of counts: each episode then draws N uniformly from it
  (after the scenario draw, from the same generator), so one shared per-worker network learns every
  size; scenario patterns are tiled to N (:func:`~.params.from_scenario`);
* ``params``: a :meth:`SimParams.to_dict` to use as the base job (default :func:`~.params.reference`);
* ``randomise``: domain randomisation per episode (:mod:`.randomise`, default True);
* ``reward``: :class:`~dynamix_byteps.policy.ppo.mdp.RewardWeights` fields to override;
* ``ladder``: the action ladder's factors (default :data:`~dynamix_byteps.policy.ppo.mdp.LADDER`).

With several worker counts the spaces are those of the largest, ``N_max``, and padded
(:attr:`DynamixSimEnv.padded`): the observation is ``N_max × NUM_FEATURES`` feature values (rows of
absent workers are 0) followed by ``N_max`` mask values (1 = the worker exists), the action is
``MultiDiscrete([len(LADDER)] × N_max)`` of which the first N entries apply.
:class:`~dynamix_byteps.policy.ppo.module.PerWorkerPPOModule` (``model_config["padded"]``) pools
over the mask and pins absent workers to "keep", so they add nothing to the PPO loss.

All randomness comes from ``self.np_random`` (seeded by ``reset(seed=...)``).
"""

from __future__ import annotations

from typing import ClassVar

import gymnasium as gym
import numpy as np

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.features import CLIP, NUM_FEATURES, observation
from dynamix_byteps.policy.ppo.mdp import (
    LADDER,
    RewardWeights,
    apply_actions,
    check_ladder,
)
from dynamix_byteps.policy.sim.dynamics import Simulator
from dynamix_byteps.policy.sim.params import SimParams, from_scenario, reference
from dynamix_byteps.policy.sim.randomise import randomised
from dynamix_byteps.scenarios import scenario

__all__ = ["DynamixSimEnv", "scenario_params"]


def scenario_params(names, workers: int, base: SimParams | None = None, scenario_file=None) -> list[SimParams]:
    """One :class:`SimParams` per scenario name, ``workers`` workers each.

    Raises:
        ConfigurationError: an unknown scenario (the message lists the known ones), or no names.
    """
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigurationError("no scenario given; name at least one, e.g. --scenario straggler")
    base = base or reference(workers)
    return [from_scenario(scenario(n, scenario_file), workers=workers, base=base) for n in names]


class DynamixSimEnv(gym.Env):
    """Batch-size control of a simulated synchronous data-parallel job (module docstring)."""

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        unknown = set(config) - {"scenarios", "scenario_file", "workers", "params", "randomise", "reward", "ladder"}
        if unknown:
            raise ConfigurationError(f"unknown environment option(s) {sorted(unknown)}")
        counts = config.get("workers", 4)
        self.worker_counts = sorted({int(n) for n in counts}) if isinstance(counts, (list, tuple)) else [int(counts)]
        if not self.worker_counts or self.worker_counts[0] < 1:
            raise ConfigurationError(f"workers={counts!r} must be a count >= 1 or a non-empty list of them")
        #: N_max: the width of the spaces.
        self.workers = self.worker_counts[-1]
        #: Whether observations carry a worker mask (several worker counts).
        self.padded = len(self.worker_counts) > 1
        base = SimParams.from_dict(config["params"]) if config.get("params") else None
        names = config.get("scenarios") or ["homogeneous"]
        self.jobs = {n: scenario_params(names, n, base, config.get("scenario_file")) for n in self.worker_counts}
        self.randomise = bool(config.get("randomise", True))
        self.weights = RewardWeights.from_dict(config.get("reward"))
        self.ladder = check_ladder(config.get("ladder") or LADDER, "environment option ladder")
        size = self.workers * (NUM_FEATURES + 1) if self.padded else self.workers * NUM_FEATURES
        self.observation_space = gym.spaces.Box(-CLIP, CLIP, (size,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([len(self.ladder)] * self.workers)
        self.sim: Simulator | None = None
        self.state = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        job = int(self.np_random.integers(len(self.jobs[self.workers])))
        n = self.workers
        if self.padded:
            n = self.worker_counts[int(self.np_random.integers(len(self.worker_counts)))]
        params = self.jobs[n][job]
        if self.randomise:
            params = randomised(params, self.np_random)
        self.sim = Simulator(params, self.weights, self.np_random)
        self.state = self.sim.reset()
        return self._observation(), {"scenario": params.scenario, "workers": params.num_workers}

    def _observation(self) -> np.ndarray:
        rows = observation(self.state)
        if not self.padded:
            return rows.reshape(-1)
        n = rows.shape[0]
        out = np.zeros(self.workers * (NUM_FEATURES + 1), np.float32)
        out[: n * NUM_FEATURES] = rows.reshape(-1)
        out[self.workers * NUM_FEATURES: self.workers * NUM_FEATURES + n] = 1.0
        return out

    def step(self, action):
        if self.sim is None:
            raise RuntimeError("call reset() before step()")
        out = self.sim.step(apply_actions(self.state, np.asarray(action)[: self.sim.params.num_workers], self.ladder))
        self.state = self.sim.cluster_state()
        info = dict(out.info, terms=out.terms)
        return self._observation(), float(out.reward), out.terminated, out.truncated, info
