"""eBPF network collector: per-socket TCP counters from CO-RE tracepoint programs, loaded via ctypes.

The programs (``ebpf/sockstat.bpf.c``, compiled at install time into ``sockstat.bpf.o`` next to
this file) hook BTF-typed tracepoints only (``tp_btf``: ``sock_send_length``, ``sock_recv_length``,
``tcp_retransmit_skb``, ``tcp_probe``, ``inet_sock_set_state``), so
they need neither kprobes, tracefs, kernel headers nor a compiler at run time. The object is
loaded through the system's ``libbpf.so.1`` (Debian ``libbpf1``) with ctypes: no PyPI dependency.

What the kernel keeps:

* ``socks``: one entry per TCP socket that a process sent or received on, keyed by the kernel's
  ``struct sock`` address: owning tgid (the first process to use it), 4-tuple, bytes sent and
  received (sums of the send/recv call return values), srtt, cwnd, total retransmitted
  segments, send-queue bytes, bytes acknowledged, busy time and the latest delivery-rate
  sample (read from ``tcp_sock`` as ``tcp_info`` does; tracepoints do not carry them). The
  fields are refreshed on each send, receive, retransmit and arriving segment (``tcp_probe``).
  The entry is deleted when the socket reaches TCP_CLOSE.
* ``closed``: per tgid, the final counters of its sockets that closed, so cumulative totals
  (``closed`` + open sockets) never lose a closed connection's bytes.

Bytes moved by ``sendfile``/``splice`` bypass ``sock_sendmsg`` and are not counted.
Loading needs root or CAP_BPF+CAP_PERFMON, a kernel with BTF (``/sys/kernel/btf/vmlinux``) and
the ``sock_send_length`` tracepoints (newer kernels only).
"""

from __future__ import annotations

import collections
import ctypes as C
import ctypes.util
import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from .base import CollectorUnavailable, NetworkCollector, ProcessNetStats, delivery_rate, delivery_since, traffic_rtt

OBJECT_PATH = Path(__file__).resolve().parent / "sockstat.bpf.o"
VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

# Tracepoint -> program; the first three are required, the others only add detail.
_REQUIRED_TP = {"sock_send_length": "on_send", "sock_recv_length": "on_recv", "inet_sock_set_state": "on_state"}
_OPTIONAL_TP = {"tcp_retransmit_skb": "on_retrans", "tcp_probe": "on_probe"}

_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39
_INITIAL_PID_NAMESPACE_INODE = 0xEFFFFFFC  # the kernel's PROC_PID_INIT_INO
_BTF_KIND_TYPEDEF = 8
_LIBBPF_DEBUG = 2


class SockStat(C.Structure):
    """Mirror of ``struct sock_stat`` in sockstat.bpf.c (checked against the map's value size)."""

    _fields_ = [
        ("bytes_sent", C.c_uint64),  # bytes
        ("bytes_recv", C.c_uint64),  # bytes
        ("bytes_acked", C.c_uint64),  # bytes
        ("busy_us", C.c_uint64),  # microseconds
        ("delivery_rate", C.c_uint64),  # bytes/s
        ("tgid", C.c_uint32),
        ("srtt_us", C.c_uint32),  # microseconds
        ("snd_cwnd", C.c_uint32),  # segments
        ("total_retrans", C.c_uint32),  # segments
        ("sndq", C.c_uint32),  # bytes
        ("family", C.c_uint16),
        ("sport", C.c_uint16),
        ("dport", C.c_uint16),
        ("_pad", C.c_uint16),
        ("saddr", C.c_uint8 * 16),
        ("daddr", C.c_uint8 * 16),
        ("comm", C.c_char * 16),
    ]


class ClosedStat(C.Structure):
    """Mirror of ``struct closed_stat``: final counters of a tgid's closed sockets."""

    _fields_ = [("bytes_sent", C.c_uint64), ("bytes_recv", C.c_uint64), ("retrans", C.c_uint64), ("sockets", C.c_uint64)]


class SockstatCfg(C.Structure):
    """Mirror of ``struct sockstat_cfg``, the object's only .rodata variable."""

    _fields_ = [("target_tgid", C.c_uint32)]


