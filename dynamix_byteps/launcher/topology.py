"""Where a ``bpslaunch`` job runs: its hosts and the workers on each, the network interface towards
the rendezvous host, free and available TCP ports, and the GPUs a node shows."""

from __future__ import annotations

import errno
import os
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

from dynamix_byteps.env import MAX_WORKERS
from dynamix_byteps.errors import UsageError

__all__ = ["LOCAL_HOST", "Topology", "check_port_free", "free_port", "interface_towards", "visible_gpu_count"]

LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Topology:
    """The job's hosts, this host's index among them, and the workers on each (ranks in host order)."""

    hosts: list[str]
    slots: list[int]
    node_rank: int

    @property
    def local_size(self) -> int:
        return self.slots[self.node_rank]

    @property
    def rank_offset(self) -> int:
        """Global rank of this host's first worker: the workers on the hosts before it."""
        return sum(self.slots[: self.node_rank])

    @property
    def size(self) -> int:
        return sum(self.slots)

    @property
    def root(self) -> str:
        """The address of rank 0's rendezvous (and node 0's services): the first host, or loopback alone."""
        return self.hosts[0] if len(self.hosts) > 1 else LOCAL_HOST

    @classmethod
    def of(cls, hosts: Sequence[tuple[str, int | None]] | None, node_rank: int | None,
           num_workers: int | None) -> "Topology":
        """From ``--hosts`` (``[(host, slots or None), ...]``), ``--node-rank`` and ``--num-workers``.

        Raises:
            UsageError: they disagree, or name more than ``MAX_WORKERS`` workers.
        """
        if hosts is None:
            if node_rank not in (None, 0):
                raise UsageError("--node-rank needs --hosts")
            return cls([LOCAL_HOST], [num_workers], 0)
        names = [name for name, _ in hosts]
        if node_rank is None or not 0 <= node_rank < len(names):
            raise UsageError(f"--hosts names {len(names)} hosts; give this host's --node-rank in 0..{len(names) - 1}")
        slots = [n for _, n in hosts]
        if slots[0] is None:
            if num_workers is None:
                raise UsageError("--hosts H0,H1,... needs --num-workers N (workers on each host), or give each host "
                                 "its workers as --hosts H0:S0,H1:S1,...")
            slots = [num_workers] * len(names)
        elif num_workers not in (None, slots[node_rank]):
            raise UsageError(f"--num-workers {num_workers} disagrees with --hosts, which gives this host "
                             f"(--node-rank {node_rank}) {slots[node_rank]} workers; omit --num-workers")
        if sum(slots) > MAX_WORKERS:
            raise UsageError(f"--hosts gives {sum(slots)} workers in all; a job has at most {MAX_WORKERS}")
        return cls(names, slots, node_rank)


def interface_towards(host: str) -> str:
    """The name of this machine's network interface that carries traffic to ``host`` (IPv4).

    gloo binds its sockets to one interface; by default it resolves this machine's hostname,
    which is often 127.0.0.1 and unreachable from other hosts. Raises UsageError when ``host``
    does not resolve or no interface holds the source address the kernel picks for it.
    """
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect sends nothing; it only chooses the route
            source = probe.getsockname()[0]
    except OSError as error:
        raise UsageError(f"argument --hosts: cannot find a route to {host} ({error}); set GLOO_SOCKET_IFNAME to "
                         "the network interface that reaches it") from None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addresses):
            return name
    raise UsageError(f"argument --hosts: no network interface holds {source}, this machine's address towards "
                     f"{host}; set GLOO_SOCKET_IFNAME to the interface that reaches it")


#: Where :func:`free_port` looks first: below the kernel's ephemeral range.
LISTEN_PORTS = (20000, 32768)
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (what ``connect`` and ``bind(0)`` draw from)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return LISTEN_PORTS[1]


def free_port(host: str = LOCAL_HOST) -> int:
    """A TCP port that ``host`` (IPv4) can listen on now, free until someone else binds it.

    Chosen at random below the kernel's ephemeral range (:data:`LISTEN_PORTS`, cut at
    ``ip_local_port_range``), because a port from that range can be taken by any outgoing connection
    between this call and the listener's ``bind`` (seen as EADDRINUSE in a gloo rendezvous while
    other jobs ran); the kernel's own pick (``bind(0)``) when none of 64 tries is free.
    """
    low, high = LISTEN_PORTS[0], min(LISTEN_PORTS[1], _ephemeral_start())
    rng = random.SystemRandom()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        for _ in range(64 if high > low else 0):
            port = rng.randrange(low, high)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(port: int, host: str = LOCAL_HOST, flag: str = "--port") -> None:
    """Raises UsageError when ``host:port`` cannot be bound now (port 0: when ``host`` cannot): a
    name that does not resolve and an address of another machine are named as such, a port in use
    with ``flag``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as error:
            raise UsageError(f"host {host!r} does not resolve to an address ({error.strerror}); check the names in "
                             "--hosts and --bind") from None
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                raise UsageError(f"{host} is not an address of this machine, so nothing here can listen on it; give "
                                 "one of its own addresses (--hosts lists this host first on node 0, --bind)") from None
            raise UsageError(f"argument {flag}: {host}:{port} is not available ({error.strerror}); choose another "
                             f"port or omit {flag}") from None


def visible_gpu_count(env: Mapping[str, str]) -> int:
    """Worker processes per node when BYTEPS_LOCAL_SIZE is unset: one per visible GPU, else 1."""
    devices = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if devices in ("", "none", "void"):
        return 1
    if devices == "all":
        try:
            return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
        except OSError:
            return 1
    return len([d for d in devices.split(",") if d.strip()])
