"""A summation server of the ``ps`` engine: sums each round's pushes per key and answers the pulls.

Every worker pushes partition ``key`` once per round (``round`` counts that key's pushes on the
worker, from 0) and pulls it once; the server adds the pushes of ``(key, round)`` in the payload's
dtype and answers every pull of that round once the last of the ``num_workers`` pushes has been
added. Rounds are told apart by their number, so back-to-back rounds of one key never mix (BytePS
0.2.5's CPU server returned partial sums exactly there). A round is forgotten once every worker
has pulled it.

A worker that shuts its engine down tells every server first (:meth:`SummationServer.leave`): it
will push nothing more, so every round still short of its push fails at once, and so does any such
round opened later. A worker that fails or returns early then stops the others within moments, not
after the collective timeout.

Each pull is answered with the sum and the nanoseconds, on the server's clock, from that worker's
push arriving to the sum leaving for it: the time the worker waited for the others (and for its
own pull request), which the worker subtracts from its pull to time the transfer alone.

Run one per server (``bpslaunch --engine ps --num-servers K`` starts them)::

    python -m dynamix_byteps.engine.ps_server --server-id 0 --num-servers 2 --num-workers 4 \\
        --addr 127.0.0.1 --port 29501

Each option defaults to its variable (``DYNAMIX_SERVER_ID``, ``DMLC_NUM_SERVER``, ``DYNAMIX_SIZE``
or ``DMLC_NUM_WORKER``, ``DMLC_PS_ROOT_URI``, ``DYNAMIX_PS_PORT``, ``DYNAMIX_TIMEOUT``);
``DYNAMIX_PS_CHANNELS`` restricts TensorPipe's channels (:mod:`~dynamix_byteps.engine.ps_rendezvous`). The
server returns once every worker has shut its engine down, exits with status 3
(``STOPPED_BY_A_WORKER``) when a worker reports that the job failed, and exits by itself when its
parent process (the launcher) is gone, so it never outlives the job. It also exits with status 3
once a worker's process is gone without leaving the job (SIGKILL, a crash, ``os._exit``: no worker
can report that), after failing that worker's rounds for the others: it checks every second that
each worker still answers, and a worker whose connection fails is gone (one that is slow to answer
is left to the collectives' timeout). Without it, the servers of a torchrun job (which starts no
servers, so none of its own outlive it) waited for the dead worker forever, and the survivors for
``DYNAMIX_TIMEOUT``. SIGINT ends it as SIGTERM does, without a word.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import warnings

import torch
from torch.distributed import rpc

from dynamix_byteps.engine.ps_rendezvous import (
    STOPPED_BY_A_WORKER,
    PSRendezvous,
    channels_from_env,
    server_name,
    worker_name,
)
from dynamix_byteps.env import DEFAULT_TIMEOUT_S, optional_int
from dynamix_byteps.errors import ConfigurationError

PARENT_POLL_S = 1.0
WORKER_POLL_S = 1.0  # how often a server checks that every worker still answers


class _Round:
    """The pushes and pulls of one key in one round."""

    __slots__ = ("lock", "total", "pushes", "pulls", "waiting", "arrived_ns", "complete", "error")

    def __init__(self):
        self.lock = threading.Lock()
        self.total = None  # the running sum, the first push's tensor (received for us, so ours to add into)
        self.pushes = 0
        self.pulls = 0
        self.waiting: list = []  # (future, worker) of pulls that came before the last push
        self.arrived_ns: dict[int, int] = {}  # worker -> monotonic ns its push arrived
        self.complete = False
        self.error: str | None = None

    def answer(self, future: torch.futures.Future, worker: int) -> None:
        """Send the sum and the hold: ns since ``worker``'s push arrived (0 if it never did)."""
        now = time.monotonic_ns()
        future.set_result((self.total, now - self.arrived_ns.get(worker, now)))


