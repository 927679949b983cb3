"""Link emulation without netem on a 2-host test bed: receiver-side random loss (nft,
``Testbed.set_loss`` / the ``lossy_link`` fault) and added latency (``testing.delay_proxy``).
One bed serves the module's jobs; each job has a hard timeout and the bed is closed at the end."""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
from test_faults import steps_done

from dynamix_byteps.testing import delay_proxy, netns
from dynamix_byteps.testing.faults import Fault, run_with_faults

REASON = netns.available()
needs_bed = pytest.mark.skipif(REASON is not None, reason=f"network test bed unavailable: {REASON}")

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "scripts" / "elastic_worker.py"
STEPS, BATCH, STEP_SLEEP_S, INTERVAL = 30, 4, 0.2, 2


@pytest.fixture(scope="module")
def bed():
    with netns.Testbed(2) as testbed:
        yield testbed


def decisions(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()][1:]


def job_args(run_dir: Path, *extra: str) -> list[str]:
    return ["--policy", "static", "--decision-interval", str(INTERVAL), "--monitor", "auto", "--grace-period", "2",
            "--batch-size", str(BATCH), "--checkpoint", str(run_dir / "ckpt.pt"), "--log-dir", str(run_dir), *extra]


def worker(out: Path) -> list[str]:
    return [sys.executable, str(WORKER), str(out), str(STEPS * BATCH * 2), "-1", "-1", str(STEP_SLEEP_S)]


@needs_bed
@pytest.mark.timeout(240)
def test_loss_on_a_host_raises_the_retransmits_its_senders_agent_reports_and_the_job_completes(bed, tmp_path):
    out, run_dir, fault_step = tmp_path / "out", tmp_path / "run", 10
    out.mkdir()
    try:
        result = run_with_faults(bed, [1, 1], worker(out), job_args(run_dir),
                                 [Fault("lossy_link", at_step=fault_step, target=1, loss=0.1)],
                                 progress=steps_done(out), timeout_s=180)
    finally:
        bed.set_loss(1, 0)
    assert result.job.ok, "\n".join(result.job.outputs)[-3000:]
    assert result.orphans == [] and "10.0% loss" in result.fired[0][2]
    # Host 1 drops what it receives: rank 0 (host 0) retransmits its data to rank 1; rank 1 loses only ACKs.
    retransmits = [(d["step"], d["state"]["workers"]["node"][0].get("retransmits") or 0) for d in decisions(run_dir)
                   if d["state"]["workers"].get("node")]
    before = [r for step, r in retransmits if step < fault_step]
    after = [r for step, r in retransmits if step >= fault_step + 2 * INTERVAL]
    assert before and after, retransmits
    assert sum(after) >= 5 and sum(after) / len(after) > 3 * sum(before) / len(before), retransmits


@needs_bed
def test_set_loss_refuses_the_root_namespace_and_bad_probabilities(bed):
    with pytest.raises(ValueError, match="root namespace"):
        bed.set_loss(0, 0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        bed.set_loss(1, 1.0)
    with pytest.raises(ValueError, match="loss must be a probability"):
        Fault("lossy_link", at_s=1, target=1, loss=0)


def echo_server() -> socket.socket:
    """A loopback TCP echo server on a daemon thread; it closes each connection after the client's EOF."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket):
        with conn:
            for data in iter(lambda: conn.recv(65536), b""):
                conn.sendall(data)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def median_rtt_s(address, n: int = 7) -> float:
    with socket.create_connection(address, timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@pytest.mark.timeout(60)
def test_the_delay_proxy_adds_its_delay_each_way_and_forwards_bulk_data_intact():
    delay_s = 0.03
    with echo_server() as server, delay_proxy.DelayProxy(server.getsockname(), delay_s) as proxy:
        direct, proxied = median_rtt_s(server.getsockname()), median_rtt_s(proxy.address)
        assert proxied >= direct + 2 * delay_s * 0.95, (direct, proxied)
        payload = bytes(range(256)) * 8192  # 2 MiB
        with socket.create_connection(proxy.address, timeout=20) as conn:
            sender = threading.Thread(target=lambda: (conn.sendall(payload), conn.shutdown(socket.SHUT_WR)))
            sender.start()
            echoed = b"".join(iter(lambda: conn.recv(1 << 20), b""))
            sender.join()
        assert echoed == payload


@needs_bed
@pytest.mark.timeout(240)
def test_the_control_plane_works_through_a_delay_proxy_in_front_of_the_scheduler(bed, tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    port = netns._free_port(bed.hosts[0].address)
    proxy = delay_proxy.start(bed, 0, (bed.hosts[0].address, port), ("127.0.0.1", port), delay_s=0.05)
    try:
        # the scheduler listens on loopback; every worker and agent dials host 0's address: the proxy
        result = netns.run_job(bed, [1, 1], worker(out), job_args(run_dir, "--scheduler-port", str(port), "--bind",
                                                                  "127.0.0.1"), timeout_s=180, grace_s=2)
    finally:
        netns.stop(proxy, 2)
    assert result.ok, "\n".join(result.outputs)[-3000:]
    assert "unreachable" not in "\n".join(result.outputs)
    made = decisions(run_dir)
    assert len(made) >= STEPS // INTERVAL - 2, made
    assert all(len(d["state"]["workers"]["rank"]) == 2 and min(d["state"]["workers"]["reports"]) > 0 for d in made)
    assert any(d["state"]["workers"].get("node") for d in made)  # the agents' reports crossed the proxy too
