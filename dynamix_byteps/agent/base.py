"""What a node agent's collectors measure, and the interface they share.

A collector turns kernel state into per-process, cumulative counters; the agent samples it
every interval and turns counters into rates. Collectors never walk the whole TCP table in the
sampling loop (milliseconds on these kernels).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

MONITORS = ("auto", "ebpf", "proc", "off")
"""Values of ``--monitor``: eBPF falling back to proc, eBPF only, TCP_INFO and /proc only, none."""

NODE_METRICS_MAX_AGE_S = 10.0
"""Age beyond which the scheduler leaves a rank's node metrics out of decisions, seconds: its agent
died or stopped seeing the worker (Prometheus likewise marks a series stale once its target stops
answering). Ten default agent intervals."""

MAX_INTERVAL_S = NODE_METRICS_MAX_AGE_S / 2
"""Longest ``dynamix agent --interval``, seconds: a live agent's metrics never go stale between two reports."""


@dataclass(frozen=True)
class ProcessNetStats:
    """TCP traffic of one process (all its TCP sockets), cumulative since the collector saw it.

    Attributes:
        pid: process id (global pid namespace).
        bytes_sent: bytes the process handed to TCP send calls, bytes.
        bytes_received: bytes returned by its TCP receive calls, bytes.
        retransmits: TCP segments retransmitted on its sockets, segments.
        srtt_s: smoothed round-trip time of its open connection sockets, weighted by the bytes each
            delivered since the collector's previous sample (:func:`traffic_rtt`), seconds; None if no socket.
        cwnd: congestion window, mean over open sockets, segments; None if no socket.
        send_queue_bytes: bytes written but not yet acknowledged, summed over sockets, bytes.
        sockets: open TCP sockets seen.
        delivery_rate_bytes_per_s: what its sockets delivered per second of being busy since the
            collector's previous sample, combined by :func:`delivery_rate`, bytes/s; None when
            no socket had data in flight in that time.
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


MIN_BUSY_S = 0.02
"""Busy time below which a socket's time is taken from the kernel's flight sample, seconds (2-20 jiffies)."""


class SocketDelivery(NamedTuple):
    """What one TCP socket delivered between two samples of a collector.

    Attributes:
        acked_bytes: growth of ``tcpi_bytes_acked`` (RFC 4898 ThruOctetsAcked), bytes.
        busy_s: growth of ``tcpi_busy_time - tcpi_rwnd_limited`` (Linux >= 4.10): time with
            data queued or in flight, less the time the peer's receive window held sending back
            (a receiver that does not read is not the path's fault: a reader stopped for 0.5 s
            during 2 MB on an unshaped link took its rate from 45 to 4 MB/s), counted in whole
            kernel jiffies (1-10 ms), seconds.
        sample_bytes_per_s: the kernel's latest delivery-rate sample (``tcpi_delivery_rate``,
            Linux >= 4.9: one flight's delivered bytes over its send-or-ack interval), bytes/s;
            0 before the first.
    """

    acked_bytes: int
    busy_s: float
    sample_bytes_per_s: float


def delivery_since(previous: tuple[int, float], acked_bytes: int, busy_s: float,
                   sample_bytes_per_s: float) -> SocketDelivery:
    """What a socket delivered since a collector's previous sample.

    ``previous`` is its ``(acked bytes, busy seconds)`` then, ``acked_bytes`` and ``busy_s`` the
    same counters now (bytes, seconds), ``sample_bytes_per_s`` the kernel's latest sample. A
    counter that went down belongs to a new socket under a reused key: it counts from zero.
    """
    acked_before, busy_before = previous
    if acked_before > acked_bytes or busy_before > busy_s:
        acked_before, busy_before = 0, 0.0
    return SocketDelivery(acked_bytes - acked_before, busy_s - busy_before, sample_bytes_per_s)


def delivery_rate(sockets: Iterable[SocketDelivery]) -> float | None:
    """One process's delivery rate over an interval: its sockets' bytes over the time they took, bytes/s.

    A socket's time is its busy time when that is at least :data:`MIN_BUSY_S`, so the rate is
    what the path carried while there was something to carry (a worker idle between pushes does
    not lower it, as it lowers bytes/s). A socket busy for less (a fast link, a short transfer)
    takes ``acked_bytes / sample_bytes_per_s`` instead, since a few jiffies cannot time it. The
    kernel's sample alone is not used for long transfers because it describes the last flight
    only: after 2 MB over a 20 Mbit/s tbf link it measured 0.5x to 42x the link over eight
    transfers, where busy time gave 0.74x to 0.97x.

    The result is ``Σ bytes / Σ time``, the bytes-weighted harmonic mean of the sockets' rates.
    A connection to a co-located peer (loopback speed) adds almost no time and does not hide a
    slow uplink the worker's other connections cross (a maximum would report the loopback), and
    a control connection that sent a few segments weighs by those few bytes (a minimum would
    report it). A socket that delivered at most 2 bytes delivered no data (its SYN and FIN count
    one byte each) and is left out, as is one with neither time measure. Returns None when no
    socket qualifies.
    """
    total = time_s = 0.0
    for acked, busy_s, sample in sockets:
        if acked <= 2:
            continue
        if busy_s >= MIN_BUSY_S:
            time_s += busy_s
        elif sample > 0:
            time_s += acked / sample
        else:
            continue
        total += acked
    return total / time_s if time_s > 0 else None


def traffic_rtt(sockets: Iterable[tuple[float, SocketDelivery]]) -> float | None:
    """One process's round-trip time over an interval: its sockets' smoothed RTTs (``tcpi_rtt``,
    seconds) weighted by the bytes each delivered in the interval, seconds.

    The result is the RTT its data saw. With a plain mean, an idle control connection counted as
    much as the link the gradients cross: a worker with a 20 ms uplink and a loopback gRPC channel
    to a scheduler on its host read 10 ms, halving the round-trip time of the parameter-server
    host's workers alone. A socket that only receives weighs by what it sent (its RTT is timed on
    those sends). Sockets that delivered at most 2 bytes (SYN and FIN) carry no weight; when none
    delivered more, the plain mean of their RTTs. None without sockets.
    """
    sockets = list(sockets)
    busy = [(rtt_s, delivery.acked_bytes) for rtt_s, delivery in sockets if delivery.acked_bytes > 2]
    if busy:
        return sum(rtt_s * acked for rtt_s, acked in busy) / sum(acked for _, acked in busy)
    return sum(rtt_s for rtt_s, _ in sockets) / len(sockets) if sockets else None


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
