"""The interface every communication engine implements.

An engine moves ``torch.Tensor`` buffers, on the engine's :attr:`Engine.device` (CPU for gloo,
the worker's GPU for nccl), between the worker processes of one job. It knows nothing about
models, names of gradients or batch sizes: the frontends build those on top of four collectives
(in-place sum all-reduce, broadcast, integer exchange, barrier).

Collectives are matched by **issue order**: every worker must issue the same sequence of
collectives. :mod:`dynamix_byteps.negotiation` checks that before each round, because gloo
aborts the process on a size mismatch and silently sums garbage on a dtype mismatch.
"""

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np

from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import CommunicationError

EXCHANGE_NAME = "dynamix.exchange"  # the all-reduce behind Engine.exchange


def describe_collective(name: str) -> str:
    """How an error message names the all-reduce ``name``: the user's tensor, or what an internal one does."""
    if name == EXCHANGE_NAME:
        return "the exchange between the workers that starts each push_pull, broadcast and optimizer step"
    if name.startswith("Gradient.bucket."):
        return f"the gradient reduction of bucket {name.rsplit('.', 1)[1]}"
    if name == "Gradient.trailer":
        return "the gradient reduction's trailer (batch sizes, norms, plan digests)"
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


class Engine(abc.ABC):
    """A communication backend. Created by :func:`dynamix_byteps.engine.start`."""

    name: str

    def __init__(self, env: WorkerEnv):
        self.env = env

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
