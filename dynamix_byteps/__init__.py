"""dynamix_byteps: BytePS-compatible data-parallel training with a per-worker batch size
chosen at run time.

``import dynamix_byteps as bps`` gives the framework-neutral part of the BytePS API; the
framework frontends are ``dynamix_byteps.torch`` and ``dynamix_byteps.tensorflow``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

# Before any module of this package imports grpc: processes that use gRPC here fork children
# that never use it (the launcher's workers, DataLoader workers beside the worker's scheduler
# client thread), and gRPC's fork handlers would log "skipping fork() handlers" on each fork and
# can crash a child forked while a gRPC thread is busy. Users who need them set it themselves.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from dynamix_byteps import engine as _engine  # noqa: E402
from dynamix_byteps import tensorboard_scalars as _scalars
from dynamix_byteps.errors import (
    CommunicationError,
    ConfigurationError,
    DatasetNotFoundError,
    DynamixError,
    EngineUnavailableError,
    InvalidAssignmentError,
    NotInitializedError,
    TensorMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "CommunicationError",
    "ConfigurationError",
    "DatasetNotFoundError",
    "DynamixError",
    "EngineUnavailableError",
    "InvalidAssignmentError",
    "NotInitializedError",
    "TensorMismatchError",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "log_scalar",
    "rank",
    "shutdown",
    "size",
    "step_statistics",
    "untimed",
]


def init(lazy: bool = True) -> None:
    """Join the job described by the environment (set by ``bpslaunch``); idempotent.

    Blocks until every worker has joined. ``lazy`` exists for BytePS compatibility and is ignored.

    Raises:
        ConfigurationError: a ``DMLC_*``/``BYTEPS_*``/``DYNAMIX_*`` variable is invalid.
        EngineUnavailableError: the selected engine cannot be imported.
        CommunicationError: the rendezvous with the other workers failed.
    """
    del lazy
    _engine.start()


def shutdown() -> None:
    """Leave the job and release the engine; stops reporting to the scheduler, flushes and closes
    this worker's TensorBoard events. Safe to call twice."""
    from dynamix_byteps import batch_plan

    plan = batch_plan.default()
    if plan.monitor is not None:
        plan.monitor.close()
    plan.forget_shared()
    _scalars.close()
    _engine.stop()


def is_initialized() -> bool:
    return _engine.is_started()


def rank() -> int:
    """This worker's global rank, ``0 <= rank < size()``."""
    return _engine.current().rank


def size() -> int:
    """Number of worker processes in the job."""
    return _engine.current().size


def local_rank() -> int:
    """This worker's index among the workers on its node."""
    return _engine.current().local_rank


def local_size() -> int:
    """Number of worker processes on this node."""
    return _engine.current().local_size


def untimed():
    """Context manager: leave the enclosed code out of this worker's step and training times.

    Wrap evaluation, checkpointing or logging between training steps in it, so the throughput
    the batch-size policy sees (and the ``FACTOR@START-END`` straggler windows) count training
    only. A no-op before a ``DistributedOptimizer`` exists.
    """
    from dynamix_byteps import batch_plan

    monitor = batch_plan.default().monitor
    return monitor.untimed() if monitor is not None else contextlib.nullcontext()


def step_statistics():
    """This worker's sums since its ``DistributedOptimizer`` was created (the newest frontend on
    the default batch plan: the newest sampler's).

    Returns:
        :class:`~dynamix_byteps.control.step_monitor.StepStatistics`: ``steps``, ``samples``,
        ``compute_s`` and ``push_pull_s`` (seconds), and ``samples_per_s``, the compute-only
        throughput θ_i (samples/s). All zero before a ``DistributedOptimizer`` exists.
    """
    from dynamix_byteps import batch_plan
    from dynamix_byteps.control.step_monitor import StepStatistics

    monitor = batch_plan.default().monitor
    return dataclasses.replace(monitor.totals) if monitor is not None else StepStatistics()


def log_scalar(tag: str, value, step: int | None = None) -> None:
    """Record ``value`` under ``tag`` in this worker's TensorBoard run (``bpslaunch --log-dir``).

    For a script's own metrics, e.g. ``bps.log_scalar("test/accuracy", 0.87)`` after an
    evaluation; ``dynamix report`` plots tags containing ``accuracy`` and ``test/loss``
    against wall time. A no-op (after checking the arguments) when the job has no log directory.

    Args:
        tag: TensorBoard tag, a non-empty string; ``/`` groups charts (``test/accuracy``).
        value: a real number (float, int, numpy scalar, or 0-dim tensor).
        step: x coordinate; default: the global step, i.e. optimizer steps completed so far
            (0 before a ``DistributedOptimizer`` has stepped).

    Raises:
        ValueError: ``tag`` is empty or not a string, ``value`` is not a real number, or
            ``step`` is not an integer >= 0.
    """
    from dynamix_byteps import batch_plan

    monitor = batch_plan.default().monitor
    _scalars.log_scalar(tag, value, step, monitor.global_step if monitor is not None else 0)
