"""Optional engine on real BytePS (``byteps.torch``), for GPU clusters.

Selected only with ``bpslaunch --engine byteps`` or ``DYNAMIX_ENGINE=byteps``; imported lazily,
so nothing else needs BytePS installed. Two workarounds for BytePS 0.2.5 defects are built in:

* only **in-place** push_pull is used (out-of-place returns an uninitialised tensor on CPU);
* completion is awaited by **polling** before ``synchronize`` (``synchronize`` alone can
  deadlock on the GIL with torch 2.x).

BytePS keys tensors by name, so names given here must be unique per tensor and identical on
every worker; the frontends guarantee that.
"""

from __future__ import annotations

import time

from dynamix_byteps import timing
from dynamix_byteps.engine.base import Engine, Handle, describe_collective
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import CommunicationError, EngineUnavailableError

POLL_INTERVAL_S = 2e-4


def _import_byteps_torch():
    try:
        import byteps.torch as byteps_torch
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the byteps engine needs BytePS with its PyTorch plugin, which failed to import ({exc}). "
            "It requires CUDA and NCCL: build it on a GPU machine (docker/Dockerfile.gpu), "
            "or run with the embedded default engine: --engine gloo / DYNAMIX_ENGINE=gloo"
        ) from exc
    return byteps_torch


class _BytePSHandle(Handle):
    """BytePS's ``handle`` of one push_pull, timed by ``span`` once polling has seen it finish."""

    def __init__(self, bps, handle: int, span: timing.Span):
        self._bps = bps
        self._handle = handle
        self._span = span
        self._finished = False

    def done(self) -> bool:
        return self._finished or bool(self._bps.poll(self._handle))

    def wait(self) -> None:
        if self._finished:
            return
        while not self._bps.poll(self._handle):
            time.sleep(POLL_INTERVAL_S)
        self._span.end()
        try:
            self._bps.synchronize(self._handle)
        except RuntimeError as exc:
            raise CommunicationError(f"BytePS {describe_collective(self._span.name)} failed: {exc}") from exc
        self._finished = True


class BytePSEngine(Engine):
    """``byteps.torch`` push_pull through its scheduler and servers (``DMLC_*`` set by bpslaunch)."""

    name = "byteps"

    @staticmethod
    def _import_plugin():
        return _import_byteps_torch()

    def __init__(self, env: WorkerEnv):
        super().__init__(env)
        self._bps = self._import_plugin()
        self._bps.init()
        self._declared: set[str] = set()
        self._rounds = 0

    @property
    def rank(self) -> int:
        return self._bps.rank()

    @property
    def size(self) -> int:
        return self._bps.size()

    @property
    def local_rank(self) -> int:
        return self._bps.local_rank()

    @property
    def local_size(self) -> int:
        return self._bps.local_size()

    def _declare(self, name: str) -> None:
        if name not in self._declared:
            self._bps.declare(name)
            self._declared.add(name)

    def all_reduce_async(self, tensor, name: str) -> Handle:
        self._declare(name)
        span = self.timing.start(name, tensor.numel() * tensor.element_size())
        handle = self._bps.push_pull_async_inplace(tensor, average=False, name=name)
        return _BytePSHandle(self._bps, handle, span)

    def broadcast(self, tensor, root_rank: int, name: str) -> None:
        # BytePS's own broadcast: every rank but the root zeroes its copy, then a sum.
        if self.rank != root_rank:
            tensor.zero_()
        self.all_reduce_async(tensor, f"dynamix.broadcast.{name}").wait()

    def barrier(self) -> None:
        import torch

        # A fresh name per round: BytePS would otherwise overlap back-to-back rounds of one key.
        self._rounds += 1
        self.all_reduce_async(torch.zeros(1), f"dynamix.barrier.{self._rounds}").wait()

    def shutdown(self) -> None:
        self._bps.shutdown()
