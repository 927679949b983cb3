"""The delivery rate both network collectors report (``ProcessNetStats.delivery_rate_bytes_per_s``).

Each test runs once per collector (``proc``: TCP_INFO through pidfd_getfd; ``ebpf``: the
sockstat programs, skipped where they cannot load and the machine could not load them anyway)
on real TCP connections between peer processes (tests/tcp_peers.py). The shaped-link test
builds a network test bed (dynamix_byteps.testing.netns: needs root, iproute2 and tbf; skipped
with the reason otherwise) of one host behind 20 Mbit/s and one unshaped.
"""

from __future__ import annotations

import pytest
from tcp_peers import Peer, connect_peers, ebpf_collector_or_skip, move_bytes

from dynamix_byteps.agent.base import NetworkCollector, delivery_rate
from dynamix_byteps.testing import netns

MB = 1_000_000
SHAPED_MBIT = 20.0


@pytest.fixture(params=["proc", "ebpf"])
def collector(request) -> NetworkCollector:
    if request.param == "proc":
        from dynamix_byteps.agent.procfs import ProcCollector

        c = ProcCollector()
    else:
        c = ebpf_collector_or_skip()
    yield c
    c.close()


def test_the_rate_of_a_process_weighs_each_socket_by_its_bytes():
    # 1 MB at 1 MB/s and 1 MB at 100 MB/s take 1.01 s: 2 MB / 1.01 s. Idle or sample-less sockets are left out.
    assert delivery_rate([(MB, 1 * MB), (MB, 100 * MB), (0, 5), (7, 0)]) == pytest.approx(2 * MB / 1.01)
    assert delivery_rate([(0, 5 * MB), (300, 0)]) is None
    assert delivery_rate([]) is None


@pytest.mark.timeout(60)
def test_a_loopback_sender_reports_a_delivery_rate_and_an_idle_one_none(collector):
    with Peer("server", "127.0.0.1", 0) as server, Peer("client", "127.0.0.1", server.port) as client:
        pids = {server.pid, client.pid}
        collector.sample(pids)  # first sight: the connection below counts from its start
        connect_peers(server, client)
        move_bytes(client, server, 4 * MB)
        sent = collector.sample(pids)
        rate = sent[client.pid].delivery_rate_bytes_per_s
        # loopback: tens of MB/s at the least (2 cores shared with other jobs), never beyond 1 TB/s
        assert rate is not None and 10 * MB < rate < 1e12, sent[client.pid]
        assert sent[server.pid].delivery_rate_bytes_per_s is None  # it received only

        idle = collector.sample(pids)  # nothing sent since: the kernel's last sample is stale, not reported
        assert idle[client.pid].delivery_rate_bytes_per_s is None
        assert idle[client.pid].srtt_s is not None  # the connection is still there

        move_bytes(server, client, 1 * MB)
        back = collector.sample(pids)
        assert back[server.pid].delivery_rate_bytes_per_s is not None
        assert back[client.pid].delivery_rate_bytes_per_s is None


@pytest.fixture(scope="module")
def shaped_bed():
    """Host 1 behind a 20 Mbit/s tbf link, host 2 unshaped; both reach host 0 over the bridge."""
    reason = netns.available()
    if reason is not None:
        pytest.skip(f"network test bed unavailable: {reason}")
    with netns.Testbed(3, rates_mbit={1: SHAPED_MBIT}) as bed:
        yield bed


def _rate_to_host0(collector: NetworkCollector, bed: netns.Testbed, host: int, n: int) -> float:
    """The delivery rate a client on ``host`` reports after sending ``n`` bytes to a peer on host 0, bytes/s."""
    with Peer("server", bed.hosts[0].address, 0) as server, \
            Peer("client", bed.hosts[0].address, server.port, netns=bed.hosts[host].namespace) as client:
        collector.sample({client.pid})
        connect_peers(server, client)
        move_bytes(client, server, n)
        rate = collector.sample({client.pid})[client.pid].delivery_rate_bytes_per_s
    assert rate is not None
    return rate


@pytest.mark.timeout(120)
def test_a_link_shaped_by_tc_reports_a_lower_delivery_rate(collector, shaped_bed):
    shaped = _rate_to_host0(collector, shaped_bed, 1, 2 * MB)  # ~0.8 s at 20 Mbit/s
    free = _rate_to_host0(collector, shaped_bed, 2, 2 * MB)
    link = SHAPED_MBIT * 1e6 / 8  # bytes/s
    # the estimate counts whole MSS-sized segments per interval and tbf lets 10 ms bursts through;
    # a sample taken during loss recovery is lower (measured 0.54-0.96x the link)
    assert 0.1 * link < shaped < 2 * link, (shaped, free)
    assert shaped < 0.5 * free, (shaped, free)
