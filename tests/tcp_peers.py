"""Test harness for the network collectors: TCP peer processes and a lossy namespace pair.

``Peer`` runs one child Python process that holds a single TCP socket and obeys text commands
on its stdin, answering one line each on its stdout, so a test knows every byte that crossed
the connection and when. ``lossy_namespace_pair`` builds two network namespaces joined by a
veth in which the receiver drops a share of what the sender sends, to force retransmits.
Both clean up after themselves: a peer is killed if it does not exit when told, and the
namespaces (with their veth ends and nft tables) are deleted even when setup fails halfway.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

# The child process. It prints "pid <n>" on start (a server then "port <n>"), and then answers:
#   accept        -> "accepted"         (server: take the one connection, close the listener)
#   connect       -> "connected"        (client: connect to host:port)
#   sockname      -> "sockname <ip> <port>" (the connected socket's local address)
#   send <n>      -> "sent <n>"         (after all n bytes are handed to the kernel)
#   recv <n>      -> "recv <got>"       (got < n only if the other side closed first)
#   eof <secs>    -> "eof True|False"   (whether the other side closed within secs)
#   state         -> "state <tcpi_state>"
#   close         -> "closed"
#   exit          -> (exits)
PEER_SCRIPT = r"""
import os, socket, sys
role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def out(*a):
    print(*a, flush=True)
out("pid", os.getpid())
s = None
if role == "server":
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, port))
    ls.listen(1)
    out("port", ls.getsockname()[1])
chunk = b"x" * (1 << 16)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "accept":
        s, _ = ls.accept()
        ls.close()
        out("accepted")
    elif cmd == "connect":
        s = socket.create_connection((host, port), timeout=40)
        s.settimeout(None)
        out("connected")
    elif cmd == "sockname":
        out("sockname", *s.getsockname()[:2])
    elif cmd == "send":
        n = left = int(args[0])
        while left:
            k = min(left, len(chunk))
            s.sendall(chunk[:k])
            left -= k
        out("sent", n)
    elif cmd == "recv":
        n, got = int(args[0]), 0
        while got < n:
            d = s.recv(min(1 << 20, n - got))
            if not d:
                break
            got += len(d)
        out("recv", got)
    elif cmd == "eof":
        s.settimeout(float(args[0]))
        try:
            out("eof", s.recv(1) == b"")
        except socket.timeout:
            out("eof", False)
    elif cmd == "state":
        out("state", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0])
    elif cmd == "close":
        s.close()
        out("closed")
    elif cmd == "exit":
        break
"""


class Peer:
    """A child process holding one TCP socket, driven by the text commands of ``PEER_SCRIPT``.

    ``role`` is ``"server"`` (listens on host:port, 0 for any; ``self.port`` is the bound port)
    or ``"client"`` (connects to host:port on ``connect``). With ``netns`` the process runs in
    that network namespace (``ip netns exec`` execs Python, so ``self.pid`` is the process that
    owns the socket). Use as a context manager, or call ``stop()`` in a ``finally``.
    """

    def __init__(self, role: str, host: str, port: int, netns: str | None = None):
        argv = [sys.executable, "-c", PEER_SCRIPT, role, host, str(port)]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.pid = int(self.expect("pid"))
            self.port = int(self.expect("port")) if role == "server" else port
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def read(self, timeout: float = 30.0) -> list[str]:
        """The next answer line, split into words; fails if none comes within ``timeout``."""
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not result or not result[0]:
            raise AssertionError(f"peer {self.proc.pid} gave no answer (rc={self.proc.poll()})")
        return result[0].split()

    def expect(self, word: str, timeout: float = 30.0) -> str:
        """Read an answer that must start with ``word``; return its first argument ("" if none)."""
        line = self.read(timeout)
        assert line and line[0] == word, f"expected {word!r} from peer, got {line}"
        return line[1] if len(line) > 1 else ""

    def send(self, line: str) -> None:
        """Send one command without waiting for its answer."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def cmd(self, line: str, timeout: float = 30.0) -> list[str]:
        """Send one command and return its answer."""
        self.send(line)
        return self.read(timeout)

    def stop(self) -> None:
        """Ask the process to exit; kill it if it does not. Safe to call more than once."""
        try:
            if self.proc.poll() is None:
                try:
                    self.send("exit")
                    self.proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait(timeout=5)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


