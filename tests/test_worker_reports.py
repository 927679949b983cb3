"""What a worker's StepMonitor tells the scheduler (issue 18, items 10 and 11): every report and
registration of normal use is one the scheduler accepts, with or without a DynamicBatchSampler."""

from __future__ import annotations

import logging

import pytest
from one_worker import OneWorkerEngine

from dynamix_byteps.assignment import Assignment, AssignmentSchedule, BatchBounds
from dynamix_byteps.batch_plan import BatchPlan
from dynamix_byteps.control import dynamix_pb2
from dynamix_byteps.control.cluster import validate_report, validate_worker_info
from dynamix_byteps.control.step_monitor import StepMonitor
from dynamix_byteps.env import WorkerEnv

K = 5


class _RecordingClient:
    """Stands in for SchedulerClient: keeps the reports, answers with ``latest``, joined at ``joined_version``."""

    def __init__(self, latest=None, joined_version=None):
        self.reports = []
        self._latest = latest
        self.joined_version = joined_version if joined_version is not None else latest and latest.version

    def submit(self, report):
        self.reports.append(report)

    def latest(self):
        return self._latest

    def close(self):
        pass


class _NoNoise:
    grad_sq = trace_cov = None


def _monitor(client) -> StepMonitor:
    env = WorkerEnv.from_environ({"DYNAMIX_SCHEDULER": "127.0.0.1:1", "DYNAMIX_DECISION_INTERVAL": str(K)})
    monitor = StepMonitor(OneWorkerEngine(), env, "sgd")
    monitor._client = client
    return monitor


def _train(monitor, samples_per_step, plan, first_step=0):
    for i, samples in enumerate(samples_per_step):
        monitor.after_step(samples, _NoNoise(), step=first_step + i + 1, plan=plan)


def test_an_epochs_partial_last_step_still_gives_a_report_within_the_bounds():
    schedule = AssignmentSchedule([16], BatchBounds.build(1, min_batch=16, max_batch=64), dataset_size=1000)
    client = _RecordingClient()
    monitor = _monitor(client)
    _train(monitor, [16] * (K - 1) + [3], BatchPlan(schedule))  # the epoch ends with 3 samples
    [report] = client.reports
    info = validate_worker_info(monitor._worker_info(), None)
    assert report.local_batch_size == 16
    assert validate_report(report, info).batch_size == 16  # accepted, not "outside the bounds"
    assert report.samples_per_s == pytest.approx((16 * (K - 1) + 3) / (report.compute_s * K))


def test_an_assignment_taking_effect_inside_the_interval_shows_in_the_reported_batch():
    schedule = AssignmentSchedule([16], BatchBounds.build(1, min_batch=8, max_batch=64))
    schedule.apply(Assignment((32,), 3, 1))  # steps 3 and 4 of the first interval run 32
    client = _RecordingClient()
    _train(_monitor(client), [16, 16, 16, 32, 32], BatchPlan(schedule))
    [report] = client.reports
    assert report.local_batch_size == round((3 * 16 + 2 * 32) / 5)  # the guardrails see it is not settled


def test_without_a_sampler_the_declared_batch_is_registered_and_reported(caplog):
    client = _RecordingClient(dynamix_pb2.Assignment(version=0, batch_sizes=[32]))
    monitor = _monitor(client)
    plan = BatchPlan()  # no sampler: no schedule
    _train(monitor, [32] * K, plan)
    [report] = client.reports
    info = validate_worker_info(monitor._worker_info(), None)  # batch_size=0 was refused
    assert info.batch_size == 32 and validate_report(report, info).batch_size == 32
    client._latest = dynamix_pb2.Assignment(version=1, batch_sizes=[48])
    with caplog.at_level(logging.ERROR, logger="dynamix_byteps.control.step_monitor"):
        _train(monitor, [32] * (2 * K), plan, first_step=K)
    [said] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # not the no-loss warning
    assert "NOT applied" in said and "DynamicBatchSampler" in said


def test_without_a_sampler_a_decision_made_before_the_first_answer_is_still_said_unapplied(caplog):
    """The worker joined at version 0; on a loaded machine the first answer it reads may already carry
    the policy's version 1 (CI saw it): that is a change the job cannot apply, and it is said."""
    client = _RecordingClient(dynamix_pb2.Assignment(version=1, batch_sizes=[48]), joined_version=0)
    monitor = _monitor(client)
    with caplog.at_level(logging.ERROR, logger="dynamix_byteps.control.step_monitor"):
        _train(monitor, [32] * (2 * K), BatchPlan())
    [said] = [r.getMessage() for r in caplog.records]
    assert "NOT applied" in said and "[48]" in said


def test_without_any_declared_batch_no_report_is_sent_and_the_fix_is_named(caplog):
    client = _RecordingClient()
    monitor = _monitor(client)
    with caplog.at_level(logging.ERROR, logger="dynamix_byteps.control.step_monitor"):
        _train(monitor, [None] * (2 * K), BatchPlan())
    assert client.reports == []
    [said] = [r.getMessage() for r in caplog.records]
    assert "set_local_batch_size" in said and "DynamicBatchSampler" in said