@dataclass(frozen=True)
class SocketEntry:
    """One open TCP socket as the kernel map holds it (``key`` is the kernel's socket address).

    Addresses are ``(host, port)``; bytes in bytes, ``srtt_s`` in seconds, ``cwnd`` in segments,
    ``retransmits`` in segments, ``send_queue_bytes`` and ``bytes_acked`` in bytes, ``busy_s``
    the time the socket had data queued or in flight and the peer's receive window did not hold
    it back, in seconds (whole kernel jiffies; 0 where
    the kernel config is unreadable, and then the rate falls back to the kernel's sample),
    ``delivery_rate_bytes_per_s`` the kernel's latest delivery-rate sample in bytes/s (0
    before the first; kept while idle).
    """

    key: int
    pid: int
    comm: str
    local: tuple[str, int]
    remote: tuple[str, int]
    bytes_sent: int
    bytes_received: int
    srtt_s: float
    cwnd: int
    retransmits: int
    send_queue_bytes: int
    bytes_acked: int
    busy_s: float
    delivery_rate_bytes_per_s: int


# ---------------------------------------------------------------------------------------------
# libbpf through ctypes

_PRINT_FN = C.CFUNCTYPE(C.c_int, C.c_int, C.c_char_p, C.c_void_p)
_libbpf: C.CDLL | None = None
_libbpf_messages: collections.deque[str] = collections.deque(maxlen=64)
_print_cb = None  # keeps the ctypes callback alive


def _load_libbpf() -> C.CDLL:
    """The system libbpf with the prototypes used here; its messages go to a ring, not stderr."""
    global _libbpf, _print_cb
    if _libbpf is not None:
        return _libbpf
    name = ctypes.util.find_library("bpf")
    if name is None:
        raise CollectorUnavailable("libbpf not found: install the libbpf1 package (scripts/install-system-packages.sh)")
    try:
        lib = C.CDLL(name, use_errno=True)
    except OSError as e:
        raise CollectorUnavailable(f"cannot load {name}: {e}; install the libbpf1 package") from e
    vp, i, cp = C.c_void_p, C.c_int, C.c_char_p
    protos = [
        ("libbpf_set_print", vp, [_PRINT_FN]),
        ("bpf_object__open_file", vp, [cp, vp]),
        ("bpf_object__load", i, [vp]),
        ("bpf_object__close", None, [vp]),
        ("bpf_object__next_program", vp, [vp, vp]),
        ("bpf_object__next_map", vp, [vp, vp]),
        ("bpf_object__find_map_by_name", vp, [vp, cp]),
        ("bpf_program__name", cp, [vp]),
        ("bpf_program__set_autoload", i, [vp, C.c_bool]),
        ("bpf_program__attach", vp, [vp]),
        ("bpf_link__destroy", i, [vp]),
        ("bpf_map__name", cp, [vp]),
        ("bpf_map__fd", i, [vp]),
        ("bpf_map__value_size", C.c_uint32, [vp]),
        ("bpf_map__max_entries", C.c_uint32, [vp]),
        ("bpf_map__set_initial_value", i, [vp, vp, C.c_size_t]),
        ("bpf_map_get_next_key", i, [i, vp, vp]),
        ("bpf_map_lookup_elem", i, [i, vp, vp]),
        ("bpf_map_delete_elem", i, [i, vp]),
        ("btf__load_vmlinux_btf", vp, []),
        ("btf__find_by_name_kind", C.c_int32, [vp, cp, C.c_uint32]),
        ("btf__free", None, [vp]),
    ]
    try:
        for fname, restype, argtypes in protos:
            f = getattr(lib, fname)
            f.restype, f.argtypes = restype, argtypes
    except AttributeError as e:
        raise CollectorUnavailable(f"{name} is too old ({e}); need libbpf >= 1.0 (Debian 12 libbpf1)") from e

    libc = C.CDLL(None)
    vsnprintf = libc.vsnprintf
    vsnprintf.restype, vsnprintf.argtypes = C.c_int, [C.c_char_p, C.c_size_t, C.c_char_p, C.c_void_p]

    def _on_print(level: int, fmt: bytes, args: int) -> int:
        if level < _LIBBPF_DEBUG:
            buf = C.create_string_buffer(512)
            vsnprintf(buf, len(buf), fmt, args)
            _libbpf_messages.append(buf.value.decode(errors="replace").strip())
        return 0

    _print_cb = _PRINT_FN(_on_print)
    lib.libbpf_set_print(_print_cb)
    _libbpf = lib
    return lib


