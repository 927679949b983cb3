"""The PPO agent's observation: one feature row per worker, computed from a :class:`ClusterState`.

The simulator (:mod:`dynamix_byteps.policy.sim`) and the scheduler's ``ppo`` policy call the same
:func:`observation`, so the network sees in production exactly the quantities, transforms and
clipping it was trained on. numpy only (no torch, no Ray): this module is on the decision path.

Each row is ``WORKER_FEATURES`` (worker i's own state) followed by ``GLOBAL_FEATURES`` (the same
on every row). Every value is a fixed transform, then clipped to ``[-CLIP, CLIP]``; there are no
running statistics, so nothing but this code and :data:`FEATURE_VERSION` defines the
normalisation (recorded in ``features.json`` by :func:`spec`, checked by :func:`check_spec`).
Unknown inputs (a missing node metric, no gradient noise estimate, no loss yet) give 0 and the
matching ``*_known`` flag 0.

Worker features (``b_i`` local batch, ``b̄0`` mean initial local batch, ``c_i`` compute_s,
``p_i`` push_pull_s, ``θ_i`` samples_per_s):

======================  ==================================================================
``log2_batch``          log2(b_i / b̄0)
``log2_batch_to_min``   log2(b_i / min_batch_i)                      (>= 0; 0 at the bound)
``log2_batch_to_max``   log2(max_batch_i / b_i), CLIP when unbounded (>= 0; 0 at the bound)
``log2_speed``          log2(θ_i / mean_j θ_j)                       (0 when unknown)
``log2_compute_to_max`` log2(c_i / max_j c_j)                        (<= 0; 0 = the straggler)
``wait_fraction``       p_i / (c_i + p_i): barrier wait plus communication share of the step
``cpu_util``            node agent's host CPU busy fraction, 0–1
``log10_rtt_ms``        log10(rtt_s · 1000): TCP smoothed RTT
``log1p_retransmits``   log(1 + retransmits) per agent sample
``node_known``          1 when the node agent reported any of the three above
======================  ==================================================================

Global features (``M`` global batch, ``M0`` initial global batch, ``L_t`` the loss history):

======================  ==================================================================
``log2_global_batch``   log2(M / M0)
``log2_noise_to_batch`` log2(B_noise / M), B_noise = tr(Σ)/|G|² (McCandlish et al. 2018, eq. 2.8)
``noise_known``         1 when B_noise is known
``log2_loss_ratio``     log2(L_now / L_first): training progress, 0 at the start
``loss_trend``          10 · (mean(L[-2:]) − mean(L[-4:-2])) / L_first: slope per interval
``comm_fraction``       min_i p_i / max_i (c_i + p_i): pure communication share of a step
======================  ==================================================================

``min_j``/``max_j`` use the workers whose value is finite; a non-finite loss is skipped.
"""

from __future__ import annotations

import math

import numpy as np

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.base import ClusterState, as_floats, float_or_nan

__all__ = [
    "CLIP",
    "FEATURES",
    "FEATURE_VERSION",
    "GLOBAL_FEATURES",
    "NUM_FEATURES",
    "WORKER_FEATURES",
    "check_spec",
    "observation",
    "spec",
]

#: Bumped whenever a feature's meaning, order or transform changes: policies trained on another
#: version are refused by :func:`check_spec`.
FEATURE_VERSION = 1
CLIP = 5.0

WORKER_FEATURES = (
    "log2_batch",
    "log2_batch_to_min",
    "log2_batch_to_max",
    "log2_speed",
    "log2_compute_to_max",
    "wait_fraction",
    "cpu_util",
    "log10_rtt_ms",
    "log1p_retransmits",
    "node_known",
)
GLOBAL_FEATURES = (
    "log2_global_batch",
    "log2_noise_to_batch",
    "noise_known",
    "log2_loss_ratio",
    "loss_trend",
    "comm_fraction",
)
FEATURES = WORKER_FEATURES + GLOBAL_FEATURES
NUM_FEATURES = len(FEATURES)

_TINY = 1e-12


def _log2_ratio(num: np.ndarray, den) -> np.ndarray:
    """Element-wise log2(num/den), 0 where it is not finite (a zero, negative, NaN or inf input).
    Call under ``np.errstate(all="ignore")``."""
    out = np.log2(num / den)
    out[~np.isfinite(out)] = 0.0
    return out


def _loss(x) -> float | None:
    v = float_or_nan(x)
    return v if math.isfinite(v) and v > 0 else None


def _loss_terms(history) -> tuple[float, float]:
    """``(log2_loss_ratio, loss_trend)`` from the first and the last four valid losses."""
    first = next((v for v in map(_loss, history) if v is not None), None)
    if first is None:
        return 0.0, 0.0
    recent: list[float] = []
    for x in reversed(history):
        v = _loss(x)
        if v is not None:
            recent.insert(0, v)
            if len(recent) == 4:
                break
    ratio = math.log2(recent[-1] / first)
    if len(recent) == 4:
        trend = 10.0 * (sum(recent[-2:]) - sum(recent[:2])) / 2.0 / first
    elif len(recent) >= 2:
        trend = 10.0 * (recent[-1] - recent[-2]) / first
    else:
        trend = 0.0
    return ratio, trend


