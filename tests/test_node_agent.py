"""The node agent: worker discovery through mailboxes, sampling, and reports to a real scheduler."""

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from dynamix_byteps.agent.node_agent import NodeAgent, discover_workers
from dynamix_byteps.control import dynamix_pb2
from dynamix_byteps.control.mailbox import Mailbox, mailbox_name, remove_job_mailboxes
from dynamix_byteps.control.scheduler import SchedulerServer
from dynamix_byteps.policy.base import Decision, Policy


class Remember(Policy):
    name = "remember"

    def __init__(self):
        self.states = []

    def decide(self, state):
        self.states.append(state)
        return Decision(state.batch_sizes, "keep")


@pytest.fixture
def job():
    return f"t{os.getpid()}x{threading.get_ident() % 10000}"


@pytest.mark.timeout(60)
def test_workers_are_found_through_their_mailboxes(job):
    with Mailbox.create(mailbox_name(job, 3)), Mailbox.create(mailbox_name(job, 0)):
        assert discover_workers(job) == {0: os.getpid(), 3: os.getpid()}
    assert discover_workers(job) == {}


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a segment file to another user")
def test_a_segment_whose_file_belongs_to_another_user_than_its_owner_pid_is_ignored(job):
    # A segment written by user 54321 that names a process of this user (root): forged, skipped.
    with Mailbox.create(mailbox_name(job, 0)) as forged, Mailbox.create(mailbox_name(job, 1)):
        os.chown("/dev/shm" + forged.name, 54321, 54321)
        assert discover_workers(job) == {1: os.getpid()}


def _worker_killed_leaving_its_mailbox(name: str) -> subprocess.Popen:
    """A worker that creates mailbox ``name`` and is SIGKILLed, not yet reaped (a zombie)."""
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from dynamix_byteps.control.mailbox import Mailbox
        box = Mailbox.create({name!r})
        os.kill(os.getpid(), signal.SIGKILL)""")])
    os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
    return worker


@pytest.mark.timeout(60)
@pytest.mark.parametrize("death", ["zombie", "pid reused"])
def test_the_mailbox_of_a_killed_worker_is_not_a_worker(job, death):
    """A SIGKILLed worker leaves its segment; neither its zombie nor a later process of the same user
    that got its pid is measured as that rank (the header keeps the creator's start time)."""
    name = mailbox_name(job, 0)
    worker = _worker_killed_leaving_its_mailbox(name)
    other = subprocess.Popen(["sleep", "30"])
    try:
        if death == "pid reused":
            worker.wait()
            with open("/dev/shm" + name, "r+b") as segment:  # what a reused pid looks like: owner_pid runs
                segment.seek(16)
                segment.write(other.pid.to_bytes(8, "little"))
        assert discover_workers(job) == {}
    finally:
        other.kill()
        other.wait()
        worker.wait()
        remove_job_mailboxes(job)


@pytest.mark.timeout(60)
def test_agent_reports_traffic_and_host_metrics_that_reach_the_policy(job):
    policy = Remember()
    server = SchedulerServer(policy, num_workers=1, decision_interval=1)
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        with Mailbox.create(mailbox_name(job, 0)):
            agent = NodeAgent(job, server.address, monitor="proc", interval_s=0.1)
            try:
                agent.sample()  # first sample: counters start
                peer.sendall(b"x" * 100_000)
                received = 0
                while received < 100_000:
                    received += len(conn.recv(65536))
                report = agent.sample()
                agent.send(report)
            finally:
                agent.close()
        (worker,) = report.workers
        assert worker.rank == 0
        assert worker.node.tx_bytes_per_s > 0 and worker.node.rx_bytes_per_s > 0
        assert worker.node.delivery_rate_bytes_per_s > 0  # the sending socket's; the idle listener has none
        assert 0.0 <= worker.node.cpu_util <= 1.0 and worker.node.memory_used_bytes > 0
        assert not worker.node.HasField("gpu_util")  # no GPU here: unavailable, not zero
        stub_info = dynamix_pb2.WorkerInfo(rank=0, world_size=1, batch_size=8)
        server.register(stub_info)
        server.report(dynamix_pb2.Report(rank=0, step=1, local_batch_size=8, compute_s=0.1, push_pull_s=0.0,
                                         samples_per_s=80.0))
        node = policy.states[-1].workers[0].node
        assert node["tx_bytes_per_s"] > 0 and node["delivery_rate_bytes_per_s"] > 0
    finally:
        for s in (peer, conn, listener):
            s.close()
        server.stop(grace=None)


def _ebpf_refuses(monkeypatch):
    """Where eBPF cannot load (tests/test_ebpf_collector.py shows the real refusals as non-root),
    the collector raises CollectorUnavailable; here its constructor is made to, as root cannot be
    refused otherwise."""
    from dynamix_byteps.agent import ebpf
    from dynamix_byteps.agent.base import CollectorUnavailable

    def refuse(self, *args, **kwargs):
        raise CollectorUnavailable("loading BPF programs is not permitted (needs CAP_BPF and CAP_PERFMON)")
    monkeypatch.setattr(ebpf.EbpfCollector, "__init__", refuse)


@pytest.mark.parametrize("job, scheduler, why", [("../../etc/x", "127.0.0.1:1", "job name '../../etc/x'"),
                                                 ("", "127.0.0.1:1", "job name ''"),
                                                 ("j", "garbage", "'garbage' is not HOST:PORT")])
def test_a_job_the_workers_refuse_or_an_address_that_is_not_host_port_is_refused(job, scheduler, why):
    with pytest.raises(ValueError, match=why):  # it monitored nothing, forever
        NodeAgent(job, scheduler, monitor="off")


@pytest.mark.timeout(60)
def test_monitor_ebpf_that_cannot_load_exits_2_with_the_reason(monkeypatch, capsys):
    from dynamix_byteps import cli

    _ebpf_refuses(monkeypatch)
    assert cli.main(["agent", "--job", "j", "--scheduler", "127.0.0.1:1", "--monitor", "ebpf"]) == 2
    assert "CAP_BPF" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_monitor_auto_falls_back_to_proc(monkeypatch, caplog):
    from dynamix_byteps.agent.node_agent import make_collector

    _ebpf_refuses(monkeypatch)
    collector = make_collector("auto")
    try:
        assert collector.name == "proc"
        assert "CAP_BPF" in caplog.text
    finally:
        collector.close()
    assert make_collector("off") is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [2**32, 4096])
