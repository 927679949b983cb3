"""Training on a mixture of fitted profiles: one profile per episode, perturbed.

A *profile* is the :class:`~dynamix_byteps.policy.sim.params.SimParams` that ``dynamix sim fit``
fitted to real runs of one scenario on one machine (per-worker speeds of the run, with the
scenario's time-varying slowdown windows put back, see :func:`profile_from_fit`). A policy trained
on one profile learns that job's numbers; trained on several, each perturbed, no single scenario
is its training set and it has to read the observation.

Profiles file (``profiles.json``, what ``dynamix policy train --profiles FILE`` reads)::

    {"profiles": [{"name": "straggler", "scenario": "straggler", "source": "...",
                   "params": {SimParams.to_dict()}}, ...],
     "held_out": ["swapping-stragglers"]}

``held_out``: scenarios declared for evaluation only; :func:`load_profiles` refuses a file in which
a profile was fitted to one of them.

Per episode (:class:`MixtureSimEnv`): one profile drawn uniformly, tiled to the episode's N workers
(rank ``r`` plays fitted rank ``r mod 4``), then :func:`perturbed`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np

from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.sim.dynamics import Simulator
from dynamix_byteps.policy.sim.env import DynamixSimEnv
from dynamix_byteps.policy.sim.params import SimParams, Window, scaled_start
from dynamix_byteps.policy.sim.randomise import log_uniform
from dynamix_byteps.scenarios import Scenario

__all__ = ["PERTURBATION", "START_FACTORS", "WORKER_SPREAD", "MixtureSimEnv", "Profile", "load_profiles", "perturbed", "profile_from_fit", "tiled",
           "write_profiles"]

#: Each perturbed quantity is multiplied by a log-uniform draw in [1/PERTURBATION, PERTURBATION] ...
PERTURBATION = 1.25
#: ... and each worker's throughput, on top of the common draw, by one in [1/WORKER_SPREAD, WORKER_SPREAD].
WORKER_SPREAD = 1.1
#: The episode's initial batch is the fitted one times one of these: a user may start far from the
#: best batch, and a policy that has only seen the fitted start cannot tell it is not there.
START_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class Profile:
    """One fitted job: ``name``, the ``scenario`` its runs were recorded on, where it came from
    (``source``, free text) and its simulator ``params``."""

    name: str
    scenario: str
    source: str
    params: SimParams

    def to_dict(self) -> dict:
        return {"name": self.name, "scenario": self.scenario, "source": self.source, "params": self.params.to_dict()}


def profile_from_fit(fitted: SimParams, scenario: Scenario, name: str | None = None, source: str = "") -> Profile:
    """The profile of a run of ``scenario`` fitted by ``dynamix sim fit``.

    A slowdown over the whole run is in the fitted speeds already and is left as it is. A windowed
    one (``start > 0`` or ``end < 1``) is not: the fit blurs it into the rank's speed and jitter.
    Such a rank takes the fitted parameters of the median-throughput rank that no slowdown touched
    (on one machine the ranks differ only by the scenario's slowdowns) and gets the window back as a
    :class:`~dynamix_byteps.policy.sim.params.Window` (a fraction of the progress to the target
    loss in the simulator, of the training budget in the run).

    Raises:
        ConfigurationError: the fit has another number of workers than the scenario, or every rank
            has a windowed slowdown (no undisturbed rank to take the speed from).
    """
    if fitted.num_workers != scenario.workers:
        raise ConfigurationError(f"the fit has {fitted.num_workers} workers, scenario {scenario.name!r} "
                                 f"{scenario.workers}; fit a run of that scenario")
    windowed = {s.rank: s for s in scenario.slowdowns if s.start > 0.0 or s.end < 1.0}
    workers = list(fitted.workers)
    if windowed:
        free = sorted((w for r, w in enumerate(workers) if r not in {s.rank for s in scenario.slowdowns}),
                      key=lambda w: w.samples_per_s)
        if not free:
            raise ConfigurationError(f"scenario {scenario.name!r} slows every rank in a window; no rank shows the "
                                     "undisturbed speed to fit")
        median = free[len(free) // 2]
        for rank, s in windowed.items():
            workers[rank] = replace(median, slowdowns=(Window(s.factor, s.start, s.end),))
    params = replace(fitted, workers=tuple(workers), scenario=name or scenario.name)
    return Profile(name or scenario.name, scenario.name, source, params)


def tiled(params: SimParams, workers: int) -> SimParams:
    """``params`` on ``workers`` workers: rank ``r`` is rank ``r mod N`` of ``params`` (speed,
    windows, link, initial batch). Raises :class:`ConfigurationError` for ``workers < 1``."""
    if workers < 1:
        raise ConfigurationError(f"workers={workers!r} must be >= 1")
    n = params.num_workers
    return replace(params, workers=tuple(params.workers[r % n] for r in range(workers)),
                   initial_batch=tuple(params.initial_batch[r % n] for r in range(workers)))


def perturbed(params: SimParams, rng: np.random.Generator, spread: float = PERTURBATION) -> SimParams:
    """A perturbed copy of a profile for one episode; every draw from ``rng``.

    Multiplied by log-uniform draws in ``[1/spread, spread]``: all workers' throughput θ together
    (then each worker's by its own draw in ``[1/WORKER_SPREAD, WORKER_SPREAD]``, so a fitted 3x
    straggler stays 2.5x-3.6x), every worker's fixed time per step, the communication time (through
    the bandwidth of the default and of each own link), both noise-scale laws B0 (the one that sets
    progress and the measured one, alike) and τ (noise-free steps per e-fold of the loss). The
    initial local batch is times one of :data:`START_FACTORS` (every worker alike, within the bounds,
    by :func:`~dynamix_byteps.policy.sim.params.scaled_start`: the job's gap-free batch and loss
    noise stay) and node-agent metrics are present with probability 1/2. Slowdown windows, bounds,
    K and the loss levels stay.
    """
    speed, fixed = log_uniform(rng, spread), log_uniform(rng, spread)
    comm = log_uniform(rng, spread)
    workers = tuple(
        replace(w, samples_per_s=w.samples_per_s * speed * log_uniform(rng, WORKER_SPREAD), fixed_s=w.fixed_s * fixed,
                bandwidth_bytes_per_s=None if w.bandwidth_bytes_per_s is None else w.bandwidth_bytes_per_s / comm)
        for w in params.workers)
    s = params.stats
    noise = log_uniform(rng, spread)
    stats = replace(s, noise_scale=s.noise_scale * noise, steps_scale=s.steps_scale * log_uniform(rng, spread),
                    measured_noise_scale=None if s.measured_noise_scale is None else s.measured_noise_scale * noise)
    job = replace(params, workers=workers, stats=stats,
                  comm=replace(params.comm, bandwidth_bytes_per_s=params.comm.bandwidth_bytes_per_s / comm),
                  node_metrics=bool(rng.random() < 0.5))
    return scaled_start(job, float(rng.choice(START_FACTORS)))


def write_profiles(path: str | os.PathLike, profiles: list[Profile], held_out: list[str]) -> None:
    """Write the profiles file (module docstring) atomically; raises OSError."""
    write_atomic(path, json.dumps({"profiles": [p.to_dict() for p in profiles], "held_out": list(held_out)},
                                  indent=2) + "\n")


def load_profiles(path: str | os.PathLike) -> tuple[list[Profile], list[str]]:
    """``(profiles, held_out)`` of a profiles file (module docstring).

    Raises:
        ConfigurationError: the file cannot be read, is not of this format, holds no profile or
            two of one name, or a profile was fitted to a held-out scenario.
    """
    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except OSError as error:
        raise ConfigurationError(f"cannot read profiles file {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigurationError(f"profiles file {path} is not JSON: {error}") from None
    try:
        held_out = [str(x) for x in data.get("held_out", [])]
        profiles = [Profile(str(p["name"]), str(p["scenario"]), str(p.get("source", "")), SimParams.from_dict(p["params"]))
                    for p in data["profiles"]]
    except (AttributeError, KeyError, TypeError) as error:
        raise ConfigurationError(f"profiles file {path} is not a profiles file ({error!r}): write it with "
                                 "scripts/build_policy_library.py fit") from None
    names = [p.name for p in profiles]
    if not profiles or len(set(names)) != len(names):
        raise ConfigurationError(f"profiles file {path} must hold at least one profile and each name once, got {names}")
    leaked = [p.name for p in profiles if p.scenario in held_out]
    if leaked:
        raise ConfigurationError(f"profiles file {path}: profile(s) {leaked} were fitted to a scenario held out for "
                                 f"evaluation ({', '.join(held_out)}); remove them")
    return profiles, held_out


class MixtureSimEnv(DynamixSimEnv):
    """:class:`~dynamix_byteps.policy.sim.env.DynamixSimEnv` over a mixture of profiles.

    Config keys: ``profiles`` (a list of :meth:`SimParams.to_dict`, required), ``perturb`` (default
    True: :func:`perturbed` per episode), and ``workers``, ``reward``, ``ladder`` as the base
    environment. Each episode draws a profile uniformly and N as the base does.
    """

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        raw = config.pop("profiles", None)
        self.perturb = bool(config.pop("perturb", True))
        if not raw:
            raise ConfigurationError("MixtureSimEnv needs a non-empty 'profiles' list")
        profiles = [SimParams.from_dict(p) for p in raw]
        super().__init__({**config, "randomise": False})
        self.jobs = {n: [tiled(p, n) for p in profiles] for n in self.worker_counts}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        _, info = super().reset(seed=seed, options=options)
        if self.perturb:
            self.sim = Simulator(perturbed(self.sim.params, self.np_random), self.weights, self.np_random)
            self.state = self.sim.reset()
        return self._observation(), info