def connect_peers(server: Peer, client: Peer) -> None:
    """Establish the one connection between ``server`` and ``client``."""
    server.send("accept")
    assert client.cmd("connect") == ["connected"]
    assert server.read() == ["accepted"]


def move_bytes(sender: Peer, receiver: Peer, n: int) -> None:
    """Send exactly ``n`` bytes from ``sender`` to ``receiver``, checking both ends saw all of them."""
    sender.send(f"send {n}")
    assert receiver.cmd(f"recv {n}") == ["recv", str(n)]
    assert sender.read() == ["sent", str(n)]


NETNS_TOOLS = ("ip", "nft")


def missing_netns_tools() -> list[str]:
    """Which of the tools ``lossy_namespace_pair`` needs are not on PATH."""
    return [tool for tool in NETNS_TOOLS if shutil.which(tool) is None]


@dataclass(frozen=True)
class LossyLink:
    """Two namespaces on one veth; what ``sender_addr`` sends to ``receiver_addr`` is partly dropped."""

    sender_ns: str
    receiver_ns: str
    sender_addr: str
    receiver_addr: str


def _ip(*argv: str) -> None:
    subprocess.run(argv, check=True, timeout=20, capture_output=True)


@contextmanager
def lossy_namespace_pair(name_prefix: str, subnet: str = "10.213.0", loss_percent: int = 10) -> Iterator[LossyLink]:
    """Create namespaces ``<name_prefix>_<tag>_{s,r}`` joined by a veth, with addresses
    ``<subnet>.1`` (sender) and ``<subnet>.2`` (receiver), where an nft rule in the receiver
    drops ``loss_percent``% of the packets arriving from the sender at random.

    Needs root, ``ip`` and ``nft`` (see ``missing_netns_tools``); a failing setup step raises
    ``subprocess.CalledProcessError``. The namespaces are deleted on exit, and on any failure,
    which also removes the veth pair and the nft table.
    """
    tag = uuid.uuid4().hex[:6]
    sender_ns, receiver_ns = f"{name_prefix}_{tag}_s", f"{name_prefix}_{tag}_r"
    sender_dev, receiver_dev = f"{name_prefix}{tag}s"[:15], f"{name_prefix}{tag}r"[:15]
    link = LossyLink(sender_ns, receiver_ns, f"{subnet}.1", f"{subnet}.2")
    try:
        _ip("ip", "netns", "add", sender_ns)
        _ip("ip", "netns", "add", receiver_ns)
        _ip("ip", "link", "add", sender_dev, "netns", sender_ns, "type", "veth",
            "peer", "name", receiver_dev, "netns", receiver_ns)
        for ns, dev, addr in ((sender_ns, sender_dev, link.sender_addr),
                              (receiver_ns, receiver_dev, link.receiver_addr)):
            _ip("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("ip", "-n", ns, "link", "set", dev, "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
        nft = ("ip", "netns", "exec", receiver_ns, "nft")
        _ip(*nft, "add", "table", "inet", "lossy")
        _ip(*nft, "add", "chain", "inet", "lossy", "in", "{ type filter hook prerouting priority 0; }")
        _ip(*nft, "add", "rule", "inet", "lossy", "in", "ip", "saddr", link.sender_addr,
            "numgen", "random", "mod", "100", "<", str(loss_percent), "counter", "drop")
        yield link
    finally:
        for ns in (sender_ns, receiver_ns):
            subprocess.run(["ip", "netns", "delete", ns], check=False, timeout=20, capture_output=True)


def ebpf_collector_or_skip():
    """A loaded :class:`~dynamix_byteps.agent.ebpf.EbpfCollector` (the caller closes it); the test
    skips with the collector's reason where loading is not permitted, but fails where the machine
    could load it (root with kernel BTF)."""
    import pytest

    from dynamix_byteps.agent.base import CollectorUnavailable
    from dynamix_byteps.agent.ebpf import EbpfCollector

    try:
        return EbpfCollector()
    except CollectorUnavailable as e:
        if os.geteuid() == 0 and os.path.exists("/sys/kernel/btf/vmlinux"):
            raise  # root with BTF: the collector must load here
        pytest.skip(f"eBPF collector cannot load here: {e}")
