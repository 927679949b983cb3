"""No-eBPF collector: per-socket ``tcp_info`` through ``pidfd_getfd``, plus host CPU and memory from psutil.

How a sample works, for each watched pid:

1. list ``/proc/<pid>/fd`` and keep the ``socket:[inode]`` links (no walk of the TCP table:
   ``/proc/net/tcp``, ``ss`` and inet_diag dumps cost milliseconds on these kernels);
2. duplicate each socket into this process with ``pidfd_getfd(pidfd_open(pid), fd)``;
3. on the duplicate: ``getsockopt(SOL_TCP, TCP_INFO)`` and the ``SIOCOUTQ``/``SIOCINQ`` ioctls;
4. **close the duplicate at once.** A held duplicate keeps the connection alive after the
   trainer closes its own fd: no FIN is sent and the peer never sees EOF.

Non-TCP sockets (unix, UDP, netlink) are remembered by inode and not duplicated again.

Byte counters per socket (exact, what the application moved through send/recv calls):

* sent     = ``tcpi_bytes_acked`` + ``SIOCOUTQ`` (written but not yet acked)
* received = ``tcpi_bytes_received`` - ``SIOCINQ`` (arrived but not yet read)

each less the FIN's one sequence number once a FIN was sent (resp. received). A process's
counters are the sum over its sockets plus the last-seen counters of its sockets that have gone
away, so they never go backwards. Sockets already open when the collector first saw the pid
count from that moment (their earlier history is taken as a baseline), matching the eBPF
collector, which sees only events after it is loaded.

Needs Linux >= 5.6 and root, ``CAP_SYS_PTRACE``, or ptrace rights over the targets
(``PTRACE_MODE_ATTACH_REALCREDS``); otherwise :class:`CollectorUnavailable` says why.

Process and host figures psutil gives come from psutil. What is read from /proc directly is what
psutil does not give: a process's socket inodes without walking the TCP tables (psutil's
``net_connections`` walks ``/proc/net/tcp*``), this process's effective capabilities
(``CapEff`` in ``/proc/self/status``) and ``kernel.yama.ptrace_scope``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import select
import socket
import struct
import sys
from dataclasses import dataclass, field

from .base import (
    CollectorUnavailable,
    NetworkCollector,
    ProcessNetStats,
    SocketDelivery,
    delivery_rate,
    delivery_since,
    traffic_rtt,
)

log = logging.getLogger(__name__)

SYS_PIDFD_GETFD = 438  # same number on x86_64, arm64 and every arch on the generic syscall table
SOL_TCP = socket.IPPROTO_TCP
TCP_INFO = getattr(socket, "TCP_INFO", 11)
SIOCINQ = 0x541B  # == FIONREAD
SIOCOUTQ = 0x5411  # == TIOCOUTQ
CAP_SYS_PTRACE = 19

# TCP states (include/net/tcp_states.h)
TCP_ESTABLISHED, TCP_SYN_SENT, TCP_SYN_RECV = 1, 2, 3
TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_TIME_WAIT, TCP_CLOSE = 4, 5, 6, 7
TCP_CLOSE_WAIT, TCP_LAST_ACK, TCP_LISTEN, TCP_CLOSING = 8, 9, 10, 11
# States in which our FIN is queued/sent (it occupies one sequence number in write_seq/bytes_acked)
_FIN_SENT = frozenset({TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_CLOSING, TCP_TIME_WAIT, TCP_LAST_ACK})
# States in which the peer's FIN was received (it occupies one sequence number in rcv_nxt)
_FIN_RECEIVED = frozenset({TCP_CLOSE_WAIT, TCP_LAST_ACK, TCP_CLOSING, TCP_TIME_WAIT})

# struct tcp_info: (TcpInfo field, byte offset, struct code), from include/uapi/linux/tcp.h and
# checked against this kernel's BTF. An older kernel's shorter struct leaves the later fields None.
_TCP_INFO_LAYOUT = (
    ("state", 0, "B"), ("unacked", 24, "I"), ("rtt_us", 68, "I"), ("snd_cwnd", 80, "I"),
    ("total_retrans", 100, "I"), ("bytes_acked", 120, "Q"), ("bytes_received", 128, "Q"),
    ("notsent_bytes", 144, "I"), ("data_segs_out", 156, "I"),
    ("delivery_rate", 160, "Q"),  # Linux >= 4.9
    ("busy_time_us", 168, "Q"), ("rwnd_limited_us", 176, "Q"),  # Linux >= 4.10
    ("bytes_sent", 200, "Q"), ("bytes_retrans", 208, "Q"),  # Linux >= 4.19
)
_TCP_INFO_FIELDS = tuple((name, offset, struct.Struct("=" + code)) for name, offset, code in _TCP_INFO_LAYOUT)
_TCPI_LEN_WANTED = 232  # through tcpi_snd_wnd; older kernels return less, missing fields -> None


@dataclass(frozen=True)
class TcpInfo:
    """The fields of ``struct tcp_info`` this project uses (None where the kernel's struct is shorter).

    Attributes:
        state: TCP state number (1 ESTABLISHED ... 10 LISTEN).
        rtt_us: smoothed RTT, microseconds.
        snd_cwnd: congestion window, segments.
        total_retrans: segments retransmitted over the connection's life.
        unacked: segments sent and not yet acknowledged.
        bytes_acked: bytes acknowledged by the peer (RFC 4898 ThruOctetsAcked).
        bytes_received: bytes received in sequence (RFC 4898 ThruOctetsReceived).
        notsent_bytes: bytes written but not yet sent.
        data_segs_out: segments sent that carried data.
        bytes_sent: data bytes sent, retransmissions included (RFC 4898 HCDataOctetsOut).
        bytes_retrans: data bytes retransmitted.
        delivery_rate: the kernel's latest delivery-rate sample, bytes/s (0: no sample yet).
        busy_time_us: time the socket had data queued or in flight, microseconds in whole
            kernel jiffies (see :class:`.base.SocketDelivery`).
        rwnd_limited_us: the part of ``busy_time_us`` in which the peer's receive window held
            sending back, microseconds in whole kernel jiffies.
    """

    state: int
    rtt_us: int | None
    snd_cwnd: int | None
    total_retrans: int | None
    unacked: int | None
    bytes_acked: int | None
    bytes_received: int | None
    notsent_bytes: int | None
    data_segs_out: int | None = None
    bytes_sent: int | None = None
    bytes_retrans: int | None = None
    delivery_rate: int | None = None
    busy_time_us: int | None = None
    rwnd_limited_us: int | None = None


def parse_tcp_info(buf: bytes) -> TcpInfo:
    """Parse the bytes ``getsockopt(SOL_TCP, TCP_INFO)`` returned (native byte order); a field
    past the end of ``buf`` (an older kernel's shorter struct) is None.

    Raises:
        ValueError: ``buf`` is empty.
    """
    if not buf:
        raise ValueError("empty tcp_info")
    return TcpInfo(**{name: fmt.unpack_from(buf, offset)[0] if len(buf) >= offset + fmt.size else None
                      for name, offset, fmt in _TCP_INFO_FIELDS})


def tcp_info(sock: socket.socket) -> TcpInfo:
    """``TCP_INFO`` of a TCP socket this process holds."""
    return parse_tcp_info(sock.getsockopt(SOL_TCP, TCP_INFO, _TCPI_LEN_WANTED))


# ---------------------------------------------------------------------------------------------
# pidfd_getfd


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_uint]


def pidfd_getfd(pidfd: int, targetfd: int) -> int:
    """Duplicate ``targetfd`` of the process behind ``pidfd`` into this process (close-on-exec).

    Raises OSError (EPERM without ptrace rights, EBADF if the fd is gone, ESRCH if the process
    exited, ENOSYS before Linux 5.6).
    """
    fd = _syscall(SYS_PIDFD_GETFD, pidfd, targetfd, 0)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pidfd_getfd: {os.strerror(e)}")
    return fd


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _yama_ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: classic ptrace rules (same uid, dumpable)


def check_pidfd_getfd() -> None:
    """Raise :class:`CollectorUnavailable` with the reason if ``pidfd_getfd`` cannot work here."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        raise CollectorUnavailable("proc collector: pidfd_open is unavailable (needs Linux >= 5.3, Python >= 3.9)")
    try:
        pidfd = os.pidfd_open(os.getpid())
    except OSError as e:
        raise CollectorUnavailable(f"proc collector: pidfd_open failed: {e}") from e
    r, w = os.pipe()
    try:
        os.close(pidfd_getfd(pidfd, r))
    except OSError as e:
        if e.errno == errno.ENOSYS:
            raise CollectorUnavailable("proc collector: kernel lacks pidfd_getfd (needs Linux >= 5.6)") from e
        raise CollectorUnavailable(f"proc collector: pidfd_getfd on this process failed: {e}") from e
    finally:
        for fd in (pidfd, r, w):
            os.close(fd)
    privileged = os.geteuid() == 0 or bool(_effective_caps() & (1 << CAP_SYS_PTRACE))
    if not privileged and _yama_ptrace_scope() >= 2:
        raise CollectorUnavailable(
            "proc collector: pidfd_getfd needs root or CAP_SYS_PTRACE here "
            f"(kernel.yama.ptrace_scope={_yama_ptrace_scope()}, euid={os.geteuid()})"
        )


# ---------------------------------------------------------------------------------------------
# The collector


@dataclass
class _Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmits: int = 0

    def add(self, other: _Counters) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.retransmits += other.retransmits


@dataclass
class _Socket:
    base: _Counters  # kernel counters when first seen (zero for sockets born after the pid was first seen)
    last: _Counters  # last counters seen, less base, never decreasing
    delivered: tuple[int, float]  # (tcpi_bytes_acked in bytes, tcpi_busy_time - tcpi_rwnd_limited in s) at the previous sample


@dataclass
class _Proc:
    pidfd: int
    sockets: dict[int, _Socket] = field(default_factory=dict)  # inode -> socket
    gone: _Counters = field(default_factory=_Counters)  # sockets that went away
    not_tcp: set[int] = field(default_factory=set)  # inodes of non-TCP sockets
    seen: bool = False  # a sample completed before (sockets found later start from zero)


@dataclass(frozen=True)
class SocketSample:
    """One TCP socket of a watched process at the last sample (for the agent's detail views)."""

    pid: int
    inode: int
    info: TcpInfo
    bytes_sent: int  # bytes handed to send calls, since the socket was created
    bytes_received: int  # bytes returned by receive calls, since the socket was created
    send_queue_bytes: int  # written, not yet acknowledged (SIOCOUTQ)


class ProcCollector(NetworkCollector):
    """Per-process TCP counters from ``tcp_info`` on duplicated socket fds (see the module doc)."""

    name = "proc"

    def __init__(self) -> None:
        check_pidfd_getfd()
        self._procs: dict[int, _Proc] = {}
        self.last_sockets: dict[int, list[SocketSample]] = {}

    # -- per socket ------------------------------------------------------------------------------

    @staticmethod
    def _query(dupfd: int) -> tuple[int, TcpInfo, int, int] | None:
        """(inode, tcp_info, outq, inq) of a duplicated fd if it is a TCP socket, else None."""
        st = os.fstat(dupfd)
        try:
            s = socket.socket(fileno=dupfd)
        except OSError:
            return None
        try:
            # The kernel reports IPPROTO_TCP only for AF_INET/AF_INET6 stream sockets (MPTCP is 262).
            if s.proto != socket.IPPROTO_TCP:
                return None
            info = tcp_info(s)
            outq = inq = 0
            if info.state != TCP_LISTEN:
                buf = bytearray(4)
                try:
                    fcntl.ioctl(dupfd, SIOCOUTQ, buf)
                    outq = struct.unpack("=i", buf)[0]
                    fcntl.ioctl(dupfd, SIOCINQ, buf)
                    inq = struct.unpack("=i", buf)[0]
                except OSError:
                    pass
            return st.st_ino, info, outq, inq
        finally:
            s.detach()  # the caller closes dupfd, exactly once

    @staticmethod
    def _app_bytes(info: TcpInfo, outq: int, inq: int) -> tuple[int, int]:
        """(bytes handed to send calls, bytes returned by receive calls) of one socket.

        ``bytes_acked + SIOCOUTQ`` is ``write_seq`` less the initial sequence number, so it also
        counts the SYN on active opens (the SYN-ACK's ack advances ``snd_una`` through the
        counter) and our FIN once sent. Data counters (``bytes_sent - bytes_retrans +
        notsent``) count neither; their difference, 0-2, is taken off. Where the data counters
        are off (a local transmit that failed is counted in ``bytes_sent``) the difference is
        clamped, so the error stays within those 2 sequence numbers.
        ``bytes_received - SIOCINQ`` counts the peer's FIN once it arrived: taken off in the
        states that follow a received FIN, and in CLOSE (where a reset is the other way in).
        """
        sent = (info.bytes_acked or 0) + outq
        if info.bytes_sent is not None and info.bytes_retrans is not None and info.notsent_bytes is not None:
            data = info.bytes_sent - info.bytes_retrans + info.notsent_bytes
            sent -= min(2, max(0, sent - data))
        elif info.state in _FIN_SENT and sent > 0:
            sent -= 1
        received = (info.bytes_received or 0) - inq
        if info.state in _FIN_RECEIVED or info.state == TCP_CLOSE:
            received = max(0, received - 1)
        return sent, received

    # -- per process -----------------------------------------------------------------------------

    def _open(self, pid: int) -> _Proc | None:
        proc = self._procs.get(pid)
        if proc is not None:
            return proc
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except OSError as e:
            raise CollectorUnavailable(f"proc collector: pidfd_open({pid}) failed: {e}") from e
        proc = _Proc(pidfd=pidfd)
        self._procs[pid] = proc
        return proc

    def _forget(self, pid: int) -> None:
        proc = self._procs.pop(pid, None)
        if proc is not None:
            os.close(proc.pidfd)
        self.last_sockets.pop(pid, None)

    @staticmethod
    def _exited(proc: _Proc) -> bool:
        return bool(select.select([proc.pidfd], [], [], 0)[0])

    def _sample_pid(self, pid: int, proc: _Proc) -> ProcessNetStats | None:
        fd_dir = f"/proc/{pid}/fd"
        links: list[tuple[int, int]] = []  # (fd, inode)
        try:
            names = os.listdir(fd_dir)
        except (FileNotFoundError, ProcessLookupError):
            return None
        except PermissionError as e:
            raise CollectorUnavailable(f"proc collector: cannot list {fd_dir}: {e}") from e
        for name in names:
            try:
                target = os.readlink(f"{fd_dir}/{name}")
            except OSError:
                continue  # fd closed meanwhile
            if target.startswith("socket:["):
                links.append((int(name), int(target[8:-1])))

        current: dict[int, _Socket] = {}
        details: list[SocketSample] = []
        rtts: list[tuple[float, SocketDelivery]] = []  # (srtt seconds, what the socket delivered)
        cwnds: list[int] = []
        sendq = 0
        deliveries: list[SocketDelivery] = []  # since the previous sample
        still_not_tcp: set[int] = set()
        for fd, inode in links:
            if inode in proc.not_tcp:
                still_not_tcp.add(inode)
                continue
            if inode in current:
                continue  # same socket under two fds
            try:
                dupfd = pidfd_getfd(proc.pidfd, fd)
            except OSError as e:
                if e.errno in (errno.EBADF, errno.ESRCH):
                    continue  # fd closed or process exited since the listing
                if e.errno == errno.EPERM:
                    raise CollectorUnavailable(
                        f"proc collector: pidfd_getfd on pid {pid} not permitted "
                        "(needs root, CAP_SYS_PTRACE or ptrace rights over the process)"
                    ) from e
                raise
            try:
                got = self._query(dupfd)
            finally:
                os.close(dupfd)  # never keep a duplicate: it would hold the connection open
            if got is None:
                still_not_tcp.add(inode)
                continue
            real_inode, info, outq, inq = got
            sent, received = self._app_bytes(info, outq, inq)
            retrans = info.total_retrans or 0
            delivered = (info.bytes_acked or 0, ((info.busy_time_us or 0) - (info.rwnd_limited_us or 0)) / 1e6)
            old = proc.sockets.get(real_inode)
            if old is None:
                if proc.seen:  # born since the last sample: counts from its start
                    old = _Socket(base=_Counters(), last=_Counters(), delivered=(0, 0.0))
                else:
                    old = _Socket(base=_Counters(sent, received, retrans), last=_Counters(), delivered=delivered)
            old.last = _Counters(
                max(old.last.bytes_sent, sent - old.base.bytes_sent),
                max(old.last.bytes_received, received - old.base.bytes_received),
                max(old.last.retransmits, retrans - old.base.retransmits),
            )
            current[real_inode] = old
            details.append(SocketSample(pid, real_inode, info, sent, received, outq))
            if info.state != TCP_LISTEN:
                delivery = delivery_since(old.delivered, *delivered, info.delivery_rate or 0)
                if info.rtt_us is not None:
                    rtts.append((info.rtt_us / 1e6, delivery))
                if info.snd_cwnd is not None:
                    cwnds.append(info.snd_cwnd)
                sendq += outq
                deliveries.append(delivery)
            old.delivered = delivered

        for inode, sock in proc.sockets.items():
            if inode not in current:
                proc.gone.add(sock.last)
        proc.sockets = current
        proc.not_tcp = still_not_tcp
        proc.seen = True
        self.last_sockets[pid] = details

        total = _Counters()
        total.add(proc.gone)
        for sock in current.values():
            total.add(sock.last)
        return ProcessNetStats(
            pid=pid,
            bytes_sent=total.bytes_sent,
            bytes_received=total.bytes_received,
            retransmits=total.retransmits,
            srtt_s=traffic_rtt(rtts),
            cwnd=sum(cwnds) / len(cwnds) if cwnds else None,
            send_queue_bytes=sendq,
            sockets=len(rtts),
            delivery_rate_bytes_per_s=delivery_rate(deliveries),
        )

    def sample(self, pids: set[int]) -> dict[int, ProcessNetStats]:
        """Cumulative counters for each live pid in ``pids``.

        ``sockets``, ``srtt_s``, ``cwnd`` and ``send_queue_bytes`` cover connection sockets
        (listening sockets are left out); ``delivery_rate_bytes_per_s`` those that were busy
        since the previous call (a socket first seen now counts from zero if the pid was seen
        before, else from now, as the byte counters do). Raises :class:`CollectorUnavailable`
        when a pid's sockets cannot be duplicated (no ptrace rights over it).
        """
        out: dict[int, ProcessNetStats] = {}
        for pid in list(self._procs):
            if pid not in pids:
                self._forget(pid)
        for pid in pids:
            proc = self._open(pid)
            if proc is None:
                continue
            if self._exited(proc):
                self._forget(pid)
                continue
            stats = self._sample_pid(pid, proc)
            if stats is None or self._exited(proc):  # gone, or pid reused during the listing
                self._forget(pid)
                continue
            out[pid] = stats
        return out

    def close(self) -> None:
        for pid in list(self._procs):
            self._forget(pid)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:  # interpreter shutdown: the fds go with the process anyway
            pass


# ---------------------------------------------------------------------------------------------
# Host metrics


@dataclass(frozen=True)
class HostMetrics:
    """Host-wide utilisation.

    Attributes:
        cpu_util: busy fraction of all CPUs since the previous sample (since boot on the
            first), 0-1.
        mem_used_bytes: total - available memory, bytes.
        mem_total_bytes: physical memory, bytes.
        cpus: logical CPUs.
    """

    cpu_util: float
    mem_used_bytes: int
    mem_total_bytes: int
    cpus: int


class HostMonitor:
    """Host CPU and memory through psutil; CPU utilisation is over the interval between samples."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._prev = psutil.cpu_times()

    @staticmethod
    def _busy_total(t) -> tuple[float, float]:
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = sum(t)
        # guest time is already counted in user/nice on Linux
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        return total - idle, total

    def sample(self) -> HostMetrics:
        ps = self._psutil
        now = ps.cpu_times()
        busy1, total1 = self._busy_total(now)
        busy0, total0 = self._busy_total(self._prev)
        if total1 - total0 <= 0:  # no tick since the previous sample: since boot instead
            busy0 = total0 = 0.0
        self._prev = now
        util = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
        vm = ps.virtual_memory()
        return HostMetrics(
            cpu_util=min(1.0, max(0.0, util)),
            mem_used_bytes=int(vm.total - vm.available),
            mem_total_bytes=int(vm.total),
            cpus=ps.cpu_count() or 1,
        )
