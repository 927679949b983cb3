"""The no-eBPF collectors: TCP_INFO through pidfd_getfd, /proc readers, host metrics, NVML absent.

The TCP tests run two peer processes (tests/tcp_peers.py) driven line by line over their
stdin/stdout, so every byte count is known exactly. The retransmit test needs root, ``ip`` and
``nft``; it builds two network namespaces (``dxf_`` prefix, tests/tcp_peers.py) joined by a veth
and drops 10% of what reaches the receiver.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest
from tcp_peers import (
    Peer,
    connect_peers,
    lossy_namespace_pair,
    missing_netns_tools,
    move_bytes,
)

from dynamix_byteps.agent import gpu
from dynamix_byteps.agent.base import NetworkCollector
from dynamix_byteps.agent.gpu import GpuMonitor, GpuStats
from dynamix_byteps.agent.procfs import (
    TCP_ESTABLISHED,
    HostMonitor,
    ProcCollector,
)


@pytest.fixture
def collector():
    c = ProcCollector()
    yield c
    c.close()


def _own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_loopback_exchange_exact_bytes_and_close(collector: ProcCollector):
    assert isinstance(collector, NetworkCollector) and collector.name == "proc"
    with Peer("server", "127.0.0.1", 0) as server, Peer("client", "127.0.0.1", server.port) as client:
        pids = {server.pid, client.pid}
        # First sight before the connection exists: everything the connection carries counts.
        first = collector.sample(pids)
        assert set(first) == pids
        assert first[server.pid].sockets == 0  # its listening socket is not a connection
        assert first[client.pid].bytes_sent == 0 and first[client.pid].srtt_s is None

        connect_peers(server, client)
        n_up, n_down = 1_000_003, 300_007
        move_bytes(client, server, n_up)
        move_bytes(server, client, n_down)

        fds_before = _own_fds()
        stats = collector.sample(pids)
        assert _own_fds() == fds_before  # every duplicate closed
        c, s = stats[client.pid], stats[server.pid]
        assert (c.pid, c.bytes_sent, c.bytes_received) == (client.pid, n_up, n_down)
        assert (s.pid, s.bytes_sent, s.bytes_received) == (server.pid, n_down, n_up)
        for st in (c, s):
            assert st.sockets == 1
            assert st.srtt_s is not None and 0 < st.srtt_s < 0.05  # loopback: µs, not ms
            assert st.cwnd is not None and st.cwnd >= 1
            assert st.send_queue_bytes == 0
            assert st.retransmits >= 0

        # The client closes while the collector samples as fast as it can: no duplicate may
        # keep the connection alive, so the server sees EOF and leaves ESTABLISHED.
        stop = threading.Event()
        sampled = [0]

        def hammer():
            while not stop.is_set():
                collector_bg.sample(pids)
                sampled[0] += 1

        collector_bg = ProcCollector()
        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        try:
            assert client.cmd("close") == ["closed"]
            assert server.cmd("eof 5") == ["eof", "True"]
        finally:
            stop.set()
            t.join(10)
            collector_bg.close()
        assert sampled[0] > 0
        assert int(server.cmd("state")[1]) != TCP_ESTABLISHED  # CLOSE_WAIT

        after = collector.sample(pids)
        # Counters never go backwards: the client's closed socket is kept in its totals, and the
        # server's FIN is not counted as a byte.
        assert after[client.pid].sockets == 0 and after[client.pid].srtt_s is None
        assert (after[client.pid].bytes_sent, after[client.pid].bytes_received) == (n_up, n_down)
        assert (after[server.pid].bytes_sent, after[server.pid].bytes_received) == (n_down, n_up)
        assert server.cmd("close") == ["closed"]
        final = collector.sample(pids)
        assert final[server.pid].sockets == 0
        assert (final[server.pid].bytes_sent, final[server.pid].bytes_received) == (n_down, n_up)

        # An exited process is left out.
        client.stop()
        assert client.pid not in collector.sample(pids)
        assert server.pid in collector.sample(pids)


@pytest.mark.timeout(60)
def test_sockets_open_at_first_sight_count_from_then(collector: ProcCollector):
    with Peer("server", "127.0.0.1", 0) as server, Peer("client", "127.0.0.1", server.port) as client:
        pids = {server.pid, client.pid}
        connect_peers(server, client)
        move_bytes(client, server, 5000)
        base = collector.sample(pids)  # history before this is the baseline
        assert base[client.pid].bytes_sent == 0 and base[server.pid].bytes_received == 0
        assert base[client.pid].sockets == 1
        move_bytes(client, server, 7000)
        now = collector.sample(pids)
        assert now[client.pid].bytes_sent == 7000
        assert now[server.pid].bytes_received == 7000


@pytest.fixture
def lossy_link():
    """Sender and receiver namespaces (``dxf_`` prefix) on a veth; the receiver drops 10% of what
    arrives from the sender. Skips where they cannot be built."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    missing = missing_netns_tools()
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (apt-get install iproute2 nftables)")
    try:
        with lossy_namespace_pair("dxf", subnet="10.231.0") as link:
            yield link
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot build the lossy link: {e.cmd}: {e.stderr.decode(errors='replace').strip()}")


