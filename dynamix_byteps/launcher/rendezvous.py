"""Restart rendezvous of a multi-host elastic job (``bpslaunch --hosts ... --restart-on-failure N``).

Node 0's launcher serves the gRPC service ``dynamix.v1.Rendezvous`` (``protos/dynamix.proto``) on
``--restart-port`` of the first of ``--hosts`` for the whole job (:class:`RendezvousServer`). A run
of the job is a round: when it ends, every other host's launcher calls ``EndRound`` with its
:class:`RunReport` and waits (:func:`end_round`); node 0 takes them (:meth:`RendezvousServer.collect`),
decides and publishes one decision (:meth:`RendezvousServer.answer`), which every waiting call
returns. A stopped launcher calls ``Leave`` instead: its report counts, nothing is sent back
(:func:`leave`).

Security is the scheduler's (:mod:`dynamix_byteps.control.security`): every call carries
``DYNAMIX_TOKEN`` as ``x-dynamix-token`` metadata, and a call with another token is answered
UNAUTHENTICATED before its request is read (so it is never counted); node 0 serves TLS with
``--tls-cert/--tls-key`` and the other hosts verify it with ``--tls-ca``. Requests are parsed in the
handler: bytes that are no ``RoundReport`` get INVALID_ARGUMENT, a report of another run
FAILED_PRECONDITION, a node that is not a reporting host of the run or a report that no launcher
can send (:meth:`RunReport.problem`) INVALID_ARGUMENT, not counted; unknown
fields are skipped (proto3). Every wait is bounded: node 0 waits ``REPORT_TIMEOUT_S`` for the
reports, a host waits that plus 30 s for the decision, and gives up after ``REFUSED_S`` of node 0
being unreachable.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.client import CHANNEL_OPTIONS
from dynamix_byteps.control.security import (
    SERVER_OPTIONS,
    TOKEN_METADATA_KEY,
    TokenInterceptor,
    grpc_address,
    listen,
    open_channel,
    server_credentials,
)

__all__ = ["REFUSED_S", "REPORT_TIMEOUT_S", "RendezvousServer", "RunReport", "end_round", "leave"]

SERVICE = "dynamix.v1.Rendezvous"
REPORT_TIMEOUT_S = 120.0  # node 0 waits this long for the other hosts' reports of a run
REFUSED_S = 10.0  # node 0 serves from its start: unreachable this long, it is gone
ANSWER_MARGIN_S = 30.0  # a host waits REPORT_TIMEOUT_S + this for the decision
LEAVE_TIMEOUT_S = 2.0
STOP_POLL_S = 0.05  # how often a wait asks its ``stopped``


@dataclass(frozen=True)
class RunReport:
    """How one run ended on one host.

    Attributes:
        node: the host's index in this run's ``--hosts``.
        run: the run (0, then 1 after the first restart, ...).
        code: the launcher's exit code for the run (0 when every worker succeeded).
        failed: the global rank of the worker whose failure ended the run on this host, or None
            (success, or the launcher itself was signalled).
        failed_at: wall-clock time (s since the epoch) the launcher saw that failure.
        killed: global ranks of the workers that died of a signal the launcher did not send.
        self_failed: global ranks of the workers that exited with a code > 0 on their own.
        workers: global ranks of this host's workers in the run.
        started: whether a worker of this host got through ``bps.init`` (the rendezvous completes for
            all workers or none, so a run no host started failed at start-up).
        server_failed: a summation server of this host (``--engine ps``) failed and ended the run
            here (then ``failed`` is None); the next run keeps every worker.
    """

    node: int
    run: int
    code: int
    failed: int | None
    failed_at: float | None
    killed: list[int] = field(default_factory=list)
    self_failed: list[int] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)
    started: bool = True
    server_failed: bool = False

    def message(self) -> dynamix_pb2.RoundReport:
        return dynamix_pb2.RoundReport(
            node=self.node, run=self.run, exit_code=self.code, failed=self.failed, failed_at=self.failed_at,
            killed=self.killed, self_failed=self.self_failed, workers=self.workers, started=self.started,
            server_failed=self.server_failed)

    def problem(self) -> str | None:
        """Why this report cannot be a launcher's (None when it can): ``code`` outside 0..255 (an
        exit status; 256 would exit 0), ``failed_at`` not finite, a rank listed twice, or ``failed``,
        ``killed`` or ``self_failed`` naming a rank that is not one of ``workers``."""
        if not 0 <= self.code <= 255:
            return f"exit_code {self.code} is no exit status (0..255)"
        if self.failed_at is not None and not math.isfinite(self.failed_at):
            return f"failed_at {self.failed_at} is not a time"
        for name in ("workers", "killed", "self_failed"):
            ranks = getattr(self, name)
            if len(set(ranks)) != len(ranks):
                return f"{name} {ranks} lists a rank twice"
            if name != "workers" and not set(ranks) <= set(self.workers):
                return f"{name} {ranks} names a rank that is not one of workers {self.workers}"
        if self.failed is not None and self.failed not in self.workers:
            return f"failed {self.failed} is not one of workers {self.workers}"
        return None

    @classmethod
    def of(cls, m: dynamix_pb2.RoundReport) -> RunReport:
        return cls(node=m.node, run=m.run, code=m.exit_code, failed=m.failed if m.HasField("failed") else None,
                   failed_at=m.failed_at if m.HasField("failed_at") else None, killed=list(m.killed),
                   self_failed=list(m.self_failed), workers=list(m.workers), started=m.started,
                   server_failed=m.server_failed)


def decision_message(decision: dict) -> dynamix_pb2.RoundDecision:
    """``{"exit": code, "reason": text}`` or ``{"slots", "lost"[, "port"][, "scheduler_port"]}`` as a message."""
    if "exit" in decision:
        return dynamix_pb2.RoundDecision(end=dynamix_pb2.JobEnd(exit_code=decision["exit"], reason=decision["reason"]))
    return dynamix_pb2.RoundDecision(next=dynamix_pb2.NextRound(
        slots=decision["slots"], lost=decision["lost"], port=decision.get("port"),
        scheduler_port=decision.get("scheduler_port")))


def decision_dict(m: dynamix_pb2.RoundDecision) -> dict:
    """The inverse of :func:`decision_message`."""
    if m.WhichOneof("outcome") == "end":
        return {"exit": m.end.exit_code, "reason": m.end.reason}
    decision = {"slots": list(m.next.slots), "lost": list(m.next.lost)}
    decision.update({key: getattr(m.next, key) for key in ("port", "scheduler_port") if m.next.HasField(key)})
    return decision


class RendezvousServer:
    """Node 0's side: serves ``Rendezvous`` on ``(host, port)`` (0 = pick, see :attr:`port`) from
    construction to :meth:`close`, for a job of at most ``hosts`` hosts.

    Raises:
        OSError: the address cannot be bound.
        ConfigurationError: ``tls_cert``/``tls_key`` are not a readable PEM pair.
        ValueError: ``token`` is not usable as gRPC metadata.
    """

    def __init__(self, host: str, port: int, token: str, tls_cert=None, tls_key=None, hosts: int = 2):
        self._cond = threading.Condition()
        self._round, self._peers = 0, None  # the run whose reports are taken; its reporting hosts once known
        self._reports: dict[int, RunReport] = {}  # of the round, by node
        self._refused: dict[tuple[int, int], str] = {}  # (run, node) -> why
        self._decisions: dict[int, dict] = {}  # run -> the decision every host of it gets
        self._closed = False
        # raw bytes in: parsed in the handler, so that malformed ones get INVALID_ARGUMENT (gRPC says INTERNAL)
        handlers = {"EndRound": grpc.unary_unary_rpc_method_handler(
                        self._end_round, response_serializer=dynamix_pb2.RoundDecision.SerializeToString),
                    "Leave": grpc.unary_unary_rpc_method_handler(
                        self._leave, response_serializer=dynamix_pb2.LeaveReply.SerializeToString)}
        # one thread per waiting host, and as many for hosts retrying a call whose cancellation is not seen yet
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * hosts + 4),
                                   handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
                                   interceptors=(TokenInterceptor(token),), options=SERVER_OPTIONS)
        self.port = listen(self._server, host, port, server_credentials(tls_cert, tls_key))
        self._server.start()

    def collect(self, run: int, peers: int, timeout_s: float = REPORT_TIMEOUT_S,
                stopped: Callable[[], bool] = lambda: False) -> dict[int, RunReport]:
        """Take the reports of ``run`` until hosts ``1..peers`` have each sent one, ``timeout_s``
        passes or ``stopped()`` is true (asked every ``STOP_POLL_S``); returns ``{node: report}``.
        Every caller waits until :meth:`answer`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._round, self._peers = run, peers
            for node in [n for n in self._reports if n > peers]:  # reported before the run's hosts were known
                del self._reports[node]
                self._refused[(run, node)] = f"node {node} is no reporting host of run {run} (nodes 1..{peers})"
            self._cond.notify_all()
            while len(self._reports) != peers and not stopped() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(timeout=min(left, STOP_POLL_S))
            return dict(self._reports)

    def answer(self, run: int, decision: dict) -> None:
        """Publish ``decision`` as every host's answer for ``run`` (also to a host reporting late)."""
        with self._cond:
            self._decisions[run] = decision
            self._round, self._peers, self._reports = run + 1, None, {}
            self._cond.notify_all()

    def close(self) -> None:
        """Stop serving; calls still waiting are answered UNAVAILABLE, answered ones get 2 s to be sent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.stop(2.0).wait()

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take(self, raw: bytes, context: grpc.ServicerContext) -> RunReport:
        """The report in ``raw``, recorded for its round; aborts the call when it does not fit."""
        try:
            report = RunReport.of(dynamix_pb2.RoundReport.FromString(raw))
        except DecodeError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed RoundReport message: {error}")
        if (problem := report.problem()) is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed report of node {report.node}: {problem}")
        with self._cond:
            if report.run == self._round and (report.node == 0 or (self._peers is not None and report.node > self._peers)):
                peers = "?" if self._peers is None else self._peers
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"node {report.node} is no reporting host of run {report.run} (nodes 1..{peers})")
            if report.run != self._round and report.run not in self._decisions:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"report of run {report.run}; node 0 takes the reports of run {self._round}")
            if report.run == self._round:
                self._reports[report.node] = report
                self._cond.notify_all()
        return report

    def _end_round(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        report = self._take(raw, context)
        key = (report.run, report.node)
        with self._cond:
            while not (report.run in self._decisions or key in self._refused or self._closed):
                if not context.is_active():  # the caller gave up (or retries on another call)
                    context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
                self._cond.wait(timeout=1.0)
            if key in self._refused:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._refused[key])
            if report.run not in self._decisions:
                context.abort(grpc.StatusCode.UNAVAILABLE, "node 0's launcher is exiting")
            return decision_message(self._decisions[report.run])

    def _leave(self, raw: bytes, context: grpc.ServicerContext) -> dynamix_pb2.LeaveReply:
        self._take(raw, context)
        return dynamix_pb2.LeaveReply()


def end_round(node0: tuple[str, int], report: RunReport, token: str, tls_ca=None,
              timeout_s: float = REPORT_TIMEOUT_S, stopped: Callable[[], bool] = lambda: False) -> dict:
    """A non-zero host's side: send ``report`` to node 0 at ``node0`` (host, port; retrying
    while node 0 is unreachable, for at most ``REFUSED_S``) and return its decision (a dict, as
    :func:`decision_dict`); ``{"exit": report.code, "reason": why}`` when it refuses the report, when
    none comes within ``timeout_s`` + ``ANSWER_MARGIN_S`` (node 0 may wait ``timeout_s`` for the
    slowest host), or once ``stopped()`` is true (asked every ``STOP_POLL_S``; the call is cancelled)."""
    start = time.monotonic()
    deadline = start + timeout_s + ANSWER_MARGIN_S
    address = grpc_address(*node0)
    with open_channel(address, tls_ca, CHANNEL_OPTIONS) as channel:
        call = dynamix_pb2_grpc.RendezvousStub(channel).EndRound
        while True:
            future = call.future(report.message(), timeout=max(0.01, deadline - time.monotonic()),
                                 metadata=((TOKEN_METADATA_KEY, token),))
            while not future.done() and not stopped():
                time.sleep(STOP_POLL_S)
            if stopped():
                future.cancel()
                return {"exit": report.code, "reason": "stopped while waiting for node 0's decision"}
            try:
                return decision_dict(future.result())
            except grpc.RpcError as error:
                code, details = error.code(), error.details()
            now = time.monotonic()
            if code == grpc.StatusCode.UNAVAILABLE and now < min(deadline, start + REFUSED_S):
                time.sleep(0.5)
                continue
            if code == grpc.StatusCode.UNAVAILABLE:
                why = f"no answer from node 0 at {address} ({details})"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"no decision from node 0 at {address} within {timeout_s + ANSWER_MARGIN_S:g} s"
            elif code == grpc.StatusCode.UNAUTHENTICATED:
                why = "node 0 refused the report: wrong DYNAMIX_TOKEN: every host needs the same one"
            else:
                why = f"node 0 refused the report: {details} ({code.name})"
            return {"exit": report.code, "reason": why}


def leave(node0: tuple[str, int], report: RunReport, token: str, tls_ca=None) -> None:
    """Send ``report`` to node 0 at ``node0`` (host, port) without waiting for a decision (a stopped
    launcher); errors are ignored."""
    with open_channel(grpc_address(*node0), tls_ca, CHANNEL_OPTIONS) as channel:
        try:
            dynamix_pb2_grpc.RendezvousStub(channel).Leave(report.message(), timeout=LEAVE_TIMEOUT_S,
                                                           metadata=((TOKEN_METADATA_KEY, token),))
        except grpc.RpcError:
            pass
