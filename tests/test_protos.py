"""Generated control-plane modules (protos/dynamix.proto -> dynamix_byteps.control.dynamix_pb2*)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc


@pytest.mark.timeout(60)
def test_generated_modules_describe_the_v1_protocol():
    assert dynamix_pb2.DESCRIPTOR.package == "dynamix.v1"
    service = dynamix_pb2.DESCRIPTOR.services_by_name["Scheduler"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "Register": ("WorkerInfo", "RegisterReply"),
        "ReportMetrics": ("Report", "Assignment"),
        "ReportNode": ("NodeReport", "NodeReportReply"),
    }
    for cls in ("SchedulerStub", "SchedulerServicer", "add_SchedulerServicer_to_server"):
        assert hasattr(dynamix_pb2_grpc, cls)
    # the grpc module uses its own sibling, not a top-level "dynamix_pb2"
    assert dynamix_pb2_grpc.dynamix__pb2 is dynamix_pb2


@pytest.mark.timeout(60)
def test_assignment_serialises_and_parses_round_trip():
    a = dynamix_pb2.Assignment(
        version=7,
        effective_step=12_345_678_901,
        batch_sizes=[32, 64, 48, 16],
        lr_scale=1.25,
        policy="ppo",
        reason="rank 3 is a straggler",
    )
    data = a.SerializeToString()
    b = dynamix_pb2.Assignment.FromString(data)
    assert b == a
    assert list(b.batch_sizes) == [32, 64, 48, 16]
    assert b.effective_step == 12_345_678_901
    assert b.lr_scale == 1.25
    assert b.policy == "ppo" and b.reason == "rank 3 is a straggler"
    reply = dynamix_pb2.RegisterReply(decision_interval=3, assignment=a)
    assert dynamix_pb2.RegisterReply.FromString(reply.SerializeToString()).assignment == a
    with pytest.raises(ValueError):
        dynamix_pb2.Assignment(batch_sizes=[-1])


class _Scheduler(dynamix_pb2_grpc.SchedulerServicer):
    def __init__(self):
        self.reports: list = []

    def Register(self, request, context):
        return dynamix_pb2.RegisterReply(
            decision_interval=request.rank,
            assignment=dynamix_pb2.Assignment(version=0, batch_sizes=[request.min_batch] * 2, policy="static"),
        )

    def ReportMetrics(self, request, context):
        self.reports.append(request)
        # answer with something computed from the request, so a canned reply cannot pass
        return dynamix_pb2.Assignment(
            version=len(self.reports),
            effective_step=request.step + 10,
            batch_sizes=[request.local_batch_size, 2 * request.local_batch_size],
            lr_scale=request.samples_per_s / 1000.0,
            policy="proportional",
            reason=f"rank {request.rank} at loss {request.loss:.2f}",
        )


@pytest.mark.timeout(60)
def test_in_process_grpc_server_answers_report_metrics():
    servicer = _Scheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dynamix_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = dynamix_pb2_grpc.SchedulerStub(channel)
            reply = stub.Register(
                dynamix_pb2.WorkerInfo(rank=1, host="127.0.0.1", engine="gloo", min_batch=8, max_batch=512),
                timeout=20,
            )
            assert reply.decision_interval == 1
            assert list(reply.assignment.batch_sizes) == [8, 8]

            report = dynamix_pb2.Report(
                rank=1,
                step=400,
                local_batch_size=64,
                compute_s=0.12,
                push_pull_s=0.03,
                samples_per_s=1500.0,
                loss=0.75,
            )
            assignment = stub.ReportMetrics(report, timeout=20)
    finally:
        server.stop(grace=None).wait(10)

    assert assignment.version == 1
    assert assignment.effective_step == 410
    assert list(assignment.batch_sizes) == [64, 128]
    assert assignment.lr_scale == pytest.approx(1.5)
    assert assignment.policy == "proportional"
    assert assignment.reason == "rank 1 at loss 0.75"
    assert len(servicer.reports) == 1 and servicer.reports[0] == report
