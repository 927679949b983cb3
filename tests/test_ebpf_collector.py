"""eBPF network collector (dynamix_byteps.agent.ebpf) against real TCP traffic.

Needs root (or CAP_BPF+CAP_PERFMON), kernel BTF and the object built at install time; where
loading is not permitted the traffic tests skip with the collector's own reason. The
retransmit test also needs ``ip`` and ``nft`` (scripts/install-system-packages.sh) and creates
two network namespaces named ``dxt_*`` joined by a veth, removed afterwards. The peers and the
namespaces come from tests/tcp_peers.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import wait_until
from tcp_peers import (
    Peer,
    connect_peers,
    ebpf_collector_or_skip,
    lossy_namespace_pair,
    missing_netns_tools,
    move_bytes,
)

from dynamix_byteps.agent.base import CollectorUnavailable
from dynamix_byteps.agent.ebpf import check_available

MB = 1_000_000


@pytest.fixture
def collector():
    c = ebpf_collector_or_skip()
    yield c
    c.close()


@pytest.mark.timeout(60)
def test_loopback_bytes_rtt_and_close(collector):
    with Peer("server", "127.0.0.1", 0) as server, Peer("client", "127.0.0.1", server.port) as client:
        port = server.port
        connect_peers(server, client)
        client_port = int(client.cmd("sockname")[2])
        move_bytes(client, server, 3 * MB)
        move_bytes(server, client, 1 * MB)

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

        assert client.cmd("close") == ["closed"]
        assert server.cmd("close") == ["closed"]
        assert wait_until(lambda: not conn_entries(), 10), f"closed sockets still in the map: {conn_entries()}"

        after = collector.sample({client.pid, server.pid})
        c, s = after[client.pid], after[server.pid]
        assert (c.bytes_sent, c.bytes_received, c.sockets, c.srtt_s) == (3 * MB, 1 * MB, 0, None)
        assert (s.bytes_sent, s.bytes_received, s.sockets, s.srtt_s) == (1 * MB, 3 * MB, 0, None)


@pytest.fixture
def lossy_link():
    """Two namespaces joined by a veth; the receiver drops 10% of what arrives from the sender."""
    missing = missing_netns_tools()
    assert not missing, f"{missing} missing: run scripts/install-system-packages.sh"
    with lossy_namespace_pair("dxt") as link:
        yield link


@pytest.mark.timeout(60)
def test_retransmits_rise_under_receiver_loss(collector, lossy_link):
    with Peer("server", lossy_link.receiver_addr, 0, netns=lossy_link.receiver_ns) as receiver:
        before = collector.sample({receiver.pid})
        with Peer("client", lossy_link.receiver_addr, receiver.port, netns=lossy_link.sender_ns) as sender:
            connect_peers(receiver, sender)
            move_bytes(sender, receiver, 4 * MB)
            stats = collector.sample({sender.pid, receiver.pid})
            assert before[receiver.pid].retransmits == 0
            assert stats[sender.pid].bytes_sent == 4 * MB
            assert stats[receiver.pid].bytes_received == 4 * MB
            assert stats[sender.pid].retransmits > 0, stats[sender.pid]
            assert sender.cmd("close") == ["closed"]
            after = collector.sample({sender.pid})  # the closed socket's retransmits are kept
            assert after[sender.pid].retransmits >= stats[sender.pid].retransmits


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("full, what", [("_socks_capacity", "open TCP sockets"),
                                        ("_closed_capacity", "processes with closed TCP sockets")])
def test_a_full_map_is_said_and_the_agent_measures_through_proc_instead(collector, caplog, full, what):
    """The maps hold every process's sockets (16384) and closed-socket totals per process (16384):
    on a host busier than that, what a worker moved went uncounted and its bytes and rates read
    low, silently."""
    import logging

    from dynamix_byteps.agent.node_agent import NodeAgent

    with Peer("server", "127.0.0.1", 0) as server, Peer("client", "127.0.0.1", server.port) as client:
        connect_peers(server, client)
        move_bytes(client, server, 1000)
        collector.sample({client.pid})  # room to spare
        setattr(collector, full, 0)  # as full as a host with 16384 of them makes it
        with pytest.raises(CollectorUnavailable, match=rf"its map of {what} is full \(\d+, of all the processes"):
            collector.sample({client.pid})
    agent = NodeAgent("breakit", "127.0.0.1:1", monitor="auto")
    try:
        agent.collector.close()
        agent.collector = collector  # as the agent's own eBPF collector, full
        with caplog.at_level(logging.WARNING, logger="dynamix_byteps.agent"):
            agent.sample()
        assert agent.collector.name == "proc"
        assert any(r.getMessage().startswith(f"eBPF monitoring stopped (its map of {what} is full (")
                   and r.getMessage().endswith("; using TCP_INFO and /proc instead") for r in caplog.records)
    finally:
        agent.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_in_a_pid_namespace_ebpf_is_unavailable_and_auto_measures_through_proc(collector):
    """In a container the programs record the host's pids while the workers' mailboxes hold the
    container's: a worker's 100 kB read as 0 bytes (its traffic went to the host pid it has there)."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", textwrap.dedent("""
        import os, socket
        from dynamix_byteps.agent.base import CollectorUnavailable
        from dynamix_byteps.agent.ebpf import EbpfCollector
        from dynamix_byteps.agent.node_agent import make_collector

        try:
            EbpfCollector().close()
            print("loaded")
        except CollectorUnavailable as why:
            print("unavailable:", why)
        collector = make_collector("auto")
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        collector.sample({os.getpid()})
        client.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(peer.recv(65536))
        print(collector.name, collector.sample({os.getpid()})[os.getpid()].bytes_sent)
        collector.close()
        """)], capture_output=True, text=True, timeout=50)
    assert probe.returncode == 0, probe.stderr
    unavailable, measured = probe.stdout.splitlines()
    assert unavailable.startswith("unavailable: this agent runs in a pid namespace of its own (a container)"), probe
    assert measured == "proc 100000", probe
