"""Elastic restart across hosts: the ``bpslaunch`` of every host agrees on the next run.

With ``--hosts ... --restart-on-failure N``, node 0's launcher listens on ``--restart-port``
(on the first of ``--hosts``) for the whole job. After each run, every other launcher sends it
one JSON line, its :class:`RunReport`, and waits for one line back; node 0 adds its own report,
calls :func:`decide`, and answers every host with the same decision:

* ``{"exit": code, "reason": ...}``: the job ends; every launcher exits with ``code``;
* ``{"slots": [S0, S1, ...], "port": P, "scheduler_port": Q, "lost": [ranks]}``: the next run
  has ``Si`` workers on host ``i`` (ranks in host order, as always), rendezvous on the fresh
  ``port`` and a scheduler for the new size on ``scheduler_port``; a host given 0 slots leaves
  the job (its launcher exits 0).

Which workers are lost: those killed by a signal their launcher did not send (SIGKILL, the OOM
killer); when none was, the worker of the earliest failure (the others are the collectives it
broke; wall-clock times, so the hosts' clocks should agree to well under a second). Each lost
worker takes one slot from its host. The job ends instead when every report is 0 (done), when no
restart is left, when no worker got through ``bps.init`` or every worker failed on its own (an
error in the command, not a lost worker), when host 0 (the rendezvous and the scheduler) would be left without a worker, or when
a launcher was stopped by a signal: a stopped host only :func:`tell`-s node 0 and exits; a
stopped node 0 answers no one, and the others give up after ``REFUSED_S`` of refused connections.

Every message carries ``DYNAMIX_TOKEN`` (required, as for a multi-host scheduler); a connection
with another token is answered ``{"error": ...}`` and ignored. Node 0 waits ``REPORT_TIMEOUT_S``
for the other hosts' reports: a host that is gone by then ends the job (``exit`` with the first
failure's code).
"""

from __future__ import annotations

import hmac
import json
import socket
import time
from dataclasses import asdict, dataclass, field

__all__ = ["REPORT_TIMEOUT_S", "Coordinator", "RunReport", "decide", "report_and_wait", "tell"]

REPORT_TIMEOUT_S = 120.0  # node 0 waits this long for the other hosts' reports of a run
REFUSED_S = 10.0  # node 0 listens from its start: refused this long, it is gone
_MAX_LINE = 1 << 20


@dataclass(frozen=True)
class RunReport:
    """How one run ended on one host.

    Attributes:
        node: the host's index in this run's ``--hosts``.
        run: the run (0, then 1 after the first restart, ...).
        code: the launcher's exit code for the run (0 when every worker succeeded).
        failed: the global rank of the worker whose failure ended the run on this host, or None
            (success, or the launcher itself was signalled).
        killed: global ranks of the workers that died of a signal the launcher did not send.
        failed_at: wall-clock time (s since the epoch) the launcher saw that failure.
        self_failed: global ranks of the workers that exited with a code > 0 on their own.
        workers: global ranks of this host's workers in the run.
        token: the shared secret (``DYNAMIX_TOKEN``).
        started: whether a worker of this host got through ``bps.init`` (the rendezvous completes for
            all workers or none, so a run no host started failed at start-up).
    """

    node: int
    run: int
    code: int
    failed: int | None
    failed_at: float | None
    killed: list[int] = field(default_factory=list)
    self_failed: list[int] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)
    token: str = ""
    started: bool = True


