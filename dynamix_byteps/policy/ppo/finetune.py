"""Online fine-tuning: update the served PPO policy from the scheduler's decision log.

Imports torch and Ray RLlib (``pip install 'dynamix-byteps[rl]'``); it runs in its own process
(``dynamix policy finetune``, or ``bpslaunch --policy ppo --fine-tune``), never in the scheduler.
No Ray instance is started: RLlib's learner is built and updated in this process
(RLlib's ``Learner.update(episodes=...)``).

**Data.** Every ``ppo`` decision in ``<run_dir>/decisions.jsonl`` carries, in ``terms``
(:meth:`~dynamix_byteps.policy.ppo.serve.PPOPolicy.decide`), the observation ``obs`` (N, F), the
chosen ladder ``actions`` (N,), the ``logits`` (N, A), ``logp`` (the actions' log-probability
under softmax(logits), summed over workers) and the ``generation`` that decided. Consecutive
decisions ``i, i+1`` of the same N make one transition; its reward is :func:`transition_reward`.
Runs of consecutive transitions become RLlib ``SingleAgentEpisode`` s (truncated, so GAE
bootstraps from the value of the last observation). With ``explore`` on in the scheduler
(``bpslaunch --fine-tune`` turns it on) the logged ``logp`` is the behaviour policy's and PPO's
clipped ratio is the usual importance correction; with greedy serving the logged actions are the
mode of the same distribution and the update is the usual near-on-policy approximation.

**Update.** Every ``every`` transitions decided by the generation in force, one
``Learner.update`` (``epochs`` passes, ``lr``, PPO clip 0.2) runs on those transitions only (PPO
is on-policy: transitions of older generations are dropped). The network is exported with
:func:`~dynamix_byteps.policy.ppo.export.export_module` (ONNX Runtime parity and parameter-count
checks) into ``DIR/generations/NNNNNN/`` with its weights (``module_state.pt``) and published
(:mod:`.publish`: files fsynced, then the manifest replaced atomically); the scheduler swaps it
in at its next decision.

**Rollback.** A new generation is on probation for the first ``window`` decision intervals
after it first decided (its own decisions and the guardrails' in between: a fallback on
divergence is its doing too). Reward collapse is defined as::

    mean(r over those `window` intervals) < μ − k·max(σ, 1e-6)

with μ, σ the mean and standard deviation of the per-decision reward of the batch it was trained
on (the previous generation's decisions), ``k`` = ``collapse_k`` (default 2). On collapse the last
good generation's files are republished as a new generation number (``rollback_of`` names the bad
one), the learner goes back to its weights, and an event is logged; otherwise the generation
becomes the last good one, and its decisions (the probation window included) feed the next
update. Events (``publish``, ``accept``, ``rollback``, and ``failed`` for an update or export that
raised: the batch is dropped and the last good weights restored) are appended to
``<run_dir>/finetune.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from dynamix_byteps.control.cluster import DECISION_LOG
from dynamix_byteps.control.decision_record import DecisionRecord, parse_decision_lenient
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.guardrails import SETTLING
from dynamix_byteps.policy.ppo.mdp import RewardWeights, check_ladder, reward
from dynamix_byteps.policy.ppo.module import (
    PerWorkerPPOModule,  # first: keeps TensorFlow out of RLlib
)
from dynamix_byteps.policy.ppo.policy_format import trained_reward
from dynamix_byteps.policy.ppo.publish import generation_dir, publish, read_manifest
from dynamix_byteps.policy.ppo.served import served_metadata
from dynamix_byteps.regular_files import open_regular

__all__ = ["EVENTS", "STATE_FILE", "FineTuner", "Transition", "transition_reward", "transitions"]

log = logging.getLogger("dynamix_byteps.policy.ppo.finetune")

EVENTS = "finetune.jsonl"
STATE_FILE = "module_state.pt"


@dataclass
class Transition:
    """Decision ``i`` and what followed until decision ``i+1``.

    Decisions the guardrails skipped while an assignment was taking effect (rule 2, "settling":
    the network was not asked) are not decisions here: ``i+1`` is the next one the network took,
    and the transition spans the intervals in between.

    Attributes:
        position: index of decision ``i`` among the log's lines without settling waits (0-based;
            decision indices restart with the scheduler, lines do not).
        decision: the scheduler's index of decision ``i``.
        generation: policy generation that decided.
        obs, next_obs: float32 (N·F,) observations at decisions ``i`` and ``i+1``.
        actions: int64 (N,) ladder indices; ``logits`` float32 (N·A,); ``logp`` their log-probability.
        reward: :func:`transition_reward`.
    """

    position: int
    decision: int
    generation: int
    obs: np.ndarray
    next_obs: np.ndarray
    actions: np.ndarray
    logits: np.ndarray
    logp: float
    reward: float


def _finite(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def transition_reward(record: DecisionRecord, following: DecisionRecord, weights: RewardWeights, first_loss: float,
                      ref_interval_s: float) -> tuple[float, dict]:
    """The reward of decision ``record``, measured over the interval up to ``following``.

    :func:`~dynamix_byteps.policy.ppo.mdp.reward` with real-run quantities:

    * ΔP = (L_i − L_{i+1}) / L_first: loss decrease over the interval as a fraction of the run's
      first logged loss (the simulator divides by the way to a target loss, unknown in a real
      run); 0 when a loss is missing or not finite;
    * Δt = (step_{i+1} − step_i) · step_time_{i+1}, seconds: the interval's steps at the measured
      synchronous step time (max over workers of compute + push_pull), so scheduling delays and
      restarts do not count; ``ref_interval_s`` the same for the run's first decision;
    * the batch change of decision ``i`` (``batch_sizes_before`` → ``batch_sizes``).

    Returns:
        ``(r, terms)`` as :func:`~dynamix_byteps.policy.ppo.mdp.reward`.
    """
    now, then = (_finite((r.reward or {}).get("loss")) for r in (record, following))
    progress = (now - then) / first_loss if now is not None and then is not None and first_loss > 0 else 0.0
    step_time = _finite((following.reward or {}).get("step_time_s")) or 0.0
    interval = max(0, following.step - record.step) * step_time
    return reward(weights, progress, interval, ref_interval_s,
                  np.asarray(record.batch_sizes_before, float), np.asarray(record.batch_sizes, float))


def _ppo_terms(record: DecisionRecord) -> dict | None:
    """The PPO terms of a decision, None when it was not decided by the network."""
    terms = record.terms
    if not isinstance(terms, dict) or "obs" not in terms or "logits" not in terms or "generation" not in terms:
        return None
    n = len(record.batch_sizes or ())
    if n == 0 or len(terms["obs"]) != n or len(terms.get("actions") or ()) != n:
        return None
    return terms


def _settling(record: DecisionRecord) -> bool:
    """A decision the guardrails skipped while the last assignment took effect (rule 2)."""
    terms = record.terms
    guard = terms.get("guard") if isinstance(terms, dict) else None
    return isinstance(guard, dict) and SETTLING in guard


def _without_settling(records: list[DecisionRecord]) -> list[tuple[DecisionRecord, bool]]:
    """``(record, follows)`` for each record that is not a settling wait; ``follows``: the record
    kept before it has the previous decision index, settling waits in between allowed."""
    out, expected = [], None
    for record in records:
        index = record.decision
        follows = expected is not None and index == expected
        expected = index + 1 if isinstance(index, int) else None
        if not (follows and _settling(record)):
            out.append((record, follows))
    return out


def transitions(records: list[DecisionRecord], weights: RewardWeights, first_loss: float,
                ref_interval_s: float) -> list[Transition]:
    """Transitions of consecutive ``ppo`` decisions in ``records`` (in log order, settling waits
    skipped); a decision not made by the network (fallback, error, another policy), a gap in the
    decision index or a change of N ends a run of transitions."""
    out = []
    for position, ((record, _), (following, follows)) in enumerate(pairwise(_without_settling(records))):
        a, b = _ppo_terms(record), _ppo_terms(following)
        if a is None or b is None or not follows or len(a["obs"]) != len(b["obs"]):
            continue
        r, _ = transition_reward(record, following, weights, first_loss, ref_interval_s)
        out.append(Transition(
            position=position, decision=int(record.decision), generation=int(a["generation"]),
            obs=np.asarray(a["obs"], np.float32).reshape(-1), next_obs=np.asarray(b["obs"], np.float32).reshape(-1),
            actions=np.asarray(a["actions"], np.int64), logits=np.asarray(a["logits"], np.float32).reshape(-1),
            logp=float(a["logp"]), reward=float(r)))
    return out


class DecisionTail:
    """New complete lines of a growing ``decisions.jsonl`` (a partial last line waits)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.records: list[DecisionRecord] = []
        self.lines = 0  # complete lines read, for the line numbers of warnings
        self.resets = 0  # times the file was found replaced or truncated (read again from the start)

    def read(self) -> list[DecisionRecord]:
        """Parse what was appended since the last call; returns the new records."""
        try:
            with open_regular(self.path) as f:
                if f.seek(0, os.SEEK_END) < self.offset:  # replaced or truncated: start over
                    self.offset, self.lines, self.records, self.resets = 0, 0, [], self.resets + 1
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        lines = data[:end].split(b"\n")[:-1]
        numbered = enumerate(lines, self.lines + 1)
        self.lines += len(lines)
        # Not a decision record (the scheduler writes none such): skipped, as a partial line is.
        new = [r for n, line in numbered if line.strip() and (r := parse_decision_lenient(line, self.path, n)) is not None]
        self.records.extend(new)
        return new


