"""Domain randomisation: a perturbed copy of a job's :class:`SimParams` for each training episode.

A policy trained on one exact simulator learns its numbers; trained on perturbed copies it has
to read the observation (throughput, communication share, B_noise ratio, loss progress) and so
transfers to jobs it has not seen. Each draw (log-uniform ``×[1/s, s]`` unless stated):

* all workers' θ ×[1/2, 2] together, then each worker ×[1/1.2, 1.2] (mild heterogeneity);
  ``fixed_s`` ×[1/3, 3]; jitter uniform in [0.02, 0.15];
* ``model_bytes`` ×[1/5, 5] (communication from a few ms to ~0.15 s per step at 1 Gbit/s),
  ``latency_s`` ×[1/2, 2];
* B_noise at the start ×[1/2.5, 2.5], its growth γ ×uniform[0.7, 1.3] (the measured law, when it
  has its own, alike), τ ×[1/1.4, 1.4];
* the initial local batch ×{1/2, 1, 2} (every worker alike, within the bounds; the job's gap-free
  batch and loss noise stay where they were);
* node-agent metrics present with probability 1/2.

The scenario's slowdown windows and links are kept as they are.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dynamix_byteps.policy.sim.params import SimParams, scaled_start

__all__ = ["log_uniform", "randomised"]


def log_uniform(rng: np.random.Generator, spread: float) -> float:
    """A factor drawn log-uniformly from ``[1/spread, spread]`` (``spread >= 1``), one draw from ``rng``."""
    return float(np.exp(rng.uniform(-np.log(spread), np.log(spread))))


def randomised(params: SimParams, rng: np.random.Generator) -> SimParams:
    """A perturbed copy of ``params`` (module docstring); every draw comes from ``rng``."""
    speed = log_uniform(rng, 2.0)
    fixed = log_uniform(rng, 3.0)
    jitter = float(rng.uniform(0.02, 0.15))
    workers = tuple(
        replace(w, samples_per_s=w.samples_per_s * speed * log_uniform(rng, 1.2), fixed_s=w.fixed_s * fixed,
                jitter=jitter)
        for w in params.workers
    )
    comm = replace(params.comm, model_bytes=params.comm.model_bytes * log_uniform(rng, 5.0),
                   latency_s=params.comm.latency_s * log_uniform(rng, 2.0))
    s = params.stats
    noise, growth = log_uniform(rng, 2.5), float(rng.uniform(0.7, 1.3))
    stats = replace(s, noise_scale=s.noise_scale * noise, noise_growth=s.noise_growth * growth,
                    steps_scale=s.steps_scale * log_uniform(rng, 1.4))
    if s.measured_noise_scale is not None:
        stats = replace(stats, measured_noise_scale=s.measured_noise_scale * noise,
                        measured_noise_growth=None if s.measured_noise_growth is None else s.measured_noise_growth * growth)
    job = replace(params, workers=workers, comm=comm, stats=stats, node_metrics=bool(rng.random() < 0.5))
    return scaled_start(job, float(rng.choice([0.5, 1.0, 2.0])))
