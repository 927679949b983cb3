"""One standalone scheduler serving several jobs one after the other (``dynamix scheduler`` under
torchrun, docs/porting.md): a new job starts from its own batch sizes, never from the previous
job's assignment, while the same job's workers coming back keep the assignment in force.

A real scheduler on 127.0.0.1 and real stubs; workers register at their first report boundary
(step K, as a worker's SchedulerClient does), never at step 0.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from test_scheduler import K, ScriptedPolicy, code_of, info, report, running, stub_for

from dynamix_byteps.control.cluster import MAX_STEP, Cluster

WORLD = 2


class Steered(ScriptedPolicy):
    """Answers ``sizes`` while set, else keeps the sizes in force; remembers every state."""

    def __init__(self, sizes=None):
        super().__init__(lambda s: self.sizes if self.sizes is not None else s.batch_sizes)
        self.sizes = sizes


def register(stub, rank, step, batch, lo=1, hi=0):
    return stub.Register(info(rank, WORLD, batch=batch, lo=lo, hi=hi, step=step)).assignment


def interval(stub, step, batches, slow_rank=None):
    """Every rank reports the interval ending at ``step``, rank 0 last; rank 0's answer (the one
    the job applies: rank 0 broadcasts it)."""
    answers = {}
    for r in reversed(range(WORLD)):
        compute = 0.1 * (8 if r == slow_rank else 1)
        answers[r] = stub.ReportMetrics(report(r, step, batch=batches[r], compute=compute))
    return answers[0]


def job_one(stub, policy, batch=32, intervals=6):
    """The tester's first job: 32 per worker, rank 1 slow, moved to [63, 1] by the policy."""
    register(stub, 0, K, batch)
    register(stub, 1, K, batch)
    sizes = [batch] * WORLD
    for i in range(2, intervals + 2):
        answer = interval(stub, i * K, sizes, slow_rank=1)
        sizes = list(answer.batch_sizes)
    assert sizes == [63, 1] and len(policy.states) == intervals
    return sizes


@pytest.mark.timeout(60)
def test_a_second_job_starts_from_its_own_batch_sizes_not_the_first_jobs(caplog):
    policy = Steered((63, 1))
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        job_one(stub, policy)
        version = server.cluster.current.version
        policy.sizes = None  # job 2 has no straggler: the policy keeps what is in force
        caplog.set_level(logging.INFO, logger="dynamix_byteps.scheduler")

        # job 2: batch 8 per worker; its rank 0 registers and reports before its rank 1 registers
        first = register(stub, 0, K, 8)
        assert list(first.batch_sizes) == [], "the first job's sizes reached the new job"
        assert list(stub.ReportMetrics(report(0, K, batch=8)).batch_sizes) == []
        joined = register(stub, 1, K, 8)
        assert list(joined.batch_sizes) == [8, 8] and joined.version == version
        assert "a new job registered" in caplog.text and "starting over from its batch sizes [8, 8]" in caplog.text

        seen = len(policy.states)
        applied = []
        for step in range(2 * K, 6 * K, K):  # ten steps and more: the defect switched at step 10
            answer = interval(stub, step, [8, 8])
            applied.append(list(answer.batch_sizes))
        assert applied == [[8, 8]] * 4
        states = policy.states[seen:]
        assert [s.step for s in states] == [2 * K, 3 * K, 4 * K, 5 * K]
        assert all(s.initial_batch_sizes == (8, 8) for s in states)
        assert [w.batch_size for w in states[0].workers] == [8, 8]
        # its own throughput (8 / 0.1 on both ranks), not smoothed with the first job's
        assert [w.samples_per_s for w in states[0].workers] == pytest.approx([80.0, 80.0])
        assert [w.min_batch for w in states[0].workers] == [1, 1]


@pytest.mark.timeout(60)
def test_a_rerun_after_a_killed_job_starts_from_its_own_sizes():
    policy = Steered((63, 1))
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        job_one(stub, policy)  # then every worker is killed at step 7K: nothing more from them
        policy.sizes = None
        assert list(register(stub, 1, K, 32).batch_sizes) == []
        assert list(register(stub, 0, K, 32).batch_sizes) == [32, 32]
        assert server.cluster.initial_batch_sizes == (32, 32) and server.cluster.throughput == {}
        assert [list(interval(stub, step, [32, 32]).batch_sizes) for step in (2 * K, 3 * K)] == [[32, 32]] * 2
        assert policy.states[-1].loss_history == (1.0, 1.0)  # the killed job's losses are gone