class SummationServer:
    """Per-key, per-round sums of ``num_workers`` pushes (thread-safe: RPC handlers run concurrently)."""

    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._rounds: dict[tuple[int, int], _Round] = {}
        self._left: set[int] = set()  # workers that shut down: they push nothing more

    def staying(self) -> list[int]:
        """The workers that have not shut their engine down."""
        with self._lock:
            return [worker for worker in range(self.num_workers) if worker not in self._left]

    @property
    def open_rounds(self) -> int:
        """Rounds not yet pulled by every worker."""
        with self._lock:
            return len(self._rounds)

    def _round(self, key: int, round_: int) -> _Round:
        with self._lock:
            state = self._rounds.get((key, round_))
            if state is None:
                state = self._rounds[(key, round_)] = _Round()
                if self._left:
                    state.error = _stranded(key, round_, min(self._left))
            return state

    def leave(self, worker: int) -> int:
        """Worker rank ``worker`` shut down: fail every open round it has not pushed (their pulls
        raise ``ValueError`` naming it) and every round opened from now on. Returns how many open
        rounds failed: others were waiting for a push that will never come."""
        with self._lock:
            self._left.add(worker)
            rounds = list(self._rounds.items())
        stranded = 0
        for (key, round_), state in rounds:
            with state.lock:
                if state.complete or state.error is not None or worker in state.arrived_ns:
                    continue
                state.error = _stranded(key, round_, worker)
                failed, state.waiting = state.waiting, []
            stranded += 1
            for future, _ in failed:
                future.set_exception(ValueError(state.error))
        return stranded

    def _forget(self, key: int, round_: int) -> None:
        with self._lock:
            self._rounds.pop((key, round_), None)

    def push(self, key: int, round_: int, tensor: torch.Tensor, worker: int) -> None:
        """Add ``tensor`` (1-D, any dtype) to round ``round_`` of ``key``, pushed by worker rank ``worker``.

        A push never raises: when the round has failed (its pushes differ in shape or dtype, or a
        worker left without pushing it), every pull of the round raises ``ValueError`` saying why,
        the pusher's own included. (An exception raised in an RPC handler is also printed by the
        server, once per push.)
        """
        state = self._round(key, round_)
        arrived = time.monotonic_ns()
        with state.lock:
            state.arrived_ns[worker] = arrived
            if state.error is None and state.total is not None and (
                    state.total.shape != tensor.shape or state.total.dtype != tensor.dtype):
                state.error = (f"key {key} round {round_}: workers pushed different tensors "
                               f"({tuple(state.total.shape)} {state.total.dtype} and {tuple(tensor.shape)} {tensor.dtype})")
            if state.error is not None:
                failed, state.waiting = state.waiting, []
            else:
                failed = None
                if state.total is None:
                    state.total = tensor
                else:
                    state.total += tensor
                state.pushes += 1
                if state.pushes < self.num_workers:
                    return
                ready, state.waiting = state.waiting, []
                state.complete = True
                finished = state.pulls == self.num_workers
        if failed is not None:
            for future, _ in failed:
                future.set_exception(ValueError(state.error))
            return
        if finished:
            self._forget(key, round_)
        for future, puller in ready:
            state.answer(future, puller)

    def pull(self, key: int, round_: int, worker: int) -> torch.futures.Future:
        """A future of ``(sum, hold_ns)`` for round ``round_`` of ``key``, set once every worker has
        pushed it: the sum (1-D, the pushes' dtype) and the ns from ``worker``'s push arriving to
        the answer leaving (int, server clock; the module docstring says why)."""
        future = torch.futures.Future()
        state = self._round(key, round_)
        with state.lock:
            state.pulls += 1
            if state.error is not None:
                future.set_exception(ValueError(state.error))
                return future
            if not state.complete:
                state.waiting.append((future, worker))
                return future
            finished = state.pulls == self.num_workers
        if finished:
            self._forget(key, round_)
        state.answer(future, worker)
        return future


def _stranded(key: int, round_: int, worker: int) -> str:
    return (f"worker {worker} left the job without pushing key {key} round {round_} (its process is ending: it "
            "failed or returned before the others; its own output says why)")


# RPC calls a function by its qualified name, so the process's server must be reachable from one:
# this is it, set once by serve().
_serving: SummationServer | None = None


def push(key: int, round_: int, tensor: torch.Tensor, worker: int) -> None:
    """RPC entry: :meth:`SummationServer.push` on this process's server."""
    _serving.push(key, round_, tensor, worker)


@rpc.functions.async_execution
def pull(key: int, round_: int, worker: int) -> torch.futures.Future:
    """RPC entry: :meth:`SummationServer.pull` on this process's server."""
    return _serving.pull(key, round_, worker)


def leave(worker: int) -> int:
    """RPC entry: :meth:`SummationServer.leave` on this process's server."""
    return _serving.leave(worker)


def abort(reason: str) -> None:
    """RPC entry: a worker saw the job fail; exit now (status :data:`STOPPED_BY_A_WORKER`) instead of
    waiting for a graceful shutdown that can no longer come."""
    _stop(f"a worker reported: {reason}")


def alive() -> bool:
    """RPC entry on a worker: answers a server's check that its process is still there."""
    return True


_stopping = threading.Lock()  # taken, never released, by the first _stop


def _stop(reason: str) -> None:
    """Exit with status :data:`STOPPED_BY_A_WORKER` in 0.2 s, after the answers under way went out.
    Only the first call says why: every worker of a failed job reports, at once, from RPC threads
    whose prints ran into one line."""
    if not _stopping.acquire(blocking=False):
        return
    print(f"ps server: stopping, {reason}", file=sys.stderr, flush=True)
    threading.Timer(0.2, os._exit, args=(STOPPED_BY_A_WORKER,)).start()


