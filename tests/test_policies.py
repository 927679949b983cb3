"""Batch-size policies: static, proportional (LB-BSP), goodput (Pollux), and the registry."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamix_byteps.cli import build_parser
from dynamix_byteps.cli.scheduler import build_policy
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.policy import (
    ClusterState,
    GoodputPolicy,
    Guarded,
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


@pytest.mark.parametrize("option", ["candidates", "max_global_batch"])
@pytest.mark.parametrize("value", [100.7, True, "100"])
def test_a_whole_number_option_is_not_truncated(option, value):
    with pytest.raises(ConfigurationError, match=f"{option} must be a whole number"):
        make_policy("goodput", **{option: value})


@pytest.mark.parametrize("value", [np.int64(512), 512.0, 5.12e2])
def test_a_whole_number_option_takes_numpy_integers_and_whole_floats(value):
    policy = make_policy("goodput", max_global_batch=value)
    assert policy.max_global_batch == 512 and type(policy.max_global_batch) is int


def test_goodput_candidates_are_bounded_so_a_decision_ends():
    with pytest.raises(ConfigurationError, match="candidates must be between 2 and 10000"):
        make_policy("goodput", candidates=10**23)


@pytest.mark.parametrize("option", ["divergence_window", "settle_limit"])
def test_a_guardrails_whole_number_is_not_truncated(option):
    with pytest.raises(ValueError, match=f"{option} must be a whole number"):
        Guarded(make_policy("static"), **{option: 2.5})


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


# -- proportional under the ps engine: compute plus each worker's own communication -----------------

def ps_state(thetas, sizes, comm, *, engine="ps", exposed=None, **kw):
    """A state whose workers report ``comm[i] = (push_s, pull_s)`` and ``exposed[i]`` as their
    exposed communication (None: ``push_s + pull_s``, nothing hidden behind backward)."""
    base = make_state(thetas, sizes, **kw)
    if exposed is None:
        exposed = [None if None in c else c[0] + c[1] for c in comm]
    workers = tuple(WorkerState(**{**w.__dict__, "push_s": c[0], "pull_s": c[1], "exposed_comm_s": e})
                    for w, c, e in zip(base.workers, comm, exposed))
    return dataclasses.replace(base, workers=workers, engine=engine)


def test_bounded_split_with_offsets_equalises_weighted_time_plus_offset():
    # 1000(T - 0.05) + 2·1000·T = 300 → T = 0.11667: 66.7, 116.7, 116.7
    assert bounded_split(300, [1000.0] * 3, [8] * 3, [1024] * 3, [0.05, 0.0, 0.0]) == [67, 117, 116]
    # an offset beyond what the total can cover puts that worker on its lower bound
    assert bounded_split(96, [1600.0] * 3, [8] * 3, [1024] * 3, [1.36, 0.02, 0.02]) == [8, 44, 44]
    # equal offsets change nothing: b ∝ w
    assert bounded_split(96, [1600.0, 800.0, 800.0], [1] * 3, [1024] * 3, [0.3] * 3) == [48, 24, 24]
    with pytest.raises(ValueError, match="offsets must be finite"):
        bounded_split(96, [1.0, 1.0], [1, 1], [100, 100], [0.0, math.nan])
    with pytest.raises(ValueError, match="same length"):
        bounded_split(96, [1.0, 1.0], [1, 1], [100, 100], [0.0])


def test_bounded_split_stays_exact_and_quick_when_an_offset_dwarfs_the_step():
    # λ ≈ 2e300 used to cancel against the offset into a share of ~1e288 samples, which the
    # rounding then walked back one sample at a time (a CI run hung here for 40 minutes)
    assert bounded_split(1770, [2943.5375954891156], [28], [math.inf], [2e300]) == [1770]
    assert bounded_split(100, [0.5, 5000.0, 3.0], [1] * 3, [math.inf] * 3, [1e300, 1e300, 0.1]) == [1, 1, 98]


EXTREME = st.sampled_from([5e-324, 1e-300, 0.5, 5000.0, 1e300, 1.7e308])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_bounded_split_answers_within_bounds_for_extreme_finite_inputs(data):
    n = data.draw(st.integers(1, 8))
    w = [data.draw(st.one_of(st.floats(0.5, 5000), EXTREME)) for _ in range(n)]
    off = [data.draw(st.one_of(st.floats(0.0, 4.0), EXTREME, st.just(0.0))) for _ in range(n)]
    lo = [data.draw(st.integers(1, 64)) for _ in range(n)]
    hi = [low + data.draw(st.integers(0, 512)) if data.draw(st.booleans()) else math.inf for low in lo]
    total = data.draw(st.integers(sum(lo) + 1, sum(lo) + 3000))
    b = bounded_split(total, w, lo, hi, off)
    assert all(low <= x <= h for x, low, h in zip(b, lo, hi))
    assert sum(b) == min(total, sum(hi))


@given(st.lists(st.tuples(st.floats(10.0, 5000.0), st.floats(0.0, 0.5)), min_size=1, max_size=8),
       st.integers(1, 4000))
@settings(max_examples=200, deadline=None)
def test_bounded_split_with_offsets_sums_to_total_within_bounds(workers, total):
    weights, offsets = [w for w, _ in workers], [o for _, o in workers]
    n = len(workers)
    out = bounded_split(total, weights, [1] * n, [1000] * n, offsets)
    assert all(1 <= b <= 1000 for b in out)
    assert sum(out) == min(max(total, n), 1000 * n)
    # the continuous optimum's finishing times are equal for every worker off its bounds: one batch
    # unit of rounding apart at most
    free = [i for i, b in enumerate(out) if 1 < b < 1000]
    times = [out[i] / weights[i] + offsets[i] for i in free]
    slack = max((1.0 / weights[i] for i in free), default=0.0)
    assert not times or max(times) - min(times) <= 2 * slack + 1e-9


def test_proportional_under_ps_gives_the_slow_link_worker_a_smaller_batch():
    # equal compute speed; rank 2 needs 0.1 s per step to push and pull over its link:
    # 320(T - 0.1) + 2·320(T - 0.01) = 96 → T = 0.14, b = 12.8, 41.6, 41.6
    state = ps_state([320.0] * 3, [32] * 3, [(0.005, 0.005), (0.005, 0.005), (0.05, 0.05)])
    d = ProportionalPolicy().decide(state)
    assert sum(d.batch_sizes) == 96 and d.batch_sizes[2] == 13 and sorted(d.batch_sizes[:2]) == [41, 42]
    finish = [b / 320.0 + m for b, m in zip(d.batch_sizes, [0.01, 0.01, 0.1])]
    assert max(finish) - min(finish) <= 1 / 320.0 + 1e-9  # compute + own comm equalised
    assert d.terms["own_comm_s"] == pytest.approx([0.01, 0.01, 0.1])
    assert d.predicted_gain > 0.05 and "(ps)" in d.reason
    # the step-time model: the round ends when the last worker's push arrives
    assert d.terms["step_time_now_s"] == pytest.approx(32 / 320.0 + 0.1)
    # a link slow enough puts its worker on its lower bound, the others share the rest
    far = ProportionalPolicy().decide(ps_state([320.0] * 3, [32] * 3, [(0.005, 0.005)] * 2 + [(0.125, 0.125)]))
    assert far.batch_sizes[2] == 1 and sorted(far.batch_sizes[:2]) == [47, 48]


def test_proportional_under_ps_balances_the_exposed_communication_not_the_whole_transfer():
    """A worker behind a moderately slow link whose pushes mostly overlap its backward: 97 ms of push and
    pull, 42 ms of it exposed. Balancing the whole transfer puts it on ~24 of 64; the exposed part calls
    for a trim."""
    thetas, sizes = [640.0, 640.0, 640.0, 790.0], [64] * 4
    comm = [(0.004, 0.004)] * 3 + [(0.055, 0.042)]
    d = ProportionalPolicy().decide(ps_state(thetas, sizes, comm, exposed=[0.005] * 3 + [0.042]))
    assert d.terms["own_comm_s"] == pytest.approx([0.005] * 3 + [0.042])
    assert sum(d.batch_sizes) == 256 and 50 <= d.batch_sizes[3] < 64
    whole = ProportionalPolicy().decide(ps_state(thetas, sizes, comm))  # what the old model did
    assert whole.batch_sizes[3] < 30


@pytest.mark.parametrize("engine, comm", [
    ("gloo", [(0.005, 0.005), (0.005, 0.005), (0.125, 0.125)]),  # a ring: communication is common
    ("ps", [(0.05, 0.02)] * 3),  # equal own communication
    ("ps", [(0.005, 0.005), (0.005, None), (0.125, 0.125)]),  # one worker did not report its pull
])
def test_proportional_stays_throughput_proportional_without_per_worker_differences(engine, comm):
    thetas, sizes = [1600.0, 800.0, 800.0], [32, 32, 32]
    plain = ProportionalPolicy().decide(make_state(thetas, sizes))
    d = ProportionalPolicy().decide(ps_state(thetas, sizes, comm, engine=engine))
    assert d.batch_sizes == plain.batch_sizes == (48, 24, 24)
    assert d.terms["own_comm_s"] is None or engine == "ps"


def test_the_cluster_carries_each_workers_push_pull_and_exposed_communication_to_the_policy():
    from dynamix_byteps.control import dynamix_pb2
    from dynamix_byteps.control.cluster import Cluster, Rejected, cluster_state

    def run(engines, comm):
        cluster = Cluster(num_workers=3, decision_interval=10, policy_name="proportional")
        with cluster.lock:
            for rank, engine in enumerate(engines):
                cluster.register_locked(dynamix_pb2.WorkerInfo(rank=rank, world_size=3, host="h", engine=engine,
                                                               batch_size=32, min_batch=1))
            snap = None
            for rank, (push, pull, *exposed) in enumerate(comm):  # exposed: (push + pull) / 2 unless given
                report = dynamix_pb2.Report(rank=rank, step=10, local_batch_size=32, compute_s=0.1, push_pull_s=0.3,
                                            samples_per_s=320.0)
                if push is not None:
                    report.push_s, report.pull_s = push, pull
                    report.exposed_comm_s = exposed[0] if exposed else (push + pull) / 2
                _, snap = cluster.report_locked(report)
        return cluster_state(snap)

    state = run(["ps"] * 3, [(0.005, 0.004), (0.006, 0.005), (0.125, 0.12)])
    assert state.engine == "ps"
    assert [(w.push_s, w.pull_s) for w in state.workers] == [(0.005, 0.004), (0.006, 0.005), (0.125, 0.12)]
    assert [w.exposed_comm_s for w in state.workers] == pytest.approx([0.0045, 0.0055, 0.1225])
    assert ProportionalPolicy().decide(state).batch_sizes[2] < 32
    ring = run(["gloo"] * 3, [(None, None)] * 3)
    assert ring.engine == "gloo" and all(w.push_s is None and w.exposed_comm_s is None for w in ring.workers)
    assert run(["ps", "gloo", "ps"], [(None, None)] * 3).engine == ""  # mixed: no engine to go by
    with pytest.raises(Rejected, match="push_s"):
        run(["ps"] * 3, [(-1.0, 0.0)] * 3)
    with pytest.raises(Rejected, match="exposed_comm_s"):
        run(["ps"] * 3, [(0.1, 0.1, -0.1)] * 3)


def test_goodput_under_ps_models_each_workers_own_link_and_shrinks_the_slow_link_worker():
    # noise small enough that goodput keeps M0 = 96; rank 2's link costs 0.1 s per step against 0.01 s
    comm = [(0.005, 0.005), (0.005, 0.005), (0.05, 0.05)]
    state = ps_state([320.0] * 3, [32] * 3, comm, grad_sq=1.0, trace_cov=1.0)
    d = GoodputPolicy().decide(state)
    # the round ends when the slow link's push arrives: 32/320 + 0.1, not max(b/θ) + the fastest link
    assert d.terms["step_time_now_s"] == pytest.approx(32 / 320.0 + 0.1)
    assert d.terms["global_batch_chosen"] == 96 and d.batch_sizes[2] == 13
    assert d.predicted_gain == pytest.approx((32 / 320.0 + 0.1) / d.terms["step_time_predicted_s"] - 1)
    assert d.predicted_gain > 0.3
    assert GoodputPolicy().predict_gain(state, d.batch_sizes) == pytest.approx(d.predicted_gain)
    assert "own link time (ps)" in d.reason