@pytest.mark.timeout(60)
def test_retransmits_rise_under_receiver_side_loss(collector: ProcCollector, lossy_link):
    link = lossy_link
    with Peer("server", link.receiver_addr, 5201, netns=link.receiver_ns) as server, \
            Peer("client", link.receiver_addr, 5201, netns=link.sender_ns) as client:
        pids = {server.pid, client.pid}
        connect_peers(server, client)
        history = [collector.sample(pids)[client.pid].retransmits]
        n = 4_000_000
        client.send(f"send {n}")
        server.send(f"recv {n}")
        done: list[list[str]] = []
        reader = threading.Thread(target=lambda: done.append(server.read(50)), daemon=True)
        reader.start()
        while reader.is_alive():
            history.append(collector.sample(pids)[client.pid].retransmits)
            time.sleep(0.02)
        assert done == [["recv", str(n)]]
        assert client.read() == ["sent", str(n)]
        final = collector.sample(pids)
        history.append(final[client.pid].retransmits)
        assert history == sorted(history), history  # cumulative: never backwards
        assert history[0] == 0 and history[-1] > 0, history
        # Byte counts stay exact under loss (application bytes, not wire bytes).
        assert final[client.pid].bytes_sent == n
        assert final[server.pid].bytes_received == n
        assert final[server.pid].retransmits == 0  # the receiver sent no data


