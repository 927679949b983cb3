"""The worker's gRPC client of the scheduler, on a background thread.

Training never waits for the scheduler: ``submit`` only replaces the report waiting to be sent
and returns. The thread registers (again after a scheduler restart, and after a refused report,
which may mean that the scheduler holds another registration of this rank), sends the newest report,
and keeps the newest assignment it was answered with. When the scheduler is slow, restarting
or gone, one warning is logged, training goes on with the last assignment, and gRPC's channel
reconnects with exponential backoff by itself. A refused registration (e.g. another job size) is
logged once as an error: the scheduler's policy is not applied while it refuses.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Callable

import grpc

from dynamix_byteps.argtypes import dial_host
from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.security import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY, open_channel

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 2.0
_TLS_FAILURE = "handshake failed"  # in gRPC's UNAVAILABLE details, e.g. "Ssl handshake failed: ... CERTIFICATE_VERIFY_FAILED"
# In gRPC's UNAVAILABLE details when the peer does not speak HTTP/2, e.g. an HTTP/1 server:
# "Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 79)"
_NOT_GRPC = "failed parsing http/2"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


class SchedulerClient:
    """Reports to the scheduler at ``address`` (``host:port``) and remembers its newest assignment.

    Args:
        address: the scheduler's ``host:port`` or gRPC target (:func:`~dynamix_byteps.argtypes.dial_address`).
        token: shared secret sent as ``x-dynamix-token`` metadata, or None.
        worker_info: called (on the client thread) whenever the worker must (re-)register.
        tls_ca: PEM CA file to verify a TLS scheduler with; None = plaintext.

    Attributes:
        joined_version: the version of the assignment in force when this worker first registered
            (later registrations, after a scheduler restart, keep it); None before.
    """

    def __init__(self, address: str, token: str | None, worker_info: Callable[[], dynamix_pb2.WorkerInfo],
                 tls_ca: str | None = None):
        self.address = address
        self._metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        self._worker_info = worker_info
        self._channel = open_channel(address, tls_ca, CHANNEL_OPTIONS)
        self._stub = dynamix_pb2_grpc.SchedulerStub(self._channel)
        self._cond = threading.Condition()
        self._pending: dynamix_pb2.Report | None = None
        self._latest: dynamix_pb2.Assignment | None = None
        self.joined_version: int | None = None
        self._registered = False
        self._registering = False  # the call in flight (or that failed last) is Register
        self._registration_refused = False  # said until a registration is accepted
        self._failing = False
        self._misconfigured = False  # a TLS or address mistake was logged
        self._stopped = False
        self._sending = False
        self._thread = threading.Thread(target=self._run, name="dynamix-scheduler-client", daemon=True)
        self._thread.start()
        # A daemon thread inside gRPC while the interpreter finalises is killed mid-call, so the
        # thread is stopped before that even when nobody calls bps.shutdown().
        atexit.register(self.close)

    def submit(self, report: dynamix_pb2.Report) -> None:
        """Queue ``report`` for sending, replacing an unsent older one; never blocks."""
        with self._cond:
            if not self._stopped:
                self._pending = report
                self._cond.notify_all()

    def latest(self) -> dynamix_pb2.Assignment | None:
        """The newest assignment the scheduler answered with, or None before the first answer."""
        with self._cond:
            return self._latest

    def close(self, grace_s: float = RPC_TIMEOUT_S) -> None:
        """Give the report still waiting (and a call in flight) up to ``grace_s`` seconds to reach
        the scheduler, then stop the thread and close the channel, cancelling whatever is left: the
        last interval still reaches the decision log, and a gone scheduler delays the exit by at
        most ``grace_s``. Safe to call twice; :meth:`submit` does nothing afterwards."""
        with self._cond:
            if self._stopped:
                return
            self._cond.wait_for(lambda: self._pending is None and not self._sending, timeout=grace_s)
            self._stopped = True
            self._cond.notify_all()
        self._channel.close()  # cancels a call still in flight, so the join is short
        self._thread.join(timeout=RPC_TIMEOUT_S + 1)
        atexit.unregister(self.close)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                report, self._pending = self._pending, None
                self._sending = True
            try:
                self._send(report)
            except grpc.RpcError as exc:
                if self._stopped:  # cancelled by close()
                    return
                self._note_failure(exc)
            except ValueError:  # "Cannot invoke RPC on closed channel": close() came first
                if self._stopped:
                    return
                raise
            else:
                if self._failing:
                    log.warning("scheduler at %s is reachable again", self.address)
                self._failing = False
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _send(self, report: dynamix_pb2.Report) -> None:
        if not self._registered:
            self._registering = True
            reply = self._stub.Register(self._worker_info(), timeout=RPC_TIMEOUT_S, metadata=self._metadata)
            self._registered, self._registering, self._registration_refused = True, False, False
            if self.joined_version is None:
                self.joined_version = reply.assignment.version
            self._keep(reply.assignment)
        try:
            self._keep(self._stub.ReportMetrics(report, timeout=RPC_TIMEOUT_S, metadata=self._metadata))
        except grpc.RpcError as exc:
            # FAILED_PRECONDITION: the scheduler restarted and forgot us. INVALID_ARGUMENT: it holds
            # another registration of our rank (other bounds or host); registering again restores ours.
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                self._registered = False
            raise

    def _keep(self, assignment: dynamix_pb2.Assignment) -> None:
        if assignment.batch_sizes:
            with self._cond:
                self._latest = assignment

    def _note_failure(self, exc: grpc.RpcError) -> None:
        details = (exc.details() or "").lower()
        if exc.code() == grpc.StatusCode.UNAVAILABLE and (_TLS_FAILURE in details or _NOT_GRPC in details):
            self._registered = False
            if not self._misconfigured:  # a configuration mistake, not an outage: said once, as an error
                if _TLS_FAILURE in details:
                    log.error("TLS handshake with the scheduler at %s fails (%s): the scheduler's policy is NOT "
                              "applied and training continues with the last assignment. Check --tls-ca (the CA that "
                              "signed the scheduler's --tls-cert) and that the certificate names %s", self.address,
                              exc.details(), dial_host(self.address))
                else:
                    log.error("%s answers, but not as a gRPC server (%s): the scheduler's policy is NOT applied and "
                              "training continues with the last assignment. Check that DYNAMIX_SCHEDULER names the "
                              "port of a dynamix scheduler (bpslaunch --scheduler-port), not another service's",
                              self.address, exc.details())
            self._misconfigured = self._failing = True
            return
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._registered = False
            if not self._failing:
                log.warning("scheduler at %s is unreachable (%s); training continues with the last "
                            "assignment and reconnects when it is back", self.address, exc.code().name)
        elif self._registering:
            if not self._registration_refused:
                log.error("scheduler at %s refused this worker's registration: %s %s. The scheduler's policy is NOT "
                          "applied while it refuses (the registration is retried with every report); training "
                          "continues with the last assignment", self.address, exc.code().name, exc.details())
            self._registration_refused = True
        elif not self._failing:
            log.warning("scheduler at %s refused a report: %s %s", self.address, exc.code().name, exc.details())
        self._failing = True
