"""Batch-size policies: static, proportional (LB-BSP), goodput (Pollux), and the registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamix_byteps.cli import UsageError, build_parser, build_policy
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import (
    ClusterState,
    GoodputPolicy,
    Policy,
    ProportionalPolicy,
    StaticPolicy,
    WorkerState,
    make_policy,
)
from dynamix_byteps.policy.goodput import efficiency
from dynamix_byteps.policy.proportional import bounded_split


def make_state(thetas, sizes, *, push_pull=0.05, min_batch=1, max_batch=None, initial=None, **kw):
    n = len(thetas)
    pp = push_pull if isinstance(push_pull, (list, tuple)) else [push_pull] * n
    lo = min_batch if isinstance(min_batch, (list, tuple)) else [min_batch] * n
    hi = max_batch if isinstance(max_batch, (list, tuple)) else [max_batch] * n
    workers = []
    for i in range(n):
        t = thetas[i]
        ok = t is not None and math.isfinite(t) and t > 0
        workers.append(WorkerState(
            rank=i, batch_size=sizes[i], compute_s=sizes[i] / t if ok else float("nan"),
            push_pull_s=pp[i], samples_per_s=t, min_batch=lo[i], max_batch=hi[i],
        ))
    return ClusterState(step=100, workers=tuple(workers),
                        initial_batch_sizes=tuple(initial or sizes), **kw)


# -- the state -----------------------------------------------------------------------------------

def test_bounds_are_integer_columns_where_a_missing_or_odd_bound_is_no_bound():
    lo = [1, 8, 0, "7", float("nan"), None, 5.9, 3]
    hi = [None, 64, 0, None, float("inf"), "x", 3, 2]
    s = make_state([100.0] * 8, [32] * 8, min_batch=lo, max_batch=hi)
    low, high = s.bounds
    assert low.dtype == np.int64 and low.tolist() == [1, 8, 1, 7, 1, 1, 5, 3]
    assert high.tolist() == [math.inf, 64, 1, math.inf, math.inf, math.inf, 5, 3]  # high >= low
    assert s.bounds is s.bounds  # computed once per state
    with pytest.raises(ValueError, match="read-only"):
        low[0] = 4


# -- static --------------------------------------------------------------------------------------

def test_static_returns_the_initial_allocation():
    s = make_state([300, 100], [40, 24], initial=(32, 32))
    d = StaticPolicy().decide(s)
    assert d.batch_sizes == (32, 32) and d.predicted_gain == 0


# -- proportional --------------------------------------------------------------------------------

def test_proportional_gives_a_three_times_slower_worker_a_third():
    s = make_state([300, 300, 300, 100], [64] * 4)
    d = ProportionalPolicy().decide(s)
    b = d.batch_sizes
    assert sum(b) == 256
    assert all(isinstance(x, int) for x in b)
    assert max(b[:3]) - min(b[:3]) <= 1
    assert abs(3 * b[3] - b[0]) <= 3          # b3 ≈ b0 / 3
    assert b == (77, 77, 77, 25)
    # step time 64/100 + 0.05 = 0.69 s → 77/300 + 0.05 ≈ 0.307 s
    assert d.predicted_gain == pytest.approx((0.69 - (77 / 300 + 0.05)) / 0.69)


def test_proportional_keeps_the_global_batch_when_balanced():
    s = make_state([200, 200], [50, 50])
    d = ProportionalPolicy().decide(s)
    assert d.batch_sizes == (50, 50) and d.predicted_gain == pytest.approx(0.0)


def test_proportional_respects_bounds_and_redistributes_the_clamped_part():
    # worker 0 is 10x faster but capped at 100; the slow ones' floor is 40
    s = make_state([1000, 100, 100, 10], [64] * 4, min_batch=[1, 1, 1, 40], max_batch=[100, None, None, None])
    b = ProportionalPolicy().decide(s).batch_sizes
    assert b[0] == 100 and b[3] == 40
    assert sum(b) == 256
    assert b[1] + b[2] == 116 and abs(b[1] - b[2]) <= 1


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -5.0, None])
def test_proportional_keeps_the_size_of_a_worker_without_throughput(bad):
    s = make_state([300, bad, 100, 300], [64, 40, 64, 64])
    d = ProportionalPolicy().decide(s)
    b = d.batch_sizes
    assert b[1] == 40
    assert sum(b) == 232
    assert b[0] == b[3] and abs(3 * b[2] - b[0]) <= 3
    assert math.isfinite(d.predicted_gain)


def test_proportional_without_any_throughput_keeps_all_sizes():
    s = make_state([float("nan"), 0.0], [16, 48])
    d = ProportionalPolicy().decide(s)
    assert d.batch_sizes == (16, 48) and d.predicted_gain == 0.0


def test_proportional_comm_estimate_is_the_stragglers_push_pull():
    # fast workers wait at the barrier, so their push_pull is long; the straggler's is the network
    s = make_state([300, 300, 300, 100], [64] * 4, push_pull=[0.477, 0.477, 0.477, 0.05])
    assert ProportionalPolicy().decide(s).terms["comm_s"] == pytest.approx(0.05)
    assert ProportionalPolicy(comm="mean").decide(s).terms["comm_s"] == pytest.approx((3 * 0.477 + 0.05) / 4)


def _continuous_split(total, w, lo, hi):
    """Independent reference: bisection on λ in Σ clamp(λ·w_i, lo_i, hi_i) = total."""
    def f(lam):
        return sum(min(max(lam * a, low), h) for a, low, h in zip(w, lo, hi))
    a, b = 0.0, 1.0
    while f(b) < total:
        b *= 2
    for _ in range(200):
        m = (a + b) / 2
        a, b = (m, b) if f(m) < total else (a, m)
    return [min(max(b * x, low), h) for x, low, h in zip(w, lo, hi)]


@st.composite
def split_cases(draw):
    n = draw(st.integers(1, 8))
    w = [draw(st.floats(0.1, 1e4)) for _ in range(n)]
    lo = [draw(st.integers(1, 50)) for _ in range(n)]
    hi = [low + draw(st.integers(0, 300)) if draw(st.booleans()) else math.inf for low in lo]
    total = draw(st.integers(0, 3000))
    return total, w, lo, hi


@settings(max_examples=300, deadline=None)
@given(split_cases())
def test_bounded_split_matches_the_continuous_water_filling(case):
    total, w, lo, hi = case
    b = bounded_split(total, w, lo, hi)
    assert all(isinstance(x, int) for x in b)
    assert all(low <= x <= h for x, low, h in zip(b, lo, hi))
    if sum(lo) <= total <= sum(hi):
        assert sum(b) == total
        for x, ref in zip(b, _continuous_split(total, w, lo, hi)):
            assert abs(x - ref) < 1 + 1e-6
    elif total < sum(lo):
        assert b == lo
    else:
        assert b == [int(h) for h in hi]


@st.composite
def cluster_states(draw):
    n = draw(st.integers(1, 8))
    thetas, sizes, lo, hi = [], [], [], []
    for _ in range(n):
        thetas.append(draw(st.one_of(st.floats(0.5, 5000), st.sampled_from([0.0, float("nan"), float("inf")]))))
        low = draw(st.integers(1, 64))
        h = draw(st.one_of(st.none(), st.integers(low, low + 512)))
        lo.append(low)
        hi.append(h)
        sizes.append(draw(st.integers(low, h if h is not None else low + 512)))
    return make_state(thetas, sizes, min_batch=lo, max_batch=hi,
                      push_pull=draw(st.floats(0.0, 1.0)))


@settings(max_examples=300, deadline=None)
@given(cluster_states())
def test_proportional_sums_to_the_global_batch_within_bounds(state):
    d = ProportionalPolicy().decide(state)
    assert len(d.batch_sizes) == len(state.workers)
    assert sum(d.batch_sizes) == state.global_batch     # current sizes are in bounds: feasible
    for b, w in zip(d.batch_sizes, state.workers):
        assert isinstance(b, int) and b >= max(1, w.min_batch)
        assert w.max_batch is None or b <= w.max_batch
        if not (math.isfinite(w.samples_per_s) and w.samples_per_s > 0):
            assert b == w.batch_size
    assert math.isfinite(d.predicted_gain)


# -- goodput -------------------------------------------------------------------------------------

def test_efficiency_is_pollux_formula():
    assert efficiency(256, 1000.0, 256) == 1.0
    assert efficiency(1256, 1000.0, 256) == pytest.approx(1256 / 2256)
    # equals AdaScale gain / scale with var = tr(Σ)/M0, sqr = |G|² (AdaptDL form)
    sqr, tr, m0, m = 2.0, 600.0, 32, 512
    var, scale = tr / m0, m / m0
    assert efficiency(m, tr / sqr, m0) == pytest.approx((var + sqr) / (var / scale + sqr) / scale)


def _goodput_state(noise, **kw):
    return make_state([250] * 4, [64] * 4, push_pull=0.1, grad_sq=1.0, trace_cov=noise, **kw)


def test_goodput_picks_a_larger_batch_when_gradients_are_noisier():
    small = GoodputPolicy(scale_down=True).decide(_goodput_state(1.0)).terms["global_batch_chosen"]
    large = GoodputPolicy().decide(_goodput_state(1e5)).terms["global_batch_chosen"]
    assert small < 256 < large


def test_goodput_never_goes_below_the_initial_global_batch_by_default():
    # Pollux/AdaptDL scale up from M0 only; with B_noise ≈ 1 smaller would win on paper.
    d = GoodputPolicy().decide(_goodput_state(1.0))
    assert d.terms["global_batch_range"][0] == 256
    assert d.terms["global_batch_chosen"] == 256 and d.batch_sizes == (64, 64, 64, 64)


def test_goodput_finds_the_analytic_optimum():
    # Θ = 4·250 samples/s, c = 0.1 s, no bounds: goodput ∝ M / ((M/Θ + c)(B_noise + M))
    # is maximal at M* = sqrt(c·Θ·B_noise) = 1000 for B_noise = 1e4; the grid is ~15% coarse.
    d = GoodputPolicy().decide(_goodput_state(1e4))
    m = d.terms["global_batch_chosen"]
    assert 850 <= m <= 1180
    assert sum(d.batch_sizes) == m and max(d.batch_sizes) - min(d.batch_sizes) <= 1
    assert d.predicted_gain == pytest.approx(d.terms["goodput_chosen"] / d.terms["goodput_now"] - 1)
    assert d.predicted_gain > 0


@pytest.mark.parametrize("grad_sq,trace_cov", [(None, None), (1.0, None), (0.0, 5.0), (1.0, float("nan")), (float("nan"), 1.0)])
def test_goodput_without_noise_estimate_equals_proportional(grad_sq, trace_cov):
    s = make_state([300, 300, 300, 100], [64] * 4, grad_sq=grad_sq, trace_cov=trace_cov)
    d = GoodputPolicy().decide(s)
    assert d.batch_sizes == ProportionalPolicy().decide(s).batch_sizes == (77, 77, 77, 25)
    assert d.terms["fallback"] == "proportional"


@pytest.mark.parametrize("noise", [0.0, 1.0, 1e3, 1e9])
def test_goodput_stays_in_the_feasible_range(noise):
    s = make_state([300, 300, 300, 100], [64] * 4, min_batch=8, max_batch=128, dataset_size=300,
                   grad_sq=1.0, trace_cov=noise)
    d = GoodputPolicy(scale_down=True).decide(s)
    m = d.terms["global_batch_chosen"]
    assert d.terms["global_batch_range"] == [32, 300]
    assert 32 <= m <= 300 and sum(d.batch_sizes) == m
    assert GoodputPolicy().feasible_range(s) == (256, 300)
    assert all(8 <= b <= 128 for b in d.batch_sizes)
    if noise >= 1e9:
        assert m == 300          # efficiency ≈ 1 everywhere: the largest batch wins
    if noise == 0.0:
        # efficiency M0/M makes goodput ∝ 1/step time: the fastest step wins. Worker 3 is pinned
        # at its floor of 8 up to M = 80 ([24, 24, 24, 8]), so 32…80 tie; the tie goes to the
        # candidate nearest the current 256.
        assert d.terms["step_time_predicted_s"] == pytest.approx(8 / 100 + 0.05)
        assert m == 80


@settings(max_examples=150, deadline=None)
@given(cluster_states(), st.floats(0.0, 1e7))
def test_goodput_always_answers_a_valid_allocation(state, noise):
    s = ClusterState(step=state.step, workers=state.workers, initial_batch_sizes=state.initial_batch_sizes,
                     grad_sq=1.0, trace_cov=noise)
    d = GoodputPolicy().decide(s)
    for b, w in zip(d.batch_sizes, s.workers):
        assert isinstance(b, int) and b >= max(1, w.min_batch)
        assert w.max_batch is None or b <= w.max_batch
    assert math.isfinite(d.predicted_gain)


# -- registry ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,cls", [("static", StaticPolicy), ("proportional", ProportionalPolicy),
                                      ("goodput", GoodputPolicy), ("Goodput", GoodputPolicy)])
def test_make_policy_builds_by_name(name, cls):
    p = make_policy(name)
    assert isinstance(p, cls) and isinstance(p, Policy) and p.name == name.lower()


def test_make_policy_passes_options():
    assert make_policy("goodput", candidates=10, comm="mean").candidates == 10


def test_make_policy_ppo_without_a_path_names_the_flag():
    with pytest.raises(ConfigurationError, match="--policy-path DIR"):
        make_policy("ppo")


@pytest.mark.parametrize("name,options", [("nope", {}), ("goodput", {"candidates": 1}), ("static", {"x": 1})])
def test_make_policy_rejects_bad_input(name, options):
    with pytest.raises(ConfigurationError):
        make_policy(name, **options)


# ---- scheduler --policy-option values --------------------------------------------------------
# ``dynamix scheduler --policy-option KEY=VALUE``: boolean options reach the policy as booleans.


def _goodput(value):
    args = build_parser().parse_args(["scheduler", "--policy", "goodput", "--policy-option", f"scale_down={value}"])
    return build_policy(args.policy, dict(args.policy_option), max_change=2.0, hysteresis=0.05).policy


@pytest.mark.parametrize("value, expected", [("false", False), ("False", False), ("0", False), ("true", True)])
def test_scale_down_false_is_false(value, expected):
    assert _goodput(value).scale_down == expected


def test_a_scale_down_that_is_not_a_boolean_is_a_usage_error():
    with pytest.raises(UsageError, match="scale_down must be true or false"):
        _goodput("no")


@pytest.mark.parametrize("name", ["nope", "../../etc", "/tmp"])
def test_a_library_name_given_as_an_option_is_looked_up_in_the_library(name):
    args = build_parser().parse_args(["scheduler", "--policy", "ppo", "--policy-option", f"name={name}"])
    with pytest.raises(UsageError, match="in the policy library"):  # was: make_policy() got multiple values for 'name'
        build_policy(args.policy, dict(args.policy_option), max_change=2.0, hysteresis=0.05)