class FineTuner:
    """The trainer process's state (module docstring).

    Args:
        run_dir: the scheduler's run directory (``decisions.jsonl``; ``finetune.jsonl`` is written).
        policy_path: the policy directory the scheduler serves (new generations are published here).
        checkpoint: RLlib checkpoint of the served policy (default ``policy_path/checkpoint``);
            ignored when the served generation has its own ``module_state.pt`` (a restarted trainer).
        every: transitions per update (>= 2).
        window: transitions a new generation is judged on (>= 1).
        collapse_k: k of the collapse rule (>= 0).
        lr, epochs, minibatch: the update (Adam learning rate, passes over the batch, minibatch size
            (default ``every``)).
        seed: torch seed of the learner.

    Raises:
        ConfigurationError: bad numbers, a policy directory without a checkpoint, or a checkpoint
            whose network or action ladder does not match the served policy's.
    """

    def __init__(self, run_dir, policy_path, *, checkpoint=None, every: int = 64, window: int = 16,
                 collapse_k: float = 2.0, lr: float = 1e-4, epochs: int = 4, minibatch: int | None = None,
                 seed: int = 0):
        import torch

        from dynamix_byteps.policy.ppo.export import load_module, module_ladder

        if every < 2 or window < 1 or epochs < 1 or not (collapse_k >= 0) or not (lr > 0):
            raise ConfigurationError(f"fine-tuning needs every >= 2 (got {every}), window >= 1 ({window}), "
                                     f"epochs >= 1 ({epochs}), collapse_k >= 0 ({collapse_k}), lr > 0 ({lr})")
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.run_dir, self.root = Path(run_dir), Path(policy_path)
        self.every, self.window, self.collapse_k = int(every), int(window), float(collapse_k)
        self.lr, self.epochs, self.minibatch = float(lr), int(epochs), int(minibatch or every)
        self.tail = DecisionTail(self.run_dir / DECISION_LOG)
        manifest, served, meta = served_metadata(self.root)
        self.weights = trained_reward(served, meta)
        self.module = load_module(checkpoint if checkpoint is not None else self.root / "checkpoint")
        self.num_actions = int(self.module.action_space.nvec[0])  # the length of its ladder
        trained = module_ladder(self.module)
        served_ladder = check_ladder((meta.get("actions") or {}).get("ladder"),
                                     f"{served / 'features.json'}: the served policy's action ladder")
        if len(trained) != len(served_ladder) or not all(map(math.isclose, trained, served_ladder)):
            raise ConfigurationError(
                f"the checkpoint's action ladder {[round(f, 3) for f in trained]} is not the served policy's "
                f"{[round(f, 3) for f in served_ladder]} ({served / 'features.json'}); fine-tune the checkpoint the "
                "served policy was exported from")
        state_file = served / STATE_FILE
        if state_file.is_file():
            self.module.set_state(torch.load(state_file, weights_only=True))
        self.good = (manifest.number, served, self._weights())
        self.generation = manifest.number
        self.probation: dict | None = None
        self.used: set[int] = set()  # log lines already trained on
        self._learners: dict[int, object] = {}
        self.updates = 0

    # ---- pieces ------------------------------------------------------------------------------

    def _weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def _learner(self, n: int):
        """An RLlib PPO learner for N workers, holding (and training) ``self.module``'s weights."""
        learner = self._learners.get(n)
        if learner is None:
            from ray.rllib.algorithms.ppo import PPOConfig
            from ray.rllib.core.rl_module.rl_module import RLModuleSpec

            from dynamix_byteps.policy.ppo.train import ENTROPY, PPO_SETTINGS

            settings = {k: PPO_SETTINGS[k] for k in ("gamma", "lambda_", "clip_param", "vf_clip_param")}
            observation_space, action_space = _spaces(n, self.num_actions)
            # A job's observations carry no worker mask, even for a policy trained on several worker counts.
            model_config = {**self.module.model_config, "padded": False}
            config = (PPOConfig().environment(observation_space=observation_space, action_space=action_space)
                      .learners(num_learners=0)
                      .training(lr=self.lr, entropy_coeff=ENTROPY[1], train_batch_size_per_learner=self.every,
                                minibatch_size=self.minibatch, num_epochs=self.epochs, **settings)
                      .rl_module(rl_module_spec=RLModuleSpec(module_class=PerWorkerPPOModule,
                                                             model_config=model_config)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                learner = config.build_learner()
            self._learners[n] = learner
        learner.module["default_policy"].set_state(self.module.get_state())
        return learner

    def _episodes(self, batch: list[Transition], n: int) -> list:
        from ray.rllib.core.columns import Columns
        from ray.rllib.env.single_agent_episode import SingleAgentEpisode

        obs_space, act_space = _spaces(n, self.num_actions)
        runs, current = [], []
        for t in batch:
            if current and t.position != current[-1].position + 1:
                runs.append(current)
                current = []
            current.append(t)
        runs.append(current)
        episodes = []
        for run in runs:
            episodes.append(SingleAgentEpisode(
                observations=[t.obs for t in run] + [run[-1].next_obs], actions=[t.actions for t in run],
                rewards=[t.reward for t in run], observation_space=obs_space, action_space=act_space,
                extra_model_outputs={Columns.ACTION_DIST_INPUTS: [t.logits for t in run],
                                     Columns.ACTION_LOGP: [np.float32(t.logp) for t in run]},
                truncated=True, len_lookback_buffer=0).to_numpy())
        return episodes

    def _event(self, kind: str, **fields) -> dict:
        event = {"time": time.time(), "event": kind, **fields}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / EVENTS, "a") as f:
            f.write(json.dumps(event) + "\n")
        return event

    def _publish(self, directory: Path, **fields) -> int:
        generation = max(self.generation, read_manifest(self.root).number) + 1
        publish(self.root, generation, directory, **fields)
        self.generation = generation
        return generation

    # ---- the loop ----------------------------------------------------------------------------

    def _reference(self) -> tuple[float, float] | None:
        """``(first_loss, ref_interval_s)`` of the run (:func:`transition_reward`), None before known."""
        records = self.tail.records
        losses = (_finite((r.reward or {}).get("loss")) for r in records)
        first_loss = next((v for v in losses if v is not None and v > 0), 0.0)
        first = next((r for r in records if _finite((r.reward or {}).get("step_time_s"))), None)
        steps = next((b.step - a.step for a, b in pairwise(records) if b.step > a.step), 0)
        ref = steps * float(first.reward["step_time_s"]) if first is not None else 0.0
        return (first_loss, ref) if ref > 0 else None

    def _transitions(self) -> list[Transition]:
        reference = self._reference()
        if reference is None:
            return []
        return [t for t in transitions(self.tail.records, self.weights, *reference) if t.position not in self.used]

    def _probation_rewards(self) -> list[float]:
        """Rewards of the intervals after the generation on probation first decided, its own
        decisions and the guardrails' (a fallback on divergence is its doing too), in order."""
        reference = self._reference()
        generation = self.probation["generation"]
        records = self.tail.records
        start = next((i for i, r in enumerate(records) if (_ppo_terms(r) or {}).get("generation") == generation), None)
        if reference is None or start is None:
            return []
        out = []
        for record, following in pairwise(records[start:]):
            decided_by = (record.terms or {}).get("generation")
            previous_index = -2 if record.decision is None else record.decision
            if decided_by not in (None, generation) or following.decision != previous_index + 1:
                continue
            out.append(transition_reward(record, following, self.weights, *reference)[0])
        return out

    def update(self, batch: list[Transition]) -> dict:
        """One ``Learner.update`` on ``batch`` (same N), export and publish; returns the event."""
        import torch

        from dynamix_byteps.policy.ppo.export import export_module

        n = len(batch[0].actions)
        learner = self._learner(n)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = learner.update(episodes=self._episodes(batch, n),
                                    timesteps={"num_env_steps_sampled_lifetime": (self.updates + 1) * len(batch)},
                                    num_epochs=self.epochs, minibatch_size=min(self.minibatch, len(batch)))
        seconds = time.perf_counter() - t0
        self.module.set_state(learner.module["default_policy"].get_state())
        self.updates += 1
        generation = max(self.generation, read_manifest(self.root).number) + 1
        directory = generation_dir(self.root, generation)
        rewards = np.array([t.reward for t in batch])
        info = {"decisions": [batch[0].decision, batch[-1].decision], "transitions": len(batch),
                "from_generation": batch[0].generation, "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()), "update_s": seconds, "learner": _scalars(result)}
        export_module(self.module, directory, {"fine_tune": info})
        torch.save(self.module.state_dict(), directory / STATE_FILE)
        self._publish(directory, parent=self.good[0], reason="fine-tune")
        self.probation = {"generation": self.generation, "directory": directory,
                          "mean": info["reward_mean"], "std": info["reward_std"]}
        self.used.update(t.position for t in batch)
        log.info("published generation %d (update on decisions %d-%d, %.2f s)", self.generation,
                 *info["decisions"], seconds)
        return self._event("publish", generation=self.generation, **info)

    def judge(self, rewards: list[float]) -> dict:
        """Accept the generation on probation, or roll back on reward collapse (module docstring)."""
        p = self.probation
        self.probation = None
        mean = float(np.mean(rewards))
        threshold = p["mean"] - self.collapse_k * max(p["std"], 1e-6)
        fields = {"window_mean": mean, "threshold": threshold, "baseline_mean": p["mean"], "baseline_std": p["std"]}
        if mean >= threshold:
            self.good = (p["generation"], p["directory"], self._weights())
            log.info("generation %d accepted (mean reward %.4g >= %.4g)", p["generation"], mean, threshold)
            return self._event("accept", generation=p["generation"], **fields)
        good_generation, good_directory, good_weights = self.good
        self.module.load_state_dict(good_weights)
        self._publish(good_directory, parent=good_generation, rollback_of=p["generation"], reason="reward collapse")
        log.warning("generation %d rolled back: mean reward %.4g over %d decisions < %.4g; republished generation %d "
                    "as %d", p["generation"], mean, len(rewards), threshold, good_generation, self.generation)
        return self._event("rollback", generation=self.generation, rollback_of=p["generation"],
                           restored=good_generation, **fields)

    def step(self) -> list[dict]:
        """Read new decisions; judge the generation on probation and/or update. Returns the events."""
        resets = self.tail.resets
        self.tail.read()
        if self.tail.resets != resets:
            self.used.clear()
        events = []
        ready = [t for t in self._transitions() if t.generation == self.generation]
        if self.probation is not None:
            rewards = self._probation_rewards()
            if len(rewards) < self.window:
                return events
            events.append(self.judge(rewards[:self.window]))
            if events[-1]["event"] == "rollback":
                return events
            ready = [t for t in self._transitions() if t.generation == self.generation]
        by_n: dict[int, list[Transition]] = {}
        for t in ready:
            by_n.setdefault(len(t.actions), []).append(t)
        for batch in by_n.values():
            if len(batch) >= self.every:
                batch = batch[:self.every]
                try:
                    events.append(self.update(batch))
                except Exception as error:  # an update or export that fails must not end the trainer
                    log.exception("update on decisions %d-%d failed; keeping generation %d",
                                  batch[0].decision, batch[-1].decision, self.generation)
                    self.module.load_state_dict(self.good[2])
                    self.used.update(t.position for t in batch)
                    events.append(self._event("failed", generation=self.generation,
                                              decisions=[batch[0].decision, batch[-1].decision],
                                              error=f"{type(error).__name__}: {error}"[:1000]))
                break
        return events

    def run(self, poll_s: float = 2.0, stop=None) -> None:
        """:meth:`step` every ``poll_s`` seconds until ``stop`` (a ``threading.Event``) is set."""
        while stop is None or not stop.is_set():
            try:
                self.step()
            except OSError as error:  # e.g. a full disk: keep serving what is published, try again
                log.warning("fine-tuning step failed: %s", error)
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)


def _spaces(n: int, num_actions: int):
    """RLlib's observation and action spaces of an N-worker job (as the simulator's) and a ladder
    of ``num_actions`` steps."""
    import gymnasium as gym

    from dynamix_byteps.policy.ppo.features import CLIP, NUM_FEATURES

    return (gym.spaces.Box(-CLIP, CLIP, (n * NUM_FEATURES,), np.float32),
            gym.spaces.MultiDiscrete([num_actions] * n))


def _scalars(result) -> dict:
    """Plain-float learner statistics of ``Learner.update``'s result (RLlib's Stats or floats)."""
    out = {}
    module = result.get("default_policy", {}) if isinstance(result, dict) else {}
    for key, value in module.items():
        try:
            value = float(value.peek() if hasattr(value, "peek") else value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[key] = value
    return out
