"""The restart rendezvous of ``bpslaunch --hosts ... --restart-on-failure``: node 0's gRPC service
(dynamix_byteps.launcher.rendezvous) with real servers and clients on 127.0.0.1, no mocks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest

from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.security import TOKEN_METADATA_KEY, open_channel
from dynamix_byteps.launcher import rendezvous
from dynamix_byteps.launcher.config import PROG
from dynamix_byteps.launcher.rendezvous import RendezvousServer, RunReport, decision_dict, decision_message, end_round, leave
from dynamix_byteps.launcher.topology import free_port

TOKEN = "secret"


def report(node, run=0, code=137):
    return RunReport(node=node, run=run, code=code, failed=node, failed_at=1.5, killed=[node], workers=[node])


@pytest.fixture
def server():
    coordinator = RendezvousServer("127.0.0.1", 0, TOKEN, hosts=3)
    try:
        yield coordinator
    finally:
        coordinator.close()


def address(server):
    return ("127.0.0.1", server.port)


def call(server, method, body: bytes, token=TOKEN, timeout=5.0):
    """``method`` called with the raw request ``body``; returns the status code and details."""
    with open_channel(f"127.0.0.1:{server.port}") as channel:
        try:
            channel.unary_unary(f"/{rendezvous.SERVICE}/{method}")(body, timeout=timeout,
                                                                    metadata=((TOKEN_METADATA_KEY, token),))
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def hosts_in_background(server, nodes, answers, token=TOKEN, timeout_s=20.0):
    threads = [threading.Thread(target=lambda n=n: answers.__setitem__(
        n, end_round(address(server), report(n), token, timeout_s=timeout_s))) for n in nodes]
    for thread in threads:
        thread.start()
    return threads


def test_reports_and_decisions_survive_the_wire_unchanged():
    full = RunReport(node=2, run=3, code=1, failed=5, failed_at=1700000000.25, killed=[5], self_failed=[4, 5],
                     workers=[4, 5], started=False, server_failed=True)
    empty = RunReport(node=1, run=0, code=0, failed=None, failed_at=None)
    for mine in (full, empty):
        assert RunReport.of(dynamix_pb2.RoundReport.FromString(mine.message().SerializeToString())) == mine
    for decision in ({"exit": 143, "reason": "stopped"}, {"slots": [2, 0, 1], "lost": [2], "port": 29600},
                     {"slots": [1, 1], "lost": [], "port": 29600, "scheduler_port": 29601}):
        assert decision_dict(dynamix_pb2.RoundDecision.FromString(
            decision_message(decision).SerializeToString())) == decision


@pytest.mark.timeout(60)
def test_node_0_answers_every_host_with_one_decision_and_a_wrong_token_is_unauthenticated_and_not_counted(server):
    answers = {}
    wrong = hosts_in_background(server, [1], answers, token="wrong")
    wrong[0].join(20)  # refused at once, before node 0 collects
    assert answers[1]["exit"] == 137 and "wrong DYNAMIX_TOKEN" in answers[1]["reason"], answers
    code, details = call(server, "EndRound", report(1).message().SerializeToString(), token="wrong")
    assert code == grpc.StatusCode.UNAUTHENTICATED and TOKEN_METADATA_KEY in details
    assert server.collect(0, 2, timeout_s=0.5) == {}  # neither wrong-token report counts
    threads = hosts_in_background(server, [1, 2], answers)
    got = server.collect(0, 2, timeout_s=20)
    assert got == {1: report(1), 2: report(2)}
    server.answer(0, {"slots": [1, 0, 0], "lost": [1, 2], "port": 29600})
    for thread in threads:
        thread.join(20)
    assert answers == {n: {"slots": [1, 0, 0], "lost": [1, 2], "port": 29600} for n in (1, 2)}


@pytest.mark.timeout(60)
def test_a_host_that_never_reports_times_node_0_out_and_a_host_gets_its_answer_in_bounded_time(server, monkeypatch):
    monkeypatch.setattr(rendezvous, "ANSWER_MARGIN_S", 1.0)
    answers = {}
    threads = hosts_in_background(server, [1], answers, timeout_s=1.0)
    # host 1's report is in before node 0 collects (its thread, channel and call can take longer than
    # the 1 s collect on a loaded machine)
    deadline = time.monotonic() + 20
    while 1 not in server._reports:
        assert time.monotonic() < deadline and threads[0].is_alive(), answers
        time.sleep(0.01)
    started = time.monotonic()
    got = server.collect(0, 2, timeout_s=1.0)  # host 2 never reports
    assert list(got) == [1] and time.monotonic() - started < 5
    # node 0 would answer now; when it does not, the host gives up after timeout_s + ANSWER_MARGIN_S
    threads[0].join(10)
    assert not threads[0].is_alive()
    assert answers[1] == {"exit": 137, "reason": f"no decision from node 0 at 127.0.0.1:{server.port} within 2 s"}


@pytest.mark.timeout(60)
def test_a_host_whose_node_0_is_gone_gives_up_after_refused_s_and_a_late_host_gets_the_decision(server, monkeypatch):
    monkeypatch.setattr(rendezvous, "REFUSED_S", 1.0)
    started = time.monotonic()
    gone = end_round(("127.0.0.1", free_port("127.0.0.1")), report(1), TOKEN)
    assert time.monotonic() - started < 5
    assert gone["exit"] == 137 and gone["reason"].startswith("no answer from node 0 at 127.0.0.1:"), gone
    server.collect(0, 1, timeout_s=0.2)
    server.answer(0, {"exit": 137, "reason": "host(s) 1 sent no report"})
    assert end_round(address(server), report(1), TOKEN) == {"exit": 137, "reason": "host(s) 1 sent no report"}


@pytest.mark.timeout(60)
def test_malformed_reports_and_reports_of_another_run_or_host_are_refused_with_a_reason_and_not_counted(server):
    code, details = call(server, "EndRound", b"\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed RoundReport" in details
    assert call(server, "EndRound", report(0).message().SerializeToString())[0] == grpc.StatusCode.INVALID_ARGUMENT
    other_run = end_round(address(server), report(1, run=1), TOKEN)
    assert other_run["exit"] == 137 and other_run["reason"] == (
        "node 0 refused the report: report of run 1; node 0 takes the reports of run 0 (FAILED_PRECONDITION)")
    assert server.collect(0, 1, timeout_s=0.3) == {}
    answers = {}
    threads = hosts_in_background(server, [2], answers)  # run 0 has one reporting host: node 1
    threads[0].join(20)
    assert answers[2] == {"exit": 137, "reason": "node 0 refused the report: node 2 is no reporting host of run 0 "
                          "(nodes 1..1) (INVALID_ARGUMENT)"}
    # an unknown field (a newer launcher's) is skipped, as proto3 does; the report counts
    unknown = report(1).message().SerializeToString() + b"\xf8\x06\x01"  # field 111, varint 1
    caller = threading.Thread(target=call, args=(server, "EndRound", unknown, TOKEN, 20.0))
    caller.start()
    assert server.collect(0, 1, timeout_s=10) == {1: report(1)}
    server.answer(0, {"exit": 0, "reason": "done"})
    caller.join(20)


@pytest.mark.timeout(60)
def test_a_stopped_host_leaves_with_its_report_counted_and_without_waiting(server):
    started = time.monotonic()
    leave(address(server), report(1, code=143), TOKEN)
    assert time.monotonic() - started < 3
    assert server.collect(0, 1, timeout_s=1) == {1: report(1, code=143)}


@pytest.mark.timeout(60)
def test_node_0_on_a_taken_port_says_so():
    with RendezvousServer("127.0.0.1", 0, TOKEN) as first:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            RendezvousServer("127.0.0.1", first.port, TOKEN)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
@pytest.mark.timeout(120)
def test_over_tls_a_host_verified_by_the_ca_gets_the_decision_and_a_plaintext_one_does_not(tmp_path):
    from test_tls import make_ca

    pki = make_ca(tmp_path / "pki", "rendezvous-test-ca")
    with RendezvousServer("127.0.0.1", 0, TOKEN, pki["cert"], pki["key"]) as server:
        answers = {}
        thread = threading.Thread(target=lambda: answers.__setitem__(1, end_round(
            address(server), report(1), TOKEN, tls_ca=str(pki["ca"]), timeout_s=20)))
        thread.start()
        assert server.collect(0, 1, timeout_s=20) == {1: report(1)}
        server.answer(0, {"exit": 0, "reason": "every worker succeeded"})
        thread.join(20)
        assert answers[1] == {"exit": 0, "reason": "every worker succeeded"}
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                dynamix_pb2_grpc.RendezvousStub(channel).EndRound(report(1).message(), timeout=3,
                                                                   metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token, message", [(TOKEN, "argument --restart-port: cannot listen on 127.0.0.1:"),
                                            ("two words", "DYNAMIX_TOKEN: the token must be printable ASCII")])
def test_bpslaunch_node_0_whose_rendezvous_cannot_serve_is_a_usage_error(tmp_path, token, message):
    with RendezvousServer("127.0.0.1", 0, TOKEN) as taken:
        port = taken.port if token == TOKEN else free_port("127.0.0.1")
        proc = subprocess.run(
            [sys.executable, "-m", "dynamix_byteps.launcher", "--hosts", "127.0.0.1:1,127.0.0.2:1", "--node-rank", "0",
             "--port", str(free_port("127.0.0.1")), "--restart-port", str(port), "--restart-on-failure", "1",
             "--checkpoint", str(tmp_path / "c.pt"), "--", "true"],
            env={**os.environ, "DYNAMIX_TOKEN": token}, capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 2 and f"{PROG}: error: {message}" in proc.stderr, proc.stderr