@pytest.mark.timeout(60)
def test_unprivileged_collector_is_unavailable_with_reason(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    # Import as root (the venv may be unreadable to others), then become nobody.
    code = (
        "import os\n"
        "from dynamix_byteps.agent.procfs import ProcCollector\n"
        "from dynamix_byteps.agent.base import CollectorUnavailable\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        "    ProcCollector().sample({1})\n"
        "    print('AVAILABLE')\n"
        "except CollectorUnavailable as e:\n"
        "    print('UNAVAILABLE', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=30,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("UNAVAILABLE proc collector:"), r.stdout


# --------------------------------------------------------------------------------------------- GPU


def _assert_all_unavailable(st: GpuStats) -> None:
    assert st.available is False and st.reason
    for f in ("device_index", "util", "mem_used_bytes", "mem_total_bytes", "sm_clock_mhz",
              "process_mem_used_bytes", "process_sm_util"):
        assert getattr(st, f) is None, f


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_gpu_monitor_without_nvml(error, caplog):
    pynvml = pytest.importorskip("pynvml")
    init_fails = mock.patch.object(pynvml, "nvmlInit", side_effect=pynvml.NVMLError(getattr(pynvml, error)))
    with init_fails, caplog.at_level(logging.INFO, logger="dynamix_byteps.agent.gpu"):
        mon = GpuMonitor()
        assert mon.available is False
        assert mon.reason and ("Not Found" in mon.reason or "Not Loaded" in mon.reason), mon.reason
        for _ in range(3):
            out = mon.sample({os.getpid(), 1})
            assert set(out) == {os.getpid(), 1}
            for st in out.values():
                _assert_all_unavailable(st)
        assert mon.devices() == []
        mon.close()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gpu_visible, level", [(False, logging.INFO), (True, logging.WARNING)])
def test_gpu_unavailable_is_a_warning_only_on_a_host_that_shows_an_nvidia_gpu(gpu_visible, level, caplog):
    pynvml = pytest.importorskip("pynvml")
    init_fails = mock.patch.object(pynvml, "nvmlInit", side_effect=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with init_fails, mock.patch.object(gpu, "_nvidia_gpu_visible", return_value=gpu_visible), \
            caplog.at_level(logging.DEBUG, logger="dynamix_byteps.agent.gpu"):
        GpuMonitor().close()
    (record,) = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert record.levelno == level, record
    assert ("shows no NVIDIA GPU" in record.getMessage()) is not gpu_visible


@pytest.mark.parametrize("device, driver_entry, visible", [
    (None, None, False), ("nvidiactl", None, False), ("nvidia0", None, True), (None, "0000:17:00.0", True)])
def test_an_nvidia_gpu_shows_as_a_device_node_or_in_the_drivers_gpu_list(tmp_path, monkeypatch, device,
                                                                           driver_entry, visible):
    dev, gpus = tmp_path / "dev", tmp_path / "gpus"
    dev.mkdir()
    if device:
        (dev / device).touch()
    if driver_entry:
        (gpus / driver_entry).mkdir(parents=True)
    monkeypatch.setattr(gpu, "DEVICE_DIR", dev)
    monkeypatch.setattr(gpu, "DRIVER_GPUS_DIR", gpus)
    assert gpu._nvidia_gpu_visible() is visible


@pytest.mark.timeout(60)
def test_gpu_monitor_real_nvml_never_raises():
    mon = GpuMonitor()  # on this machine kind: no NVML library
    out = mon.sample({os.getpid()})
    if not mon.available:
        assert mon.reason
        _assert_all_unavailable(out[os.getpid()])
    mon.close()


@pytest.mark.timeout(60)
def test_gpu_monitor_without_pynvml():
    with mock.patch.dict(sys.modules, {"pynvml": None}):
        mon = GpuMonitor()
    assert not mon.available and "pynvml" in mon.reason
    _assert_all_unavailable(mon.sample([5])[5])


@pytest.mark.timeout(60)
def test_gpu_monitor_fake_device_per_process():
    pynvml = pytest.importorskip("pynvml")
    from types import SimpleNamespace as NS

    def no_support(*a):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    patches = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: f"h{i}",
        "nvmlDeviceGetUtilizationRates": lambda h: NS(gpu=75 if h == "h1" else 5, memory=10),
        "nvmlDeviceGetMemoryInfo": lambda h, *a: NS(used=40 << 30, total=80 << 30, free=40 << 30),
        "nvmlDeviceGetClockInfo": lambda h, t: 1980,
        "nvmlDeviceGetComputeRunningProcesses":
            lambda h: [NS(pid=111, usedGpuMemory=3 << 30)] if h == "h1" else [NS(pid=222, usedGpuMemory=None)],
        "nvmlDeviceGetGraphicsRunningProcesses": no_support,
        "nvmlDeviceGetProcessUtilization":
            lambda h, ts: [NS(pid=111, smUtil=60, memUtil=20, timeStamp=ts + 1)] if h == "h1" else no_support(),
    }
    with mock.patch.multiple(pynvml, **patches):
        mon = GpuMonitor()
        assert mon.available and mon.device_count == 2
        out = mon.sample({111, 222, 333}, device_of={333: 0})
        mon.close()
    a, b, c = out[111], out[222], out[333]
    assert (a.device_index, a.util, a.sm_clock_mhz, a.process_mem_used_bytes, a.process_sm_util) == (
        1, 0.75, 1980, 3 << 30, 0.6)
    assert (a.mem_used_bytes, a.mem_total_bytes) == (40 << 30, 80 << 30)
    assert (b.device_index, b.util, b.process_mem_used_bytes, b.process_sm_util) == (0, 0.05, None, None)
    assert c.device_index == 0 and c.process_mem_used_bytes is None and c.available


# --------------------------------------------------------------------------------- host


@pytest.mark.timeout(60)
def test_host_metrics_in_range():
    mon = HostMonitor()
    burn = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.6: pass"])
    try:
        time.sleep(0.3)
        for _ in range(3):
            time.sleep(0.1)
            h = mon.sample()
            assert 0.0 <= h.cpu_util <= 1.0
            assert 0 < h.mem_used_bytes <= h.mem_total_bytes
            assert h.cpus >= 1
    finally:
        burn.wait(timeout=10)
