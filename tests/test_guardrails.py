"""Guardrails: fallback on divergence, bounds, maximum change, hysteresis — one rule per test."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamix_byteps.env import MAX_BATCH
from dynamix_byteps.policy import (
    ClusterState,
    Decision,
    Guarded,
    Policy,
    ProportionalPolicy,
    StaticPolicy,
    WorkerState,
)


class Fixed(Policy):
    """Proposes the given sizes with the given predicted gain."""

    name = "fixed"

    def __init__(self, sizes, gain=1.0):
        self.sizes, self.gain, self.calls = sizes, gain, 0

    def decide(self, state):
        self.calls += 1
        return Decision(self.sizes, "fixed proposal", self.gain)


class Broken(Policy):
    name = "broken"

    def decide(self, state):
        raise RuntimeError("boom")


def make_state(sizes, *, thetas=None, min_batch=1, max_batch=None, initial=None, loss=()):
    n = len(sizes)
    thetas = thetas or [100.0] * n
    lo = min_batch if isinstance(min_batch, (list, tuple)) else [min_batch] * n
    hi = max_batch if isinstance(max_batch, (list, tuple)) else [max_batch] * n
    workers = tuple(
        WorkerState(rank=i, batch_size=sizes[i], compute_s=sizes[i] / thetas[i], push_pull_s=0.05,
                    samples_per_s=thetas[i], min_batch=lo[i], max_batch=hi[i])
        for i in range(n)
    )
    return ClusterState(step=50, workers=workers, initial_batch_sizes=tuple(initial or sizes),
                        loss_history=tuple(loss))


# -- rule 2: bounds ------------------------------------------------------------------------------

def test_bounds_clamp_each_proposal():
    s = make_state([64, 64, 64, 64], min_batch=8, max_batch=128)
    g = Guarded(Fixed([1000, 0, 5, 100]), max_change=math.inf, hysteresis=0.0)
    d = g.decide(s)
    assert d.batch_sizes == (128, 8, 8, 100)
    assert "bounds" in d.reason


def test_invalid_proposals_keep_the_current_size():
    s = make_state([32, 32, 32])
    d = Guarded(Fixed([float("nan"), 2.5, 40]), max_change=math.inf, hysteresis=0.0).decide(s)
    assert d.batch_sizes == (32, 32, 40)
    d = Guarded(Fixed([10, 10]), hysteresis=0.0).decide(s)  # wrong length
    assert d.batch_sizes == (32, 32, 32)
    d = Guarded(Fixed(None), hysteresis=0.0).decide(s)  # not a sequence at all
    assert d.batch_sizes == (32, 32, 32) and "0 sizes for 3 workers" in d.reason
    d = Guarded(Fixed([40, [48, 56], 24]), max_change=math.inf, hysteresis=0.0).decide(s)  # one entry a sequence
    assert d.batch_sizes == (40, 32, 24) and "ranks [1]: invalid proposal" in d.reason
    d = Guarded(Fixed([[40], [48], [24]]), max_change=math.inf, hysteresis=0.0).decide(s)  # every entry one
    assert d.batch_sizes == (32, 32, 32) and "ranks [0, 1, 2]: invalid proposal" in d.reason


# -- rule 3: maximum change ----------------------------------------------------------------------

def test_max_change_limits_each_worker():
    s = make_state([64, 64, 64, 64])
    d = Guarded(Fixed([300, 10, 64, 64]), max_change=2.0, hysteresis=0.0,
                preserve_global_batch=False).decide(s)
    assert d.batch_sizes == (128, 32, 64, 64)
    assert "change" in d.reason


def test_max_change_keeps_the_global_batch_when_it_can():
    s = make_state([64, 64, 64, 64])
    d = Guarded(Fixed([77, 77, 77, 25]), max_change=2.0, hysteresis=0.0).decide(s)
    assert sum(d.batch_sizes) == 256
    assert d.batch_sizes[3] == 32                    # 64 / 2
    assert all(32 <= b <= 128 for b in d.batch_sizes)


def test_max_change_with_the_proportional_policy_reaches_the_target_in_two_decisions():
    thetas = [300.0, 300.0, 300.0, 100.0]
    g = Guarded(ProportionalPolicy(), max_change=2.0)
    d1 = g.decide(make_state([64] * 4, thetas=thetas))
    assert sum(d1.batch_sizes) == 256 and d1.batch_sizes[3] == 32
    d2 = g.decide(make_state(list(d1.batch_sizes), thetas=thetas, initial=[64] * 4))
    assert d2.batch_sizes == (77, 77, 77, 25)


def test_a_small_factor_still_moves_every_size_by_one_sample():
    # --max-change 1.01 held every size below ~100 where it was: ceil(64/1.01) = 64 = floor(64*1.01)
    s = make_state([64, 3, 64, 3])
    d = Guarded(Fixed([32, 6, 128, 1]), max_change=1.01, hysteresis=0.0, preserve_global_batch=False).decide(s)
    assert d.batch_sizes == (63, 4, 65, 2)
    assert Guarded(Fixed([32, 6, 128, 1]), max_change=1.0, hysteresis=0.0).decide(s).batch_sizes == (64, 3, 64, 3)


def test_bounds_win_over_max_change():
    s = make_state([10, 10], min_batch=[64, 1], max_batch=[None, 4])
    d = Guarded(Fixed([10, 10]), max_change=2.0, hysteresis=0.0).decide(s)
    assert d.batch_sizes == (64, 4)


# -- rule 4: hysteresis --------------------------------------------------------------------------

def test_hysteresis_keeps_sizes_for_a_small_predicted_gain():
    s = make_state([64, 64])
    d = Guarded(Fixed([70, 58], gain=0.01), hysteresis=0.05).decide(s)
    assert d.batch_sizes == (64, 64) and d.predicted_gain == 0.0
    assert "hysteresis" in d.reason
    d = Guarded(Fixed([70, 58], gain=0.2), hysteresis=0.05).decide(s)
    assert d.batch_sizes == (70, 58) and d.predicted_gain == 0.2


def test_hysteresis_uses_the_re_evaluated_gain():
    # slightly unequal workers: the proportional policy predicts ~2% and must be ignored at 5%
    s = make_state([64] * 4, thetas=[300.0, 300.0, 300.0, 290.0])
    assert 0 < ProportionalPolicy().decide(s).predicted_gain < 0.05
    d = Guarded(ProportionalPolicy(), hysteresis=0.05).decide(s)
    assert d.batch_sizes == (64, 64, 64, 64)
    assert Guarded(ProportionalPolicy(), hysteresis=0.0).decide(s).batch_sizes != (64, 64, 64, 64)


class Predicting(Fixed):
    """Predicts a large gain for its own proposal, a small one for anything else."""

    def predict_gain(self, state, sizes):
        return self.gain if tuple(sizes) == self.sizes else 0.01


def test_hysteresis_judges_the_target_and_the_clipped_step_must_still_gain():
    s = make_state([64, 64])
    assert Guarded(Predicting([100, 28], gain=0.5), max_change=4.0).decide(s).batch_sizes == (100, 28)
    d = Guarded(Predicting([200, 28], gain=0.5), max_change=2.0).decide(s)   # clipped to 128
    assert d.batch_sizes == (128, 100) and d.predicted_gain == 0.01  # the global batch kept; the step's gain reported
    assert d.terms["guard"]["predicted_gain_of_target"] == 0.5

    class Worsening(Predicting):  # the clipped step alone would be slower
        def predict_gain(self, state, sizes):
            return self.gain if tuple(sizes) == self.sizes else -0.1

    d = Guarded(Worsening([200, 28], gain=0.5), max_change=2.0).decide(s)
    assert d.batch_sizes == (64, 64) and "is predicted to gain -0.1" in d.reason
    d = Guarded(Predicting([200, 28], gain=0.02), max_change=2.0).decide(s)  # a target below the threshold
    assert d.batch_sizes == (64, 64) and "predicted gain 0.02 < 0.05" in d.reason


def test_a_factor_near_one_moves_towards_a_worthwhile_target_under_the_default_hysteresis():
    # --max-change 1.01 with a 3x straggler: each one-sample step gains ~1.5%, below 5%, and was
    # refused every decision although the target gains ~40%
    s = make_state([64, 64], thetas=[300.0, 100.0])
    d = Guarded(ProportionalPolicy(), max_change=1.01).decide(s)
    assert d.batch_sizes == (65, 63) and 0 < d.predicted_gain < 0.05


def test_guarded_reports_the_gain_of_what_it_returns():
    s = make_state([64] * 4, thetas=[300.0, 300.0, 300.0, 100.0])
    d = Guarded(ProportionalPolicy(), max_change=2.0).decide(s)
    assert d.batch_sizes != (77, 77, 77, 25)
    assert d.predicted_gain == pytest.approx(ProportionalPolicy().predict_gain(s, d.batch_sizes))


def test_hysteresis_does_not_apply_to_static():
    s = make_state([80, 48], initial=[64, 64])
    assert Guarded(StaticPolicy()).decide(s).batch_sizes == (64, 64)


# -- rule 1: fallback ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_falls_back_to_the_initial_allocation(bad):
    inner = Fixed([100, 28], gain=1.0)
    s = make_state([96, 32], initial=[64, 64], loss=[2.0, 1.5, bad])
    d = Guarded(inner).decide(s)
    assert d.batch_sizes == (64, 64)
    assert "fallback" in d.reason and inner.calls == 0


def test_rising_loss_falls_back_to_the_initial_allocation():
    inner = Fixed([100, 28], gain=1.0)
    s = make_state([96, 32], initial=[64, 64], loss=[2.0, 2.3, 2.7, 3.2])
    d = Guarded(inner, divergence_window=3).decide(s)
    assert d.batch_sizes == (64, 64)
    assert "rose" in d.reason


@pytest.mark.parametrize("loss", [[2.0, 2.1, 2.05, 2.3], [2.1, 2.2, 2.3], [float("nan"), 2.0]])
def test_no_fallback_without_divergence(loss):
    s = make_state([96, 32], initial=[64, 64], loss=loss)
    assert Guarded(Fixed([100, 28]), hysteresis=0.0).decide(s).batch_sizes == (100, 28)


# -- always valid --------------------------------------------------------------------------------

def test_a_policy_that_raises_keeps_the_current_sizes():
    d = Guarded(Broken()).decide(make_state([16, 48]))
    assert d.batch_sizes == (16, 48) and "failed" in d.reason


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_guarded_answers_are_always_valid(data):
    n = data.draw(st.integers(1, 6))
    lo = [data.draw(st.integers(1, 32)) for _ in range(n)]
    hi = [data.draw(st.one_of(st.none(), st.integers(low, low + 200))) for low in lo]
    now = [data.draw(st.integers(1, 400)) for _ in range(n)]
    proposal = [data.draw(st.one_of(st.integers(-10, 5000), st.floats(allow_nan=True))) for _ in range(n)]
    max_change = data.draw(st.sampled_from([1.0, 1.5, 2.0, 4.0]))
    s = make_state(now, min_batch=lo, max_batch=hi)
    d = Guarded(Fixed(proposal, gain=data.draw(st.floats(-1, 1))), max_change=max_change,
                preserve_global_batch=data.draw(st.booleans())).decide(s)
    assert len(d.batch_sizes) == n
    for b, low, h, c in zip(d.batch_sizes, lo, hi, now):
        assert type(b) is int and b >= max(1, low)
        assert h is None or b <= h
        c_lo, c_hi = math.ceil(c / max_change - 1e-9), math.floor(c * max_change + 1e-9)
        if max_change > 1:
            c_lo, c_hi = max(1, min(c_lo, c - 1)), max(c_hi, c + 1)
        if max(low, c_lo) <= min(h if h is not None else math.inf, c_hi):   # window meets the bounds
            assert c_lo <= b <= c_hi


def test_an_astronomical_proposal_for_unbounded_workers_is_capped_not_an_overflow():
    """Found by the property test above: four proposals of ~9e307 summed to inf in rule 4's
    global-batch split (OverflowError out of decide) and, without the window, passed through as
    sizes the scheduler refuses."""
    s = make_state([1, 1, 1, 1])
    d = Guarded(Fixed([8.98846567431158e307] * 4, gain=1.0), hysteresis=0.0, preserve_global_batch=True).decide(s)
    assert d.batch_sizes == (2, 2, 2, 2)
    unlimited = Guarded(Fixed([1e300, 5, 1e300, 7], gain=1.0), hysteresis=0.0, max_change=math.inf).decide(s)
    assert unlimited.batch_sizes == (MAX_BATCH, 5, MAX_BATCH, 7)


def test_a_flat_noisy_loss_that_ticks_up_three_times_is_not_divergence():
    inner = Fixed([100, 28], gain=1.0)
    s = make_state([96, 32], initial=[64, 64], loss=[2.30, 2.31, 2.32, 2.33])
    d = Guarded(inner, divergence_window=3).decide(s)
    assert d.batch_sizes != (64, 64)
    assert "rose" not in d.reason


def test_three_chance_rises_of_a_noisy_falling_loss_are_not_divergence():
    """Interval means from a recorded straggler run: three rises in a row, 27% from the first
    to the last, but the window's mean barely moved."""
    inner = Fixed([100, 28], gain=1.0)
    s = make_state([96, 32], initial=[64, 64], loss=[0.369, 0.304, 0.268, 0.317, 0.323, 0.340])
    assert Guarded(inner, divergence_window=3).decide(s).batch_sizes == (100, 28)


