"""The scheduler and its client under hostile or careless input (issue 18, control plane).

Each test reproduces one class of failure against a real gRPC scheduler on 127.0.0.1: numbers
beyond any physical range, a damaged decision log, bogus steps, bursts of early rank-0 reports,
a rank taken over by another client, an unauthenticated ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import wait_until
from test_scheduler import TOKEN, K, ScriptedPolicy, code_of, decisions, info, register_all, report, running, stub_for

from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.client import SchedulerClient
from dynamix_byteps.control.cluster import LIVE_RANK_S, MAX_STEP
from dynamix_byteps.control.scheduler import DECISION_LOG, SERVICE, _encode_line
from dynamix_byteps.env import MAX_BATCH

HUGE = 1e308  # finite, but two of them overflow a sum


def _complete_interval(stub, md, step, world=4, **kw):
    return [stub.ReportMetrics(report(r, step, **kw), metadata=md) for r in range(world)][-1]


# ---- 3: every number the scheduler accepts is bounded ------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["compute_s", "push_pull_s", "samples_per_s"])
def test_a_huge_finite_timing_is_refused_naming_the_field(field):
    with running(ScriptedPolicy()) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        bad = report(0, K // 2)
        setattr(bad, field, HUGE)
        code, details = code_of(stub.ReportMetrics, bad, metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["memory_used_bytes", "gpu_memory_used_bytes", "rtt_s", "tx_bytes_per_s",
                                   "rx_bytes_per_s", "delivery_rate_bytes_per_s", "retransmits"])
def test_a_huge_node_metric_is_refused_naming_the_field(field):
    value = 2**64 - 1 if field == "retransmits" else HUGE
    with running(ScriptedPolicy()) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        node = dynamix_pb2.NodeMetrics(**{field: value})
        code, details = code_of(stub.ReportMetrics, report(0, K // 2, node=node), metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"node.{field}" in details
        agent = dynamix_pb2.NodeReport(host="h", workers=[dynamix_pb2.WorkerNode(rank=0, node=node)])
        assert code_of(stub.ReportNode, agent, metadata=md)[0] == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["step", "dataset_size"])
def test_a_registration_beyond_any_real_run_is_refused(field):
    with running(ScriptedPolicy()) as server, stub_for(server) as (stub, md, _):
        bad = info(0)
        setattr(bad, field, 2**64 - 1)
        code, details = code_of(stub.Register, bad, metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details


@pytest.mark.timeout(60)
def test_an_unbounded_worker_registering_a_batch_size_no_report_may_carry_is_refused():
    """With max_batch=0 (no limit) a size beyond MAX_BATCH used to be accepted as the rank's
    initial size, and every report the worker then sent at that size was refused."""
    with running(ScriptedPolicy(), num_workers=1) as server, stub_for(server) as (stub, md, _):
        code, details = code_of(stub.Register, info(0, world=1, hi=0, batch=2**32 - 1), metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "batch_size" in details and str(MAX_BATCH) in details
        assert list(stub.Register(info(0, world=1, hi=0, batch=MAX_BATCH), metadata=md).assignment.batch_sizes) == [MAX_BATCH]
        assert stub.ReportMetrics(report(0, K // 2, batch=MAX_BATCH), metadata=md).batch_sizes


@pytest.mark.timeout(60)
def test_huge_losses_and_statistics_still_give_a_logged_decision(tmp_path):
    with running(ScriptedPolicy(), run_dir=tmp_path) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        for step in (K // 2, K):  # two reports per rank: their sums would overflow
            for r in range(4):
                stub.ReportMetrics(report(r, step, loss=HUGE, grad_sq=HUGE, trace_cov=-HUGE), metadata=md)
    [line] = decisions(tmp_path)
    assert line["state"]["workers"]["loss"] == [None] * 4  # diverged, not a number
    assert line["state"]["grad_sq"] is None and line["state"]["trace_cov"] is None


def test_a_record_with_a_value_json_cannot_hold_is_still_written():
    line = json.loads(_encode_line({"decision": 3, "timing": {"policy_s": math.inf}, "x": [math.nan, object()]}))
    assert line["decision"] == 3 and line["timing"]["policy_s"] is None and line["x"][0] is None


# ---- 6: a damaged decision log ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["-5", "1e30", str(2**64 - 1), "true", '"7"', "[1]"])
def test_an_out_of_range_logged_version_is_skipped_and_every_rpc_still_works(tmp_path, bad):
    (tmp_path / DECISION_LOG).write_text('{"version": 6}\n' + f'{{"version": {bad}}}\n')
    with running(ScriptedPolicy(lambda s: (16, 16, 16, 16)), run_dir=tmp_path) as server, stub_for(server) as (stub, md, _):
        assert register_all(stub, md)[-1].assignment.version == 6
        assert _complete_interval(stub, md, K).version == 7
    assert decisions(tmp_path)[-1]["version"] == 7


# ---- 7: a bogus step cannot make every later report stale --------------------------------------


@pytest.mark.timeout(60)
def test_one_report_with_a_huge_step_does_not_stop_the_decisions(tmp_path):
    policy = ScriptedPolicy()
    with running(policy, run_dir=tmp_path) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        stub.ReportMetrics(report(0, MAX_STEP), metadata=md)
        for step in (K, 2 * K, 3 * K):
            _complete_interval(stub, md, step)
    assert [s.step for s in policy.states][-2:] == [2 * K, 3 * K]


@pytest.mark.timeout(60)
def test_one_registration_with_a_huge_step_does_not_stop_the_decisions():
    policy = ScriptedPolicy()
    with running(policy) as server, stub_for(server) as (stub, md, _):
        stub.Register(info(0, step=MAX_STEP), metadata=md)
        for r in (1, 2, 3):
            stub.Register(info(r), metadata=md)
        for step in (K, 2 * K):
            _complete_interval(stub, md, step)
    assert [s.step for s in policy.states] == [K, 2 * K]


@pytest.mark.timeout(60)
def test_a_rank_rejoining_at_an_earlier_step_gets_a_decision_not_an_internal_error():
    policy = ScriptedPolicy()
    with running(policy) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        _complete_interval(stub, md, K)
        stub.Register(info(2, step=0), metadata=md)  # restarted from step 0: the others already passed K
        assert stub.ReportMetrics(report(2, K), metadata=md).batch_sizes  # was INTERNAL (KeyError)
        _complete_interval(stub, md, 2 * K)
    assert [s.step for s in policy.states] == [K, K, 2 * K]


# ---- 8: no client can starve the others ------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_burst_of_rank_0_reports_does_not_starve_the_other_ranks():
    with running(ScriptedPolicy(lambda s: (16, 16, 16, 16))) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        for r in (1, 2):
            stub.ReportMetrics(report(r, K), metadata=md)
        burst = [stub.ReportMetrics.future(report(0, K), metadata=md, timeout=30) for _ in range(200)]
        started = time.monotonic()
        answer = stub.ReportMetrics(report(3, K), metadata=md, timeout=2)
        waited_s = time.monotonic() - started
        assert answer.version == 1 and waited_s < 1.5, f"rank 3 waited {waited_s:.2f} s behind the burst"
        started = time.monotonic()
        assert all(f.result().batch_sizes for f in burst)
        assert time.monotonic() - started < 2


async def _answered_beside_stalled_calls(address: str, stalled: int) -> tuple[list, list[grpc.StatusCode]]:
    """Open ``stalled`` Register calls that send their headers and never their request, then a
    normal Register and ReportMetrics on the same connection; their answers, then the codes of
    the stalled calls once cancelled."""
    async def never_sends():
        await asyncio.Event().wait()
        yield b""

    async with grpc.aio.insecure_channel(address) as channel:
        open_register = channel.stream_unary(f"/{SERVICE}/Register")  # raw bytes, headers first
        calls = [open_register(never_sends()) for _ in range(stalled)]
        try:
            await asyncio.gather(*(call.wait_for_connection() for call in calls))
            stub = dynamix_pb2_grpc.SchedulerStub(channel)
            answers = [await stub.Register(info(0, world=1), timeout=10),
                       await stub.ReportMetrics(report(0, K // 2), timeout=10)]
        finally:
            for call in calls:
                call.cancel()
        return answers, [await call.code() for call in calls]


@pytest.mark.timeout(60)
def test_calls_that_never_send_their_request_do_not_stop_the_scheduler_answering():
    """Each stalled call used to hold one of the handler threads while it waited for its request,
    so max_threads of them left registrations and reports unanswered (DEADLINE_EXCEEDED)."""
    threads_before = set(threading.enumerate())
    with running(ScriptedPolicy(), max_threads=4) as server:
        (registered, reported), stalled = asyncio.run(_answered_beside_stalled_calls(f"127.0.0.1:{server.port}", 3 * 4))
        assert registered.decision_interval == K and list(reported.batch_sizes) == [32]
        assert stalled == [grpc.StatusCode.CANCELLED] * 3 * 4
    assert not [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("dynamix")]


# ---- 9: a live rank cannot be taken over -----------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", [{"host": "10.9.9.9"}, {"lo": 100, "batch": 100}, {"hi": 0}])
def test_a_re_registration_changing_a_live_rank_is_refused_until_it_falls_silent(change):
    with running(ScriptedPolicy()) as server, stub_for(server) as (stub, md, _):
        clock = server.cluster.clock = FakeClock()
        register_all(stub, md)
        assert stub.Register(info(0), metadata=md).assignment.batch_sizes  # the same worker again: fine
        code, details = code_of(stub.Register, info(0, **change), metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 0 is registered from host" in details
        assert stub.ReportMetrics(report(0, K // 2), metadata=md).batch_sizes  # the real worker goes on
        clock.now += LIVE_RANK_S + 1
        assert stub.Register(info(0, **change), metadata=md).assignment.batch_sizes  # a restarted job


@pytest.mark.timeout(60)
def test_a_worker_refused_by_another_registration_of_its_rank_registers_again():
    with running(ScriptedPolicy(), num_workers=1) as server, stub_for(server) as (stub, md, _):
        clock = server.cluster.clock = FakeClock()
        client = SchedulerClient(f"127.0.0.1:{server.port}", None, lambda: info(0, world=1))
        try:
            client.submit(report(0, K))
            assert wait_until(lambda: server.cluster.last_step.get(0) == K, 10)
            clock.now += LIVE_RANK_S + 1  # the worker was silent: another client takes its rank
            stub.Register(info(0, world=1, lo=100, batch=100, host="10.9.9.9"), metadata=md)
            client.submit(report(0, 2 * K))  # refused: 32 is outside [100, 128]
            assert wait_until(lambda: client._failing, 10)
            clock.now += LIVE_RANK_S + 1
            client.submit(report(0, 3 * K))  # registers again, then reports
            assert wait_until(lambda: server.cluster.workers[0].host == "127.0.0.1"
                              and server.cluster.last_step.get(0) == 3 * K, 10)
        finally:
            client.close()


# ---- 12: /metrics needs the token ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_metrics_need_the_schedulers_token():
    with running(ScriptedPolicy(), metrics_port=0, token=TOKEN) as server:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-dynamix-token": TOKEN}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            assert refused.value.code == 401
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert b"dynamix_assignment_version" in resp.read()


class SlowPolicy(ScriptedPolicy):
    def __init__(self):
        super().__init__()
        self.deciding = threading.Event()

    def decide(self, state):
        self.deciding.set()
        time.sleep(1.5)
        return super().decide(state)


def _hold_the_only_thread(stub, md, policy):
    """Register four workers and report for them, rank 0 last: its decision holds a one-thread
    scheduler's thread for SlowPolicy's 1.5 s. Returns that call's future once the policy decides."""
    register_all(stub, md)
    for r in (1, 2, 3):
        stub.ReportMetrics(report(r, K), metadata=md)
    deciding = stub.ReportMetrics.future(report(0, K), metadata=md, timeout=30)
    # A fixed pause here lost the race on a loaded machine: calls sent next could reach the thread first.
    assert policy.deciding.wait(20), "rank 0's report never reached the policy"
    return deciding


