"""Communication engines behind one small interface, and the process's current engine.

``start()`` creates the engine named by ``DYNAMIX_ENGINE`` (default ``gloo``; ``auto`` is nccl
where every local worker has a GPU, else gloo) for the worker described by the environment
(:class:`~dynamix_byteps.env.WorkerEnv`: bpslaunch's or torchrun's variables); ``current()``
returns it; ``stop()`` shuts it down, and runs by itself at interpreter exit (a gloo process
group left to the interpreter's teardown could abort the process, "terminate called without an
active exception"). Engines are imported only when selected.

When the engine has started, the worker tells its launcher so (``DYNAMIX_STARTED_DIR``: a failure
before any worker got there is an error in the command, not a lost worker), and when its rendezvous
or a collective of it fails (it raises :class:`~dynamix_byteps.errors.CommunicationError`: if it then
fails, its failure came from a peer's or the network's, not its own), and checks that its
monitoring mailbox (``DYNAMIX_JOB_ID``) can be created: when it cannot, it warns and unsets
``DYNAMIX_JOB_ID``, so the job trains without this worker's host metrics instead of crashing.
Under bpslaunch, which forwards a Ctrl-C to every worker and says so, a KeyboardInterrupt that ends
the worker prints one line, where it was, instead of its traceback.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path

from dynamix_byteps.engine.base import Engine, Handle
from dynamix_byteps.env import COLLECTIVE_FAILED_SUFFIX, JOB_ID_ENV, STARTED_DIR_ENV, WorkerEnv, resolve_engine
from dynamix_byteps.errors import NotInitializedError, on_communication_failure

__all__ = ["Engine", "Handle", "create", "current", "is_started", "start", "stop"]

_lock = threading.Lock()
_current: Engine | None = None


def create(env: WorkerEnv, framework: str = "torch") -> Engine:
    """Construct the engine ``env.engine``: ``gloo`` or ``nccl`` (``torch.distributed`` with that
    backend, :class:`~dynamix_byteps.engine.distributed.TorchDistributedEngine`), ``byteps``, ``ps``
    (summation servers, :class:`~dynamix_byteps.engine.ps.ParameterServerEngine`), or
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
    if env.engine == "ps":
        from dynamix_byteps.engine.ps import ParameterServerEngine

        return ParameterServerEngine(env)
    from dynamix_byteps.engine.distributed import TorchDistributedEngine

    return TorchDistributedEngine(env, env.engine)


def start(env: WorkerEnv | None = None, framework: str = "torch") -> Engine:
    """Start the process's engine once; later calls return the running one (like ``bps.init``)."""
    global _current
    with _lock:
        if _current is None:
            env = env or WorkerEnv.from_environ()
            _tell_launcher_of_failed_collectives(env.rank)  # a failed rendezvous too: a peer may have died
            _current = create(env, framework)
            atexit.unregister(stop)  # registered once, however often the engine restarts
            atexit.register(stop)
            _tell_launcher_started(_current.rank)
            _give_up_unusable_mailbox(_current.rank)
            _leave_interrupts_to_bpslaunch()
        return _current


def _tell_launcher_of_failed_collectives(rank: int) -> None:
    """Leave ``<DYNAMIX_STARTED_DIR>/<rank>.collective-failed`` as soon as this process raises a
    CommunicationError, from the rendezvous on: a worker still in its rendezvous when a peer that got
    through it dies fails there, and that failure is the peer's, not its own."""
    folder = os.environ.get(STARTED_DIR_ENV)
    if folder:
        on_communication_failure(functools.partial(_touch, Path(folder) / f"{rank}{COLLECTIVE_FAILED_SUFFIX}"))


def _tell_launcher_started(rank: int) -> None:
    """Leave ``<DYNAMIX_STARTED_DIR>/<rank>``: this worker joined the job (bpslaunch reads it)."""
    folder = os.environ.get(STARTED_DIR_ENV)
    if folder:
        _touch(Path(folder) / str(rank))


_excepthook_found = sys.excepthook  # the hook before ours: it prints every other exception


def _leave_interrupts_to_bpslaunch() -> None:
    """Under bpslaunch (``DYNAMIX_STARTED_DIR`` set), a KeyboardInterrupt that ends the program prints
    one line, where the program was, instead of its traceback: bpslaunch forwards its SIGINT (Ctrl-C)
    to every worker and says so itself."""
    global _excepthook_found
    if os.environ.get(STARTED_DIR_ENV) and sys.excepthook is not _interrupt_in_one_line:
        _excepthook_found = sys.excepthook
        sys.excepthook = _interrupt_in_one_line


def _interrupt_in_one_line(kind, error, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        print(f"interrupted{_where(traceback.extract_tb(tb))}", file=sys.stderr, flush=True)
    else:
        _excepthook_found(kind, error, tb)


def _where(frames: traceback.StackSummary) -> str:
    """`` at FILE:LINE in FUNCTION`` of the innermost of ``frames`` in the program's own file (else the
    innermost); empty without frames."""
    program = getattr(sys.modules.get("__main__"), "__file__", None)
    own = [frame for frame in frames if frame.filename == program] or frames
    return f" at {own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError:
        pass  # only a restart decision reads it, and the folder may be gone with the launcher


def _give_up_unusable_mailbox(rank: int) -> None:
    """Unset ``DYNAMIX_JOB_ID`` with a warning when this worker's mailbox cannot be created (held by
    another live process, a foreign file, an invalid job id): the mailbox only feeds monitoring."""
    job = os.environ.get(JOB_ID_ENV)
    if not job:
        return
    from dynamix_byteps.control.mailbox import mailbox_name, unavailable_reason

    try:
        reason = unavailable_reason(mailbox_name(job, rank))
    except ValueError as error:
        reason = str(error)
    if reason is not None:
        os.environ.pop(JOB_ID_ENV, None)
        warnings.warn(f"rank {rank}: the monitoring mailbox is unavailable ({reason}); training goes on without "
                      "the node agent's network and GPU metrics of this worker", RuntimeWarning, stacklevel=3)


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