def _gone_workers(server: SummationServer, timeout_s: float) -> list[int]:
    """The workers, not shut down, whose check failed before ``timeout_s``: their connection
    failed (a check that times out is a slow worker, not a gone one)."""
    checks, answered_at = {}, {}
    start = time.monotonic()
    for worker in server.staying():
        checks[worker] = future = rpc.rpc_async(worker_name(worker), alive, timeout=timeout_s)
        future.add_done_callback(lambda _, worker=worker: answered_at.setdefault(worker, time.monotonic()))
    gone = []
    for worker, future in checks.items():
        try:
            future.wait()
        except RuntimeError:
            if answered_at.get(worker, start + timeout_s) - start < timeout_s:
                gone.append(worker)
    staying = set(server.staying())
    return [worker for worker in gone if worker in staying]  # shutting down meanwhile is leaving


def _watch_workers(server: SummationServer, timeout_s: float) -> None:
    """Stop this server once a worker's process is gone without leaving (the module docstring says why)."""
    while True:
        time.sleep(WORKER_POLL_S)
        try:
            gone = _gone_workers(server, timeout_s)
        except RuntimeError:  # the RPC agent is shutting down: the job is ending
            return
        if gone:
            for worker in gone:
                server.leave(worker)  # the others' pulls of its rounds raise at once, naming it
            _stop(f"worker {gone[0]}'s process is gone without leaving the job (killed or crashed; the launcher's "
                  "or its own output says why): the workers cannot go on without it")
            return


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def serve(server_id: int, group: PSRendezvous) -> None:
    """Join ``group`` as server ``server_id`` and serve until every worker has shut down.

    Raises:
        RuntimeError: the rendezvous failed (from torch.distributed.rpc).
    """
    global _serving
    if not 0 <= server_id < group.num_servers:
        raise ValueError(f"server id {server_id} must be in 0..{group.num_servers - 1}")
    _serving = SummationServer(group.num_workers)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True, name="ps-parent-watch").start()
    with warnings.catch_warnings():  # TensorPipe's setup calls a deprecated c10d path internally
        warnings.simplefilter("ignore", UserWarning)
        rpc.init_rpc(server_name(server_id), rank=server_id, world_size=group.world_size,
                     rpc_backend_options=group.rpc_options())
    threading.Thread(target=_watch_workers, args=(_serving, group.timeout_s), daemon=True, name="ps-worker-watch").start()
    rpc.shutdown(graceful=True, timeout=0)  # blocks, serving, until every member has called shutdown


def _env_int(*names: str) -> int | None:
    """The first of ``names`` that is set, as an integer >= 0 (ConfigurationError naming it otherwise)."""
    for name in names:
        value = optional_int(os.environ, name, 0)
        if value is not None:
            return value
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ConfigurationError as error:
        print(f"python -m dynamix_byteps.engine.ps_server: error: {error}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamix_byteps.engine.ps_server",
                                     description="A summation server of the ps engine.")
    parser.add_argument("--server-id", type=int, default=_env_int("DYNAMIX_SERVER_ID"))
    parser.add_argument("--num-servers", type=int, default=_env_int("DMLC_NUM_SERVER"))
    parser.add_argument("--num-workers", type=int, default=_env_int("DYNAMIX_SIZE", "DMLC_NUM_WORKER"))
    parser.add_argument("--addr", default=os.environ.get("DMLC_PS_ROOT_URI") or "127.0.0.1")
    parser.add_argument("--port", type=int, default=_env_int("DYNAMIX_PS_PORT"))
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("DYNAMIX_TIMEOUT") or DEFAULT_TIMEOUT_S),
                        help="seconds an RPC may take (default: DYNAMIX_TIMEOUT or %(default)s)")
    args = parser.parse_args(argv)
    for option in ("server_id", "num_servers", "num_workers", "port"):
        if getattr(args, option) is None:
            parser.error(f"--{option.replace('_', '-')} is required (or its environment variable)")
    torch.set_num_threads(1)
    group = PSRendezvous(args.num_servers, args.num_workers, args.addr, args.port, args.timeout, channels_from_env())
    # Interrupted, a server has nothing to save or say: it ends as SIGTERM ends it, without a
    # KeyboardInterrupt traceback and the RPC agent's warnings of a shutdown that is not graceful.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        serve(args.server_id, group)
    except (RuntimeError, ValueError) as error:
        print(f"ps server {args.server_id}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Workers call dynamix_byteps.engine.ps_server.push, not __main__.push: serve from that module.
    from dynamix_byteps.engine import ps_server

    sys.exit(ps_server.main())
