"""The embedded engines: ``torch.distributed`` with the gloo backend (CPU tensors, the default)
or the nccl backend (CUDA tensors, one GPU per worker process).

Rank 0 hosts the rendezvous at the root address of :class:`~dynamix_byteps.env.WorkerEnv`
(``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``, or torchrun's ``MASTER_ADDR:MASTER_PORT``); a job of one
worker needs no network at all. Under torchrun the launcher's agent already serves a TCPStore on
``MASTER_PORT`` and sets ``TORCHELASTIC_USE_AGENT_STORE=True``; torch's ``tcp://`` rendezvous
then makes every rank, rank 0 included, a client of that store, so the same code serves both.

Every collective's start, end and bytes go to the engine's timing ring (:attr:`Engine.timing`). With
gloo the end is the host time at which this worker first saw the collective complete
(:meth:`Handle.done` true or :meth:`Handle.wait` returned): no Python code runs on gloo's threads,
because a gloo thread that needs the GIL while the interpreter exits aborts the process
("terminate called without an active exception"). With nccl the host returns long
before the GPU has reduced anything, so the duration comes from CUDA events: one recorded on the
current stream before the collective is issued, one after :meth:`Handle.wait` has made that
stream wait for it; the event is recorded in the ring, as ``start_ns + elapsed``, once the GPU has
passed both (checked without blocking at later issues and waits; :meth:`flush_timings` blocks).
"""

from __future__ import annotations

import collections
import datetime
import gc
import threading

from dynamix_byteps.argtypes import url_host
from dynamix_byteps.engine.base import Engine, Handle, describe_collective
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import CommunicationError, EngineUnavailableError
from dynamix_byteps.timing import CommTiming, Span

try:
    import torch
    import torch.distributed as dist

    # Imported before any process group exists, because this module binds ``group.WORLD`` as a
    # default argument when first imported (torch._dynamo imports it, and constructing any
    # torch.optim optimizer imports torch._dynamo): bound to a live group, it kept the group and its
    # gloo threads running after destroy_process_group, into the interpreter's finalization, where a
    # gloo thread that needed the GIL to free a tensor aborted the finished worker ("terminate
    # called without an active exception", exit code 134).
    import torch.distributed.nn.functional  # noqa: F401
except ImportError as exc:  # pragma: no cover - torch is an install requirement
    raise EngineUnavailableError(
        f"the gloo and nccl engines need PyTorch ({exc}); install it with: pip install torch==2.13.0"
    ) from exc

BACKENDS = ("gloo", "nccl")


def _communication_error(exc: Exception, what: str) -> CommunicationError:
    return CommunicationError(
        f"{what} failed: {exc}. A peer worker probably exited or hung; check the other "
        "workers' output (bpslaunch prefixes each line with its rank)."
    )


def _default_group(what: str):
    """torch.distributed's default process group, or :class:`CommunicationError` for ``what`` once
    it was destroyed."""
    group = dist.group.WORLD
    if group is None:
        raise CommunicationError(f"{what} after the process group was destroyed (bps.shutdown() or "
                                 "torch.distributed.destroy_process_group()): call bps.init() again first")
    return group


