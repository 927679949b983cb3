"""Absurd node metrics (NaN, inf, negative, beyond any machine) on the agent's side: one such value
is left out with a warning naming it, and the rest of the host's report still reaches a real
scheduler over gRPC (it refuses a whole report for one bad field)."""

from __future__ import annotations

import logging
import math

import grpc
import pytest

from dynamix_byteps.agent.node_agent import NodeAgent, node_metrics
from dynamix_byteps.control import dynamix_pb2
from dynamix_byteps.control.scheduler import SchedulerServer
from dynamix_byteps.policy.static import StaticPolicy

GOOD = {"cpu_util": 0.5, "memory_used_bytes": 1e9, "tx_bytes_per_s": 1e6, "rtt_s": 0.001}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 1e16])
def test_an_absurd_delivery_rate_is_left_out_and_the_rest_reaches_the_scheduler(caplog, bad):
    refused = set()
    with caplog.at_level(logging.WARNING, logger="dynamix_byteps.agent"):
        node = node_metrics(3, {**GOOD, "delivery_rate_bytes_per_s": bad}, refused)
        node_metrics(3, {**GOOD, "delivery_rate_bytes_per_s": bad}, refused)  # warned once per field
    assert not node.HasField("delivery_rate_bytes_per_s")
    assert {f.name: v for f, v in node.ListFields()} == GOOD
    warnings = [r.getMessage() for r in caplog.records if "delivery_rate" in r.getMessage()]
    assert warnings == [f"rank 3: node.delivery_rate_bytes_per_s={bad!r} must be a number between 0 and 1e+15; "
                        "left out of the node reports while it lasts"], warnings
    server = SchedulerServer(StaticPolicy(), num_workers=1, decision_interval=1)
    server.start()
    agent = NodeAgent("breakit", server.address, monitor="proc", interval_s=0.1)
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.agent"):
            agent.send(dynamix_pb2.NodeReport(host="h", workers=[dynamix_pb2.WorkerNode(rank=0, node=node)]))
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.agent"):
            raw = dynamix_pb2.NodeMetrics(**GOOD, delivery_rate_bytes_per_s=bad)  # unfiltered: refused, with why
            agent.send(dynamix_pb2.NodeReport(host="h", workers=[dynamix_pb2.WorkerNode(rank=0, node=raw)]))
        assert any("INVALID_ARGUMENT: node.delivery_rate_bytes_per_s=" in r.getMessage() for r in caplog.records)
    finally:
        agent.close()
        server.stop(grace=None)


def _two_workers(clock):
    from dynamix_byteps.control.cluster import Cluster

    cluster = Cluster(num_workers=2, decision_interval=10, policy_name="static", clock=clock)
    for rank in (0, 1):
        cluster.register_locked(dynamix_pb2.WorkerInfo(rank=rank, world_size=2, host="h", batch_size=32, step=1))
    return cluster


def _decided_node_metrics(cluster, step):
    """The node metrics each rank's WorkerState carries in the decision at ``step``."""
    from dynamix_byteps.control.cluster import cluster_state

    snap = None
    for rank in (0, 1):
        _, snap = cluster.report_locked(dynamix_pb2.Report(rank=rank, step=step, local_batch_size=32, compute_s=0.1,
                                                           push_pull_s=0.01, samples_per_s=320.0))
    assert snap is not None
    return [w.node for w in cluster_state(snap).workers]


def _agent_reports(cluster, rtt_s):
    cluster.node_report_locked(dynamix_pb2.NodeReport(host="h", workers=[
        dynamix_pb2.WorkerNode(rank=r, node=dynamix_pb2.NodeMetrics(rtt_s=rtt_s)) for r in (0, 1)]))


@pytest.mark.timeout(60)
def test_a_dead_agents_or_a_restarted_workers_node_metrics_do_not_reach_the_policy():
    from dynamix_byteps.agent.base import NODE_METRICS_MAX_AGE_S

    now = [100.0]
    cluster = _two_workers(lambda: now[0])
    _agent_reports(cluster, 0.5)  # a congested link, measured once
    assert _decided_node_metrics(cluster, 11) == [{"rtt_s": 0.5}, {"rtt_s": 0.5}]
    now[0] += NODE_METRICS_MAX_AGE_S / 2
    assert _decided_node_metrics(cluster, 21) == [{"rtt_s": 0.5}, {"rtt_s": 0.5}]  # still fresh
    now[0] += NODE_METRICS_MAX_AGE_S  # the agent was SIGKILLed: nothing new since
    assert _decided_node_metrics(cluster, 31) == [{}, {}]
    _agent_reports(cluster, 0.002)  # a new agent measures again
    # rank 1's worker restarts: what the agent measured was its previous process
    cluster.register_locked(dynamix_pb2.WorkerInfo(rank=1, world_size=2, host="h", batch_size=32, step=31))
    assert _decided_node_metrics(cluster, 41) == [{"rtt_s": 0.002}, {}]


