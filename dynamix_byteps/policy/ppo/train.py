"""Train the DYNAMIX agent with RLlib PPO in the simulator; write checkpoint, ONNX and features.

Imports torch and Ray RLlib (``pip install 'dynamix-byteps[rl]'``). The layout is the one
that measured fastest on 2 cores: the new API stack, sampling and learning in the driver
(``num_env_runners=0``, ``num_learners=0``) with 4 vectorised environments, one torch thread,
and a private local Ray instance (``num_cpus=2``, no dashboard, a capped object store, its own
temporary directory, removed afterwards) that is shut down even when training fails, and whose
processes and directory a guardian process removes if the trainer is killed (SIGKILL). Called
inside a running Ray instance (``ray_session()`` around several trainings saves starting one
for each, ~8 s), training uses that one and leaves it running.

Determinism: RLlib seeds the global ``random``/numpy/torch generators and the environments
from ``seed``; on one machine with one torch thread the same seed gives the same network.

Output directory::

    DIR/checkpoint/        RLlib's own format (Algorithm.save_to_path): resume or fine-tune
    DIR/policy.onnx        the network, served by ``--policy ppo --policy-path DIR``
    DIR/features.json      observation spec, ladder, reward weights, hashes, training metadata
    DIR/training.json      per-iteration mean episode return and timings
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.launcher._guardian import Guardian
from dynamix_byteps.policy.ppo.imitate import DEADBAND, check_imitation, clone, demonstrations
from dynamix_byteps.policy.ppo.mdp import RewardWeights, ladder_factors
from dynamix_byteps.policy.ppo.module import (
    PerWorkerPPOModule,  # first: keeps TensorFlow out of RLlib
)
from dynamix_byteps.policy.ppo.policy_format import FEATURES_FILE, POLICY_FILE, TRAINING_FILE

__all__ = ["IMITATION_LR", "PPO_SETTINGS", "ppo_config", "ray_session", "train"]

#: PPO hyper-parameters (RLlib names). Returns are O(1), so the value-loss clip is lifted. Unless
#: overridden, the entropy bonus decays linearly from ENTROPY[0] to ENTROPY[1] over the run, so the
#: final policy is nearly deterministic and its greedy actions (what the scheduler serves) do what
#: the sampled ones learned to do.
PPO_SETTINGS = {
    "train_batch_size_per_learner": 2000,
    "minibatch_size": 250,
    "num_epochs": 8,
    "lr": 5e-4,
    "gamma": 0.99,
    "lambda_": 0.95,
    "clip_param": 0.2,
    "vf_clip_param": 100.0,
}
ENTROPY = (0.01, 0.001)
#: PPO's learning rate after cloning a heuristic (``imitate``), unless overridden: small steps keep
#: the policy near the teacher while it looks for improvements. Measured on a fitted straggler job,
#: 45 iterations: at 5e-4 the mean return rose from the teacher's −2.36 to −2.27 in 20 iterations,
#: then drifted to −2.45; at 1.5e-4 it rose to −2.28 and held there.
IMITATION_LR = 1.5e-4
# Environments stepped together: one forward pass of the network per step for all of them. RLlib's
# per-call overhead, not the simulator, dominates sampling; 16 instead of 4 halves it.
ENVS_PER_RUNNER = 16
# Seconds a killed trainer's Ray processes get to end after SIGTERM (then SIGKILL): they own no data.
RAY_GRACE_S = 2.0


def ppo_config(env_config: dict, seed: int, *, hidden: int = 64, metadata: dict | None = None, padded: bool = False,
               env=None, **overrides):
    """The ``PPOConfig`` used for training (module docstring); ``overrides`` replace :data:`PPO_SETTINGS`;
    ``padded``: the environment has several worker counts (``PerWorkerPPOModule``'s ``padded``);
    ``env``: the environment class (default :class:`~dynamix_byteps.policy.sim.env.DynamixSimEnv`)."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from dynamix_byteps.policy.sim.env import DynamixSimEnv

    settings = {**PPO_SETTINGS, **overrides}
    return (
        PPOConfig()
        .environment(env or DynamixSimEnv, env_config=env_config)
        .env_runners(num_env_runners=0, num_envs_per_env_runner=ENVS_PER_RUNNER)
        .learners(num_learners=0)
        .training(**settings)
        .rl_module(rl_module_spec=RLModuleSpec(module_class=PerWorkerPPOModule,
                                               model_config={"hidden": hidden, "padded": padded,
                                                             "dynamix": metadata or {}}))
        .debugging(seed=seed, log_level="ERROR")
    )


@contextlib.contextmanager
def ray_session(scratch: Sequence[str] = ()):
    """A private local Ray instance for the duration of the block (module docstring); inside a Ray
    instance the caller started (a sweep of trainings, a notebook), that one, left running. While
    the private instance runs, SIGTERM raises ``SystemExit(143)`` in the main thread, so that Ray
    is shut down and its directory removed as after Ctrl-C. A guardian (bpslaunch's) stops every
    process that keeps a file of that directory open and removes it if this process dies without
    doing so (SIGKILL, the OOM killer): Ray ties to this process only the processes it starts
    itself, and the raylet's agents outlived it by about a minute. The guardian removes the caller's
    ``scratch`` directories (absolute, named ``dynamix-*``) then too; the caller removes them otherwise."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    temp_dir = tempfile.mkdtemp(prefix="dynamix-ray-")  # short: Ray's socket paths must fit 107 bytes
    on_main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    guardian = Guardian(grace_s=RAY_GRACE_S)
    try:
        guardian.start()
        guardian.tell(f"users {temp_dir}")
        for directory in (temp_dir, *scratch):
            guardian.tell(f"scratch {directory}")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 object_store_memory=200 * 2**20, _temp_dir=temp_dir)
        if on_main_thread:
            # ray.init installs Ray's fatal-signal handler for SIGTERM, which dumps a stack trace and
            # aborts (exit 134, a core file where enabled) with Ray's helpers and temp_dir left behind
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        yield ray
    finally:
        try:
            ray.shutdown()
        finally:  # Ctrl-C or SIGTERM may come during the shutdown, which takes seconds
            shutil.rmtree(temp_dir, ignore_errors=True)
            guardian.stop()
            if on_main_thread:
                signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)


def _exit_on_sigterm(signum, frame):
    """SIGTERM's exit status (143), through the ``finally`` blocks that stop the training and Ray."""
    raise SystemExit(128 + signum)


def train(out_dir, scenarios, *, iterations: int = 150, seed: int = 0, workers: int | list[int] = 4,
          reward: RewardWeights | None = None, scenario_file=None, params: dict | None = None,
          randomise: bool = True, hidden: int = 64, progress: bool = True, init=None, ladder: str = "coarse",
          profiles=None, held_out=(), imitate: str | None = None, imitation_episodes: int = 40,
          imitation_deadband: float = DEADBAND, **ppo_overrides) -> dict:
    """Train, save the checkpoint, export ONNX + features; return a summary dict.

    Args:
        out_dir: output directory (created; an earlier policy inside is replaced: its files are
            removed when the new checkpoint is saved, before the new ones are exported).
        scenarios: scenario names for the simulator (one is drawn per episode); ignored with ``profiles``.
        iterations: PPO iterations of ``train_batch_size_per_learner`` environment steps.
        seed: seeds RLlib, numpy, torch and the environments.
        workers: simulated workers N, or a list of counts drawn per episode (one shared network
            learns all of them; see :class:`~dynamix_byteps.policy.sim.env.DynamixSimEnv`).
        reward: reward weights (default :class:`RewardWeights`).
        scenario_file, params, randomise: passed to :class:`~dynamix_byteps.policy.sim.env.DynamixSimEnv`.
        hidden: width of the network.
        progress: show a tqdm progress bar on stderr.
        init: start from the network of this checkpoint (``DIR/checkpoint`` of an earlier training,
            same ``hidden``) instead of random weights: fine-tuning a policy to other simulator
            parameters. Optimiser state and the entropy schedule start afresh.
        ladder: the action ladder, a name of :data:`~dynamix_byteps.policy.ppo.mdp.LADDERS`; the
            exported ``features.json`` records its factors and the scheduler applies them.
        profiles: profiles (:class:`~dynamix_byteps.policy.ppo.mixture.Profile`) to train on instead of
            ``scenarios`` + ``params``: one drawn per episode, perturbed unless ``randomise`` is
            False (:class:`~dynamix_byteps.policy.ppo.mixture.MixtureSimEnv`). The training record
            (``features.json``'s ``training``) names them (``profiles``: name, scenario, source)
            and ``held_out``, the scenarios kept aside for evaluation.
        held_out: scenario names declared for evaluation only (recorded; with ``profiles``, a
            profile fitted to one of them is refused).
        imitate: start from a network cloned from this heuristic (a name in
            :data:`~dynamix_byteps.policy.ppo.imitate.TEACHERS`) on ``imitation_episodes`` episodes
            of the training environment instead of random weights
            (:mod:`~dynamix_byteps.policy.ppo.imitate`); the training record keeps the teacher,
            its mean return and the clone's agreement with it. Not with ``init``.
        imitation_deadband: relative size change, in [0, 1), below which a teacher's decision
            is cloned as "keep" (:mod:`~dynamix_byteps.policy.ppo.imitate`).
        ppo_overrides: replace entries of :data:`PPO_SETTINGS`.

    Returns:
        ``{"iterations", "seconds", "returns": [...], "final_return", "checkpoint", "policy", "imitation"}``
        (``imitation``: the clone's record, None without ``imitate``).

    Raises:
        ConfigurationError: a bad scenario, worker count, reward weight or ladder name, a profile
            fitted to a held-out scenario, an unknown teacher, a dead band outside [0, 1),
            ``imitate`` with ``init``, or an ``init`` checkpoint that does not load (before Ray starts).
    """
    import torch
    from tqdm import tqdm

    from dynamix_byteps.policy.ppo.export import (
        MODULE_SUBDIR,
        export_module,
        load_module,
        module_dir,
    )
    from dynamix_byteps.policy.sim.env import DynamixSimEnv

    out = Path(out_dir).resolve()  # RLlib reads a relative path as a URI without a scheme
    reward = reward or RewardWeights()
    scenarios = [scenarios] if isinstance(scenarios, str) else list(scenarios)
    counts = sorted({int(n) for n in workers}) if isinstance(workers, (list, tuple)) else [int(workers)]
    common = {"workers": counts if len(counts) > 1 else counts[0], "reward": reward.to_dict(),
              "ladder": list(ladder_factors(ladder))}
    held_out = list(held_out)
    if profiles:
        from dynamix_byteps.policy.ppo.mixture import MixtureSimEnv

        leaked = [p.name for p in profiles if p.scenario in held_out]
        if leaked:
            raise ConfigurationError(f"profile(s) {leaked} were fitted to a scenario held out for evaluation "
                                     f"({', '.join(held_out)}); train without them")
        env_class, scenarios = MixtureSimEnv, sorted({p.scenario for p in profiles})
        env_config = {**common, "profiles": [p.params.to_dict() for p in profiles], "perturb": bool(randomise)}
    else:
        env_class = DynamixSimEnv
        env_config = {**common, "scenarios": scenarios, "randomise": bool(randomise), "params": params,
                      "scenario_file": str(scenario_file) if scenario_file else None}
    padded = env_class(env_config).padded  # also validates the configuration before Ray starts
    if imitate is not None:
        check_imitation(imitate, imitation_episodes, imitation_deadband)
        if init is not None:
            raise ConfigurationError("start from a checkpoint (init) or from a cloned heuristic (imitate), not both")
    init_dir = None
    if init is not None:
        load_module(init)  # a damaged checkpoint is refused now, not after Ray has started
        init_dir = module_dir(init).resolve()
    steps = int(ppo_overrides.get("train_batch_size_per_learner", PPO_SETTINGS["train_batch_size_per_learner"]))
    ppo_overrides.setdefault("entropy_coeff", [[0, ENTROPY[0]], [max(1, iterations * steps), ENTROPY[1]]])
    if imitate is not None:
        ppo_overrides.setdefault("lr", IMITATION_LR)
    metadata = {"scenarios": scenarios, "workers": counts, "seed": int(seed), "iterations": int(iterations),
                "randomise": bool(randomise), "reward": reward.to_dict(), "ppo": {**PPO_SETTINGS, **ppo_overrides},
                "init": str(init_dir) if init_dir else None, "ladder": env_config["ladder"], "held_out": held_out,
                "profiles": [{"name": p.name, "scenario": p.scenario, "source": p.source} for p in profiles or ()]}
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    history = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dynamix-clone-") as scratch, ray_session([scratch]), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # RLlib registers its environment wrapper with gymnasium under this one name for every
        # algorithm it builds, on purpose (SingleAgentEnvRunner.make_env); gymnasium's notice of it
        # came with every training after the first in a process
        warnings.filterwarnings("ignore", message=".*Overriding environment rllib-single-agent-env-v0 already in "
                                "registry", category=UserWarning)
        if imitate is not None:
            init_dir = Path(scratch)
            metadata["imitation"] = _cloned_teacher(init_dir, env_class(env_config), imitate, imitation_episodes,
                                                    imitation_deadband, seed,
                                                    {"hidden": hidden, "padded": padded, "dynamix": metadata},
                                                    float(ppo_overrides.get("gamma", PPO_SETTINGS["gamma"])))
        algo = ppo_config(env_config, seed, hidden=hidden, metadata=metadata, padded=padded, env=env_class,
                          **ppo_overrides).build_algo()
        try:
            if init_dir is not None:  # strict: PerWorkerPPOModule.set_state raises on any mismatch
                algo.restore_from_path(str(init_dir), component=MODULE_SUBDIR.as_posix())
            bar = tqdm(range(iterations), desc="PPO", unit="it", disable=not progress, dynamic_ncols=True)
            for i in bar:
                t0 = time.monotonic()
                result = algo.train()
                value = result.get("env_runners", {}).get("episode_return_mean")
                value = float(value) if value is not None and math.isfinite(value) else None
                history.append({"iteration": i + 1, "episode_return_mean": value,
                                "seconds": time.monotonic() - t0})
                if value is not None:
                    bar.set_postfix(mean_return=f"{value:.3f}")
            checkpoint = _save_checkpoint(algo, out)
        finally:
            algo.stop()
    seconds = time.monotonic() - started
    export_module(load_module(checkpoint), out, {"seconds": seconds})
    returns = [h["episode_return_mean"] for h in history]
    summary = {"iterations": iterations, "seconds": seconds, "returns": returns,
               "final_return": next((r for r in reversed(returns) if r is not None), None),
               "checkpoint": str(checkpoint), "policy": str(out), "imitation": metadata.get("imitation")}
    record = {**summary, "history": history, "metadata": metadata}
    write_atomic(out / TRAINING_FILE, json.dumps(record, indent=2) + "\n")
    return summary


def _save_checkpoint(algo, out: Path) -> Path:
    """Save ``algo`` as ``out/checkpoint``; return that path. The files of a policy trained earlier
    into ``out`` are removed first (``features.json`` first, which makes ``out`` a policy): stopped
    before the export, a run must not leave them beside a checkpoint they were not exported from,
    where the scheduler would serve them and fine-tuning train the checkpoint's other weights."""
    checkpoint = out / "checkpoint"
    staging = out / f".checkpoint.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        algo.save_to_path(str(staging))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for name in (FEATURES_FILE, POLICY_FILE, TRAINING_FILE):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(checkpoint, ignore_errors=True)
    os.replace(staging, checkpoint)
    return checkpoint


def _cloned_teacher(module_path: Path, env, teacher: str, episodes: int, deadband: float, seed: int, model_config: dict,
                    gamma: float) -> dict:
    """Clone ``teacher`` into a fresh network saved at ``module_path`` (an RLModule directory, what
    ``init`` restores); return the record of it for the training metadata."""
    import torch

    demos = demonstrations(env, teacher, episodes, seed, gamma, deadband)
    torch.manual_seed(seed)
    module = PerWorkerPPOModule(observation_space=env.observation_space, action_space=env.action_space,
                                model_config=model_config)
    fit = clone(module, demos, seed=seed)
    module.save_to_path(str(module_path))
    return {"teacher": teacher, "episodes": episodes, "decisions": len(demos.actions), "deadband": deadband,
            "teacher_mean_return": float(np.mean(demos.episode_returns)), **fit}