class _CudaTimings:
    """Collectives whose CUDA events are not yet resolved, oldest first (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()

    def add(self, span: Span, start, end) -> None:
        with self._lock:
            self._pending.append((span, start, end))

    def resolve(self, block: bool = False) -> None:
        """Record every pending collective whose end event the GPU has passed (all of them if ``block``)."""
        with self._lock:
            while self._pending:
                span, start, end = self._pending[0]
                if block:
                    end.synchronize()
                elif not end.query():
                    break
                self._pending.popleft()
                span.end(span.start_ns + round(start.elapsed_time(end) * 1e6))


class _DistributedHandle(Handle):
    """``span`` is recorded once this worker sees the collective complete (gloo: host time), or, with
    ``timings`` and the CUDA event ``start`` given (nccl), once the GPU has passed the collective.

    The handle lets go of torch's ``Work`` as soon as it has seen it complete: a ``Work`` keeps the
    group's gloo connections (their I/O thread) and its store alive, so one still held at
    :meth:`TorchDistributedEngine.shutdown` (a handle the caller kept, say) left those threads
    running into the interpreter's finalization.
    """

    def __init__(self, work, what: str, span: Span, timings: _CudaTimings | None = None, start=None):
        self._work = work
        self._what = what
        self._span: Span | None = span
        self._cuda = (timings, start) if timings is not None else None

    def done(self) -> bool:
        if self._work is not None:
            if not self._work.is_completed():
                return False
            self._work = None
        self._record_host_time()
        return True

    def _record_host_time(self) -> None:
        if self._span is not None and self._cuda is None:
            span, self._span = self._span, None
            span.end()

    def wait(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                raise _communication_error(exc, self._what) from exc
            self._work = None
        self._record_host_time()
        if self._span is not None:  # nccl: timed on the GPU once it has passed the end event
            timings, start = self._cuda
            span, self._span = self._span, None
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timings.add(span, start, end)
            timings.resolve()


def _device(env: WorkerEnv, backend: str) -> torch.device:
    """The device this worker's collectives use; for nccl, makes it the current CUDA device.

    Raises:
        EngineUnavailableError: nccl without CUDA, NCCL, or a GPU for this local rank.
    """
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise EngineUnavailableError(
            f"the nccl engine needs a CUDA build of PyTorch with NCCL and a GPU, and this one (torch "
            f"{torch.__version__}) has {'no NCCL' if torch.cuda.is_available() else 'no usable CUDA device'}. "
            "Use --engine gloo (DYNAMIX_ENGINE=gloo) for CPU tensors, or --engine auto to pick nccl only "
            "where every worker has a GPU; docs/engines.md ('The CUDA path') shows how to install a CUDA torch."
        )
    count = torch.cuda.device_count()
    if count >= env.local_size:
        index = env.local_rank
    elif count == 1:  # the launcher gave each process its own GPU (CUDA_VISIBLE_DEVICES per worker)
        index = 0
    else:
        raise EngineUnavailableError(
            f"the nccl engine needs one GPU per worker process, and this node runs {env.local_size} workers "
            f"but this process sees {count} GPUs; run at most {count} workers per node, or use --engine gloo"
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


class TorchDistributedEngine(Engine):
    """A ``torch.distributed`` process group with the gloo or nccl backend.

    Args:
        env: the worker's environment.
        backend: ``gloo`` or ``nccl``.
        timing: the timing to record into, as :class:`Engine`'s; None: a new one.

    Attributes:
        name: the backend, ``gloo`` or ``nccl``.
        device: where collective tensors must live: CPU for gloo, ``cuda:<local_rank>`` for nccl
            (``cuda:0`` when the process sees a single GPU).
    """

    def __init__(self, env: WorkerEnv, backend: str = "gloo", timing: CommTiming | None = None):
        super().__init__(env, timing)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.name = backend
        if not dist.is_available() or (backend == "gloo" and not dist.is_gloo_available()):
            raise EngineUnavailableError(
                f"the {backend} engine needs a PyTorch build with torch.distributed and gloo, which torch "
                f"{torch.__version__} lacks; install the CPU wheel with: pip install torch==2.13.0"
            )
        if dist.is_initialized():
            raise EngineUnavailableError(
                "torch.distributed is already initialised in this process; call "
                "dist.destroy_process_group() first, or let dynamix_byteps own it"
            )
        self._device = _device(env, backend)
        self._timings = _CudaTimings() if backend == "nccl" else None
        timeout = datetime.timedelta(seconds=env.timeout_s)
        options = {"device_id": self._device} if backend == "nccl" else {}
        try:
            if env.size == 1:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                        **options)
            else:
                dist.init_process_group(
                    backend,
                    init_method=f"tcp://{url_host(env.root_addr)}:{env.root_port}",
                    rank=env.rank,
                    world_size=env.size,
                    timeout=timeout,
                    **options,
                )
        except (RuntimeError, ValueError) as exc:
            raise CommunicationError(
                f"{backend} rendezvous at {url_host(env.root_addr)}:{env.root_port} as rank {env.rank} of {env.size} "
                f"failed within {env.timeout_s:g} s (DYNAMIX_TIMEOUT): {exc}. Check that every worker was started "
                f"with the same {env.root_variables}, that rank 0 can listen there, and that the timeout leaves the "
                "others time to start."
            ) from exc
        # All-reduces go to the group itself: torch.distributed's function adds ~45 us of Python checks
        # per call here (the DDP reducer calls the group from C++). The group is looked up per call,
        # never kept: a reference held past destroy_process_group keeps gloo's threads alive into the
        # interpreter's exit (see the import of torch.distributed.nn.functional above).
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM
        self._sum.asyncOp = True

    @property
    def device(self) -> torch.device:
        return self._device

    def all_reduce_async(self, tensor, name: str) -> Handle:
        span = self.timing.start(name, tensor.numel() * tensor.element_size())
        if self._timings is not None:
            self._timings.resolve()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        what = describe_collective(name)
        try:
            work = _default_group(what).allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor],
                                                  self._sum)
        except RuntimeError as exc:
            raise _communication_error(exc, what) from exc
        if self._timings is not None:
            return _DistributedHandle(work, what, span, self._timings, start)
        return _DistributedHandle(work, what, span)

    def broadcast(self, tensor, root_rank: int, name: str) -> None:
        wire = tensor if tensor.device == self._device else tensor.to(self._device)
        try:
            dist.broadcast(wire, src=root_rank)
        except RuntimeError as exc:
            raise _communication_error(exc, f"broadcast of {name!r}") from exc
        if wire is not tensor:
            tensor.copy_(wire)

    def barrier(self) -> None:
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise _communication_error(exc, "barrier") from exc

    def flush_timings(self) -> None:
        if self._timings is not None:
            self._timings.resolve(block=True)

    def shutdown(self) -> None:
        self.flush_timings()
        if dist.is_initialized():
            # Unreachable objects that hold the group (a torch DDP's C++ Reducer in a reference cycle)
            # are freed now, while the group outlives them. Freed later, the Reducer's release is the
            # group's last reference: its destructor then joins gloo's work threads with the GIL held,
            # while one of them waits for the GIL to drop a finished collective's tensors (deadlock).
            gc.collect()
            dist.destroy_process_group()
