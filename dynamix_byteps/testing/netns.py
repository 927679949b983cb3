"""Emulated hosts on one Linux machine: network namespaces, a bridge, and rate-limited links.

A :class:`Testbed` of ``n`` hosts makes host 0 the root network namespace (where the caller
runs: the parameter-server host, with the scheduler and rank 0) and hosts 1..n-1 one network
namespace each. Every namespaced host is joined to a bridge in the root namespace by a veth
pair; the bridge holds host 0's address, so all hosts share one /24 subnet, chosen at random
in 10.200.0.0/13 among subnets this machine does not use::

      host 0 (root ns)                      host 1 (netns)        host 2 (netns)
      bridge dxtb<tag>b 10.a.b.1  ──veth──  10.a.b.2      ──veth──  10.a.b.3  ...

A host given a rate has a tbf qdisc of that rate on both ends of its veth, so what it sends and
what it receives are each limited to the rate (netem is not available on every kernel, so tc
adds no delay or loss here; queueing behind tbf does raise the RTT). :meth:`Testbed.set_loss`
drops a random share of what a host receives (an nft rule in its namespace), and
:mod:`.delay_proxy` adds latency to one TCP service. ``Testbed(..., cpus={host: cores})`` gives
hosts their own CPU share (:mod:`.cpu_quota`), so that one host's idle time is not the others' gain
as it would be on one machine. Processes run
on a host with :meth:`Testbed.popen`; on a namespaced host they get a private ``/dev/shm`` (a
new tmpfs per call), so node agents see only their own host's workers, as on separate machines.

Requirements (:func:`available` says which one is missing): Linux, root, iproute2's ``ip`` and
``tc``, ``mount``, and kernel support for network namespaces, veth, bridges and tbf;
:meth:`Testbed.set_loss` also needs ``nft`` (Debian package ``nftables``).

Clean-up: every object is named with the prefix ``dxtb`` and a tag unique to the instance,
and records its owner's pid (in the namespace name, in the link alias). :meth:`Testbed.close`
(called on ``with``-block exit, also on an exception, and on SIGTERM/SIGHUP while the bed is
open in the main thread) stops the processes it started and deletes everything;
:func:`cleanup_stale`, run at every start, deletes what a SIGKILLed owner left behind.

Example (as root)::

    from dynamix_byteps.testing.netns import Testbed, run_job
    with Testbed(2, rates_mbit={1: 20}) as bed:
        result = run_job(bed, [3, 1], ["python", "train.py"], ["--policy", "proportional"])
        assert result.ok, result.outputs
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Self

from dynamix_byteps.errors import DynamixError
from dynamix_byteps.launcher.topology import free_port as _free_port
from dynamix_byteps.testing import cpu_quota

__all__ = ["PREFIX", "Host", "JobResult", "Testbed", "TestbedError", "available", "cleanup_stale", "nft",
           "owned_objects", "run_job", "stop"]

PREFIX = "dxtb"  # every namespace and link of a test bed starts with this
SUBNETS = ipaddress.ip_network("10.200.0.0/13")  # the /24s a test bed picks from
TBF_LATENCY_MS = 50  # longest a packet may wait in a tbf queue before it is dropped
COMMAND_TIMEOUT_S = 20.0  # per ip/tc call
MAX_HOSTS = 250  # one /24 (host i gets .i+1)
LOSS_TABLE = f"{PREFIX}loss"  # the nft table of set_loss, in the host's namespace
LOSS_SCALE = 10_000  # numgen range: loss probabilities are rounded to 1/LOSS_SCALE
_ALIAS = "dynamix-testbed pid="
_NETNS_NAME = re.compile(rf"^{PREFIX}_([0-9a-f]+)_(\d+)_h\d+$")
# Runs in a namespaced host: a private /dev/shm (this mount namespace is ip netns exec's own), then the command.
_PRIVATE_SHM = 'mount -t tmpfs -o mode=1777 dxtb-shm /dev/shm && exec "$@"'


class TestbedError(DynamixError, RuntimeError):
    """Setting up the test bed failed; the message names the command and its error output."""

    __test__ = False  # not a pytest test class


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TestbedError(f"`{' '.join(argv)}` failed: {error}") from None
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def nft(namespace: str, script: str) -> None:
    """Run the nft ``script`` (``nft -f`` syntax) in network namespace ``namespace``.

    Raises:
        TestbedError: ``nft`` is not installed, or rejects the script (the message has its error).
    """
    if shutil.which("nft") is None:
        raise TestbedError("nft not found on PATH: install nftables (apt-get install nftables)")
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as file:
        file.write(script)
        file.flush()
        _run("ip", "netns", "exec", namespace, "nft", "-f", file.name)


def _json(*argv: str) -> list:
    out = _run(*argv).stdout.strip()
    return json.loads(out) if out else []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError also means it exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@cache
def available() -> str | None:
    """None when test beds can be built here, else the reason they cannot (for ``pytest.skip``).

    Checks root, the tools, and the kernel (a throwaway namespace with a veth pair, a bridge and
    a tbf qdisc, deleted again). The answer is cached for the process.
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root: creates network namespaces, veth pairs, a bridge and tc qdiscs"
    missing = [tool for tool in ("ip", "tc", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH (install iproute2 / util-linux)"
    probe = f"{PREFIX}_0_{os.getpid()}_h0"  # named like a bed, so cleanup_stale finds it if we die here
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _run("ip", "-n", probe, "link", "add", "pb", "type", "bridge")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "20mbit", "burst", "32kbit",
             "latency", f"{TBF_LATENCY_MS}ms")
    except TestbedError as error:
        return f"this kernel or iproute2 cannot build a test bed: {error}"
    finally:
        _run("ip", "netns", "delete", probe, check=False)
    return None


def owned_objects() -> list[tuple[str, str, int]]:
    """``(kind, name, owner pid)`` of every test-bed object on this machine: kind ``"netns"`` for
    a namespace, ``"link"`` for a root-namespace bridge or veth end."""
    found = []
    for entry in _json("ip", "-j", "netns", "list"):
        match = _NETNS_NAME.match(entry.get("name", ""))
        if match:
            found.append(("netns", entry["name"], int(match.group(2))))
    for link in _json("ip", "-j", "-d", "link", "show"):
        alias = link.get("ifalias", "")
        if link["ifname"].startswith(PREFIX) and alias.startswith(_ALIAS) and alias[len(_ALIAS):].isdigit():
            found.append(("link", link["ifname"], int(alias[len(_ALIAS):])))
    return found


def cleanup_stale() -> list[str]:
    """Delete the namespaces, root-namespace links and CPU-quota cgroups of test beds whose owner
    process is gone.

    Objects of a live owner (another test running in parallel) are left alone. Returns the
    names deleted.
    """
    deleted = []
    for kind, name, pid in owned_objects():
        if not _pid_alive(pid):
            _run(*(("ip", "netns", "delete") if kind == "netns" else ("ip", "link", "delete")), name, check=False)
            deleted.append(name)
    return deleted + cpu_quota.cleanup_stale(_owner_gone)


def _owner_gone(name: str) -> bool:
    """Whether ``name`` is a test-bed object's (``dxtb_<tag>_<pid>_h<host>``) whose owner has exited."""
    match = _NETNS_NAME.match(name)
    return match is not None and not _pid_alive(int(match.group(2)))


def _free_subnet() -> ipaddress.IPv4Network:
    """A random /24 of :data:`SUBNETS` that overlaps no route or address of the root namespace."""
    used = []
    for route in _json("ip", "-j", "-4", "route", "show", "table", "all"):
        try:
            used.append(ipaddress.ip_network(route.get("dst", ""), strict=False))
        except ValueError:  # "default", or a form this check does not need
            continue
    used += [ipaddress.ip_network(f"{a['local']}/32") for link in _json("ip", "-j", "-4", "addr", "show")
             for a in link.get("addr_info", [])]
    candidates = list(SUBNETS.subnets(new_prefix=24))
    for _ in range(100):
        subnet = secrets.choice(candidates)
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise TestbedError(f"no free /24 in {SUBNETS} after 100 tries: this machine routes most of it")


@dataclass(frozen=True)
class Host:
    """One emulated host of a :class:`Testbed`.

    Attributes:
        index: 0 for the root namespace, 1.. for the namespaced hosts.
        address: its IPv4 address on the test bed (dotted quad).
        namespace: its network namespace name (``ip netns``), None for host 0.
        device: the interface that holds ``address`` in its namespace (host 0: the bridge).
        rate_mbit: the tbf rate of its link in each direction, Mbit/s (10**6 bit/s); None = unshaped.
    """

    index: int
    address: str
    namespace: str | None
    device: str
    rate_mbit: float | None = None


class Testbed:
    """``hosts`` emulated hosts (see the module docstring); a context manager that builds them.

    Args:
        hosts: number of hosts, 2..250 (host 0 is the root namespace).
        rates_mbit: ``{host index: Mbit/s}`` for the hosts behind a rate-limited link
            (index >= 1; host 0 is the caller's own namespace and is never shaped).
        cpus: ``{host index: cores}`` for the hosts whose processes together may use only that
            many CPUs (any index, host 0 too; :mod:`.cpu_quota`), so that a host's idle time is
            not the others' gain, as on separate machines; a host without one is not limited.

    Raises:
        ValueError: a bad host count, rate or CPU count.
        TestbedError: on entry, when :func:`available` gives a reason or a setup command fails
            (everything built so far is deleted first).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int, rates_mbit: Mapping[int, float] | None = None,
                 cpus: Mapping[int, float] | None = None):
        if not 2 <= hosts <= MAX_HOSTS:
            raise ValueError(f"a test bed has 2..{MAX_HOSTS} hosts, not {hosts}")
        rates = dict(rates_mbit or {})
        for index, rate in rates.items():
            if not 1 <= index < hosts:
                raise ValueError(f"rates_mbit: host {index} is not a namespaced host (1..{hosts - 1}); host 0 is the "
                                 "root namespace and cannot be shaped, put the slow workers on another host")
            if not 0 < rate < float("inf"):
                raise ValueError(f"rates_mbit: host {index} needs a rate > 0 Mbit/s, not {rate}")
        for index, cores in (cpus or {}).items():
            if not 0 <= index < hosts or not 0 < cores < float("inf"):
                raise ValueError(f"cpus: host {index} needs an index in 0..{hosts - 1} and cores > 0, not {cores}")
        self.tag = secrets.token_hex(3)
        self._owner = os.getpid()
        self._rates = rates
        self._cpus = dict(cpus or {})
        self._quotas: dict[int, cpu_quota.CpuQuota] = {}
        self._count = hosts
        self.hosts: tuple[Host, ...] = ()
        self.bridge = f"{PREFIX}{self.tag}b"
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._old_handlers: dict[int, object] = {}

    # ---- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        reason = available()
        if reason is not None:
            raise TestbedError(f"cannot build a network test bed: {reason}")
        reason = cpu_quota.available() if self._cpus else None
        if reason is not None:
            raise TestbedError(f"cannot give the test bed's hosts CPU quotas: {reason}")
        self._catch_signals()
        try:
            cleanup_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _names(self, index: int) -> tuple[str, str, str]:
        """(namespace, root-side veth end, namespace-side veth end) of host ``index`` >= 1."""
        return (f"{PREFIX}_{self.tag}_{self._owner}_h{index}", f"{PREFIX}{self.tag}r{index}",
                f"{PREFIX}{self.tag}n{index}")

    def _build(self) -> None:
        subnet = _free_subnet()
        addresses = [str(a) for a in list(subnet.hosts())[: self._count]]
        alias = f"{_ALIAS}{self._owner}"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "alias", alias)
        _run("ip", "addr", "add", f"{addresses[0]}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts = [Host(0, addresses[0], None, self.bridge)]
        for index in range(1, self._count):
            namespace, outer, inner = self._names(index)
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", namespace)
            _run("ip", "link", "set", outer, "alias", alias)
            _run("ip", "link", "set", outer, "master", self.bridge, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{addresses[index]}/24", "dev", inner)
            _run("ip", "-n", namespace, "link", "set", inner, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            rate = self._rates.get(index)
            if rate is not None:
                for netns_args, device in (((), outer), (("-n", namespace), inner)):
                    _run("tc", *netns_args, "qdisc", "add", "dev", device, "root", *_tbf(rate))
            hosts.append(Host(index, addresses[index], namespace, inner, rate))
        for index, cores in self._cpus.items():
            try:
                self._quotas[index] = cpu_quota.CpuQuota(f"{PREFIX}_{self.tag}_{self._owner}_h{index}", cores)
            except OSError as error:
                raise TestbedError(f"cannot give host {index} a quota of {cores:g} CPUs: {error}") from None
        self.hosts = tuple(hosts)

    def close(self) -> None:
        """Stop every process started with :meth:`popen`, then delete the namespaces and links.

        Safe to call more than once. A deletion that fails is reported with a warning, not raised.
        """
        with self._lock:
            procs, self._procs = self._procs, []
        for proc in procs:
            stop(proc)
        for index in range(1, self._count):
            namespace, outer, _ = self._names(index)
            _run("ip", "link", "delete", outer, check=False)  # takes the peer in the namespace with it
            _run("ip", "netns", "delete", namespace, check=False)
        _run("ip", "link", "delete", self.bridge, check=False)
        quotas, self._quotas = self._quotas, {}
        left_quotas = [str(q.path) for q in quotas.values() if not q.close()]
        self._restore_signals()
        left = self.leftovers() + left_quotas
        if left:
            warnings.warn(f"test bed {self.tag}: could not delete {', '.join(left)}", RuntimeWarning, stacklevel=2)

    def leftovers(self) -> list[str]:
        """Names of this bed's namespaces and root-namespace links that still exist."""
        return [name for _, name, _ in owned_objects()
                if name.startswith((f"{PREFIX}_{self.tag}_", f"{PREFIX}{self.tag}"))]

    def _catch_signals(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit while open, so ``with`` blocks and ``finally`` clean up.

        Only in the main thread and only for signals still at their default action: a caller's
        own handler is left in place.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._old_handlers[sig] = signal.signal(sig, _exit_on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def _namespaced(self, host: int, what: str) -> str:
        """The namespace of host ``host``, which must be a namespaced host of the built bed."""
        if not self.hosts:
            raise TestbedError("the test bed is not built; use it as a context manager: with Testbed(...) as bed")
        if not 1 <= host < len(self.hosts):
            raise ValueError(f"{what}: host {host} is not a namespaced host (1..{len(self.hosts) - 1}); host 0 is "
                             "the root namespace and is never changed")
        return self.hosts[host].namespace

    def set_loss(self, host: int, probability: float) -> None:
        """Drop each packet host ``host`` receives with ``probability`` (0 removes the loss).

        Receiver-side random loss: one nft rule in the host's namespace, ``iifname != "lo" numgen
        random mod 10000 < p*10000 drop`` on the input hook, so every packet arriving over its veth
        (TCP data and ACKs alike, from every other host) is lost independently; what the host sends
        is not touched (its own data is lost only through the ACKs it drops). ``probability`` is
        rounded to 1e-4. Calling it again replaces the previous rule. :meth:`close` removes it with
        the namespace.

        Raises:
            ValueError: host 0 or a host outside the bed, or ``probability`` not in [0, 1).
            TestbedError: nft is missing or this kernel lacks nf_tables (the message says which).
        """
        namespace = self._namespaced(host, "set_loss")
        if not 0 <= probability < 1:
            raise ValueError(f"set_loss: the loss probability must be in [0, 1), not {probability}")
        threshold = round(probability * LOSS_SCALE)
        table = f"inet {LOSS_TABLE}"
        script = f"table {table} {{}}\ndelete table {table}\n"  # declare-then-delete: no error when absent
        if threshold:
            script += (f"add table {table}\n"
                       f"add chain {table} in {{ type filter hook input priority -10; policy accept; }}\n"
                       f'add rule {table} in iifname != "lo" numgen random mod {LOSS_SCALE} < {threshold} drop\n')
        nft(namespace, script)

    # ---- processes ----------------------------------------------------------------------------

    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``host`` in a new session (its own process group).

        On a namespaced host it runs through ``ip netns exec`` with a private ``/dev/shm``; on a
        host with a CPU quota it joins the host's cgroup first (its children inherit it);
        ``env`` is its complete environment (default: this process's). Other keyword arguments
        go to :class:`subprocess.Popen`. The process is stopped by :meth:`close` if still
        running; stop it earlier with :func:`stop`.
        """
        if not self.hosts:
            raise TestbedError("the test bed is not built; use it as a context manager: with Testbed(...) as bed")
        if not 0 <= host < len(self.hosts):
            raise ValueError(f"host {host} is not in this test bed of {len(self.hosts)} hosts")
        namespace = self.hosts[host].namespace
        command = list(argv)
        if namespace is not None:
            command = ["ip", "netns", "exec", namespace, "sh", "-c", _PRIVATE_SHM, "sh", *command]
        if host in self._quotas:
            command = self._quotas[host].command(command)
        proc = subprocess.Popen(command, env=dict(os.environ if env is None else env), start_new_session=True,
                                **kwargs)
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc


def _tbf(rate_mbit: float) -> list[str]:
    """tc arguments of a tbf qdisc at ``rate_mbit``: burst = 10 ms of traffic, at least 16 KiB."""
    burst = max(int(rate_mbit * 1e6 / 8 / 100), 16 * 1024)
    return ["tbf", "rate", f"{rate_mbit * 1000:.0f}kbit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace_s`` seconds; returns the exit status.

    ``proc`` must lead its own group (started by :meth:`Testbed.popen` or with
    ``start_new_session=True``). A process that already exited is only reaped.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


# ---- one bpslaunch job across the test bed -------------------------------------------------------


@dataclass(frozen=True)
class JobResult:
    """What :func:`run_job` saw.

    Attributes:
        returncodes: each host's bpslaunch exit status, index = host (a stopped launcher reports
            ``128 + signal`` or a negative signal number).
        timed_out: the job ran past ``timeout_s`` and was stopped.
        outputs: each host's bpslaunch console output (stdout then stderr), index = host.
    """

    returncodes: tuple[int, ...]
    timed_out: bool
    outputs: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Every host's bpslaunch exited 0 within the time limit."""
        return not self.timed_out and all(code == 0 for code in self.returncodes)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def run_job(bed: Testbed, slots: Sequence[int], command: Sequence[str], launcher_args: Sequence[str] = (), *,
            env: Mapping[str, str] | None = None, timeout_s: float = 600.0, grace_s: float = 10.0,
            cwd: str | os.PathLike | None = None) -> JobResult:
    """Run one ``bpslaunch`` job across ``bed``: ``slots[i]`` workers on host ``i``.

    Host ``i`` runs ``python -m dynamix_byteps.launcher --hosts A0:S0,A1:S1,... --node-rank i
    --port P [--scheduler-port Q] *launcher_args -- *command``, host 0 in the root namespace and
    the others inside theirs, so ranks 0..S0-1 are on host 0, the next S1 on host 1, and so on.
    ``--port`` (and, with ``--policy``, ``--scheduler-port``; with ``--restart-on-failure``,
    ``--restart-port``) are chosen free on host 0 unless ``launcher_args`` gives them; with either
    and no ``DYNAMIX_TOKEN`` in ``env``, a random token is shared by all hosts. With ``--log-dir D``
    in ``launcher_args``, host 0 writes to D (so the scheduler's ``decisions.jsonl`` is
    ``D/decisions.jsonl``) and host ``i`` to ``D/host<i>``. ``DYNAMIX_PS_CHANNELS`` defaults to
    ``basic``, so that an ``--engine ps`` job's tensors cross the emulated links.

    Once one launcher exits non-zero, the others get ``grace_s`` seconds to end by themselves (each
    reports its own workers' failure, as on separate machines); then every launcher left is stopped
    (SIGTERM, SIGKILL after ``grace_s`` seconds), as all are when ``timeout_s`` seconds have passed
    and on any exception here.

    Args:
        bed: an open :class:`Testbed`.
        slots: workers per host, one entry per host of ``bed``, each >= 1.
        command: the worker program and its arguments.
        launcher_args: further bpslaunch flags, e.g. ``["--policy", "proportional", "--log-dir", D]``;
            not ``--hosts`` or ``--node-rank``.
        env: the launchers' environment (default: this process's).
        timeout_s: seconds the whole job may take.
        grace_s: seconds between SIGTERM and SIGKILL when stopping a launcher.
        cwd: the launchers' working directory (default: this process's).

    Returns:
        A :class:`JobResult`; ``result.ok`` when every host's bpslaunch exited 0 in time.

    Raises:
        ValueError: ``slots`` does not match the bed, or ``launcher_args`` sets ``--hosts``/``--node-rank``.
    """
    if len(slots) != len(bed.hosts) or any(s < 1 for s in slots):
        raise ValueError(f"slots {list(slots)} must give >= 1 workers to each of the bed's {len(bed.hosts)} hosts")
    for flag in ("--hosts", "--node-rank"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in launcher_args):
            raise ValueError(f"launcher_args must not set {flag}: run_job sets it for each host")
    # A process that aborts in native code (std::terminate, a segfault) prints every thread's Python stack.
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    # The hosts share one kernel: TensorPipe's cma channel (the ps engine) would copy gradients from
    # process to process past the emulated links; basic sends them through the sockets.
    env.setdefault("DYNAMIX_PS_CHANNELS", "basic")
    host0 = bed.hosts[0].address
    extra = list(launcher_args)
    if _flag_value(extra, "--port") is None:
        extra += ["--port", str(_free_port(host0))]
    for needs, port_flag in (("--policy", "--scheduler-port"), ("--restart-on-failure", "--restart-port")):
        if _flag_value(extra, needs) is not None:
            if _flag_value(extra, port_flag) is None:
                extra += [port_flag, str(_free_port(host0))]
            env.setdefault("DYNAMIX_TOKEN", secrets.token_hex(16))
    log_dir = _flag_value(extra, "--log-dir")
    hosts = ",".join(f"{h.address}:{s}" for h, s in zip(bed.hosts, slots))
    launcher = [sys.executable, "-m", "dynamix_byteps.launcher", "--hosts", hosts]
    procs: list[subprocess.Popen] = []
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="dxtb-job-") as tmp:
        outs = [Path(tmp, f"host{i}.out") for i in range(len(slots))]
        try:
            for index, out in enumerate(outs):
                args = list(extra)
                if log_dir is not None and index > 0:
                    args = _with_log_dir(args, str(Path(log_dir) / f"host{index}"))
                with open(out, "wb") as sink:
                    procs.append(bed.popen(index, [*launcher, "--node-rank", str(index), *args, "--", *command],
                                           env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd))
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    settled = min(deadline, time.monotonic() + grace_s)
                    while any(p.poll() is None for p in procs) and time.monotonic() < settled:
                        time.sleep(0.2)
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.2)
        finally:
            codes = tuple(stop(p, grace_s) for p in procs)
        outputs = tuple(out.read_text(errors="replace") for out in outs)
    return JobResult(codes, timed_out, outputs)


def _with_log_dir(args: list[str], value: str) -> list[str]:
    """``args`` with the value of ``--log-dir`` replaced by ``value``."""
    out = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == "--log-dir" and i + 1 < len(args):
            out += [arg, value]
            skip = True
        elif arg.startswith("--log-dir="):
            out.append(f"--log-dir={value}")
        else:
            out.append(arg)
    return out
