"""eBPF network collector (dynamix_byteps.agent.ebpf) against real TCP traffic.

Needs root (or CAP_BPF+CAP_PERFMON), kernel BTF and the object built at install time; where
loading is not permitted the traffic tests skip with the collector's own reason. The
retransmit test also needs ``ip`` and ``nft`` (scripts/install-system-packages.sh) and creates
two network namespaces named ``dxt_*`` joined by a veth, removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from dynamix_byteps.agent.base import CollectorUnavailable
from dynamix_byteps.agent.ebpf import EbpfCollector, check_available

MB = 1_000_000

# A peer driven over stdin/stdout: prints "pid <n>" and "port <n>", transfers, then obeys
# "close" (closes its socket, answers "closed") and "exit".
PEER = r"""
import os, socket, sys
role, host, port, send_n, recv_n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def say(*a): print(*a, flush=True)
say("pid", os.getpid())
if role == "server":
    srv = socket.socket(); srv.bind((host, port)); srv.listen(1)
    say("port", srv.getsockname()[1])
    s, _ = srv.accept(); srv.close()
else:
    s = socket.create_connection((host, port), timeout=40)
def recv_exactly(n):
    got = 0
    while got < n:
        d = s.recv(min(1 << 16, n - got))
        if not d: raise SystemExit("peer closed early")
        got += len(d)
chunk = b"x" * (1 << 16)
def send_exactly(n):
    while n: k = min(n, len(chunk)); s.sendall(chunk[:k]); n -= k
if role == "server": recv_exactly(recv_n); send_exactly(send_n)
else: send_exactly(send_n); recv_exactly(recv_n)
say("done", s.getsockname()[1])
for line in sys.stdin:
    if line.strip() == "close": s.close(); say("closed")
    elif line.strip() == "exit": break
