"""The no-eBPF collectors: TCP_INFO through pidfd_getfd, /proc readers, host metrics, NVML absent.

The TCP tests run two peer processes (this file's PEER script) driven line by line over their
stdin/stdout, so every byte count is known exactly. The retransmit test needs root, ``ip`` and
``nft``; it builds two network namespaces (``dxf_`` prefix) joined by a veth and drops 10% of
what reaches the receiver.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest

from dynamix_byteps.agent.base import NetworkCollector
from dynamix_byteps.agent.gpu import GpuMonitor, GpuStats
from dynamix_byteps.agent.procfs import (
    TCP_ESTABLISHED,
    HostMonitor,
    ProcCollector,
    process_cpu_seconds,
    read_proc_io,
)

PEER = r"""
import socket, struct, sys
role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def out(*a):
    print(*a, flush=True)
s = None
if role == "server":
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, port))
    ls.listen()
    out("port", ls.getsockname()[1])
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "accept":
        s, _ = ls.accept()
        out("accepted")
    elif cmd == "connect":
        s = socket.create_connection((host, port), timeout=20)
        s.settimeout(None)
        out("connected")
    elif cmd == "send":
        n = int(args[0])
        s.sendall(b"x" * n)
        out("sent", n)
    elif cmd == "recv":
        n, got = int(args[0]), 0
        while got < n:
            d = s.recv(min(1 << 20, n - got))
            if not d:
                break
            got += len(d)
        out("recv", got)
    elif cmd == "eof":
        s.settimeout(float(args[0]))
        try:
            out("eof", s.recv(1) == b"")
        except socket.timeout:
            out("eof", False)
    elif cmd == "state":
        out("state", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0])
    elif cmd == "close":
        s.close()
        out("closed")
    elif cmd == "exit":
        break
