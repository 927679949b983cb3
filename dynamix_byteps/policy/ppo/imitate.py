"""Behaviour cloning of a heuristic: where PPO starts with ``dynamix policy train --imitate NAME``.

From random weights PPO spends its first iterations far below the heuristics and, within a training
budget that fits a 2-core machine, may not catch up (a policy trained 45 iterations on a fitted
straggler job finished 1.27× slower than ``proportional`` in the simulator). Cloning the heuristic
first starts PPO at the heuristic's return, so training only has to find where to differ from it:
the kickstarting idea of Schmitt et al., *Kickstarting Deep Reinforcement Learning* (arXiv
1803.03835), done as supervised pre-training.

**Demonstrations** (:func:`demonstrations`): the teacher, inside the scheduler's guardrails
(:class:`~dynamix_byteps.policy.guardrails.Guarded`), decides every interval of episodes of the
training environment; each decision becomes the ladder actions nearest to it
(:func:`~dynamix_byteps.policy.ppo.mdp.ladder_actions`) and those actions drive the episode, so the
states are the ones the cloned policy will meet. Below a dead band (default 10%) a change counts
as "keep": a heuristic re-balances on every noisy measurement, and those small moves carry no
signal the network could learn from the observation. The band must stay under the ladder's
smallest rung (×1.18): at 20%, ``proportional``'s 64 → 74–76 moves of a fitted straggler job's
fast workers were cloned as "keep", and the clone left two of three fast workers at 64 on the
real job.

**Fit** (:func:`clone`): cross-entropy on the actions, each action class weighted by the inverse
square root of its frequency ("keep" is >90% of the actions; unweighted, the network learns
"always keep", which is the static policy), plus the value network regressed on the
demonstrations' discounted returns, so PPO's first advantages are not noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.mdp import keep_index, ladder_actions

__all__ = ["DEADBAND", "TEACHERS", "Demonstrations", "check_imitation", "clone", "demonstrations"]

#: Relative size change below which a teacher's decision is cloned as "keep" (module docstring).
DEADBAND = 0.1
#: Policies a network can be cloned from (``dynamix policy train --imitate NAME``).
TEACHERS = ("proportional", "goodput")


@dataclass(frozen=True)
class Demonstrations:
    """The teacher's episodes, one row per decision.

    Attributes:
        observations: float32 (S, D), the environment's flat observations.
        actions: int64 (S, N_max), ladder indices ("keep" for absent workers).
        returns: float32 (S,), discounted return from each decision on.
        episode_returns: undiscounted return of each episode.
    """

    observations: np.ndarray
    actions: np.ndarray
    returns: np.ndarray
    episode_returns: tuple[float, ...]


def check_imitation(teacher: str, episodes: int, deadband: float = DEADBAND) -> None:
    """Raise :class:`ConfigurationError` unless ``teacher`` is in :data:`TEACHERS`, ``episodes`` >= 1
    and ``deadband`` (a relative size change) is in [0, 1)."""
    if teacher not in TEACHERS:
        raise ConfigurationError(f"cannot imitate {teacher!r}; choose one of {', '.join(TEACHERS)}")
    if episodes < 1:
        raise ConfigurationError(f"imitation episodes must be >= 1, got {episodes}")
    if not 0 <= deadband < 1:
        raise ConfigurationError(f"imitation dead band must be in [0, 1) (a relative change; 0.1 is 10%), got {deadband}")


def demonstrations(env, teacher: str, episodes: int, seed: int, gamma: float,
                   deadband: float = DEADBAND) -> Demonstrations:
    """Run ``teacher`` through ``episodes`` episodes of ``env`` (module docstring).

    Args:
        env: a :class:`~dynamix_byteps.policy.sim.env.DynamixSimEnv` (or subclass), reset with
            seeds ``seed``, ``seed + 1``, ...
        teacher: a name in :data:`TEACHERS`.
        episodes: >= 1.
        gamma: the discount of the returns, in (0, 1].

    Raises:
        ConfigurationError: an unknown teacher, episodes < 1 or a dead band outside [0, 1).
    """
    from dynamix_byteps.policy import make_policy
    from dynamix_byteps.policy.guardrails import Guarded

    check_imitation(teacher, episodes, deadband)
    keep = keep_index(len(env.ladder))
    observations, actions, returns, totals = [], [], [], []
    for episode in range(episodes):
        decider = Guarded(make_policy(teacher))
        obs, _ = env.reset(seed=seed + episode)
        rewards, done = [], False
        while not done:
            state = env.state
            low, high = state.bounds
            current = np.array([w.batch_size for w in state.workers], dtype=np.int64)
            wanted = np.array(decider.decide(state).batch_sizes, dtype=np.float64)
            action = np.full(env.workers, keep, dtype=np.int64)
            action[: current.size] = ladder_actions(current, wanted, low, high, env.ladder, deadband)
            observations.append(obs)
            actions.append(action)
            obs, reward, terminated, truncated, _ = env.step(action)
            rewards.append(reward)
            done = terminated or truncated
        running, discounted = 0.0, []
        for reward in reversed(rewards):
            running = reward + gamma * running
            discounted.append(running)
        returns.extend(reversed(discounted))
        totals.append(float(sum(rewards)))
    return Demonstrations(np.asarray(observations, np.float32), np.asarray(actions, np.int64),
                          np.asarray(returns, np.float32), tuple(totals))


def clone(module, demos: Demonstrations, *, epochs: int = 200, lr: float = 1e-3, minibatch: int = 256,
          seed: int = 0) -> dict:
    """Fit ``module`` (a :class:`~dynamix_byteps.policy.ppo.module.PerWorkerPPOModule`) to ``demos``
    in place (module docstring); Adam, ``epochs`` passes in shuffled minibatches.

    Returns:
        ``{"agreement": share of worker decisions whose greedy action is the teacher's (0–1),
        "value_rmse": root mean squared error of the value network on the returns}``.
    """
    import torch
    from ray.rllib.core.columns import Columns

    obs = torch.from_numpy(demos.observations)
    actions = torch.from_numpy(demos.actions)
    returns = torch.from_numpy(demos.returns)
    num_actions = int(module.action_space.nvec[0])
    _, mask = module._rows({Columns.OBS: obs})
    present = torch.ones(actions.shape, dtype=torch.bool) if mask is None else mask > 0  # padded workers are pinned to keep
    counts = torch.bincount(actions[present], minlength=num_actions).float()
    weight = (counts.sum() / (counts + 1.0)).sqrt()
    weight = weight / weight.mean()

    def logits_of(batch):
        return module.forward_train({Columns.OBS: batch})[Columns.ACTION_DIST_INPUTS].reshape(len(batch), -1, num_actions)

    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(module.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(obs), generator=generator)
        for start in range(0, len(obs), minibatch):
            idx = order[start:start + minibatch]
            rows = present[idx]
            cross_entropy = torch.nn.functional.cross_entropy(logits_of(obs[idx])[rows], actions[idx][rows], weight=weight)
            value_error = (module.compute_values({Columns.OBS: obs[idx]}) - returns[idx]).pow(2).mean()
            optimiser.zero_grad()
            (cross_entropy + 0.5 * value_error).backward()
            optimiser.step()
    with torch.no_grad():
        agreement = (logits_of(obs).argmax(-1) == actions)[present].float().mean().item()
        rmse = (module.compute_values({Columns.OBS: obs}) - returns).pow(2).mean().sqrt().item()
    return {"agreement": agreement, "value_rmse": rmse}