def decide(slots: list[int], reports: list[RunReport], restarts_left: int) -> dict:
    """The next step of the job from every host's report (``reports[i]`` is host ``i``'s).

    Returns ``{"exit": code, "reason": text}`` or ``{"slots": new_slots, "lost": ranks}`` (see the
    module docstring; the caller adds the ports).
    """
    failures = sorted((r for r in reports if r.code != 0), key=lambda r: (r.failed_at or float("inf"), r.node))
    if not failures:
        return {"exit": 0, "reason": "every worker succeeded"}
    first = failures[0].code
    if any(r.failed is None for r in failures):
        return {"exit": first, "reason": "a launcher was stopped; not restarting"}
    if restarts_left <= 0:
        return {"exit": first, "reason": "no restart left"}
    if not any(r.started for r in reports):
        return {"exit": first, "reason": "the job failed before it started (no worker got through bps.init): an "
                "error in the command or its environment, not a lost worker; not restarting"}
    workers = {w for r in reports for w in r.workers}
    if {w for r in reports for w in r.self_failed} == workers:
        return {"exit": first, "reason": "every worker failed on its own: an error in the command, not a lost worker; "
                "not restarting"}
    lost = [(r.node, rank) for r in reports for rank in r.killed] or [(failures[0].node, failures[0].failed)]
    new = list(slots)
    for node, _ in lost:
        new[node] -= 1
    if new[0] <= 0:
        return {"exit": first, "reason": "host 0 (the rendezvous and scheduler) lost its last worker; not restarting"}
    return {"slots": new, "lost": sorted(rank for _, rank in lost)}


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket, deadline: float) -> dict:
    """One JSON line from ``conn`` before ``deadline`` (monotonic); raises OSError or ValueError."""
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
        if len(data) > _MAX_LINE:
            raise ValueError("message too long")
    return json.loads(data)


class Coordinator:
    """Node 0's side: listens on ``(host, port)`` from construction to :meth:`close`.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, token: str):
        self._token = token
        self._server = socket.create_server((host, port))  # SO_REUSEADDR: a restarted job can reuse the port

    def collect(self, run: int, peers: int, timeout_s: float = REPORT_TIMEOUT_S) -> dict[int, tuple[RunReport, socket.socket]]:
        """Accept reports of ``run`` until ``peers`` hosts have sent one or ``timeout_s`` passes;
        returns ``{node: (report, connection)}`` (answer them with :meth:`answer`)."""
        got: dict[int, tuple[RunReport, socket.socket]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < peers and time.monotonic() < deadline:
            self._server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                break
            try:
                report = RunReport(**_receive(conn, deadline))
            except (OSError, ValueError, TypeError):
                conn.close()
                continue
            if not hmac.compare_digest(report.token, self._token):
                _send(conn, {"error": "wrong DYNAMIX_TOKEN: every host needs the same one"})
                conn.close()
            elif report.run != run or not 1 <= report.node <= peers:
                _send(conn, {"error": f"report of run {report.run} node {report.node}; expected run {run}, nodes 1..{peers}"})
                conn.close()
            else:
                if report.node in got:
                    got[report.node][1].close()
                got[report.node] = (report, conn)
        return got

    @staticmethod
    def answer(connections, decision: dict) -> None:
        """Send ``decision`` to every connection of :meth:`collect` and close them."""
        for conn in connections:
            try:
                _send(conn, decision)
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self._server.close()


def report_and_wait(address: tuple[str, int], report: RunReport, timeout_s: float = REPORT_TIMEOUT_S) -> dict:
    """A non-zero host's side: send ``report`` to node 0 (retrying while it is not listening yet)
    and return its decision; ``{"exit": report.code, "reason": why}`` when none comes in time."""
    deadline = time.monotonic() + timeout_s + 30.0  # node 0 may wait timeout_s for the slowest host
    refused_until = time.monotonic() + REFUSED_S
    error: Exception | None = None
    while time.monotonic() < min(deadline, refused_until if isinstance(error, ConnectionRefusedError) else deadline):
        try:
            with socket.create_connection(address, timeout=5.0) as conn:
                _send(conn, asdict(report))
                answer = _receive(conn, deadline)
        except (OSError, ValueError) as why:
            error = why
            time.sleep(0.5)
            continue
        if "error" in answer:
            return {"exit": report.code, "reason": f"node 0 refused the report: {answer['error']}"}
        return answer
    return {"exit": report.code, "reason": f"no answer from node 0 at {address[0]}:{address[1]} ({error})"}


def tell(address: tuple[str, int], report: RunReport) -> None:
    """Send ``report`` to node 0 without waiting for an answer (a stopped launcher); errors are ignored."""
    try:
        with socket.create_connection(address, timeout=2.0) as conn:
            _send(conn, asdict(report))
    except OSError:
        pass
