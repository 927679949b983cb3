"""The ``ps`` engine: BytePS's parameter-server topology on ``torch.distributed.rpc`` (TensorPipe).

A sum all-reduce cuts the tensor into partitions (:mod:`~dynamix_byteps.engine.ps_keys`); each
partition is **pushed** to the summation server that owns its key as soon as the collective is
issued, and **pulled** back once that server has the round's sum
(:mod:`~dynamix_byteps.engine.ps_server`). Each worker moves only its own bytes over its own
connections, so a worker behind a slow link delays the round's end by its own transfer, not every
hop of a ring. Broadcast, exchange and barrier are sums too.

Push and pull of every partition go to the engine's timing ring separately, under the name
``<tensor>:<partition>`` with the kinds ``timing.PUSH`` and ``timing.PULL``: the push from its
issue to the server's acknowledgement; the pull, the sum's transfer alone: the server answers
with how long it held the sum back after this worker's push arrived (waiting for the other
workers' pushes), and that hold is left out. So a worker's push and pull times are its own
link's cost, which the step monitor reports and the ``proportional`` policy balances.

The engine also creates torch.distributed's default gloo process group over the workers only (as
the gloo engine does), so that code written for it (``DistributedSampler``, ``dist.get_world_size()``)
keeps working; the servers live in a separate RPC group (:mod:`~dynamix_byteps.engine.ps_rendezvous`).
A server that dies or an RPC that exceeds ``DYNAMIX_TIMEOUT`` makes :meth:`Handle.wait` raise
:class:`~dynamix_byteps.errors.CommunicationError`.
"""

from __future__ import annotations

import sys
import threading
import warnings

import torch
from torch.distributed import rpc

from dynamix_byteps import timing
from dynamix_byteps.engine import ps_server
from dynamix_byteps.engine.base import Engine, Handle, describe_collective
from dynamix_byteps.engine.ps_keys import KeyPlan, Partition, partition_bytes_from_env
from dynamix_byteps.engine.ps_rendezvous import PSRendezvous, server_name, worker_name
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import CommunicationError

LEAVE_TIMEOUT_S = 10.0  # a server that cannot acknowledge a departure by then is gone or hung


class _Transfer:
    """The push and pull of one partition; records both spans once both have finished."""

    __slots__ = ("timing", "part", "flat", "start_ns", "pushed_ns", "pulled_ns", "hold_ns", "lock")

    def __init__(self, comm_timing: timing.CommTiming, part: Partition, flat: torch.Tensor):
        self.timing, self.part, self.flat, self.start_ns = comm_timing, part, flat, timing.now_ns()
        self.pushed_ns = self.pulled_ns = None
        self.hold_ns = 0
        self.lock = threading.Lock()

    def on_push(self, future) -> None:
        future.value()  # raises the push's error into the chained future
        self._finish(pushed_ns=timing.now_ns())

    def on_pull(self, future) -> None:
        answer = future.value()
        if isinstance(answer, BaseException):  # a failed round's error arrives as the pull's value
            raise answer
        total, hold_ns = answer
        self.flat[self.part.start:self.part.stop].copy_(total)
        self._finish(pulled_ns=timing.now_ns(), hold_ns=hold_ns)

    def _finish(self, pushed_ns=None, pulled_ns=None, hold_ns=0) -> None:
        with self.lock:
            self.pushed_ns = pushed_ns or self.pushed_ns
            self.pulled_ns = pulled_ns or self.pulled_ns
            self.hold_ns = hold_ns or self.hold_ns
            if self.pushed_ns is None or self.pulled_ns is None:
                return
        # The last pusher's sum can overtake its own acknowledgement: its push ended with the sum.
        pushed = min(self.pushed_ns, self.pulled_ns)
        # The acknowledgement left the server when the push arrived, the sum hold_ns later (server
        # clock, a duration): what remains of the pull is the sum's own transfer.
        sent = min(pushed + max(self.hold_ns, 0), self.pulled_ns)
        self.timing.record(self.part.label, self.part.nbytes, self.start_ns, pushed, timing.PUSH)
        self.timing.record(self.part.label, self.part.nbytes, sent, self.pulled_ns, timing.PULL)


class _PSHandle(Handle):
    def __init__(self, futures: list, what: str, engine: "ParameterServerEngine"):
        self._futures = futures  # chained push and pull futures; a pull's copies the sum into place
        self._what = what
        self._engine = engine

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        for future in self._futures:
            try:
                future.wait()
            except Exception as exc:  # RPC errors arrive as RuntimeError or the server's exception type
                self._engine.broken = True
                raise CommunicationError(
                    f"{self._what} failed: {exc}. A summation server or a peer worker probably exited or hung "
                    "(or the round took longer than DYNAMIX_TIMEOUT); check the servers' and workers' output."
                ) from exc


