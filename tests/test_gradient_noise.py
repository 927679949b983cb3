"""Tests for dynamix_byteps.scaling.gradient_noise (numpy only, seeded, no timing asserts)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dynamix_byteps.scaling.gradient_noise import GradientNoiseScale, estimate, gain


def _synthetic_step(rng, true_grad, noise_std, batch_sizes):
    """One data-parallel step on synthetic per-sample gradients ``G + noise``.

    Each worker averages its own per-sample gradients; the aggregate is the batch-weighted
    mean ``Σ b_i g_i / Σ b_i``, as the weighted push_pull computes it.
    """
    local = []
    for b in batch_sizes:
        samples = true_grad + rng.standard_normal((b, true_grad.size)) * noise_std
        local.append(samples.mean(axis=0))
    aggregate = sum(b * g for b, g in zip(batch_sizes, local)) / sum(batch_sizes)
    return [float(g @ g) for g in local], float(aggregate @ aggregate)


def _make_problem(seed, dim=1000, noise_scale=200.0):
    rng = np.random.default_rng(seed)
    true_grad = rng.standard_normal(dim)
    true_grad /= np.linalg.norm(true_grad)  # |G|² = 1
    variances = rng.uniform(0.1, 1.9, dim)  # anisotropic diagonal Σ
    variances *= noise_scale / variances.sum()  # tr(Σ) = noise_scale · |G|²
    return rng, true_grad, np.sqrt(variances)


@pytest.mark.parametrize("weight_power", [2.0, 1.0])
def test_recovers_known_noise_scale_with_non_uniform_batches(weight_power):
    rng, true_grad, noise_std = _make_problem(seed=1234)
    batch_sizes = [8, 24, 40, 100]
    gns = GradientNoiseScale(smoothing=0.99, weight_power=weight_power)
    for _ in range(300):
        local, global_sq = _synthetic_step(rng, true_grad, noise_std, batch_sizes)
        assert gns.update(local, batch_sizes, global_sq)
    assert gns.steps == 300 and gns.skipped == 0
    assert gns.noise_scale == pytest.approx(200.0, rel=0.10)
    assert gns.grad_sq == pytest.approx(1.0, rel=0.10)
    assert gns.trace_cov == pytest.approx(200.0, rel=0.10)


def test_noiseless_points_are_fitted_exactly():
    # y_k exactly on the line |G|² + tr(Σ)/b_k: the fit must return the line's coefficients.
    batch_sizes = np.array([3, 17, 64, 5])
    grad_sq, trace_cov = 2.5, 321.0
    local = grad_sq + trace_cov / batch_sizes
    global_sq = grad_sq + trace_cov / batch_sizes.sum()
    for p in (0.0, 1.0, 2.0):
        g2, tr = estimate(local, batch_sizes, global_sq, weight_power=p)
        assert g2 == pytest.approx(grad_sq, rel=1e-10)
        assert tr == pytest.approx(trace_cov, rel=1e-10)


@pytest.mark.parametrize("n_workers", [2, 3, 8])
@pytest.mark.parametrize("weight_power", [2.0, 1.0])
def test_equal_batches_reduce_to_mccandlish_two_batch_estimator(n_workers, weight_power):
    rng = np.random.default_rng(n_workers)
    for _ in range(20):
        b = int(rng.integers(1, 256))
        big = n_workers * b
        local = rng.uniform(0.0, 10.0, n_workers)
        global_sq = float(rng.uniform(0.0, 10.0))
        small = float(local.mean())
        # McCandlish et al. 2018, App. A.1, with B_small = b and B_big = n·b.
        expected_g2 = (big * global_sq - b * small) / (big - b)
        expected_tr = (small - global_sq) / (1.0 / b - 1.0 / big)
        g2, tr = estimate(local, [b] * n_workers, global_sq, weight_power=weight_power)
        assert g2 == pytest.approx(expected_g2, rel=1e-9, abs=1e-9)
        assert tr == pytest.approx(expected_tr, rel=1e-9, abs=1e-9)


def test_first_valid_update_is_bias_corrected():
    gns = GradientNoiseScale(smoothing=0.9)
    assert gns.grad_sq is None and gns.trace_cov is None and gns.noise_scale is None
    local, sizes, global_sq = [4.0, 2.0], [10, 30], 1.5
    assert gns.update(local, sizes, global_sq)
    g2, tr = estimate(local, sizes, global_sq)
    assert gns.grad_sq == pytest.approx(g2, rel=1e-12)
    assert gns.trace_cov == pytest.approx(tr, rel=1e-12)
    assert gns.last_estimate == (g2, tr)
    assert gns.noise_scale == pytest.approx(tr / g2, rel=1e-12)


@pytest.mark.parametrize(
    "local, global_sq",
    [
        ([float("nan"), 1.0, 2.0], 1.0),
        ([1.0, float("inf"), 2.0], 1.0),
        ([1.0, 2.0, 3.0], float("nan")),
        ([1.0, 2.0, 3.0], float("-inf")),
        ([float("inf")] * 3, float("inf")),
    ],
)
def test_non_finite_steps_are_skipped_and_never_change_the_averages(local, global_sq):
    rng, true_grad, noise_std = _make_problem(seed=7, dim=200, noise_scale=50.0)
    sizes = [5, 11, 32]
    steps = [_synthetic_step(rng, true_grad, noise_std, sizes) for _ in range(10)]
    clean, dirty = GradientNoiseScale(0.9), GradientNoiseScale(0.9)
    for i, (loc, glob) in enumerate(steps):
        clean.update(loc, sizes, glob)
        dirty.update(loc, sizes, glob)
        if i in (0, 4, 9):
            before = dirty.state_dict()
            assert dirty.update(local, sizes, global_sq) is False
            after = dirty.state_dict()
            assert after.pop("skipped") == before.pop("skipped") + 1
            assert after == before
    assert estimate(local, sizes, global_sq) is None
    assert dirty.skipped == 3 and dirty.steps == clean.steps == 10
    assert (dirty.grad_sq, dirty.trace_cov, dirty.noise_scale) == (
        clean.grad_sq, clean.trace_cov, clean.noise_scale)
    assert all(math.isfinite(v) for v in (dirty.grad_sq, dirty.trace_cov))


def test_single_worker_step_is_degenerate_and_skipped():
    assert estimate([3.0], [64], 3.0) is None
    gns = GradientNoiseScale()
    assert gns.update([3.0], [64], 3.0) is False
    assert gns.steps == 0 and gns.skipped == 1 and gns.noise_scale is None
    gns.update([4.0, 2.0], [10, 30], 1.5)
    snapshot = gns.state_dict()
    assert gns.update([3.0], [64], 3.0) is False
    after = gns.state_dict()
    assert after.pop("skipped") == 2
    snapshot.pop("skipped")
    assert after == snapshot


def test_noise_scale_is_none_while_signal_is_not_positive():
    gns = GradientNoiseScale()
    # A global norm much smaller than the local ones makes the fitted intercept negative.
    local, sizes = [10.0, 10.0], [1, 1]
    global_sq = 4.0  # |G|² = (2·4 − 1·10)/(2 − 1) = −2
    assert estimate(local, sizes, global_sq)[0] == pytest.approx(-2.0)
    assert gns.update(local, sizes, global_sq)
    assert gns.grad_sq == pytest.approx(-2.0)
    assert gns.noise_scale is None


def test_state_dict_round_trip_reproduces_outputs():
    rng, true_grad, noise_std = _make_problem(seed=99, dim=300, noise_scale=80.0)
    sizes = [7, 19, 50]
    gns = GradientNoiseScale(smoothing=0.95, weight_power=1.5)
    for _ in range(15):
        gns.update(*_with_sizes(_synthetic_step(rng, true_grad, noise_std, sizes), sizes))
    gns.update([float("nan")] * 3, sizes, 1.0)
    state = json.loads(json.dumps(gns.state_dict()))  # must be JSON-safe
    restored = GradientNoiseScale()  # different constructor args: the state wins
    restored.load_state_dict(state)
    assert restored.state_dict() == gns.state_dict()
    for _ in range(10):
        loc, glob = _synthetic_step(rng, true_grad, noise_std, sizes)
        assert gns.update(loc, sizes, glob) == restored.update(loc, sizes, glob)
        assert restored.grad_sq == gns.grad_sq
        assert restored.trace_cov == gns.trace_cov
        assert restored.noise_scale == gns.noise_scale
        assert restored.gain(400, 32) == gns.gain(400, 32)
    assert (restored.steps, restored.skipped) == (gns.steps, gns.skipped) == (25, 1)


def _with_sizes(step, sizes):
    local, global_sq = step
    return local, sizes, global_sq


def test_load_state_dict_rejects_bad_state_and_keeps_old():
    gns = GradientNoiseScale()
    gns.update([4.0, 2.0], [10, 30], 1.5)
    good = gns.state_dict()
    bad = dict(good)
    del bad["norm"]
    with pytest.raises(ValueError, match="norm"):
        gns.load_state_dict(bad)
    with pytest.raises(ValueError):
        gns.load_state_dict({**good, "smoothing": 1.0})
    with pytest.raises(ValueError):
        gns.load_state_dict({**good, "grad_sq_ema": float("nan")})
    assert gns.state_dict() == good


@pytest.mark.parametrize(
    "args",
    [
        ([1.0, 2.0], [4], 1.0),  # length mismatch
        ([], [], 1.0),  # empty
        ([1.0, 2.0], [4, 0], 1.0),  # zero batch
        ([1.0, 2.0], [4, -2], 1.0),  # negative batch
        ([1.0, 2.0], [4, float("nan")], 1.0),  # non-finite batch
        ([1.0, -2.0], [4, 8], 1.0),  # negative squared norm
        ([1.0, 2.0], [4, 8], -1.0),
    ],
)
def test_malformed_inputs_raise(args):
    with pytest.raises(ValueError):
        estimate(*args)
    gns = GradientNoiseScale()
    with pytest.raises(ValueError):
        gns.update(*args)
    assert gns.steps == 0 and gns.skipped == 0


@pytest.mark.parametrize("smoothing", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_smoothing_raises(smoothing):
    with pytest.raises(ValueError, match="smoothing"):
        GradientNoiseScale(smoothing)


# --------------------------------------------------------------------------- AdaScale gain


def test_gain_matches_formula_on_known_values():
    for mu2, trace, b0, s in [(1.0, 64.0, 32, 4.0), (0.3, 10.0, 8, 16.0), (5.0, 1e4, 128, 2.5)]:
        var = trace / b0
        expected = (var + mu2) / (var / s + mu2)
        assert gain(s, mu2, trace, b0) == pytest.approx(expected, rel=1e-12)
        # Same thing written with B_noise = tr/|G|²: (B_noise/B0 + 1)/(B_noise/B + 1).
        bn = trace / mu2
        assert gain(s, mu2, trace, b0) == pytest.approx((bn / b0 + 1) / (bn / (s * b0) + 1))


def test_gain_limits_and_bounds():
    assert gain(8.0, 1.0, 0.0, 32) == 1.0  # σ² → 0: no gain
    assert gain(8.0, 1.0, 1e-12, 32) == pytest.approx(1.0, abs=1e-9)
    assert gain(8.0, 0.0, 5.0, 32) == pytest.approx(8.0)  # μ² → 0: gain S
    assert gain(8.0, 1e-12, 5.0, 32) == pytest.approx(8.0, rel=1e-9)
    assert gain(8.0, -3.0, 5.0, 32) == pytest.approx(8.0)  # negative |G|² clipped to 0
    assert gain(8.0, 1.0, -5.0, 32) == 1.0  # negative tr(Σ) clipped to 0
    assert gain(8.0, 0.0, 0.0, 32) == 1.0  # nothing known
    assert gain(1.0, 0.7, 50.0, 32) == pytest.approx(1.0)
    rng = np.random.default_rng(3)
    for _ in range(200):
        s = float(rng.uniform(0.05, 64))
        r = gain(s, float(rng.normal()), float(rng.normal() * 100), float(rng.integers(1, 512)))
        assert min(1.0, s) - 1e-12 <= r <= max(1.0, s) + 1e-12


@pytest.mark.parametrize("args", [(0.0, 1, 1, 1), (-2.0, 1, 1, 1), (2.0, 1, 1, 0),
                                  (2.0, float("nan"), 1, 1), (2.0, 1, float("inf"), 1)])
def test_gain_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        gain(*args)


def test_gns_gain_before_estimates_is_one():
    gns = GradientNoiseScale()
    assert gns.gain(1024, 32) == 1.0
    gns.update([4.0, 2.0], [10, 30], 1.5)
    assert gns.gain(1024, 32) == pytest.approx(gain(32.0, gns.grad_sq, gns.trace_cov, 32))


@pytest.mark.parametrize("weight_power", [0.0, 1.0, 2.0])
def test_fit_is_weighted_least_squares_with_weights_b_to_the_power(weight_power):
    rng = np.random.default_rng(11)
    sizes = np.array([3, 9, 27, 50, 2])
    local = rng.uniform(0.0, 5.0, sizes.size)
    global_sq = 0.7
    x = np.append(1.0 / sizes, 1.0 / sizes.sum())
    y = np.append(local, global_sq)
    w = np.append(sizes, sizes.sum()).astype(float) ** weight_power
    # np.polyfit minimises Σ (w_poly·residual)², so w_poly = sqrt(w).
    slope, intercept = np.polyfit(x, y, 1, w=np.sqrt(w))
    g2, tr = estimate(local, sizes, global_sq, weight_power=weight_power)
    assert g2 == pytest.approx(intercept, rel=1e-9)
    assert tr == pytest.approx(slope, rel=1e-9)


def test_default_b_squared_weights_have_lower_variance_than_sample_count_weights():
    # Why the default is w ∝ b²: when b ≪ B_noise, Var|g_b|² ≈ 2·tr(Σ²)/b², so b² is the
    # inverse-variance weight. Both weightings are unbiased; b² should scatter less.
    rng, true_grad, noise_std = _make_problem(seed=5, dim=500, noise_scale=500.0)
    sizes = np.array([8, 24, 40, 100])
    estimates = {1.0: [], 2.0: []}
    for _ in range(2000):
        local_grads = true_grad + rng.standard_normal((sizes.size, true_grad.size)) * (
            noise_std / np.sqrt(sizes)[:, None])  # exact law of a mean of b samples
        aggregate = sizes @ local_grads / sizes.sum()
        local = np.einsum("ij,ij->i", local_grads, local_grads)
        for p in estimates:
            estimates[p].append(estimate(local, sizes, aggregate @ aggregate, weight_power=p))
    spread = {p: np.std(np.array(v), axis=0) for p, v in estimates.items()}
    means = {p: np.mean(np.array(v), axis=0) for p, v in estimates.items()}
    for p in estimates:  # both unbiased
        assert means[p][0] == pytest.approx(1.0, abs=0.1)
        assert means[p][1] == pytest.approx(500.0, rel=0.02)
    assert spread[2.0][0] < 0.9 * spread[1.0][0]
    assert spread[2.0][1] < 0.9 * spread[1.0][1]
