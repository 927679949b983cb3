"""The scheduler: gRPC service on the parameter-server host that turns reports into assignments.

Workers call ``Register`` once (again after a restart of either side) and ``ReportMetrics``
every decision interval of K steps. When every rank has reported a step >= the next decision
step, the caller whose report completed the interval runs the policy (outside the state lock,
one decision at a time), a new :class:`~dynamix_byteps.control.cluster.AssignmentRecord`
version is published if the sizes change, and that caller gets it back; every later caller
gets it too. Rank 0's report, whose answer all workers apply (rank 0 broadcasts it), is
answered only after the decision it waits for (at most ``ANSWER_WAIT_S``): only the report that
made rank 0 ready waits, and one at a time, so repeated or concurrent rank-0 reports (a burst,
a retrying client) are answered at once and cannot tie up the handler threads.

Observability: each decision, "keep" included, is one JSON line in ``<run_dir>/decisions.jsonl``
(written off the RPC path by one thread, one ``write`` per line on an ``O_APPEND`` descriptor,
so never a half line; a torn tail left by a crash is cut off at start), then TensorBoard scalars
in ``<run_dir>/tensorboard/scheduler`` by the same thread (:mod:`dynamix_byteps.tensorboard_scalars`), and
Prometheus gauges are served on ``metrics_port``.

Threading: calls are served by a ``grpc.aio`` server on the scheduler's own event-loop thread. A
call's request is awaited there, holding no thread, so clients that open calls and never send
their request cannot keep the others unanswered; once the request has arrived its handler runs on
one of ``max_threads`` handler threads.

Robustness: requests are parsed in the handler (so malformed bytes get INVALID_ARGUMENT, not
INTERNAL), validated completely before the state changes, and any handler exception is turned
into a status without touching the server. See :mod:`.security` for the token and size limits.

Example::

    from dynamix_byteps.control.scheduler import SchedulerServer
    with SchedulerServer(policy, num_workers=4, decision_interval=10, run_dir="runs/a") as s:
        print(s.port)
        s.wait()
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import operator
import os
import queue
import socket
import threading
import time
from concurrent import futures
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from google.protobuf.message import DecodeError

from dynamix_byteps.control import dynamix_pb2
from dynamix_byteps.control.cluster import (
    DECISION_LOG,
    INVALID_ARGUMENT,
    MAX_HOST_LEN,
    MAX_VERSION,
    MAX_WORLD_SIZE,
    AssignmentRecord,
    Cluster,
    Rejected,
    Snapshot,
    cluster_state,
)
from dynamix_byteps.control.decision_record import DecisionRecord
from dynamix_byteps.control.security import (
    MAX_CONCURRENT_RPCS,
    SERVER_OPTIONS,
    AsyncTokenInterceptor,
    grpc_address,
    is_loopback,
    listen,
    require_bearer_token,
    server_credentials,
)
from dynamix_byteps.errors import ConfigurationError, DynamixError
from dynamix_byteps.extras import import_extra
from dynamix_byteps.policy.base import Policy
from dynamix_byteps.regular_files import open_regular
from dynamix_byteps.tensorboard_scalars import decision_scalars, open_writer, scheduler_logdir

log = logging.getLogger("dynamix_byteps.scheduler")

SERVICE = "dynamix.v1.Scheduler"
MAX_REASON_LEN = 1000
# Rank 0 broadcasts the newest assignment it holds at each interval boundary, so its report's
# answer is held until the decision that report was waiting for (the other ranks' reports of the
# same boundary arrive within milliseconds): the new sizes then apply one interval sooner.
# Bounded well below the client's RPC timeout; the client thread waits, training does not.
ANSWER_WAIT_S = 0.5
# A call whose request has arrived and that waits longer than this for a handler thread is at
# risk: the workers' deadline is 2 s, and a call whose deadline passes in the queue is dropped
# unanswered (the client sees DEADLINE_EXCEEDED, or CANCELLED when the server's timer fires first).
# Both are counted and logged. Measured on the 2-core test machine with the thread-per-call server
# this replaced: it answered ~800 Register calls/s, so of 2000 sent at once by one asyncio client
# with a 2 s deadline, 241 ended DEADLINE_EXCEEDED and 117 CANCELLED.
QUEUE_WARN_S = 0.5
DEADLINE_SLACK_S = 0.01  # a call cancelled with less time left than this was cancelled for its deadline
QUEUE_WARN_EVERY_S = 10.0  # at most one warning about slow queues per this many seconds


class SchedulerStartError(DynamixError, OSError):
    """The scheduler could not bind its gRPC or metrics port."""


def _num(x):
    """A float for JSON: non-finite (NaN, ±inf) becomes null."""
    return x if x is None or math.isfinite(x) else None


def _jsonable(x, depth: int = 0):
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return _num(x)
    if depth < 12 and isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if depth < 12 and isinstance(x, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in x]
    try:
        return _num(float(x))  # numpy scalars
    except (TypeError, ValueError):
        return str(x)


def _logged_version(line: bytes) -> int | None:
    """The ``version`` of one decision-log line, None if absent or not an integer in ``[0, MAX_VERSION]``."""
    try:
        version = json.loads(line)["version"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        return None
    return version


def _encode_line(record: dict) -> bytes:
    """One JSON line; a value JSON cannot hold (inf, NaN, an object) is written as null or text,
    so a decision is never missing from the log."""
    try:
        text = json.dumps(record, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        text = json.dumps(_jsonable(record), allow_nan=False, separators=(",", ":"))
    return (text + "\n").encode()


class DecisionLog:
    """Append-only JSONL file written by a background thread, in submission order.

    Each record is encoded and written with a single ``os.write`` on an ``O_APPEND``
    descriptor (no user-space buffer), so the file never holds a half line from this process;
    a torn last line left by a crash is cut off when the file is reopened. Writing happens off
    the RPC path, so a slow run directory (NFS, a full disk) cannot stall the workers; ``close``
    drains what was submitted. ``on_record``, when given, is then called with each record on
    the same thread (the TensorBoard scalars).
    """

    def __init__(self, path: Path, on_record=None):
        self.path = Path(path)
        self._on_record = on_record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_version = self._repair_and_scan()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dynamix-decision-log", daemon=True)
        self._thread.start()

    def _repair_and_scan(self) -> int:
        """Cut a torn last line (crash mid-write) and return the newest logged version (0 if none);
        a line whose version is not an integer in ``[0, MAX_VERSION]`` is skipped with a warning."""
        try:
            with open_regular(self.path, "rb+") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - (8 << 20)))  # a 4096-worker line is ~1 MiB
                tail = f.read()
                end = tail.rfind(b"\n") + 1
                if end < len(tail):
                    f.truncate(size - (len(tail) - end))
                for line in reversed(tail[:end].splitlines()):
                    if (version := _logged_version(line)) is not None:
                        return version
                    log.warning("%s: skipping a line without a valid version (an integer in [0, %d])",
                                self.path, MAX_VERSION)
        except FileNotFoundError:
            pass
        return 0

    def submit(self, make_record) -> None:
        """Queue ``make_record()`` (a callable returning a JSON-able dict) to be built and appended."""
        self._queue.put(make_record)

    def _run(self) -> None:
        while (make_record := self._queue.get()) is not None:
            try:
                record = make_record()
                view = memoryview(_encode_line(record))
                while view:
                    view = view[os.write(self._fd, view):]
            except Exception:  # one bad record or a full disk must not end the log thread
                log.exception("cannot append a decision to %s", self.path)
                continue
            if self._on_record is not None:
                try:
                    self._on_record(record)
                except Exception:
                    log.exception("cannot record decision %s in TensorBoard", record.get("decision"))

    def close(self, timeout: float = 10.0) -> None:
        if self._fd < 0:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        os.close(self._fd)
        self._fd = -1


def _prometheus_client():
    return import_extra("prometheus_client", "scheduler", "serving the scheduler's metrics (--metrics-port)")


class SchedulerMetrics:
    """Prometheus collectors of one scheduler, in their own registry (several schedulers per process are fine)."""

    def __init__(self):
        prometheus = _prometheus_client()

        self.registry = prometheus.CollectorRegistry()
        r = self.registry
        per_rank = {
            "batch_size": "local batch size in force at the rank's last report, samples",
            "assigned_batch_size": "local batch size of the newest assignment, samples",
            "samples_per_second": "compute-only throughput at the last report, samples/s",
            "compute_seconds": "mean compute time per step at the last report, seconds",
            "push_pull_seconds": "mean push_pull time per step at the last report, seconds",
            "loss": "mean training loss over the rank's last interval",
        }
        self._gauges = {k: prometheus.Gauge(f"dynamix_worker_{k}", doc, ["rank"], registry=r) for k, doc in per_rank.items()}
        self._children: dict[int, dict] = {}
        self.decisions = prometheus.Counter("dynamix_decisions", "policy decisions, by action (change, keep, error)", ["action"], registry=r)
        self.version = prometheus.Gauge("dynamix_assignment_version", "version of the newest assignment", registry=r)
        self.registered = prometheus.Gauge("dynamix_registered_workers", "workers registered", registry=r)
        self.rejected = prometheus.Counter("dynamix_rejected_requests", "requests refused, by gRPC status code", ["code"], registry=r)
        self.decision_seconds = prometheus.Histogram(
            "dynamix_decision_seconds", "state snapshot + policy + log, seconds", registry=r,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0),
        )
        self.http = None

    def _rank(self, rank: int) -> dict:
        c = self._children.get(rank)
        if c is None:
            c = self._children[rank] = {k: g.labels(rank=str(rank)) for k, g in self._gauges.items()}
        return c

    def report(self, r) -> None:
        c = self._rank(r.rank)
        c["batch_size"].set(r.local_batch_size)
        c["samples_per_second"].set(r.samples_per_s)
        c["compute_seconds"].set(r.compute_s)
        c["push_pull_seconds"].set(r.push_pull_s)
        c["loss"].set(r.loss)

    def assignment(self, a: AssignmentRecord) -> None:
        self.version.set(a.version)
        for rank, b in enumerate(a.batch_sizes):
            if b:
                self._rank(rank)["assigned_batch_size"].set(b)

    def serve(self, host: str, port: int, token: str | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = pick) from a daemon thread; returns the port.
        With ``token``, a request needs ``Authorization: Bearer <token>`` (else 401).

        Raises:
            SchedulerStartError: the port cannot be bound.
        """
        app = _prometheus_client().make_wsgi_app(self.registry)
        if token:
            app = require_bearer_token(app, token)
        try:
            self.http = _metrics_http_server(host.strip("[]"), port, app)
        except OSError as error:
            raise SchedulerStartError(f"cannot serve /metrics on {host}:{port}: {error.strerror or error}") from None
        # shutdown() waits for the loop's next poll: 0.1 s, not the default 0.5 s, per stop
        threading.Thread(target=self.http.serve_forever, args=(0.1,), name="dynamix-metrics", daemon=True).start()
        return self.http.server_address[1]

    def close(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None


class _QueueWatch:
    """Counts calls, their request received, that waited more than :data:`QUEUE_WARN_S` for a
    handler thread or were dropped while waiting (their deadline passed),
    and says so in the log (at most every :data:`QUEUE_WARN_EVERY_S`)."""

    def __init__(self, threads: int, clock=time.monotonic):
        self.threads, self._clock = threads, clock
        self._lock = threading.Lock()
        self.slow_calls = 0  # since the scheduler started
        self._unsaid, self._unsaid_dropped, self._longest_s, self._said_at = 0, 0, 0.0, -math.inf

    def waited(self, seconds: float, dropped: bool = False) -> None:
        """Note a call that waited ``seconds`` for a thread; ``dropped``: it was cancelled before getting one."""
        if seconds <= QUEUE_WARN_S and not dropped:
            return
        with self._lock:
            self.slow_calls += 1
            self._unsaid += 1
            self._unsaid_dropped += dropped
            self._longest_s = max(self._longest_s, seconds)
            if self._clock() - self._said_at < QUEUE_WARN_EVERY_S:
                return
        self.flush()

    def flush(self) -> None:
        """Log the slow calls not reported yet (the scheduler stopping calls this too)."""
        with self._lock:
            if not self._unsaid:
                return
            count, dropped, longest = self._unsaid, self._unsaid_dropped, self._longest_s
            self._unsaid, self._unsaid_dropped, self._longest_s, self._said_at = 0, 0, 0.0, self._clock()
        log.warning("%d call(s) waited up to %.2f s, their request received, for one of the scheduler's %d handler "
                    "threads; %d of them dropped unanswered, their deadline passed while they waited (the client "
                    "got DEADLINE_EXCEEDED or CANCELLED): the scheduler got more calls at once than it answers within the "
                    "deadline", count, longest, self.threads, dropped)


class _WatchedExecutor(futures.ThreadPoolExecutor):
    """A thread pool that tells a :class:`_QueueWatch` how long each job waited for a thread."""

    def __init__(self, watch: _QueueWatch):
        super().__init__(max_workers=watch.threads, thread_name_prefix="dynamix-scheduler")
        self._watch = watch

    def submit(self, fn, /, *args, **kwargs):
        queued = time.monotonic()

        def timed():
            self._watch.waited(time.monotonic() - queued)
            return fn(*args, **kwargs)

        return super().submit(timed)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # a scrape every few seconds would flood stderr
        pass


def _metrics_http_server(host: str, port: int, app) -> WSGIServer:
    """A threaded, bound but not yet serving WSGI server for ``app``; IPv6 when ``host`` is one."""
    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    return make_server(host, port, app, Server, handler_class=_QuietHandler)


class SchedulerServer:
    """The gRPC scheduler. ``start()`` binds and returns the port; ``stop()`` ends it.

    Args:
        policy: decides batch sizes (wrap it in the guardrails before passing it in).
        num_workers: job size, or None to take it from the first registration.
        decision_interval: K, steps between decisions (>= 1).
        bind: listen address; anything but loopback requires ``token``.
        port: TCP port, 0 = pick a free one (see :attr:`port` after ``start``).
        token: shared secret every call must carry as ``x-dynamix-token`` metadata; None = no check.
        tls_cert, tls_key: PEM certificate and private key files: serve TLS only (both or neither).
        run_dir: directory of ``decisions.jsonl`` and ``tensorboard/scheduler``; None = neither.
        metrics_port: Prometheus port, 0 = pick, None = off; with ``token``, a scrape must send
            ``Authorization: Bearer <token>``.
        max_threads: handler threads, taken by a call once its request has arrived; one may wait up
            to ``ANSWER_WAIT_S`` for a decision. Calls that queue longer than ``QUEUE_WARN_S`` for a
            thread, or are dropped while queued, are counted and logged as a warning.

    Raises:
        ConfigurationError: bad arguments (non-loopback bind without a token, K < 1, one of
            ``tls_cert``/``tls_key`` only or an unreadable one, ...).
        SchedulerStartError: from ``start()`` when a port cannot be bound.
    """

    def __init__(self, policy: Policy, *, num_workers: int | None = None, decision_interval: int = 10,
                 bind: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 tls_cert: str | os.PathLike | None = None, tls_key: str | os.PathLike | None = None,
                 run_dir: str | os.PathLike | None = None, metrics_port: int | None = None, max_threads: int = 8):
        if decision_interval < 1:
            raise ConfigurationError(f"decision_interval={decision_interval} must be >= 1")
        if num_workers is not None and not 1 <= num_workers <= MAX_WORLD_SIZE:
            raise ConfigurationError(f"num_workers={num_workers} must be between 1 and {MAX_WORLD_SIZE}")
        if not token and not is_loopback(bind):
            raise ConfigurationError(
                f"binding the scheduler to {bind} makes it reachable from other hosts; "
                "pass --token or set DYNAMIX_TOKEN to a shared secret (or bind 127.0.0.1)"
            )
        self.policy = policy
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        self.bind, self._port, self.token = bind, port, token or None
        self._interceptors = (AsyncTokenInterceptor(token),) if token else ()
        self._credentials = server_credentials(tls_cert, tls_key)
        self.tls = self._credentials is not None
        self.decision_interval = decision_interval
        self.summaries = open_writer(scheduler_logdir(run_dir)) if run_dir is not None else None
        self.decision_log = (DecisionLog(Path(run_dir) / DECISION_LOG, self._record_scalars if self.summaries else None)
                             if run_dir is not None else None)
        base = self.decision_log.last_version if self.decision_log else 0
        self.cluster = Cluster(num_workers, decision_interval, self.policy_name, base_version=base)
        self.metrics = SchedulerMetrics() if metrics_port is not None else None
        self._metrics_port = metrics_port
        self._turn = threading.Condition()  # decisions one at a time, in the order they became due
        self._tickets = self._serving = 0
        self._rank0_waiting = False  # a rank-0 report is held for the decision (one at a time)
        self._said_elsewhere: set[int] = set()  # ranks an agent on another host than theirs reported (cluster.lock)
        self.queue_watch = _QueueWatch(max_threads)
        self._grpc_loop: tuple[threading.Thread, asyncio.Future] | None = None  # the loop's thread, its stop signal
        self._cached: tuple[AssignmentRecord | None, bytes] = (None, b"")
        self.port: int | None = None
        self.metrics_port: int | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> int:
        """Bind the gRPC port (and the metrics port) and serve from a background thread; returns the port.

        Raises:
            SchedulerStartError: a port cannot be bound.
            RuntimeError: it is already serving.
        """
        if self._grpc_loop is not None:
            raise RuntimeError(f"this scheduler already serves on port {self.port}; stop() it before starting it again")
        started: futures.Future = futures.Future()
        thread = threading.Thread(target=asyncio.run, args=(self._serve(started),), name="dynamix-scheduler-grpc",
                                  daemon=True)
        thread.start()
        try:
            port, stop_requested = started.result()
        except OSError as error:
            thread.join()
            raise SchedulerStartError(str(error)) from None
        self._grpc_loop, self.port = (thread, stop_requested), port
        if self.metrics is not None:
            try:
                self.metrics_port = self.metrics.serve(self.bind, self._metrics_port, self.token)
            except SchedulerStartError:
                self._stop_grpc(None)
                raise
        return port

    async def _serve(self, started: futures.Future) -> None:
        """The event loop's life: serve, tell ``started`` the port and the stop signal (or why it
        cannot bind), and once :meth:`stop` sets the signal to the grace period, stop and let the
        handlers still running finish."""
        executor = _WatchedExecutor(self.queue_watch)
        try:
            server = grpc.aio.server(handlers=[self._generic_handler(executor)], interceptors=self._interceptors,
                                     options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
            port = listen(server, self.bind, self._port, self._credentials)
            await server.start()
        except Exception as error:
            executor.shutdown()
            started.set_exception(error)
            return
        stop_requested = asyncio.get_running_loop().create_future()
        started.set_result((port, stop_requested))
        await server.stop(await stop_requested)
        await asyncio.to_thread(executor.shutdown)

    def _stop_grpc(self, grace: float | None) -> None:
        if self._grpc_loop is not None:
            thread, stop_requested = self._grpc_loop
            stop_requested.get_loop().call_soon_threadsafe(stop_requested.set_result, grace)
            thread.join()
            self._grpc_loop = None
            self.queue_watch.flush()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: calls still running after ``grace`` seconds (None: at once) are cancelled;
        then close the metrics endpoint, the decision log and the TensorBoard writer. Leaves no thread."""
        self._stop_grpc(grace)
        if self.metrics is not None:
            self.metrics.close()
        if self.decision_log is not None:
            self.decision_log.close()
        if self.summaries is not None:
            self.summaries.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until another thread stops the scheduler, or ``timeout`` seconds pass (None: no limit).

        Returns:
            True if it is still serving (the timeout passed first), else False.
        """
        if self._grpc_loop is None:
            return False
        thread, _ = self._grpc_loop
        thread.join(timeout)
        return thread.is_alive()

    def __enter__(self) -> "SchedulerServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return grpc_address(self.bind, self.port)

    # ---- the service ----------------------------------------------------------------------

    def _generic_handler(self, executor: futures.Executor):
        def method(fn, request_type, serialize):
            async def handle(raw: bytes, context):
                queued = time.monotonic()
                job = executor.submit(self._answer, fn, request_type, raw)
                try:
                    return await asyncio.wrap_future(job)
                except Rejected as refusal:
                    await context.abort(grpc.StatusCode[refusal.code], refusal.message)
                except asyncio.CancelledError:
                    # Dropped for the queue only when it never got a thread and its deadline passed
                    # (not a client that gave up, nor a call cut by stop()).
                    remaining = context.time_remaining()
                    if job.cancel() and remaining is not None and remaining < DEADLINE_SLACK_S:
                        self.queue_watch.waited(time.monotonic() - queued, dropped=True)
                    raise
            # Raw bytes in: parsing in the handler lets malformed input get INVALID_ARGUMENT (gRPC says INTERNAL).
            return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=None, response_serializer=serialize)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Register": method(self.register, dynamix_pb2.WorkerInfo, dynamix_pb2.RegisterReply.SerializeToString),
            "ReportMetrics": method(self._answer_report, dynamix_pb2.Report, None),  # returns cached bytes
            "ReportNode": method(self.report_node, dynamix_pb2.NodeReport, dynamix_pb2.NodeReportReply.SerializeToString),
        })

    def _answer(self, fn, request_type, raw: bytes):
        """``fn``'s answer to the serialized ``request_type`` message ``raw`` (on a handler thread).

        Raises:
            Rejected: malformed bytes (INVALID_ARGUMENT), a refused request, or a failure of
                ``fn`` (INTERNAL, logged).
        """
        try:
            return fn(request_type.FromString(raw))
        except DecodeError as error:
            refusal = Rejected(INVALID_ARGUMENT, f"malformed {request_type.DESCRIPTOR.name} message: {error}")
        except Rejected as rejected:
            refusal = rejected
        except Exception:  # never let a handler bug reach gRPC as a crash
            log.exception("scheduler handler failed")
            refusal = Rejected("INTERNAL", "internal error in the scheduler; see its log")
        if self.metrics is not None:
            self.metrics.rejected.labels(code=refusal.code).inc()
        raise refusal

    def register(self, info) -> dynamix_pb2.RegisterReply:
        """``Register``: record the worker, answer with the assignment in force and K."""
        with self.cluster.lock:
            current = self.cluster.register_locked(info)
            registered = len(self.cluster.workers)
            notice, held = self.cluster.notice, info.rank in self.cluster.came_back
        if self.metrics is not None:
            self.metrics.registered.set(registered)
            self.metrics.assignment(current)
        log.info("rank %d registered from %r (batch %d, bounds [%d, %s], step %d); %d workers registered%s",
                 info.rank, info.host, info.batch_size, info.min_batch or 1, info.max_batch or "-", info.step,
                 registered, f"; {current.reason}" if held else "")
        if notice:
            log.info("%s", notice)
        return dynamix_pb2.RegisterReply(assignment=_to_proto(current), decision_interval=self.decision_interval)

    def report_node(self, report) -> dynamix_pb2.NodeReportReply:
        """``ReportNode``: keep a node agent's metrics for the next decision."""
        with self.cluster.lock:
            # said once per rank, whichever of the handler threads gets its report first
            unsaid = sorted(set(self.cluster.node_report_locked(report)) - self._said_elsewhere)
            self._said_elsewhere.update(unsaid)
        for rank in unsaid:
            log.warning("the node agent on host %r reports rank %d, which registered from another host; its metrics "
                        "of that rank are left out (a worker of another job with the same DYNAMIX_JOB_ID there?)",
                        report.host[:MAX_HOST_LEN], rank)
        return dynamix_pb2.NodeReportReply()

    def report(self, report) -> dynamix_pb2.Assignment:
        """``ReportMetrics`` in-process: store the report, decide if the interval is complete.

        Unlike the RPC, rank 0 is answered at once (an in-process caller may be the one that
        reports the other ranks next)."""
        return dynamix_pb2.Assignment.FromString(self._report_bytes(report, wait=False))

    def _answer_report(self, report) -> bytes:
        return self._report_bytes(report, wait=True)

    def _report_bytes(self, report, wait: bool) -> bytes:
        awaited = None
        with self.cluster.lock:
            was_ready = 0 in self.cluster.ready
            current, snap = self.cluster.report_locked(report)
            if snap is not None:  # a ticket taken under the state lock: decisions run in interval order
                ticket, self._tickets = self._tickets, self._tickets + 1
            elif (wait and report.rank == 0 and not was_ready and not self._rank0_waiting
                  and self.cluster.awaits_others(0)):
                awaited = self._tickets  # the ticket of the decision this report completes with others
                self._rank0_waiting = True
        if self.metrics is not None:
            self.metrics.report(report)
        if snap is not None:
            with self._turn:
                while self._serving != ticket:
                    self._turn.wait()
            try:
                current = self._decide(snap)
            finally:
                with self._turn:
                    self._serving += 1
                    self._turn.notify_all()
        elif awaited is not None:
            try:
                with self._turn:
                    self._turn.wait_for(lambda: self._serving > awaited, timeout=ANSWER_WAIT_S)
            finally:
                with self.cluster.lock:
                    self._rank0_waiting = False
                    current = self.cluster.assignment_for_locked(0)
        cached, data = self._cached
        if cached is not current:
            data = _to_proto(current).SerializeToString()
            self._cached = (current, data)
        return data

    # ---- decisions ------------------------------------------------------------------------

    def _record_scalars(self, record: dict) -> None:
        """A logged decision into ``<run_dir>/tensorboard/scheduler`` (on the decision-log thread)."""
        self.summaries.add(decision_scalars(record), record["step"], record["time"])

    def _decide(self, snap: Snapshot) -> AssignmentRecord:
        t0 = time.perf_counter()
        state = cluster_state(snap)
        t1 = time.perf_counter()
        error = None
        try:
            decision = self.policy.decide(state)
            sizes, clamped = self._checked_sizes(decision.batch_sizes, snap)
            reason = str(decision.reason)[:MAX_REASON_LEN]
            gain, terms = float(decision.predicted_gain), decision.terms
        except Exception as exc:  # a policy bug keeps the assignment in force; training goes on
            log.exception("policy %s failed; keeping the current assignment", self.policy_name)
            error = f"{type(exc).__name__}: {exc}"[:MAX_REASON_LEN]
            sizes, clamped, reason, gain, terms = snap.current.batch_sizes, [], f"policy error, kept: {error}", 0.0, {}
        t2 = time.perf_counter()
        lr_scale = terms.get("lr_scale") if isinstance(terms, dict) else None
        if not isinstance(lr_scale, (int, float)) or not math.isfinite(lr_scale) or lr_scale <= 0:
            lr_scale = sum(sizes) / sum(snap.initial_batch_sizes)
        with self.cluster.lock:
            new = self.cluster.publish_locked(snap, sizes, reason, float(lr_scale))
            index = self.cluster.decisions
        action = "error" if error else ("change" if new is not snap.current else "keep")
        timing = {"policy_s": t2 - t1, "decision_s": time.perf_counter() - t0}
        if self.decision_log is not None:
            self.decision_log.submit(
                lambda: self._log_record(index, snap, state, new, action, reason, gain, terms, clamped, error, timing).to_dict())
        if self.metrics is not None:
            self.metrics.decisions.labels(action=action).inc()
            self.metrics.assignment(new)
            self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        if action == "change":
            log.info("decision %d at step %d: version %d %s (%s)", index, snap.step, new.version, list(new.batch_sizes), reason)
        return new

    @staticmethod
    def _checked_sizes(proposed, snap: Snapshot) -> tuple[tuple[int, ...], list[int]]:
        """Integers, one per rank, clamped into each worker's bounds; also the ranks that were clamped."""
        sizes = [operator.index(b) for b in proposed]
        if len(sizes) != len(snap.workers):
            raise ValueError(f"policy returned {len(sizes)} batch sizes for {len(snap.workers)} workers")
        out = tuple(b if w.min_batch <= b and (w.max_batch is None or b <= w.max_batch) else w.clamp(b)
                    for w, b in zip(snap.workers, sizes))
        return out, [r for r, (a, b) in enumerate(zip(sizes, out)) if a != b]

    def _log_record(self, index, snap, state, new, action, reason, gain, terms, clamped, error, timing) -> DecisionRecord:
        """One decision-log line. ``state.workers`` is columnar: one list per field, index = rank."""
        ws = state.workers
        workers = {
            "rank": [w.rank for w in ws],
            "batch_size": [w.batch_size for w in ws],
            "batch_size_ran": [w.batch_size_ran for w in ws],
            "compute_s": [w.compute_s for w in ws],
            "push_pull_s": [w.push_pull_s for w in ws],
            "push_s": [w.push_s for w in ws],
            "pull_s": [w.pull_s for w in ws],
            "exposed_comm_s": [w.exposed_comm_s for w in ws],
            "samples_per_s": [w.samples_per_s for w in ws],
            "min_batch": [w.min_batch for w in ws],
            "max_batch": [w.max_batch for w in ws],
            "loss": [_num(iv.loss / iv.loss_count) if iv.loss_count else None for iv in snap.intervals],
            "reports": [iv.count for iv in snap.intervals],
            "node": [w.node for w in ws],
        }
        step_time = max((w.compute_s + w.push_pull_s for w in state.workers), default=0.0)
        history = state.loss_history
        loss = history[-1] if history else None
        change = history[-1] - history[-2] if len(history) >= 2 else None
        return DecisionRecord(
            time=time.time(),
            decision=index,
            step=snap.step,
            policy=self.policy_name,
            action=action,
            version=new.version,
            previous_version=snap.current.version,
            effective_step=new.effective_step,
            batch_sizes_before=list(snap.current.batch_sizes),
            batch_sizes=list(new.batch_sizes),
            lr_scale=_num(new.lr_scale),
            reason=reason,
            predicted_gain=_num(gain),
            terms=_jsonable(terms),
            clamped_ranks=clamped,
            error=error,
            state={
                "workers": workers,
                "initial_batch_sizes": list(state.initial_batch_sizes),
                "loss_history_tail": [_num(x) for x in history[-8:]],
                "grad_sq": _num(state.grad_sq),
                "trace_cov": _num(state.trace_cov),
                "noise_scale": _num(state.noise_scale),
                "dataset_size": state.dataset_size,
                "engine": state.engine,
            },
            reward={
                "throughput_samples_per_s": state.global_batch / step_time if step_time > 0 else None,
                "step_time_s": step_time,
                "loss": _num(loss),
                "loss_change": _num(change),
            },
            timing=timing,
        )


def _to_proto(a: AssignmentRecord) -> dynamix_pb2.Assignment:
    return dynamix_pb2.Assignment(
        version=a.version, effective_step=a.effective_step, batch_sizes=a.batch_sizes,
        lr_scale=a.lr_scale, policy=a.policy, reason=a.reason,
    )
