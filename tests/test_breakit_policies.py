"""Hostile ``--engine ps`` states for the policies: push_s/pull_s/exposed_comm_s NaN, negative, infinite or
missing, zero or non-finite throughput. ``decide()`` must answer a valid allocation every time."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from test_policies import make_state

from dynamix_byteps.policy.base import ClusterState, WorkerState
from dynamix_byteps.policy.goodput import GoodputPolicy
from dynamix_byteps.policy.proportional import ProportionalPolicy

ODD = st.sampled_from([None, math.nan, -1.0, -0.0, 0.0, math.inf, -math.inf, 1e300, 5e-324])
SECONDS = st.one_of(st.floats(0.0, 2.0), ODD)


@st.composite
def ps_states(draw):
    n = draw(st.integers(1, 8))
    thetas = [draw(st.one_of(st.floats(0.5, 5000), st.sampled_from([0.0, -5.0, math.nan, math.inf]))) for _ in range(n)]
    lo = [draw(st.integers(1, 64)) for _ in range(n)]
    hi = [draw(st.one_of(st.none(), st.integers(low, low + 512))) for low in lo]
    sizes = [draw(st.integers(low, h if h is not None else low + 512)) for low, h in zip(lo, hi)]
    base = make_state(thetas, sizes, min_batch=lo, max_batch=hi, push_pull=draw(SECONDS))
    workers = tuple(WorkerState(**{**w.__dict__, "push_s": draw(SECONDS), "pull_s": draw(SECONDS),
                                   "exposed_comm_s": draw(SECONDS)})
                    for w in base.workers)
    return dataclasses.replace(base, workers=workers, engine="ps", grad_sq=draw(st.floats(0.0, 10.0)),
                               trace_cov=draw(st.one_of(st.floats(0.0, 1e7), ODD)))


def _valid(decision, state: ClusterState) -> None:
    assert len(decision.batch_sizes) == len(state.workers)
    for b, w in zip(decision.batch_sizes, state.workers):
        assert isinstance(b, int) and b >= max(1, w.min_batch)
        assert w.max_batch is None or b <= w.max_batch
    assert math.isfinite(decision.predicted_gain)


@settings(max_examples=300, deadline=None)
@given(ps_states())
def test_goodput_under_ps_always_answers_a_valid_allocation(state):
    _valid(GoodputPolicy().decide(state), state)


@settings(max_examples=300, deadline=None)
@given(ps_states())
def test_proportional_under_ps_always_answers_a_valid_allocation(state):
    _valid(ProportionalPolicy().decide(state), state)