class _ScriptedCollector:
    """A network collector that returns the next scripted ``{pid: bytes sent}`` at each sample."""

    name = "scripted"

    def __init__(self, script):
        self.script = iter(script)

    def sample(self, pids):
        from dynamix_byteps.agent.base import ProcessNetStats

        return {pid: ProcessNetStats(pid=pid, bytes_sent=sent) for pid, sent in next(self.script).items()}

    def close(self):
        pass


@pytest.mark.timeout(60)
def test_a_pid_that_comes_back_as_a_new_worker_is_not_reported_idle(monkeypatch):
    import dynamix_byteps.agent.node_agent as node_agent

    monkeypatch.setattr(node_agent, "discover_workers", lambda job: {0: 4242})
    agent = NodeAgent("breakit", "127.0.0.1:1", monitor="off")
    # rank 0's worker sent 10 MB, exited (the collector lost it), and a new worker got its pid: 1 kB so far
    agent.collector = _ScriptedCollector([{4242: 10_000_000}, {}, {4242: 1000}, {4242: 2_001_000}])
    try:
        sent = [agent.sample().workers[0].node for _ in range(4)]
    finally:
        agent.close()
    assert not sent[2].HasField("tx_bytes_per_s")  # no earlier sample of this process: unknown, not 0 B/s
    assert sent[3].tx_bytes_per_s > 0
    assert list(agent._previous) == [4242]


@pytest.mark.timeout(60)
def test_an_agent_on_another_host_than_its_ranks_is_refused_and_a_stray_rank_left_out():
    """An agent given another job's --job or --scheduler measures its own host's workers as this
    job's ranks; the ranks' registrations say which host each runs on."""
    from dynamix_byteps.control.cluster import FAILED_PRECONDITION, Cluster, Rejected

    cluster = Cluster(num_workers=3, decision_interval=10, policy_name="static")
    for rank, host in enumerate(("h0", "h1", "")):
        cluster.register_locked(dynamix_pb2.WorkerInfo(rank=rank, world_size=3, host=host, batch_size=32))

    def agent_on(host, *ranks):
        return cluster.node_report_locked(dynamix_pb2.NodeReport(host=host, workers=[
            dynamix_pb2.WorkerNode(rank=r, node=dynamix_pb2.NodeMetrics(rtt_s=0.1)) for r in ranks]))

    with pytest.raises(Rejected) as refused:
        agent_on("h1", 0)
    assert refused.value.code == FAILED_PRECONDITION
    assert refused.value.message.startswith("the node agent on host 'h1' reports rank 0, which registered from host "
                                            "'h0': the agent measures another job's workers; give it the --job")
    assert cluster.node_metrics == {}
    # its own rank and one whose host nobody named are kept; the stray one is left out, not the host's report
    assert agent_on("h1", 1, 0, 2) == [0]
    assert sorted(cluster.node_metrics) == [1, 2]


@pytest.mark.timeout(60)
def test_an_agent_reporting_before_the_first_registration_is_not_refused():
    """A scheduler without --num-workers (dynamix scheduler under torchrun) learns the job's size at
    the first registration, which comes with a worker's first report, an interval after its mailbox
    appears: the agent's reports meanwhile were refused ('workers[].rank=0 is not a rank of this
    job', logged as a warning at every start) and the first decision had no node metrics."""
    from dynamix_byteps.control.cluster import Cluster

    cluster = Cluster(num_workers=None, decision_interval=10, policy_name="static")
    _agent_reports(cluster, 0.004)
    for rank in (0, 1):
        cluster.register_locked(dynamix_pb2.WorkerInfo(rank=rank, world_size=2, host="h", batch_size=32, step=1))
    assert _decided_node_metrics(cluster, 11) == [{"rtt_s": 0.004}, {"rtt_s": 0.004}]