@pytest.mark.timeout(60)
def test_calls_dropped_after_queueing_past_their_deadline_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="dynamix_byteps.scheduler"), \
            running(policy := SlowPolicy(), max_threads=1) as server, stub_for(server) as (stub, md, _):
        deciding = _hold_the_only_thread(stub, md, policy)
        dropped = [stub.Register.future(info(1), metadata=md, timeout=0.3) for _ in range(5)]
        codes = {f.exception().code() for f in dropped}
        assert deciding.result().batch_sizes
        assert wait_until(lambda: server.queue_watch.slow_calls == 5, 10)
    assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}
    first, at_stop = [r.getMessage() for r in caplog.records if "handler threads" in r.getMessage()]
    assert first.startswith("1 call(s) waited up to ") and "1 of them dropped unanswered" in first
    assert "more calls at once" in first
    # within 10 s of the first: said when the scheduler stops
    assert at_stop.startswith("4 call(s) waited up to ") and "4 of them dropped unanswered" in at_stop


@pytest.mark.timeout(60)
def test_calls_a_client_cancels_or_stop_cuts_are_not_blamed_on_a_full_queue(caplog):
    with caplog.at_level(logging.WARNING, logger="dynamix_byteps.scheduler"), \
            running(policy := SlowPolicy(), max_threads=1) as server, stub_for(server) as (stub, md, _):
        deciding = _hold_the_only_thread(stub, md, policy)
        given_up = stub.Register.future(info(1), metadata=md, timeout=20)
        cut = [stub.Register.future(info(1), metadata=md, timeout=20) for _ in range(3)]
        time.sleep(0.3)
        given_up.cancel()
        time.sleep(0.2)
    # stopped at once (grace=None) while the three waited for the thread
    assert given_up.cancelled() and all(f.exception() is not None for f in cut)
    assert deciding.exception() is not None
    assert not [r.getMessage() for r in caplog.records if "dropped unanswered" in r.getMessage()]


@pytest.mark.timeout(30)
def test_starting_a_serving_scheduler_again_is_refused():
    with running(ScriptedPolicy()) as server:
        with pytest.raises(RuntimeError, match="already serves on port"):
            server.start()


# ---- 16: the decision log says when the workers switch ------------------------------------------


@pytest.mark.timeout(60)
def test_logged_effective_step_is_one_interval_after_the_decision(tmp_path):
    with running(ScriptedPolicy(lambda s: (16, 32, 48, 64)), run_dir=tmp_path) as server, stub_for(server) as (stub, md, _):
        register_all(stub, md)
        assert _complete_interval(stub, md, K).effective_step == 2 * K
    [line] = decisions(tmp_path)
    assert (line["step"], line["effective_step"]) == (K, 2 * K)
