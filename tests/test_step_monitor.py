"""The worker's step monitor: per-interval loss mean (what the divergence guardrail sees),
untimed sections and the straggler emulation."""

import logging
import math

import pytest
import torch
from one_worker import OneWorkerEngine

from dynamix_byteps import batch_plan
from dynamix_byteps.control.step_monitor import report_loss


@pytest.fixture(autouse=True)
def _own_default_plan(monkeypatch):
    """Each test gets a fresh default batch plan, as a new process would."""
    monkeypatch.setattr(batch_plan, "_default", batch_plan.BatchPlan())


def test_loss_mean_per_interval_and_none_when_nothing_was_reported():
    monitor = _monitor()
    assert monitor._take_mean_loss() is None
    report_loss(1.0)  # bps.report_loss: to the default plan's newest monitor
    monitor.report_loss(torch.tensor(3.0))
    assert monitor._take_mean_loss() == 2.0
    assert monitor._take_mean_loss() is None  # the next interval starts empty


def test_a_non_finite_loss_makes_the_interval_non_finite():
    monitor = _monitor()
    report_loss(1.0)
    report_loss(float("nan"))
    assert math.isnan(monitor._take_mean_loss())


def test_a_loss_reported_before_any_monitor_exists_is_dropped():
    report_loss(1.0)
    assert _monitor()._take_mean_loss() is None


def _monitor(slowdown="1", steps=0):
    from dynamix_byteps.control.step_monitor import StepMonitor
    from dynamix_byteps.env import WorkerEnv

    monitor = StepMonitor(OneWorkerEngine(), WorkerEnv.from_environ({"DYNAMIX_SLOWDOWN": slowdown}), "sgd")
    batch_plan.default().attach(monitor, None)  # what a frontend's TrainingStep does
    for _ in range(steps):
        monitor.stretch()
        monitor.after_step(8, None)
    return monitor


def test_untimed_sections_are_left_out_of_compute_and_training_time():
    import time

    import dynamix_byteps as bps

    monitor = _monitor(steps=1)
    with bps.untimed():
        time.sleep(0.3)
    monitor.stretch()
    monitor.after_step(8, None)
    stats = bps.step_statistics()
    assert (stats.steps, stats.samples) == (2, 16)
    assert stats.compute_s < 0.2  # the 0.3 s inside untimed() is not compute
    assert monitor.training_seconds() < 0.2
    assert stats.samples_per_s == stats.samples / stats.compute_s


def test_slowdown_applies_only_inside_its_window():
    import time

    def one_step(slowdown):
        monitor = _monitor(slowdown)
        time.sleep(0.01)
        monitor.stretch()
        monitor.after_step(8, None)
        return monitor

    inside, outside = one_step("50@0-1000"), one_step("50@1000-2000")
    # 50x of >= 10 ms of compute is >= 0.5 s inside the window, nothing added outside it
    assert inside.totals.compute_s >= 0.5 > outside.totals.compute_s


def test_nested_untimed_sections_count_once():
    import time

    import dynamix_byteps as bps

    monitor = _monitor("2", steps=1)  # with a slowdown, a double count made the sleep negative
    with bps.untimed():
        with bps.untimed():
            time.sleep(0.2)
        time.sleep(0.1)
    assert 0.3 <= monitor._untimed_s < 0.5
    monitor.stretch()
    monitor.after_step(8, None)
    assert monitor.totals.steps == 2


def test_transfers_inside_an_untimed_section_and_the_pause_itself_are_not_push_time():
    """A ps worker that evaluates between steps (a metric averaged by push_pull) kept the ring's
    step open across the evaluation: its push span ran from before the pause to after it."""
    import time

    import dynamix_byteps as bps
    from dynamix_byteps import timing

    monitor = _monitor()
    ring = monitor.engine.timing

    def push(seconds):
        start = timing.now_ns()
        time.sleep(seconds)
        ring.record("grad", 4, start, timing.now_ns(), timing.PUSH)

    push(0.02)  # the step's first bucket
    with bps.untimed():
        push(0.01)  # the evaluation's metric average
        time.sleep(0.4)
    push(0.02)  # the step's last bucket
    monitor.after_step(8, None)
    assert 0.04 <= monitor.totals.push_s < 0.2  # both buckets, not the 0.4 s pause nor the metric


def test_a_steps_exposed_communication_is_its_own_transfers_inside_the_wait():
    """The wait the frontend measured, given as (begin, end): only the part of it this worker's own
    pushes and pulls covered is exposed communication; the rest was waiting for the others."""
    from dynamix_byteps import timing

    monitor = _monitor()
    ring = monitor.engine.timing
    ms = 1_000_000
    w0 = timing.now_ns()
    ring.record("grad", 4, w0 - 30 * ms, w0 + 10 * ms, timing.PUSH)  # mostly hidden behind backward
    ring.record("grad", 4, w0 + 40 * ms, w0 + 50 * ms, timing.PULL)  # after a 30-ms hold
    monitor.after_step(8, None, push_pull_s=0.05, wait_ns=(w0, w0 + 50 * ms))
    assert monitor.totals.exposed_comm_s == pytest.approx(0.02)
    assert monitor.totals.push_s + monitor.totals.pull_s == pytest.approx(0.05)
    assert monitor.totals.push_pull_s == pytest.approx(0.05)


def _told_while_training(caplog, steps: int, samples: int, loss: bool) -> list[str]:
    """The warnings and errors of a monitor reporting to a real (unreachable) scheduler address,
    trained ``steps`` steps of ``samples`` samples (0: no batch size declared), with or without
    ``bps.report_loss``."""
    from dynamix_byteps.control.step_monitor import StepMonitor
    from dynamix_byteps.env import WorkerEnv
    from dynamix_byteps.scaling.gradient_noise import GradientNoiseScale

    caplog.clear()
    env = WorkerEnv.from_environ({"DYNAMIX_SCHEDULER": "127.0.0.1:9", "DYNAMIX_DECISION_INTERVAL": "2"})
    monitor = StepMonitor(OneWorkerEngine(), env, "sgd")
    batch_plan.default().attach(monitor, None)
    try:
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.control.step_monitor"):
            for _ in range(steps):
                if loss:
                    report_loss(0.5)
                monitor.after_step(samples, GradientNoiseScale())
    finally:
        monitor.close()
    return [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(60)
def test_a_worker_that_reports_no_loss_is_told_once(caplog):
    """Without bps.report_loss the policy sees no loss: the first report interval without one
    says so, once, with the Keras model.fit remedy too; a worker that reports its loss hears nothing."""
    [told] = [said for said in _told_while_training(caplog, 6, 8, loss=False) if "report_loss" in said]
    assert "no training loss" in told and "bps.report_loss(loss) every step" in told
    assert "BatchSizeCallback()" in told  # model.fit has no step of the user's own to call it in
    assert [said for said in _told_while_training(caplog, 6, 8, loss=True) if "report_loss" in said] == []


@pytest.mark.timeout(60)
def test_a_worker_that_declares_no_batch_is_told_how_on_each_frontend(caplog):
    """A Horovod Keras script under --policy (a plain tf.data dataset, no sampler) declares no batch:
    the error named only PyTorch's optimizer.set_local_batch_size, which Keras optimizers lack."""
    [told] = [said for said in _told_while_training(caplog, 6, 0, loss=True) if "nothing declares it" in said]
    assert "DynamicBatchSampler" in told and "optimizer.set_local_batch_size(n)" in told
    assert "bps.dynamic_batch_dataset" in told and "DistributedGradientTape(tape, local_batch_size=n)" in told
