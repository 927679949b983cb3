"""Three emulated hosts, the third behind a 20 Mbit/s link, one job with ``--policy proportional``.

What holds within one job: the node agent on the slow host reports the link's queueing (tbf) in its
worker's TCP RTT, an RTT weighted by the bytes each socket carried, so its idle connections (the
scheduler's, the rendezvous store's) do not dilute it. So does the agent of the ring neighbour that
sends into the slow host, whose data crosses the same link (measured: 21.5 ms on the slow host, 24.9 ms
on that neighbour, 0.4 ms on the third worker, whose data never crosses it). What does not: lower throughput or longer
push_pull on that host, and smaller batches from ``proportional``. gloo's ring all-reduce paces
every edge to the slowest one, so every rank sends the same bytes per second and waits as long in
push_pull; the gradient bytes per step do not depend on the batch size, so a smaller batch on the
slow host would not shorten the step either, and ``proportional`` (which balances compute time
``b_i / θ_i``) rightly keeps equal sizes for equal compute. The test pins that down, so a change in
either direction is noticed.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from dynamix_byteps.testing import netns

REASON = netns.available()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"network test bed unavailable: {REASON}"),
              pytest.mark.slow]
RANK_WORKER = str(Path(__file__).resolve().parents[1] / "tests" / "scripts" / "rank_worker.py")


@pytest.mark.timeout(600)
def test_the_slow_hosts_agent_reports_the_links_rtt_and_proportional_keeps_equal_batches(tmp_path):
    with netns.Testbed(3, rates_mbit={2: 20.0}) as bed:
        result = netns.run_job(
            bed, [1, 1, 1], [sys.executable, RANK_WORKER, str(tmp_path), "100", "1024"],
            ["--policy", "proportional", "--monitor", "auto", "--decision-interval", "10", "--timeout", "120",
             "--log-dir", str(tmp_path / "logs")], timeout_s=500)
    assert result.ok, result.outputs
    decisions = [json.loads(line) for line in (tmp_path / "logs" / "decisions.jsonl").read_text().splitlines()][1:]
    nodes = [d["state"]["workers"]["node"] for d in decisions]
    rtts = [[n[r]["rtt_s"] for n in nodes if n[r].get("rtt_s") is not None] for r in range(3)]
    assert all(len(r) >= 2 for r in rtts), f"too few node reports: {rtts}"
    mean_rtt = [statistics.mean(r) for r in rtts]
    # the slow host among the highest; the worker whose data does not cross the link far below
    assert mean_rtt[2] > 0.5 * max(mean_rtt) and min(mean_rtt) < 0.1 * mean_rtt[2], mean_rtt
    push_pull = [statistics.mean(d["state"]["workers"]["push_pull_s"][r] for d in decisions) for r in range(3)]
    assert max(push_pull) < 1.5 * min(push_pull), push_pull  # the ring: one pace for all
    sizes = decisions[-1]["batch_sizes"]
    assert sizes[2] >= min(sizes[:2]), sizes  # never a larger share for the fast hosts because of the link
