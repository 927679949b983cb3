"""What a node agent's collectors measure, and the interface they share.

A collector turns kernel state into per-process, cumulative counters; the agent samples it
every interval and turns counters into rates. Collectors never walk the whole TCP table in the
sampling loop (milliseconds on these kernels).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

MONITORS = ("auto", "ebpf", "proc", "off")
"""Values of ``--monitor``: eBPF falling back to proc, eBPF only, TCP_INFO and /proc only, none."""


@dataclass(frozen=True)
class ProcessNetStats:
    """TCP traffic of one process (all its TCP sockets), cumulative since the collector saw it.

    Attributes:
        pid: process id (global pid namespace).
        bytes_sent: bytes the process handed to TCP send calls, bytes.
        bytes_received: bytes returned by its TCP receive calls, bytes.
        retransmits: TCP segments retransmitted on its sockets, segments.
        srtt_s: smoothed round-trip time, mean over its open sockets, seconds; None if no socket.
        cwnd: congestion window, mean over open sockets, segments; None if no socket.
        send_queue_bytes: bytes written but not yet acknowledged, summed over sockets, bytes.
        sockets: open TCP sockets seen.
        delivery_rate_bytes_per_s: the kernel's delivery-rate estimate over the sockets that sent
            data since the collector's previous sample, combined by :func:`delivery_rate`,
            bytes/s; None when no socket sent data in that time.
    """

    pid: int
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmits: int = 0
    srtt_s: float | None = None
    cwnd: float | None = None
    send_queue_bytes: int = 0
    sockets: int = 0
    delivery_rate_bytes_per_s: float | None = None


def delivery_rate(sockets: Iterable[tuple[int, int]]) -> float | None:
    """One process's delivery rate from ``(bytes sent in the interval, socket delivery rate)`` pairs, bytes/s.

    A socket's rate is the kernel's estimate for it (``tcpi_delivery_rate`` of ``struct
    tcp_info``, Linux >= 4.9; ``delivery_rate`` in ``ss -ti``; the rate BBR uses): the data
    segments acknowledged over the last sampled flight times the MSS, divided by that flight's
    send-or-ack interval (``tcp_compute_delivery_rate`` in net/ipv4/tcp.c, samples from
    net/ipv4/tcp_rate.c). The kernel keeps an application-limited sample only if it is higher
    than the one before, so a worker's bursts between idle gaps still measure the path.

    Only sockets that sent data in the interval count (``bytes > 0``) and have a sample
    (``rate > 0``): the kernel keeps the last sample of an idle socket forever, which says
    nothing about now. The result is the bytes-weighted harmonic mean
    ``Σ b_i / Σ (b_i / r_i)``: the interval's bytes divided by the time they take at each
    socket's rate. So a connection to a co-located peer (loopback speed) adds almost no time and
    does not hide a slow uplink the worker's other connections cross (a maximum would report the
    loopback), and a control connection that sent a few segments weighs by those few bytes (a
    minimum would report it). Returns None when no socket qualifies.
    """
    total = time_s = 0.0
    for sent, rate in sockets:
        if sent > 0 and rate > 0:
            total += sent
            time_s += sent / rate
    return total / time_s if time_s > 0 else None


class CollectorUnavailable(Exception):
    """This collector cannot run here; the message says why (shown once, then the agent falls back)."""


class NetworkCollector(abc.ABC):
    """Per-process TCP statistics from one source (``ebpf`` or ``proc``)."""

    name: str

    @abc.abstractmethod
    def sample(self, pids: set[int]) -> dict[int, ProcessNetStats]:
        """Cumulative counters for each of ``pids`` that is alive (missing pids are left out)."""

    def close(self) -> None:
        """Release kernel objects (BPF links, maps, duplicated fds)."""
