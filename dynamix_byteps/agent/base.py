"""What a node agent's collectors measure, and the interface they share.

A collector turns kernel state into per-process, cumulative counters; the agent samples it
every interval and turns counters into rates. Collectors never walk the whole TCP table in the
sampling loop (milliseconds on these kernels).
"""

from __future__ import annotations

import abc
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
    """

    pid: int
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmits: int = 0
    srtt_s: float | None = None
    cwnd: float | None = None
    send_queue_bytes: int = 0
    sockets: int = 0


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