def observation(state: ClusterState) -> np.ndarray:
    """The observation of ``state``: float32 array of shape ``(len(state.workers), NUM_FEATURES)``.

    Never raises on odd but valid input (zeros, NaN, missing metrics); an empty cluster gives
    shape ``(0, NUM_FEATURES)``.
    """
    with np.errstate(all="ignore"):
        return _observation(state)


def _observation(state: ClusterState) -> np.ndarray:
    ws = state.workers
    n = len(ws)
    obs = np.zeros((n, NUM_FEATURES), dtype=np.float64)
    if n == 0:
        return obs.astype(np.float32)
    b, c, p, theta = as_floats([(w.batch_size, w.compute_s, w.push_pull_s, w.samples_per_s) for w in ws]).T
    lo, hi = state.bounds

    init = [float(x) for x in state.initial_batch_sizes if x]
    b0 = sum(init) / len(init) if init else float(np.nanmean(b))
    m = float(np.nansum(b))
    m0 = sum(init) if len(init) == n else b0 * n

    obs[:, 0] = _log2_ratio(b, b0)
    obs[:, 1] = _log2_ratio(b, lo)
    obs[:, 2] = np.where(np.isfinite(hi), _log2_ratio(hi, b), CLIP)
    valid_theta = np.isfinite(theta) & (theta > 0)
    if valid_theta.any():
        obs[:, 3] = _log2_ratio(theta, theta[valid_theta].mean())
    valid_c = np.isfinite(c) & (c > 0)
    if valid_c.any():
        obs[:, 4] = _log2_ratio(c, c[valid_c].max())
    valid_p = np.isfinite(p) & (p >= 0)
    pp = np.where(valid_p, p, 0.0)
    step = np.where(valid_c, c, 0.0) + pp
    obs[:, 5] = np.divide(pp, step, out=np.zeros(n), where=step > _TINY)

    nodes = [w.node or {} for w in ws]
    util, rtt, retrans = as_floats([(d.get("cpu_util"), d.get("rtt_s"), d.get("retransmits")) for d in nodes]).T
    has_util, has_rtt = np.isfinite(util), np.isfinite(rtt) & (rtt > 0)
    has_retrans = np.isfinite(retrans) & (retrans >= 0)
    obs[:, 6] = np.where(has_util, np.clip(util, 0.0, 1.0), 0.0)
    obs[:, 7] = np.where(has_rtt, np.log10(np.where(has_rtt, rtt, 1.0) * 1000.0), 0.0)
    obs[:, 8] = np.where(has_retrans, np.log1p(np.where(has_retrans, retrans, 0.0)), 0.0)
    obs[:, 9] = has_util | has_rtt | has_retrans

    g = len(WORKER_FEATURES)
    obs[:, g] = math.log2(m / m0) if m > 0 and m0 > 0 else 0.0
    noise = state.noise_scale
    if noise is not None and math.isfinite(noise) and noise > 0 and m > 0:
        obs[:, g + 1] = math.log2(noise / m)
        obs[:, g + 2] = 1.0
    obs[:, g + 3], obs[:, g + 4] = _loss_terms(state.loss_history)
    step_max = float(step.max())
    if step_max > _TINY and valid_p.any():
        obs[:, g + 5] = float(pp[valid_p].min()) / step_max
    np.clip(obs, -CLIP, CLIP, out=obs)
    obs[~np.isfinite(obs)] = 0.0
    return obs.astype(np.float32)


def spec() -> dict:
    """What ``features.json`` records about the observation (see :func:`check_spec`)."""
    return {
        "feature_version": FEATURE_VERSION,
        "worker_features": list(WORKER_FEATURES),
        "global_features": list(GLOBAL_FEATURES),
        "num_features": NUM_FEATURES,
        "clip": CLIP,
        "source": "dynamix_byteps.policy.ppo.features",
    }


def check_spec(recorded: dict, where: str = "features.json") -> None:
    """Raise :class:`ConfigurationError` unless ``recorded`` matches this code's :func:`spec`.

    Args:
        recorded: the ``observation`` section of a policy's ``features.json``.
        where: the file, for the message.
    """
    mine = spec()
    for key in ("feature_version", "worker_features", "global_features", "num_features", "clip"):
        if recorded.get(key) != mine[key]:
            raise ConfigurationError(
                f"{where}: the policy was trained on observation {key}={recorded.get(key)!r}, this version of "
                f"dynamix_byteps computes {mine[key]!r}; retrain it with `dynamix policy train` or use a "
                "matching dynamix_byteps version"
            )