@pytest.mark.timeout(60)
def test_a_rank_restarted_on_another_host_is_not_given_its_old_hosts_throughput():
    from dynamix_byteps.control.cluster import LIVE_RANK_S, Cluster, cluster_state

    now = [0.0]
    cluster = Cluster(num_workers=2, decision_interval=10, policy_name="static", clock=lambda: now[0])
    for rank in (0, 1):
        cluster.register_locked(dynamix_pb2.WorkerInfo(rank=rank, world_size=2, host=f"h{rank}", batch_size=32, step=1))

    def decided_throughput(step, rank_1_samples_per_s):
        snap = None
        for rank, theta in ((0, 100.0), (1, rank_1_samples_per_s)):
            _, snap = cluster.report_locked(dynamix_pb2.Report(rank=rank, step=step, local_batch_size=32, compute_s=0.1,
                                                               push_pull_s=0.01, samples_per_s=theta))
        return [w.samples_per_s for w in cluster_state(snap).workers]

    assert decided_throughput(11, 50.0) == [100.0, 50.0]
    now[0] += LIVE_RANK_S + 1  # rank 1's host died; it comes back on a machine four times as fast
    cluster.register_locked(dynamix_pb2.WorkerInfo(rank=1, world_size=2, host="h2", batch_size=32, step=11))
    assert decided_throughput(21, 200.0) == [100.0, 200.0]


class _Refusal(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _ScriptedScheduler:
    """A ReportNode stub that raises the scripted refusals (None: accepts)."""

    def __init__(self, outcomes):
        self.outcomes = iter(outcomes)

    def ReportNode(self, report, timeout, metadata):  # noqa: N802 - gRPC's method name
        outcome = next(self.outcomes)
        if outcome is not None:
            raise outcome


@pytest.mark.timeout(60)
def test_each_new_kind_of_refusal_and_the_recovery_are_said(caplog):
    """An agent started before its scheduler logged UNAVAILABLE, and then nothing about why the
    scheduler, once up, refused every report (another job's ranks, a wrong token)."""
    down = _Refusal(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    elsewhere = _Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the node agent on host 'h1' reports rank 0, ...")
    agent = NodeAgent("breakit", "127.0.0.1:1", monitor="off")
    agent._stub = _ScriptedScheduler([down, down, elsewhere, elsewhere, None, None])
    try:
        with caplog.at_level(logging.INFO, logger="dynamix_byteps.agent"):
            for _ in range(6):
                agent.send(dynamix_pb2.NodeReport(host="h1"))
    finally:
        agent.close()
    assert [r.getMessage() for r in caplog.records] == [
        "scheduler refused or missed a node report (UNAVAILABLE: failed to connect to all addresses); retrying every interval",
        "scheduler refused or missed a node report (FAILED_PRECONDITION: the node agent on host 'h1' reports rank 0, ...); "
        "retrying every interval",
        "scheduler takes this host's node reports again",
    ]


@pytest.mark.timeout(60)
def test_the_scheduler_says_once_which_rank_an_agent_reported_from_another_host(caplog):
    server = SchedulerServer(StaticPolicy(), num_workers=2, decision_interval=1)
    try:
        for rank in (0, 1):
            server.register(dynamix_pb2.WorkerInfo(rank=rank, world_size=2, host=f"h{rank}", batch_size=8))
        stray = dynamix_pb2.NodeReport(host="h1", workers=[dynamix_pb2.WorkerNode(rank=r) for r in (1, 0)])
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.control"):
            server.report_node(stray)
            server.report_node(stray)
    finally:
        server.stop(grace=None)
    assert [r.getMessage() for r in caplog.records] == [
        "the node agent on host 'h1' reports rank 0, which registered from another host; its metrics of that rank "
        "are left out (a worker of another job with the same DYNAMIX_JOB_ID there?)"]


@pytest.mark.timeout(60)
def test_a_slow_gpu_reading_does_not_inflate_the_next_rates(monkeypatch):
    """NVML calls on a busy or failing GPU can take seconds; the rates' time was taken after them,
    so the interval after a slow reading was measured short and its bytes/s came out 3x too high."""
    import dynamix_byteps.agent.node_agent as node_agent

    clock = [0.0]
    monkeypatch.setattr(node_agent.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(node_agent, "discover_workers", lambda job: {0: 4242})
    agent = NodeAgent("breakit", "127.0.0.1:1", monitor="off")
    agent.collector = _ScriptedCollector([{4242: 0}, {4242: 3_000_000}])  # 1 MB/s over the 3 s below
    gpu_seconds = iter([2.0, 0.0])  # the first reading hangs for 2 s

    def slow_gpu(pids):
        clock[0] += next(gpu_seconds)
        return {}
    monkeypatch.setattr(agent.gpu, "sample", slow_gpu)
    try:
        agent.sample()
        clock[0] += 1.0  # the interval
        node = agent.sample().workers[0].node
    finally:
        agent.close()
    assert node.tx_bytes_per_s == pytest.approx(1_000_000)