class ParameterServerEngine(Engine):
    """Workers of a ``ps`` job: sums through K summation servers over ``torch.distributed.rpc``.

    Attributes:
        name: ``ps``.
        group: the RPC group (servers, workers, rendezvous, timeout).
        plan: the partitions and key owners declared so far.
        broken: a collective failed; :meth:`shutdown` then stops the servers and leaves without
            waiting for the other workers.
    """

    name = "ps"

    def __init__(self, env: WorkerEnv, group: PSRendezvous | None = None, partition_bytes: int | None = None):
        super().__init__(env)
        from dynamix_byteps.engine.distributed import TorchDistributedEngine

        self.group = group or PSRendezvous.from_environ(env.size, env.root_addr, env.root_port, env.timeout_s)
        self.plan = KeyPlan(self.group.num_servers,
                            partition_bytes if partition_bytes is not None else partition_bytes_from_env())
        self.broken = False
        self._rounds: list[int] = []  # pushes issued per key
        self._default_group = TorchDistributedEngine(env, "gloo", self.timing)
        try:
            self.group.wait_for_store()
            with warnings.catch_warnings():  # TensorPipe's setup calls a deprecated c10d path internally
                warnings.simplefilter("ignore", UserWarning)
                rpc.init_rpc(worker_name(env.rank), rank=self.group.worker_rpc_rank(env.rank),
                             world_size=self.group.world_size, rpc_backend_options=self.group.rpc_options())
        except RuntimeError as exc:
            self._default_group.shutdown()
            raise CommunicationError(
                f"ps rendezvous at {self.group.addr}:{self.group.port} as worker {env.rank} of {env.size} with "
                f"{self.group.num_servers} servers failed within {env.timeout_s:g} s (DYNAMIX_TIMEOUT): "
                f"{str(exc).splitlines()[0]} Check that the servers were started "
                "(bpslaunch --engine ps --num-servers K) with the same DMLC_PS_ROOT_URI/DYNAMIX_PS_PORT."
            ) from exc

    def all_reduce_async(self, tensor, name: str) -> Handle:
        """Push every partition of ``tensor`` (contiguous, CPU) now; the handle's ``wait`` returns once
        every partition's sum is in ``tensor``.

        Raises:
            ValueError: ``tensor`` is not a contiguous CPU tensor.
            CommunicationError: an RPC could not be issued (the group is gone).
        """
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the ps engine sums contiguous CPU tensors; {name!r} is "
                             f"{'non-contiguous' if tensor.device.type == 'cpu' else 'on ' + str(tensor.device)}")
        what = describe_collective(name)
        flat = tensor.view(-1)
        parts = self.plan.partitions(name, flat.numel(), flat.element_size(), str(flat.dtype))
        futures = []
        try:
            for part in parts:
                while len(self._rounds) <= part.key:
                    self._rounds.append(0)
                round_ = self._rounds[part.key]
                self._rounds[part.key] += 1
                payload = flat[part.start:part.stop]  # RPC sends a view's elements only, not its storage
                transfer = _Transfer(self.timing, part, flat)
                server = server_name(part.server)
                timeout = self.group.timeout_s
                pushed = rpc.rpc_async(server, ps_server.push, args=(part.key, round_, payload, self.rank),
                                       timeout=timeout)
                pulled = rpc.rpc_async(server, ps_server.pull, args=(part.key, round_, self.rank), timeout=timeout)
                futures.append(pushed.then(transfer.on_push))
                futures.append(pulled.then(transfer.on_pull))
        except RuntimeError as exc:
            self.broken = True
            raise CommunicationError(f"{what} failed: {exc}") from exc
        return _PSHandle(futures, what, self)

    def broadcast(self, tensor, root_rank: int, name: str) -> None:
        wire = tensor.detach().to("cpu", copy=True).contiguous()
        # Broadcast sums the bytes: root + zeros is exact for every dtype, complex128's 16-byte
        # elements included (a float sum would turn -0.0 into 0.0).
        bits = wire.view(-1).view(torch.uint8)
        if self.rank != root_rank:
            bits.zero_()
        self.all_reduce_async(bits, f"dynamix.broadcast.{name}").wait()
        with torch.no_grad():
            tensor.copy_(wire)

    def _tell_servers(self, function, args: tuple, timeout: float) -> list:
        """Call RPC entry ``function(*args)`` on every server at once; the answers of those that
        gave one within ``timeout`` seconds (a server that is gone, or fails, gives none)."""
        futures = []
        for index in range(self.group.num_servers):
            try:
                futures.append(rpc.rpc_async(server_name(index), function, args=args, timeout=timeout))
            except RuntimeError:
                pass  # that server is gone already
        answers = []
        for future in futures:
            try:
                answers.append(future.wait())
            except RuntimeError:
                pass
        return answers

    def _stop_servers(self) -> None:
        self._tell_servers(ps_server.abort, (f"worker {self.rank} saw a collective fail",), timeout=2)

    def _leave(self) -> int:
        """Tell every server this worker pushes nothing more; returns how many rounds the others had
        started without it (a server that cannot be reached counts none)."""
        return sum(self._tell_servers(ps_server.leave, (self.rank,), timeout=LEAVE_TIMEOUT_S))

    def barrier(self) -> None:
        self.all_reduce_async(torch.zeros(1, dtype=torch.int64), "dynamix.barrier.").wait()

    def shutdown(self) -> None:
        """Leave the job and destroy the workers' process group. The servers are told first
        (rounds the others still wait for fail there at once); then the RPC group is left, waiting up
        to the timeout for the others, unless this worker leaves early (the others had started rounds
        without it) or a collective failed, in which case the servers still reachable are told to stop.
        A worker interrupted (KeyboardInterrupt: its launcher forwards SIGINT to every worker) waits for
        the others all the same: they are leaving too, and leaving together is quiet (TensorPipe warns
        of every connection that closes under a live RPC agent)."""
        if _interrupted():
            self._leave()
            graceful = True
        elif self.broken:
            self._stop_servers()
            graceful = False
        else:
            graceful = not self._leave()
        try:
            rpc.shutdown(graceful=graceful, timeout=self.group.timeout_s)
        except RuntimeError:
            try:
                rpc.shutdown(graceful=False)
            except RuntimeError:
                pass
        finally:
            self._default_group.shutdown()


def _interrupted() -> bool:
    """Whether a KeyboardInterrupt is being handled, or ended the program (Python's ``sys.last_value``)."""
    return any(isinstance(error, KeyboardInterrupt) for error in (sys.exception(), getattr(sys, "last_value", None)))