"""


class Peer:
    """A child process holding one TCP socket, driven by text commands."""

    def __init__(self, role: str, host: str, port: int, netns: str | None = None):
        argv = [sys.executable, "-c", PEER, role, host, str(port)]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]  # ip execs python: same pid
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.port = int(self.read()[1]) if role == "server" else port

    def read(self, timeout: float = 30.0) -> list[str]:
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not result or not result[0]:
            raise AssertionError(f"peer {self.pid} gave no answer (rc={self.proc.poll()})")
        return result[0].split()

    def cmd(self, line: str, timeout: float = 30.0) -> list[str]:
        self.send(line)
        return self.read(timeout)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=5)


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
    server = Peer("server", "127.0.0.1", 0)
    client = Peer("client", "127.0.0.1", server.port)
    pids = {server.pid, client.pid}
    try:
        # First sight before the connection exists: everything the connection carries counts.
        first = collector.sample(pids)
        assert set(first) == pids
        assert first[server.pid].sockets == 0  # its listening socket is not a connection
        assert first[client.pid].bytes_sent == 0 and first[client.pid].srtt_s is None

        server.send("accept")
        assert client.cmd("connect") == ["connected"]
        assert server.read() == ["accepted"]
        n_up, n_down = 1_000_003, 300_007
        client.send(f"send {n_up}")
        assert server.cmd(f"recv {n_up}") == ["recv", str(n_up)]
        assert client.read() == ["sent", str(n_up)]
        server.send(f"send {n_down}")
        assert client.cmd(f"recv {n_down}") == ["recv", str(n_down)]
        assert server.read() == ["sent", str(n_down)]

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
    finally:
        client.stop()
        server.stop()


@pytest.mark.timeout(60)
def test_sockets_open_at_first_sight_count_from_then(collector: ProcCollector):
    server = Peer("server", "127.0.0.1", 0)
    client = Peer("client", "127.0.0.1", server.port)
    pids = {server.pid, client.pid}
    try:
        server.send("accept")
        assert client.cmd("connect") == ["connected"]
        assert server.read() == ["accepted"]
        client.send("send 5000")
        assert server.cmd("recv 5000") == ["recv", "5000"]
        client.read()
        base = collector.sample(pids)  # history before this is the baseline
        assert base[client.pid].bytes_sent == 0 and base[server.pid].bytes_received == 0
        assert base[client.pid].sockets == 1
        client.send("send 7000")
        assert server.cmd("recv 7000") == ["recv", "7000"]
        client.read()
        now = collector.sample(pids)
        assert now[client.pid].bytes_sent == 7000
        assert now[server.pid].bytes_received == 7000
    finally:
        client.stop()
        server.stop()


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, timeout=20, capture_output=True)


@pytest.fixture
def lossy_link():
    """Namespaces dxf_s<pid> (receiver, 10.231.0.1) and dxf_c<pid> (sender, 10.231.0.2) on a veth;
    the receiver drops 10% of what arrives from the sender."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (apt-get install iproute2 nftables)")
    tag = str(os.getpid())
    ns_s, ns_c = f"dxf_s{tag}", f"dxf_c{tag}"
    veth_s, veth_c = f"dxf_vs{tag}"[:15], f"dxf_vc{tag}"[:15]
    try:
        _sh("ip", "netns", "add", ns_s)
        _sh("ip", "netns", "add", ns_c)
        _sh("ip", "link", "add", veth_s, "type", "veth", "peer", "name", veth_c)
        _sh("ip", "link", "set", veth_s, "netns", ns_s)
        _sh("ip", "link", "set", veth_c, "netns", ns_c)
        _sh("ip", "-n", ns_s, "addr", "add", "10.231.0.1/24", "dev", veth_s)
        _sh("ip", "-n", ns_c, "addr", "add", "10.231.0.2/24", "dev", veth_c)
        for ns, dev in ((ns_s, veth_s), (ns_c, veth_c)):
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        nft = ("ip", "netns", "exec", ns_s, "nft")
        _sh(*nft, "add", "table", "inet", "dxf")
        _sh(*nft, "add", "chain", "inet", "dxf", "in", "{ type filter hook prerouting priority 0; }")
        _sh(*nft, "add", "rule", "inet", "dxf", "in", "ip", "saddr", "10.231.0.2",
            "numgen", "random", "mod", "100", "<", "10", "counter", "drop")
        yield ns_s, ns_c
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot build the lossy link: {e.cmd}: {e.stderr.decode(errors='replace').strip()}")
    finally:
        for ns in (ns_s, ns_c):  # deleting a namespace deletes its veth end and nft table
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=20, capture_output=True)


@pytest.mark.timeout(60)
def test_retransmits_rise_under_receiver_side_loss(collector: ProcCollector, lossy_link):
    ns_s, ns_c = lossy_link
    server = Peer("server", "10.231.0.1", 5201, netns=ns_s)
    client = Peer("client", "10.231.0.1", 5201, netns=ns_c)
    pids = {server.pid, client.pid}
    try:
        server.send("accept")
        assert client.cmd("connect") == ["connected"]
        assert server.read() == ["accepted"]
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
    finally:
        client.stop()
        server.stop()


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
    with init_fails, caplog.at_level(logging.WARNING, logger="dynamix_byteps.agent.gpu"):
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


# --------------------------------------------------------------------------------- /proc and host


@pytest.mark.timeout(60)
def test_host_metrics_in_range():
    mon = HostMonitor()
    burn = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.6: pass"])
    try:
        time.sleep(0.3)
        first = process_cpu_seconds(burn.pid)
        for _ in range(3):
            time.sleep(0.1)
            h = mon.sample()
            assert 0.0 <= h.cpu_util <= 1.0
            assert 0 < h.mem_used_bytes <= h.mem_total_bytes
            assert h.cpus >= 1
        second = process_cpu_seconds(burn.pid)
        assert first is not None and second is not None and second > first >= 0
    finally:
        burn.wait(timeout=10)
    assert process_cpu_seconds(burn.pid) is None  # reaped
    io = read_proc_io(os.getpid())
    assert io is not None and io["syscr"] > 0 and io["rchar"] > 0
    assert read_proc_io(burn.pid) is None