"""


class Peer:
    """One PEER process (optionally wrapped, e.g. in ``ip netns exec``)."""

    def __init__(self, role: str, host: str, port: int, send_n: int, recv_n: int, prefix: list[str] = ()):
        cmd = [*prefix, sys.executable, "-c", PEER, role, host, str(port), str(send_n), str(recv_n)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = int(self.expect("pid"))

    def expect(self, word: str) -> str:
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, f"expected {word!r} from peer, got {line}"
        return line[1] if len(line) > 1 else ""

    def tell(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tell("exit")
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def collector():
    try:
        c = EbpfCollector()
    except CollectorUnavailable as e:
        if os.geteuid() == 0 and os.path.exists("/sys/kernel/btf/vmlinux"):
            raise  # root with BTF: the collector must load here
        pytest.skip(f"eBPF collector cannot load here: {e}")
    yield c
    c.close()


def wait_for(pred, timeout: float = 10.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (v := pred()):
            return v
        time.sleep(step)
    return pred()


@pytest.mark.timeout(60)
def test_loopback_bytes_rtt_and_close(collector):
    server = Peer("server", "127.0.0.1", 0, send_n=1 * MB, recv_n=3 * MB)
    client = None
    try:
        port = int(server.expect("port"))
        client = Peer("client", "127.0.0.1", port, send_n=3 * MB, recv_n=1 * MB)
        client_port = int(client.expect("done"))
        server.expect("done")

        stats = collector.sample({client.pid, server.pid, 2**22 + 7})
        assert set(stats) == {client.pid, server.pid}  # a pid that is not alive is left out
        c, s = stats[client.pid], stats[server.pid]
        assert (c.bytes_sent, c.bytes_received) == (3 * MB, 1 * MB)
        assert (s.bytes_sent, s.bytes_received) == (1 * MB, 3 * MB)
        for st in (c, s):
            assert st.sockets == 1
            assert 0 < st.srtt_s < 0.050, st
            assert st.cwnd and st.cwnd > 0

        def conn_entries():
            return [e for e in collector.socket_entries().values()
                    if {e.local[1], e.remote[1]} == {port, client_port}]

        entries = conn_entries()
        assert {e.pid for e in entries} == {client.pid, server.pid}
        client_entry = next(e for e in entries if e.pid == client.pid)
        assert client_entry.local == ("127.0.0.1", client_port) and client_entry.remote == ("127.0.0.1", port)

        client.tell("close")
        client.expect("closed")
        server.tell("close")
        server.expect("closed")
        assert wait_for(lambda: not conn_entries()), f"closed sockets still in the map: {conn_entries()}"

        after = collector.sample({client.pid, server.pid})
        c, s = after[client.pid], after[server.pid]
        assert (c.bytes_sent, c.bytes_received, c.sockets, c.srtt_s) == (3 * MB, 1 * MB, 0, None)
        assert (s.bytes_sent, s.bytes_received, s.sockets, s.srtt_s) == (1 * MB, 3 * MB, 0, None)
    finally:
        for p in (client, server):
            if p:
                p.stop()


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=20, capture_output=True)


@pytest.fixture
def lossy_link():
    """Two namespaces joined by a veth; the receiver (``b``, 10.213.0.2) drops 10% of what arrives."""
    for tool in ("ip", "nft"):
        assert shutil.which(tool), f"{tool} missing: run scripts/install-system-packages.sh"
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, veth_a, veth_b = f"dxt_{tag}_a", f"dxt_{tag}_b", f"dxt{tag}a", f"dxt{tag}b"
    try:
        _run("ip", "netns", "add", ns_a)
        _run("ip", "netns", "add", ns_b)
        _run("ip", "link", "add", veth_a, "netns", ns_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, "10.213.0.1/24"), (ns_b, veth_b, "10.213.0.2/24")):
            _run("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        nft = ["ip", "netns", "exec", ns_b, "nft"]
        _run(*nft, "add", "table", "inet", "dxt")
        _run(*nft, "add", "chain", "inet", "dxt", "in", "{ type filter hook prerouting priority 0; }")
        _run(*nft, "add", "rule", "inet", "dxt", "in", "ip", "saddr", "10.213.0.1",
             "numgen", "random", "mod", "100", "<", "10", "drop")
        yield ns_a, ns_b
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace removes its veth end, the pair and nft table
            subprocess.run(["ip", "netns", "delete", ns], timeout=20, capture_output=True)


@pytest.mark.timeout(60)
def test_retransmits_rise_under_receiver_loss(collector, lossy_link):
    ns_a, ns_b = lossy_link
    receiver = Peer("server", "10.213.0.2", 0, send_n=0, recv_n=4 * MB, prefix=["ip", "netns", "exec", ns_b])
    sender = None
    try:
        port = int(receiver.expect("port"))
        before = collector.sample({receiver.pid})
        sender = Peer("client", "10.213.0.2", port, send_n=4 * MB, recv_n=0, prefix=["ip", "netns", "exec", ns_a])
        sender.expect("done")
        receiver.expect("done")
        stats = collector.sample({sender.pid, receiver.pid})
        assert before[receiver.pid].retransmits == 0
        assert stats[sender.pid].bytes_sent == 4 * MB
        assert stats[receiver.pid].bytes_received == 4 * MB
        assert stats[sender.pid].retransmits > 0, stats[sender.pid]
        sender.tell("close")
        sender.expect("closed")
        after = collector.sample({sender.pid})  # the closed socket's retransmits are kept
        assert after[sender.pid].retransmits >= stats[sender.pid].retransmits
    finally:
        for p in (sender, receiver):
            if p:
                p.stop()


NOT_PERMITTED_CHECK = r"""
import sys
from dynamix_byteps.agent import ebpf
from dynamix_byteps.agent.base import CollectorUnavailable
reasons = []
for bypass_precheck in (False, True):  # True: let the kernel itself refuse the load
    if bypass_precheck:
        ebpf._may_load_bpf = lambda: True
    try:
        ebpf.EbpfCollector().close()
        reasons.append("LOADED")
    except CollectorUnavailable as e:
        reasons.append(str(e))
print("\n".join(reasons))
"""


@pytest.mark.timeout(60)
def test_unavailable_when_loading_not_permitted():
    try:
        check_available()
    except CollectorUnavailable as e:
        if "not permitted" not in str(e):
            pytest.skip(f"the collector is unavailable here for another reason: {e}")
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("setpriv (util-linux) is needed to drop root for this check")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        prefix = []
    out = subprocess.run([*prefix, sys.executable, "-c", NOT_PERMITTED_CHECK], capture_output=True, text=True,
                         timeout=30, cwd="/")
    assert out.returncode == 0, out.stderr
    precheck, kernel = out.stdout.strip().splitlines()
    assert "not permitted" in precheck and "CAP_BPF+CAP_PERFMON" in precheck, precheck
    assert "refused" in kernel and "CAP_BPF+CAP_PERFMON" in kernel, kernel
