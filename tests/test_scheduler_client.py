"""The worker's scheduler client (dynamix_byteps.control.client) against a real gRPC server that
holds every call until told to answer, and against a real scheduler."""

from __future__ import annotations

import http.server
import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
from conftest import has_ipv6_loopback, wait_until
from test_scheduler import ScriptedPolicy, info, running

from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.client import RPC_TIMEOUT_S, SchedulerClient
from dynamix_byteps.control.security import open_channel
from dynamix_byteps.env import WorkerEnv


class HoldingScheduler(dynamix_pb2_grpc.SchedulerServicer):
    """Answers Register and ReportMetrics only once ``release`` is set; counts calls and cancellations."""

    def __init__(self):
        self.entered = threading.Event()
        self.cancelled = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def _hold(self, context) -> None:
        self.calls += 1
        context.add_callback(lambda: None if self.release.is_set() else self.cancelled.set())
        self.entered.set()
        self.release.wait(30)

    def Register(self, request, context):
        self._hold(context)
        return dynamix_pb2.RegisterReply()

    def ReportMetrics(self, request, context):
        self._hold(context)
        return dynamix_pb2.Assignment()


@pytest.fixture
def holding_server():
    servicer = HoldingScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    dynamix_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        server.stop(grace=None)


def _report() -> dynamix_pb2.Report:
    return dynamix_pb2.Report(rank=0, step=10, local_batch_size=32, compute_s=0.1, push_pull_s=0.01,
                              samples_per_s=320.0)


@pytest.mark.timeout(60)
def test_close_sends_the_waiting_report_before_it_stops(holding_server):
    servicer, address = holding_server
    servicer.release.set()  # the scheduler answers at once
    client = SchedulerClient(address, None, lambda: dynamix_pb2.WorkerInfo(rank=0, world_size=1))
    client.submit(_report())
    client.close()
    assert servicer.calls == 2, "close() dropped the report instead of sending it"  # Register, then ReportMetrics
    assert not client._thread.is_alive()


@pytest.mark.timeout(60)
def test_close_cancels_a_call_the_scheduler_holds_past_the_grace_and_drops_later_reports(holding_server, caplog):
    servicer, address = holding_server
    client = SchedulerClient(address, None, lambda: dynamix_pb2.WorkerInfo(rank=0, world_size=1))
    client.submit(_report())
    assert servicer.entered.wait(20), "the client never called the scheduler"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dynamix_byteps.control.client"):
        client.close(grace_s=0.2)
        closing_s = time.monotonic() - started
        assert servicer.cancelled.wait(10), "the call in flight was not cancelled"
        client.submit(_report())
        client.close()
    assert closing_s < RPC_TIMEOUT_S / 2, f"close() waited {closing_s:.2f} s: it waited out the call instead of cancelling it"
    assert not client._thread.is_alive()
    assert servicer.calls == 1
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(60)
def test_a_refused_registration_says_that_the_policy_is_not_applied(caplog):
    with running(ScriptedPolicy(), num_workers=4) as server, \
            caplog.at_level(logging.WARNING, logger="dynamix_byteps.control.client"):
        _report_twice(f"127.0.0.1:{server.port}")
    [refusal] = [r for r in caplog.records if "world_size=2 does not match" in r.getMessage()]
    assert refusal.levelno == logging.ERROR and "registration" in refusal.getMessage()
    assert "policy is NOT applied" in refusal.getMessage()


@pytest.mark.timeout(60)
def test_an_address_that_is_not_a_grpc_server_is_said_once_as_an_error(caplog):
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    serving = threading.Thread(target=web.serve_forever, daemon=True)
    serving.start()
    try:
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.control.client"):
            _report_twice(f"127.0.0.1:{web.server_address[1]}")
    finally:
        web.shutdown()
        web.server_close()
        serving.join(10)
    [record] = [r for r in caplog.records if r.name == "dynamix_byteps.control.client"]
    assert record.levelno == logging.ERROR, record.getMessage()
    assert "not as a gRPC server" in record.getMessage() and "DYNAMIX_SCHEDULER" in record.getMessage()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bind, target", [
    ("127.0.0.1", "dns:///127.0.0.1:{port}"), ("127.0.0.1", "dns:localhost:{port}"), ("127.0.0.1", "ipv4:127.0.0.1:{port}"),
    pytest.param("::1", "ipv6:[::1]:{port}", marks=pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 here")),
])
def test_a_grpc_target_the_workers_accept_reaches_a_real_scheduler(bind, target):
    # DYNAMIX_SCHEDULER=dns:///... trained with a policy, then was refused as "not HOST:PORT"
    with running(ScriptedPolicy(), num_workers=1, bind=bind) as server:
        address = WorkerEnv.from_environ({"DYNAMIX_SCHEDULER": target.format(port=server.port)}).scheduler
        with open_channel(address) as channel:
            dynamix_pb2_grpc.SchedulerStub(channel).Register(info(0, world=1), timeout=10)


def _report_twice(address: str) -> None:
    """Two reports, one after the other, from rank 0 of a 2-worker job to ``address``: a
    configuration mistake must be said once, not at every report."""
    client = SchedulerClient(address, None, lambda: info(0, world=2))
    try:
        for _ in range(2):
            client.submit(_report())
            assert wait_until(lambda: not client._sending and client._pending is None, 10)
    finally:
        client.close()
