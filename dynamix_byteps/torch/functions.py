"""Broadcasts that make every worker start from the root's model, optimizer and objects."""

from __future__ import annotations

import io
from typing import Any, Iterable, Mapping

import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.errors import DynamixError
from dynamix_byteps.negotiation import describe, negotiate, round_lock


def _check_root(engine, root_rank: int) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < engine.size:
        raise ValueError(f"root_rank must be an integer rank in [0, {engine.size}), got {root_rank!r}")


def _named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    """``params`` as ``(name, tensor)`` pairs; a plain tensor is named by its position."""
    if isinstance(params, torch.Tensor):
        raise TypeError("broadcast_parameters takes a collection of tensors (model.parameters(), "
                        "model.named_parameters() or model.state_dict()), not a single tensor; wrap it in a list")
    items = params.items() if isinstance(params, Mapping) else params
    try:
        iterator = iter(items)
    except TypeError:
        raise TypeError(f"broadcast_parameters takes model.parameters(), model.named_parameters() or "
                        f"model.state_dict(), got {type(params).__name__}") from None
    named = []
    for index, item in enumerate(iterator):
        if isinstance(item, torch.Tensor):
            named.append((str(index), item))
        elif isinstance(item, tuple) and len(item) == 2:
            name, tensor = item
            if isinstance(tensor, torch.Tensor):  # a state_dict may hold non-tensor extra state
                named.append((str(name), tensor))
        else:
            raise TypeError(f"broadcast_parameters: entry {index} is a {type(item).__name__}; expected a "
                            "tensor or a (name, tensor) pair")
    return named


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor | tuple[str, torch.Tensor]],
                         root_rank: int, prefix: str = "Parameter.") -> None:
    """Overwrite each tensor in ``params`` on every worker with ``root_rank``'s values, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``:
            a mapping or an iterable (a generator too) of ``(name, tensor)`` pairs or of tensors,
            which are named by their position; the same names, shapes and dtypes on every
            worker. Non-tensor values of a mapping or pair (extra state) are skipped.
        root_rank: the rank whose values win.
        prefix: prepended to each name in errors and timing.

    Raises:
        ValueError: ``root_rank`` is not a rank of this job.
        TypeError: ``params`` is a single tensor or not iterable, or an entry is neither a
            tensor nor a ``(name, tensor)`` pair.
        TensorMismatchError: the workers' parameter lists differ.
    """
    engine = _engine.current()
    _check_root(engine, root_rank)
    named = [(prefix + name, tensor) for name, tensor in _named_tensors(params)]
    description = f"broadcast_parameters root={root_rank} " + "; ".join(describe(n, t) for n, t in named)
    with round_lock, torch.no_grad():
        negotiate(engine, "broadcast_parameters", description)
        for name, tensor in named:
            buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
            engine.broadcast(buffer, root_rank, name)
            if buffer is not tensor:
                tensor.copy_(buffer)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every worker (serialised with ``torch.save``).

    The object is unpickled on the other workers, so broadcast only what your own job created.

    Raises:
        ValueError: ``root_rank`` is not a rank of this job.
        TensorMismatchError: the workers called broadcasts with different names or roots.
        DynamixError: on the other workers, when the root could not serialise ``obj`` (the
            root raises the serialisation error itself).
    """
    engine = _engine.current()
    _check_root(engine, root_rank)
    payload, failure = b"", None
    if engine.rank == root_rank:
        try:
            stream = io.BytesIO()
            torch.save(obj, stream)
            payload = stream.getvalue()
        except Exception as exc:  # pickling can raise almost anything; every rank must still agree
            failure = exc
    with round_lock:
        lengths = negotiate(engine, "broadcast_object", f"broadcast_object {name} root={root_rank}",
                            -1 if failure else len(payload))[:, 0]
        if lengths[root_rank] < 0:
            if failure is not None:
                raise failure
            raise DynamixError(f"broadcast_object {name!r}: rank {root_rank} could not serialise the object; see its error")
        buffer = torch.zeros(int(lengths[root_rank]), dtype=torch.uint8)
        if engine.rank == root_rank:
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        engine.broadcast(buffer, root_rank, f"broadcast_object.{name}")
    if engine.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(buffer.numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, prefix: str = "Parameter.") -> None:
    """Give every worker ``root_rank``'s optimizer state and hyper-parameters (e.g. momentum, lr).

    Works before the first step too (an empty state is broadcast as such), and for any
    optimizer whose ``state_dict`` can be pickled (``LBFGS`` included).

    Args:
        optimizer: a ``torch.optim.Optimizer`` or a ``DistributedOptimizer``, over the same
            parameters on every worker.
        root_rank: the rank whose state wins.
        prefix: prepended to the broadcast's name in errors and timing, as in BytePS.

    Raises:
        ValueError: ``root_rank`` is not a rank of this job.
        TensorMismatchError: the workers called it with different roots or prefixes.
    """
    state = broadcast_object(optimizer.state_dict(), root_rank, name=f"{prefix}optimizer_state")
    if _engine.current().rank != root_rank:
        optimizer.load_state_dict(state)
