"""The embedded default engine: ``torch.distributed`` with the gloo backend over TCP.

Rank 0 hosts the rendezvous at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``; a job of one worker
needs no network at all. Every collective's start and completion times go to the timing
ring (``dynamix_byteps.timing``), the completion time from gloo's own completion callback.
"""

from __future__ import annotations

import datetime

from dynamix_byteps import timing
from dynamix_byteps.engine.base import Engine, Handle
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import CommunicationError, EngineUnavailableError

try:
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - torch is an install requirement
    raise EngineUnavailableError(
        f"the gloo engine needs PyTorch ({exc}); install it with: pip install torch==2.13.0"
    ) from exc


def _communication_error(exc: Exception, what: str) -> CommunicationError:
    return CommunicationError(
        f"{what} failed: {exc}. A peer worker probably exited or hung; check the other "
        "workers' output (bpslaunch prefixes each line with its rank)."
    )


class _GlooHandle(Handle):
    def __init__(self, work, what: str):
        self._work = work
        self._what = what

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise _communication_error(exc, self._what) from exc


class GlooEngine(Engine):
    """``torch.distributed`` process group with the gloo backend (CPU tensors)."""

    name = "gloo"

    def __init__(self, env: WorkerEnv):
        super().__init__(env)
        if not dist.is_available() or not dist.is_gloo_available():
            raise EngineUnavailableError(
                "the gloo engine needs a PyTorch build with torch.distributed and gloo; "
                "install the CPU wheel with: pip install torch==2.13.0"
            )
        if dist.is_initialized():
            raise EngineUnavailableError(
                "torch.distributed is already initialised in this process; call "
                "dist.destroy_process_group() first, or let dynamix_byteps own it"
            )
        timeout = datetime.timedelta(seconds=env.timeout_s)
        try:
            if env.size == 1:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://{env.root_addr}:{env.root_port}",
                    rank=env.rank,
                    world_size=env.size,
                    timeout=timeout,
                )
        except (RuntimeError, ValueError) as exc:
            raise CommunicationError(
                f"gloo rendezvous at {env.root_addr}:{env.root_port} as rank {env.rank} of {env.size} "
                f"failed: {exc}. Check that every worker was started with the same DMLC_PS_ROOT_URI/"
                "DMLC_PS_ROOT_PORT and that rank 0 can listen there."
            ) from exc

    def all_reduce_async(self, tensor, name: str) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        start = timing.now_ns()
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        except RuntimeError as exc:
            raise _communication_error(exc, f"push_pull of {name!r}") from exc
        work.get_future().add_done_callback(lambda _: timing.record(name, nbytes, start, timing.now_ns()))
        return _GlooHandle(work, f"push_pull of {name!r}")

    def broadcast(self, tensor, root_rank: int, name: str) -> None:
        try:
            dist.broadcast(tensor, src=root_rank)
        except RuntimeError as exc:
            raise _communication_error(exc, f"broadcast of {name!r}") from exc

    def barrier(self) -> None:
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise _communication_error(exc, "barrier") from exc

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
