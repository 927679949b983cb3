"""The interface every communication engine implements.

An engine moves ``torch.Tensor`` buffers, on the engine's :attr:`Engine.device` (CPU for gloo,
the worker's GPU for nccl), between the worker processes of one job. It knows nothing about
models, names of gradients or batch sizes: the frontends build those on top of four collectives
(in-place sum all-reduce, broadcast, integer exchange, barrier).

Collectives are matched by **issue order**: every worker must issue the same sequence of
collectives. :mod:`dynamix_byteps.negotiation` checks that before each round, because gloo
aborts the process on a size mismatch and silently sums garbage on a dtype mismatch.

An engine also owns its session's state: the communication timing (:attr:`Engine.timing`) and
the frontends' async handles (:attr:`Engine.handles`). Both go with the engine at ``shutdown()``,
so the process keeps them only through the running engine (``dynamix_byteps.engine.current()``),
and a new ``init()`` starts with neither events, names nor handles of the session before.
"""

from __future__ import annotations

import abc
import itertools
import secrets
import threading
from typing import Sequence

import numpy as np

from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import CommunicationError
from dynamix_byteps.timing import CommTiming

EXCHANGE_NAME = "dynamix.exchange"  # the all-reduce behind Engine.exchange


def describe_collective(name: str) -> str:
    """How an error message names the all-reduce ``name``: the user's tensor, or what an internal one does."""
    if name == EXCHANGE_NAME:
        return "the exchange between the workers that starts each push_pull, broadcast and optimizer step"
    if name.startswith("Gradient.bucket."):
        return f"the gradient reduction of bucket {name.rsplit('.', 1)[1]}"
    if name == "Gradient.trailer":
        return "the gradient reduction's trailer (batch sizes, norms, plan digests)"
    if name == "Gradient.announcement":
        return "the announcement that begins a gradient reduction (whether a worker's backward pass raised)"
    for prefix, operation in (("dynamix.broadcast.", "broadcast"), ("dynamix.barrier.", "barrier")):
        if name.startswith(prefix):  # the BytePS engine's broadcast and barrier are all-reduces
            return operation if operation == "barrier" else f"broadcast of {name[len(prefix):]!r}"
    return f"push_pull of {name!r}"


class Handle(abc.ABC):
    """An in-flight collective. ``wait`` returns once the tensor holds the result (for CUDA
    tensors: for every kernel issued on the current stream afterwards, as with torch.distributed)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the result is in place (never blocks)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the result is in place.

        Raises:
            CommunicationError: a peer died, the connection broke, or the engine's timeout passed.
        """


def _hashable(value: object) -> bool:
    """Whether ``value`` can be a dict key; a list or dict passed as a handle is none, and must get
    the same ValueError as any other unknown handle, not a TypeError (or none at all: ``pop`` on an
    empty dict does not hash its key)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


class HandleTable:
    """A frontend's operations in flight by handle: the positive integers that BytePS's and
    Horovod's ``*_async`` functions return, and the counter behind auto-named tensors.

    Each engine owns one (:attr:`Engine.handles`), so a session started after ``shutdown()``
    knows no handle of the one before. Handles count up from a random start below 2**52 (exact
    as a float too), so a handle kept from an earlier session is refused rather than taken for
    one of the new session's (the chance that two sessions' first million handles overlap is
    below 1e-3 · 2**-20). Thread-safe.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[int, object] = {}
        self._numbers = itertools.count(1 + secrets.randbelow(2**52 - 2**32))
        self._auto_names = itertools.count()

    def auto_name(self, prefix: str) -> str:
        """``<prefix>.<n>`` with n = 0, 1, 2, ... in call order; callers that must agree across workers
        call it in the same order on each."""
        return f"{prefix}.{next(self._auto_names)}"

    def add(self, entry: object) -> int:
        """Keep ``entry`` under a new handle and return the handle."""
        with self._lock:
            handle = next(self._numbers)
            self._entries[handle] = entry
        return handle

    def get(self, handle: int) -> object:
        """The entry under ``handle``. Raises ValueError when there is none (see :meth:`pop`)."""
        with self._lock:
            entry = self._entries.get(handle) if _hashable(handle) else None
        return self._known(handle, entry)

    def pop(self, handle: int) -> object:
        """Remove and return the entry under ``handle``.

        Raises:
            ValueError: ``handle`` was never returned by :meth:`add` of this table, or was popped already.
        """
        with self._lock:
            entry = self._entries.pop(handle, None) if _hashable(handle) else None
        return self._known(handle, entry)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @staticmethod
    def _known(handle: int, entry: object | None) -> object:
        if entry is None:
            raise ValueError(f"handle {handle!r} is unknown, was already synchronized, or belongs to a session "
                             "ended by shutdown()")
        return entry