def _last_libbpf_error() -> str:
    """The most telling recent libbpf message (for one-line reasons)."""
    for msg in reversed(_libbpf_messages):
        if "failed" in msg or "error" in msg.lower():
            return msg
    return _libbpf_messages[-1] if _libbpf_messages else ""


def _may_load_bpf() -> bool:
    """Whether this process has CAP_SYS_ADMIN or CAP_BPF+CAP_PERFMON in its effective set."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
                has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
                return has(_CAP_SYS_ADMIN) or (has(_CAP_BPF) and has(_CAP_PERFMON))
    except OSError:
        pass
    return os.geteuid() == 0


def _in_initial_pid_namespace() -> bool:
    """This process sees the pids the programs record (the initial namespace's); True when it cannot tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INITIAL_PID_NAMESPACE_INODE
    except OSError:
        return True


def check_available(object_path: Path = OBJECT_PATH) -> tuple[C.CDLL, set[str]]:
    """Cheap checks, in order (BTF, pid namespace, object built, libbpf, permission, tracepoints);
    raises ``CollectorUnavailable`` with a one-line reason naming the fix.

    Returns the loaded libbpf and the optional tracepoints this kernel lacks."""
    if not VMLINUX_BTF.exists():
        raise CollectorUnavailable(
            f"kernel has no BTF ({VMLINUX_BTF} missing): needs CONFIG_DEBUG_INFO_BTF=y; use --monitor proc"
        )
    if not _in_initial_pid_namespace():
        # The programs record the initial namespace's pids, the mailboxes this namespace's: a
        # worker's traffic would go to no pid or to a host process that has its number.
        raise CollectorUnavailable(
            "this agent runs in a pid namespace of its own (a container): the programs see the host's pids, not "
            "its workers'; use --monitor proc, or run the agent in the host's pid namespace with the workers"
        )
    if not object_path.exists():
        raise CollectorUnavailable(
            f"eBPF object {object_path.name} was not built: install clang, bpftool and libbpf-dev "
            "(scripts/install-system-packages.sh), then reinstall the package"
        )
    lib = _load_libbpf()
    if not _may_load_bpf():
        raise CollectorUnavailable(
            "not permitted to load BPF programs: run the agent as root or with CAP_BPF+CAP_PERFMON"
        )
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        raise CollectorUnavailable(f"cannot read kernel BTF ({os.strerror(C.get_errno())}); use --monitor proc")
    try:
        missing = [tp for tp in _REQUIRED_TP if lib.btf__find_by_name_kind(btf, f"btf_trace_{tp}".encode(),
                                                                          _BTF_KIND_TYPEDEF) < 0]
        absent_optional = {tp for tp in _OPTIONAL_TP if lib.btf__find_by_name_kind(btf, f"btf_trace_{tp}".encode(),
                                                                                  _BTF_KIND_TYPEDEF) < 0}
    finally:
        lib.btf__free(btf)
    if missing:
        raise CollectorUnavailable(
            f"kernel lacks the tracepoint(s) {', '.join(missing)} (newer kernels only); use --monitor proc"
        )
    return lib, absent_optional


def _refuse_full(entries: int, capacity: int, what: str) -> None:
    """Raise CollectorUnavailable when a map of ``what`` holds ``capacity`` entries: the programs'
    inserts fail from then on, silently."""
    if entries >= capacity:
        raise CollectorUnavailable(
            f"its map of {what} is full ({entries}, of all the processes on this host): what they move meanwhile "
            "is not counted, and their processes' bytes and rates would read low")


class EbpfCollector(NetworkCollector):
    """Per-process TCP counters from the ``sockstat`` eBPF programs (see the module docstring).

    The constructor loads and attaches the programs; it raises ``CollectorUnavailable`` (with the
    reason) when that is impossible here. ``sample`` reads the maps (about 6 us per socket).

    Args:
        target_tgid: record only this process's sockets (0: all processes; ``sample`` filters).
        object_path: the compiled ``sockstat.bpf.o``.
    """

    name = "ebpf"

    def __init__(self, target_tgid: int = 0, object_path: Path = OBJECT_PATH):
        self._obj = None
        self._links: list[int] = []
        self._last: dict[int, tuple[int, int, int]] = {}  # pid -> last reported (sent, recv, retrans)
        self._delivered: dict[int, tuple[int, float]] = {}  # socket key -> (bytes_acked, busy_s) at the previous sample
        lib, absent_optional = check_available(Path(object_path))
        self._lib = lib
        _libbpf_messages.clear()
        obj = lib.bpf_object__open_file(str(object_path).encode(), None)
        if not obj:
            err = C.get_errno()
            raise CollectorUnavailable(f"cannot open {object_path}: {os.strerror(err)} {_last_libbpf_error()}".strip())
        self._obj = obj
        try:
            self._configure(target_tgid, absent_optional)
            err = lib.bpf_object__load(obj)
            if err:
                err = -err
                if err in (errno.EPERM, errno.EACCES):
                    raise CollectorUnavailable(
                        f"loading BPF was refused ({os.strerror(err)}): run the agent as root or with "
                        "CAP_BPF+CAP_PERFMON (kernel.unprivileged_bpf_disabled forbids others)"
                    )
                raise CollectorUnavailable(
                    f"loading {object_path.name} failed: {os.strerror(err)}: {_last_libbpf_error()}; "
                    "rebuild it for this kernel (reinstall the package)"
                )
            for prog in self._programs(autoload_only=True):
                link = lib.bpf_program__attach(prog)
                if not link:
                    name = lib.bpf_program__name(prog).decode()
                    raise CollectorUnavailable(
                        f"attaching {name} failed: {os.strerror(C.get_errno())}: {_last_libbpf_error()}"
                    )
                self._links.append(link)
            self._socks_fd, self._socks_capacity = self._map("socks", C.sizeof(SockStat))
            self._closed_fd, self._closed_capacity = self._map("closed", C.sizeof(ClosedStat))
        except BaseException:
            self.close()
            raise

    # -- set-up helpers ------------------------------------------------------------------------

    def _programs(self, autoload_only: bool = False):
        lib, prog = self._lib, None
        enabled = self._enabled if autoload_only else None
        while prog := lib.bpf_object__next_program(self._obj, prog):
            if enabled is None or lib.bpf_program__name(prog).decode() in enabled:
                yield prog

    def _configure(self, target_tgid: int, absent_optional: set[str]) -> None:
        """Write .rodata (target tgid) and switch off the programs of tracepoints this kernel lacks."""
        lib = self._lib
        skip = {_OPTIONAL_TP[tp] for tp in absent_optional}
        self._enabled = set()
        for prog in self._programs():
            name = lib.bpf_program__name(prog).decode()
            if name in skip:
                lib.bpf_program__set_autoload(prog, False)
            else:
                self._enabled.add(name)
        cfg = SockstatCfg(target_tgid=target_tgid)
        m = None
        while m := lib.bpf_object__next_map(self._obj, m):
            if lib.bpf_map__name(m).decode().endswith(".rodata"):
                if lib.bpf_map__set_initial_value(m, C.byref(cfg), C.sizeof(cfg)) != 0:
                    raise CollectorUnavailable(
                        f"{OBJECT_PATH.name} does not match this loader (.rodata layout); reinstall the package"
                    )
                return
        if target_tgid:
            raise CollectorUnavailable(f"{OBJECT_PATH.name} has no .rodata config; reinstall the package")

    def _map(self, name: str, value_size: int) -> tuple[int, int]:
        """The fd and the capacity (entries) of map ``name``."""
        m = self._lib.bpf_object__find_map_by_name(self._obj, name.encode())
        if not m or self._lib.bpf_map__value_size(m) != value_size:
            raise CollectorUnavailable(
                f"map {name!r} in {OBJECT_PATH.name} does not match this loader; reinstall the package"
            )
        return self._lib.bpf_map__fd(m), self._lib.bpf_map__max_entries(m)

    # -- map access ----------------------------------------------------------------------------

    def _dump(self, fd: int, ktype, vtype) -> dict:
        """All entries of a hash map as {key: value copy}; entries deleted meanwhile are skipped."""
        lib, out = self._lib, {}
        key, next_key, value, prev = ktype(), ktype(), vtype(), None
        while lib.bpf_map_get_next_key(fd, prev, C.byref(next_key)) == 0:
            key.value = next_key.value
            prev = C.byref(key)
            if lib.bpf_map_lookup_elem(fd, C.byref(key), C.byref(value)) == 0:
                out[key.value] = vtype.from_buffer_copy(value)
        return out

    def socket_entries(self) -> dict[int, SocketEntry]:
        """Every open TCP socket in the map, keyed by kernel socket address."""
        entries = {}
        for key, s in self._dump(self._socks_fd, C.c_uint64, SockStat).items():
            fam = socket.AF_INET6 if s.family == socket.AF_INET6 else socket.AF_INET
            n = 16 if fam == socket.AF_INET6 else 4
            local = (socket.inet_ntop(fam, bytes(s.saddr)[:n]), s.sport)
            remote = (socket.inet_ntop(fam, bytes(s.daddr)[:n]), s.dport)
            entries[key] = SocketEntry(
                key=key, pid=s.tgid, comm=s.comm.decode(errors="replace"), local=local, remote=remote,
                bytes_sent=s.bytes_sent, bytes_received=s.bytes_recv, srtt_s=s.srtt_us / 1e6, cwnd=s.snd_cwnd,
                retransmits=s.total_retrans, send_queue_bytes=s.sndq,
                bytes_acked=s.bytes_acked, busy_s=s.busy_us / 1e6, delivery_rate_bytes_per_s=s.delivery_rate,
            )
        return entries

    def sample(self, pids: set[int]) -> dict[int, ProcessNetStats]:
        """Cumulative counters per alive pid in ``pids``: closed sockets' totals plus open sockets.

        Units: bytes, segments (retransmits, cwnd), seconds (srtt), bytes/s (delivery rate). Byte
        and retransmit counts never go backwards between calls, even when a socket closes while
        the maps are read. ``delivery_rate_bytes_per_s`` covers what the sockets delivered since
        the previous call (of any pid; a socket new to the map counts from its start).

        Raises:
            CollectorUnavailable: a map is full (16384 open sockets or processes with closed
                ones, of every process on the host): the counts would silently miss some.
        """
        closed = self._dump(self._closed_fd, C.c_uint32, ClosedStat)  # before socks: a race under-counts
        socks = self.socket_entries()
        _refuse_full(len(socks), self._socks_capacity, "open TCP sockets")
        _refuse_full(len(closed), self._closed_capacity, "processes with closed TCP sockets")
        self._prune(closed)
        delivered_now = {  # socket key -> what it delivered since the previous call
            key: delivery_since(self._delivered.get(key, (0, 0.0)), s.bytes_acked, s.busy_s, s.delivery_rate_bytes_per_s)
            for key, s in socks.items()
        }
        self._delivered = {key: (s.bytes_acked, s.busy_s) for key, s in socks.items()}
        out: dict[int, ProcessNetStats] = {}
        for pid in pids:
            if not os.path.exists(f"/proc/{pid}"):
                self._last.pop(pid, None)
                continue
            c = closed.get(pid)
            sent, recv, retrans = (c.bytes_sent, c.bytes_recv, c.retrans) if c else (0, 0, 0)
            mine = [s for s in socks.values() if s.pid == pid]
            sent += sum(s.bytes_sent for s in mine)
            recv += sum(s.bytes_received for s in mine)
            retrans += sum(s.retransmits for s in mine)
            prev = self._last.get(pid, (0, 0, 0))
            sent, recv, retrans = max(sent, prev[0]), max(recv, prev[1]), max(retrans, prev[2])
            self._last[pid] = (sent, recv, retrans)
            out[pid] = ProcessNetStats(
                pid=pid, bytes_sent=sent, bytes_received=recv, retransmits=retrans,
                srtt_s=traffic_rtt((s.srtt_s, delivered_now[s.key]) for s in mine),
                cwnd=sum(s.cwnd for s in mine) / len(mine) if mine else None,
                send_queue_bytes=sum(s.send_queue_bytes for s in mine), sockets=len(mine),
                delivery_rate_bytes_per_s=delivery_rate(delivered_now[s.key] for s in mine),
            )
        return out

    def _prune(self, closed: dict[int, ClosedStat]) -> None:
        """Forget closed-socket totals of processes that have exited (their pid may be reused)."""
        for pid in closed:
            if not os.path.exists(f"/proc/{pid}"):
                self._lib.bpf_map_delete_elem(self._closed_fd, C.byref(C.c_uint32(pid)))
                self._last.pop(pid, None)

    def close(self) -> None:
        """Detach the programs and free the object and its maps (idempotent)."""
        for link in self._links:
            self._lib.bpf_link__destroy(link)
        self._links = []
        if self._obj:
            self._lib.bpf_object__close(self._obj)
            self._obj = None

    def __enter__(self) -> EbpfCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
