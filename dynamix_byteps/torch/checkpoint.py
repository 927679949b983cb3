"""One call to save and one to restore a job: model, optimizer, sampler position, assignments,
gradient statistics and the LR-scaling base, written atomically.

Resuming continues the epoch where the last *trained* step left it, also with a different
number of workers (see ``DynamicBatchSampler.load_state_dict``), so no sample is lost or
repeated.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.atomic import atomic_write
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.negotiation import negotiate, round_lock

FORMAT_VERSION = 1


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None, optimizer=None,
                    sampler=None, **extra: Any) -> None:
    """Save the job's state to ``path`` (a collective: every worker calls it; rank 0 writes).

    The file is written to a temporary name, flushed to disk and renamed, so a crash never
    leaves a half-written checkpoint at ``path``.

    Args:
        model: its ``state_dict()`` (identical on every worker).
        optimizer: a ``DistributedOptimizer``: its state, and its noise statistics and step.
        sampler: a ``DynamicBatchSampler``: its position at the optimizer's next step (not the
            sampler's own, which runs ahead when a DataLoader prefetches).
        extra: anything else picklable (epoch counters, metrics); returned by ``load_checkpoint``.

    Raises:
        TensorMismatchError: not every worker called it at this point (e.g. only rank 0): the
            call raises on the ranks that made it, and the other ranks' next collective raises
            (if the others never issue another collective, they cannot be told: the call then
            fails with CommunicationError after the engine's timeout). Nothing is written.
        OSError: the file cannot be written (on rank 0; the other ranks then raise
            CommunicationError or wait for rank 0's exit).
    """
    engine = _engine.current()
    # A checked round, not a bare barrier: called on rank 0 alone (``if rank() == 0:``, the
    # BytePS idiom), it meets the other ranks' next collective and every rank raises
    # TensorMismatchError instead of waiting until the timeout; nothing is written then.
    with round_lock:
        negotiate(engine, "save_checkpoint", "save_checkpoint (a collective: call it on every worker)")
    if engine.rank == 0:
        state: dict[str, Any] = {"format": FORMAT_VERSION, "workers": engine.size, "extra": extra}
        if model is not None:
            state["model"] = model.state_dict()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
            if hasattr(optimizer, "dynamix_state_dict"):
                state["dynamix"] = optimizer.dynamix_state_dict()
        if sampler is not None:
            step = getattr(optimizer, "next_step", None)
            state["sampler"] = sampler.state_dict(step=step)
        with atomic_write(path) as f:
            torch.save(state, f)
    engine.barrier()


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None, optimizer=None,
                    sampler=None, trusted: bool = False) -> dict:
    """Restore what :func:`save_checkpoint` saved into the given objects; return its ``extra``.

    Every worker reads the file (it must be visible to all of them). By default only tensors and
    plain containers are unpickled (``torch.load(weights_only=True)``), so a foreign file cannot
    run code; pass ``trusted=True`` for checkpoints whose ``extra`` holds other objects.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ConfigurationError: the file is not a dynamix_byteps checkpoint, lacks a part asked for,
            or holds objects that need ``trusted=True``.
    """
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as error:
        raise ConfigurationError(f"{path} cannot be read as a dynamix_byteps checkpoint ({error}); if you "
                                 "wrote it yourself with objects in extra=, load it with trusted=True") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ConfigurationError(f"{path} is not a dynamix_byteps checkpoint (format {FORMAT_VERSION})")
    for name, target in (("model", model), ("optimizer", optimizer), ("sampler", sampler)):
        if target is not None and name not in state:
            raise ConfigurationError(f"{path} holds no {name} state; it was saved without {name}=")
    if model is not None:
        model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        if "dynamix" in state and hasattr(optimizer, "load_dynamix_state_dict"):
            optimizer.load_dynamix_state_dict(state["dynamix"])
    if sampler is not None:
        try:
            sampler.load_state_dict(state["sampler"])
        except (KeyError, TypeError) as error:
            raise ConfigurationError(f"{path} holds no valid sampler state ({error!r})") from None
    return state.get("extra", {})