@pytest.mark.timeout(60)
def test_a_new_job_resuming_its_own_checkpoint_with_other_sizes_starts_over():
    policy = Steered((63, 1))
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        job_one(stub, policy)
        policy.sizes = None
        # behind the first job's step 7K, but past its first change: only the sizes tell
        assert list(register(stub, 0, 4 * K, 16).batch_sizes) == []
        assert list(register(stub, 1, 4 * K, 48).batch_sizes) == [16, 48]
        assert list(interval(stub, 5 * K, [16, 48]).batch_sizes) == [16, 48]
        assert policy.states[-1].initial_batch_sizes == (16, 48)


@pytest.mark.timeout(60)
def test_the_same_jobs_workers_coming_back_keep_the_assignment(caplog):
    policy = Steered((63, 1))
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        job_one(stub, policy)
        current = server.cluster.current

        # a worker whose client lost the scheduler registers again further on: answered at once
        assert list(register(stub, 0, 8 * K, 63).batch_sizes) == [63, 1]
        assert interval(stub, 8 * K, [63, 1]).version == current.version
        throughput = dict(server.cluster.throughput)

        # the whole job restarted from a checkpoint at step 5K (torchrun --max-restarts): its
        # sampler state holds [63, 1]; it goes on with the assignment in force
        caplog.set_level(logging.INFO, logger="dynamix_byteps.scheduler")
        register(stub, 1, 5 * K, 1)
        assert list(register(stub, 0, 5 * K, 63).batch_sizes) == [63, 1]
        assert "the same job resumed from a checkpoint" in caplog.text and "a new job registered" not in caplog.text
        assert server.cluster.current is current and server.cluster.initial_batch_sizes == (32, 32)
        assert server.cluster.throughput == throughput and server.cluster.jobs == 1
        seen = len(policy.states)
        assert list(interval(stub, 6 * K, [63, 1]).batch_sizes) == [63, 1]
        assert [s.step for s in policy.states[seen:]] == [6 * K]


@pytest.mark.timeout(60)
def test_a_rank_coming_back_alone_gets_sizes_again_once_it_trains_in_step():
    policy = Steered((63, 1))
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        job_one(stub, policy)  # both ranks reported step 7K
        assert list(register(stub, 0, 2 * K, 63).batch_sizes) == []  # behind: held back
        seen = len(policy.states)
        assert list(interval(stub, 8 * K, [63, 1]).batch_sizes) == [63, 1]
        assert [s.step for s in policy.states[seen:]] == [8 * K] and server.cluster.jobs == 1


@pytest.mark.timeout(60)
def test_reports_forged_at_step_2_to_the_53_from_every_rank_do_not_stop_the_decisions():
    policy = ScriptedPolicy()
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        register(stub, 0, K, 32)
        register(stub, 1, K, 32)
        interval(stub, 2 * K, [32, 32])
        interval(stub, MAX_STEP, [32, 32])  # decided at 2**53: the next decision was due at 2**53 + K
        for step in (3 * K, 4 * K, 5 * K):
            interval(stub, step, [32, 32])
        assert [s.step for s in policy.states] == [2 * K, MAX_STEP, 3 * K, 4 * K, 5 * K]


@pytest.mark.timeout(60)
def test_a_job_of_another_size_is_refused_telling_to_start_another_scheduler():
    with running(ScriptedPolicy()) as server, stub_for(server) as (stub, _, _channel):
        register(stub, 0, K, 32)
        code, details = code_of(stub.Register, info(0, 3, step=K))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "serves a job of 2 workers; start another scheduler (or restart this one)" in details


def test_a_decision_taken_for_the_previous_job_is_not_installed_in_the_new_one():
    cluster = Cluster(None, K, "scripted")
    for r in range(WORLD):
        cluster.register_locked(info(r, WORLD, batch=32, lo=1, hi=0, step=K))
    cluster.report_locked(report(1, 2 * K))
    _, snap = cluster.report_locked(report(0, 2 * K))
    assert snap is not None and snap.step == 2 * K
    for r in range(WORLD):  # the next job registers while the policy decides for the last one
        cluster.register_locked(info(r, WORLD, batch=8, lo=1, hi=0, step=K))
    assert cluster.current.batch_sizes == (8, 8)
    cluster.publish_locked(snap, (63, 1), "decided for the previous job", 1.0)
    assert cluster.current.batch_sizes == (8, 8) and cluster.initial_batch_sizes == (8, 8)