def test_a_segment_of_a_rank_beyond_any_job_is_ignored_and_the_host_still_reports(job, rank):
    """One past the report's uint32 made every sample raise ValueError, and the agent exited."""
    with Mailbox.create(mailbox_name(job, 7)), Mailbox.create(mailbox_name(job, rank)):
        assert discover_workers(job) == {7: os.getpid()}
        agent = NodeAgent(job, "127.0.0.1:1", monitor="off")
        try:
            assert [w.rank for w in agent.sample().workers] == [7]
        finally:
            agent.close()


def _what_an_agent_finding_no_worker_says(agent_job, monkeypatch, caplog) -> list[str]:
    import logging

    import dynamix_byteps.agent.node_agent as node_agent

    monkeypatch.setattr(node_agent, "NO_WORKER_WARNING_S", 0.2)
    agent = NodeAgent(agent_job, "127.0.0.1:1", monitor="off", interval_s=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=agent.run, args=(stop,))
    try:
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.agent"):
            runner.start()
            stop.wait(1.0)
            stop.set()
            runner.join(10)
    finally:
        stop.set()
        agent.close()
    return [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(60)
def test_an_agent_given_another_job_than_its_workers_says_so_once(job, monkeypatch, caplog):
    with Mailbox.create(mailbox_name(job, 0)):
        said = _what_an_agent_finding_no_worker_says(job + "-typo", monkeypatch, caplog)
    assert len(said) == 1, said
    assert f"no worker of job {job}-typo found on this host" in said[0], said
    assert job in re.search(r"have mailboxes of jobs? ([^:]*): start the agent with --job set to the workers' "
                            "DYNAMIX_JOB_ID", said[0]).group(1).split(", "), said


@pytest.mark.timeout(60)
def test_an_agent_whose_jobs_mailboxes_are_no_live_workers_says_so_not_to_change_its_job(job, monkeypatch, caplog):
    """A worker of another version (another layout) or one that exited: --job is right."""
    with open(f"/dev/shm/dynamix.{job}.0", "wb") as segment:
        segment.write(bytes(4096))
    try:
        said = _what_an_agent_finding_no_worker_says(job, monkeypatch, caplog)
    finally:
        remove_job_mailboxes(job)
    assert len(said) == 1 and "its mailboxes here belong to no running worker of this dynamix_byteps version" in said[0]
    assert "--job" not in said[0], said
