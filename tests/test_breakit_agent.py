"""Absurd node metrics (NaN, inf, negative, beyond any machine) on the agent's side: one such value
is left out with a warning naming it, and the rest of the host's report still reaches a real
scheduler over gRPC (it refuses a whole report for one bad field)."""

from __future__ import annotations

import logging
import math

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
