"""Communication engines behind one small interface, and the process's current engine.

``start()`` creates the engine named by ``DYNAMIX_ENGINE`` (default ``gloo``; ``auto`` is nccl
where every local worker has a GPU, else gloo) for the worker described by the environment
(:class:`~dynamix_byteps.env.WorkerEnv`: bpslaunch's or torchrun's variables); ``current()``
returns it; ``stop()`` shuts it down. Engines are imported only when selected.
"""

from __future__ import annotations

import dataclasses
import threading

from dynamix_byteps.engine.base import Engine, Handle
from dynamix_byteps.env import WorkerEnv, resolve_engine
from dynamix_byteps.errors import NotInitializedError

__all__ = ["Engine", "Handle", "create", "current", "is_started", "start", "stop"]

_lock = threading.Lock()
_current: Engine | None = None


def create(env: WorkerEnv, framework: str = "torch") -> Engine:
    """Construct the engine ``env.engine``: ``gloo`` or ``nccl`` (``torch.distributed`` with that
    backend, :class:`~dynamix_byteps.engine.distributed.TorchDistributedEngine`), ``byteps``, or
    ``auto`` (resolved by :func:`~dynamix_byteps.env.resolve_engine`).

    ``framework`` (``torch`` or ``tensorflow``) picks BytePS's plugin for the ``byteps`` engine;
    the torch.distributed engines serve both frontends.

    Raises:
        EngineUnavailableError: the engine's library is missing or broken; the message says how to fix it.
        CommunicationError: the rendezvous with the other workers failed.
    """
    if env.engine == "auto":
        env = dataclasses.replace(env, engine=resolve_engine(env.engine, env.local_size))
    if env.engine == "byteps" and framework == "tensorflow":
        from dynamix_byteps.engine.byteps_tensorflow import BytePSTensorFlowEngine

        return BytePSTensorFlowEngine(env)
    if env.engine == "byteps":
        from dynamix_byteps.engine.byteps import BytePSEngine

        return BytePSEngine(env)
    from dynamix_byteps.engine.distributed import TorchDistributedEngine

    return TorchDistributedEngine(env, env.engine)


def start(env: WorkerEnv | None = None, framework: str = "torch") -> Engine:
    """Start the process's engine once; later calls return the running one (like ``bps.init``)."""
    global _current
    with _lock:
        if _current is None:
            _current = create(env or WorkerEnv.from_environ(), framework)
        return _current


def current() -> Engine:
    """The running engine.

    Raises:
        NotInitializedError: ``init()`` has not been called, or ``shutdown()`` has.
    """
    engine = _current
    if engine is None:
        raise NotInitializedError("dynamix_byteps has not been initialized; call bps.init() first")
    return engine


def is_started() -> bool:
    return _current is not None


def stop() -> None:
    """Shut the running engine down; a no-op when none runs."""
    global _current
    with _lock:
        if _current is not None:
            engine, _current = _current, None
            engine.shutdown()