# -- rule 2: settling ----------------------------------------------------------------------------

def _ran(state, ran):
    """``state`` with each worker's measurements taken at the batch ``ran[i]``."""
    workers = tuple(dataclasses.replace(w, batch_size_ran=b) for w, b in zip(state.workers, ran))
    return dataclasses.replace(state, workers=workers)


def test_a_decision_waits_while_the_last_assignment_has_not_taken_effect():
    inner = Fixed([100, 28], gain=1.0)
    guard = Guarded(inner, hysteresis=0.0, settle_limit=2)
    s = _ran(make_state([96, 32]), [64, 64])  # the interval still ran the sizes before [96, 32]
    d = guard.decide(s)
    assert d.batch_sizes == (96, 32) and "waiting" in d.reason and inner.calls == 0
    assert guard.decide(_ran(make_state([96, 32]), [96, 32])).batch_sizes == (100, 28)


def test_settling_waits_at_most_settle_limit_decisions_in_a_row():
    inner = Fixed([100, 28], gain=1.0)
    guard = Guarded(inner, hysteresis=0.0, settle_limit=2)
    stuck = _ran(make_state([96, 32]), [64, 64])
    answers = [guard.decide(stuck).batch_sizes for _ in range(3)]
    assert answers == [(96, 32), (96, 32), (100, 28)]


def test_a_partial_last_batch_of_an_epoch_does_not_count_as_unsettled():
    inner = Fixed([100, 28], gain=1.0)
    s = _ran(make_state([96, 32]), [92, 31])
    assert Guarded(inner, hysteresis=0.0).decide(s).batch_sizes == (100, 28)


def test_divergence_falls_back_even_while_unsettled():
    s = _ran(make_state([96, 32], initial=[64, 64], loss=[2.0, float("nan")]), [48, 48])
    assert Guarded(Fixed([100, 28])).decide(s).batch_sizes == (64, 64)