class Engine(abc.ABC):
    """A communication backend. Created by :func:`dynamix_byteps.engine.start`.

    Args:
        env: the worker's environment.
        timing: the :class:`~dynamix_byteps.timing.CommTiming` to record into; None: a new one.

    Attributes:
        env: as given.
        timing: this engine's communication timing; the step monitor reads it once per step.
        handles: this engine's :class:`HandleTable`, for the frontends' async operations.
    """

    name: str

    def __init__(self, env: WorkerEnv, timing: CommTiming | None = None):
        self.env = env
        self.timing = CommTiming() if timing is None else timing
        self.handles = HandleTable()

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def size(self) -> int:
        return self.env.size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def local_size(self) -> int:
        return self.env.local_size

    @property
    def device(self):
        """The ``torch.device`` that collective tensors must be on; CPU unless the engine says otherwise."""
        import torch

        return torch.device("cpu")

    @abc.abstractmethod
    def all_reduce_async(self, tensor, name: str) -> Handle:
        """Start an in-place element-wise **sum** of ``tensor`` over all workers.

        Args:
            tensor: contiguous ``torch.Tensor`` on :attr:`device` (any shape; float16/32/64,
                int32/64); it is overwritten with the sum.
            name: label for timing and error messages (not used for matching).
        """

    @abc.abstractmethod
    def broadcast(self, tensor, root_rank: int, name: str) -> None:
        """Overwrite ``tensor`` on every worker with ``root_rank``'s copy (blocking). ``tensor`` may be
        on any device: an engine that can only move tensors on :attr:`device` stages a copy there."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every worker has called ``barrier``."""

    def flush_timings(self) -> None:
        """Record in the timing ring every finished collective whose duration is still pending,
        waiting for the device where needed (nccl times on CUDA events); a no-op for host-timed engines."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release sockets and threads; the engine cannot be used afterwards."""

    def exchange(self, values: Sequence[int], what: str | None = None) -> np.ndarray:
        """Every worker contributes ``len(values)`` integers; all receive everyone's.

        Built on the sum all-reduce so that any engine supports it: each worker fills its
        own row of a zero matrix on :attr:`device`. ``values`` must have the same length on every worker.

        Args:
            values: this worker's integers.
            what: the user's operation the exchange is part of, for error messages (e.g.
                ``"push_pull of gradients at step 12"``); None names the exchange itself.

        Returns:
            ``np.ndarray`` of dtype int64 and shape ``(size, len(values))``; row r is rank r's.

        Raises:
            CommunicationError: a peer died, the connection broke, or the engine's timeout passed;
                the message starts with ``what`` when given.
        """
        import torch

        table = torch.zeros((self.size, len(values)), dtype=torch.int64, device=self.device)
        table[self.rank] = torch.as_tensor(list(values), dtype=torch.int64)
        try:
            self.all_reduce_async(table, EXCHANGE_NAME).wait()
        except CommunicationError as error:
            if what is None:
                raise
            raise CommunicationError(f"{what}: {error}") from error
        return table.cpu().numpy()
