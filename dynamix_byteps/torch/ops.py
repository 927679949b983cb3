"""push_pull and its handles, with the semantics of ``byteps.torch``.

``push_pull`` sums a tensor over all workers (``average=True`` divides by the number of
workers; integer tensors use truncating division, as C does). Every call first negotiates
with the other workers (see :mod:`dynamix_byteps.negotiation`): all workers must call the
same push_pulls, with the same names, shapes and dtypes, in the same order.

Handles are integers, as in BytePS (counted from a random start per session). A handle is valid
until ``synchronize``, and only in the session (``init()`` to ``shutdown()``) that issued it: the
table of handles in flight and the counter of auto-generated names belong to the running engine
(:attr:`Engine.handles`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.engine import Handle
from dynamix_byteps.negotiation import describe, negotiate, round_lock
from dynamix_byteps.torch.compression import Compression, Compressor


@dataclass
class _Pending:
    work: Handle
    wire: torch.Tensor  # what the engine reduces in place
    ctx: object
    compression: type[Compressor]
    output: torch.Tensor  # where the result must end up
    divide_after: bool  # an integer average: truncate the sum, as C does
    size: int
    prescale: int | None = None  # a floating-point average: each worker's value was divided by this power of two


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                    torch.complex128, torch.uint8, torch.int8, torch.int32, torch.int64)


def check_tensor(tensor, device: torch.device) -> None:
    """Raise TypeError unless ``tensor`` is a dense tensor on ``device`` (the engine's) of a dtype
    push_pull can sum; the message says which engine takes tensors where ``tensor`` is."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"push_pull cannot sum {tensor.dtype} tensors; use one of: {names}")
    if tensor.layout != torch.strided:
        raise TypeError(f"push_pull needs a dense tensor, got layout {tensor.layout}; call .to_dense() first")
    if tensor.device != device:
        if tensor.device.type == "cuda" and device.type == "cpu":
            hint = "start the job with --engine nccl (DYNAMIX_ENGINE=nccl), or move the tensor with .cpu()"
        elif tensor.device.type == "cpu":
            hint = f"move it with .to({str(device)!r}), or start the job with --engine gloo for CPU tensors"
        else:
            hint = f"move it with .to({str(device)!r})"
        raise TypeError(f"push_pull got a tensor on {tensor.device}, but this worker's engine reduces tensors on "
                        f"{device}: {hint}")


def _start(tensor: torch.Tensor, make_output, average: bool, name: str | None,
           compression: type[Compressor]) -> int:
    engine = _engine.current()
    check_tensor(tensor, engine.device)
    output = make_output(tensor)
    with round_lock:
        name = engine.handles.auto_name("push_pull.noname") if name is None else str(name)
        negotiate(engine, "push_pull", f"{describe(name, tensor)} average={average} compression={compression.name}")
        with torch.no_grad():
            divide_first = average and _divides_exactly(output)
            prescale = _power_of_two_at_least(engine.size) if divide_first else None
            if divide_first:
                # Scaled before the sum: n values near a narrow wire type's maximum (fp16: 65504)
                # would overflow when summed, their mean does not. A power of two scales exactly,
                # so the mean stays as exact as the sum divided by n.
                output.div_(prescale)
            wire, ctx = compression.compress(output)
            if not wire.is_contiguous():
                wire = wire.contiguous()
            work = engine.all_reduce_async(wire, name)
    return engine.handles.add(
        _Pending(work, wire, ctx, compression, output, average and not divide_first, engine.size, prescale))


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                            version: int = 0, priority: int = 0,
                            compression: type[Compressor] = Compression.none) -> int:
    """Start summing (or averaging) ``tensor`` over all workers, writing the result into it.

    Args:
        tensor: dense tensor on the engine's device (CPU with gloo, this worker's GPU with nccl),
            of any shape and a dtype in :data:`SUPPORTED_DTYPES`.
        average: return the mean over the workers: floating-point and complex tensors are divided
            by the power of two p >= ``size()`` before the sum (exact in binary floating point, so a
            compressed wire type such as float16 holds the sum without overflowing when the plain
            sum would not fit) and multiplied by p / ``size()`` after it, in float64; integers are
            summed and then divided with truncation.
        name: identical on every worker for the same logical tensor; auto-named by call order if None.
        version: accepted for BytePS compatibility.
        priority: accepted for BytePS compatibility; the engines run rounds in issue order.
        compression: ``Compression.none`` or ``Compression.fp16``.

    Returns:
        A handle for :func:`poll` and :func:`synchronize`.

    Raises:
        TypeError: not a dense tensor on the engine's device of a supported dtype (e.g. bool,
            int16, sparse, a CUDA tensor with the gloo engine).
        TensorMismatchError: the workers disagree on name, shape, dtype, ``average`` or compression.
        NotInitializedError: ``init()`` was not called.
    """
    del version, priority
    return _start(tensor, lambda t: t, average, name, compression)


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                    version: int = 0, priority: int = 0,
                    compression: type[Compressor] = Compression.none) -> int:
    """As :func:`push_pull_async_inplace`, but ``tensor`` is left untouched; the result is a new
    tensor returned by :func:`synchronize`."""
    del version, priority
    return _start(tensor, lambda t: t.detach().clone(), average, name, compression)


def poll(handle: int) -> bool:
    """True once the push_pull behind ``handle`` has finished; never blocks.

    Raises:
        ValueError: ``handle`` is unknown, was already synchronized, or was issued before the last ``shutdown()``.
        NotInitializedError: ``init()`` was not called.
    """
    return _engine.current().handles.get(handle).work.done()


def synchronize(handle: int) -> torch.Tensor:
    """Wait for the push_pull behind ``handle`` and return its result tensor.

    Raises:
        ValueError: ``handle`` is unknown, was already synchronized, or was issued before the last ``shutdown()``.
        NotInitializedError: ``init()`` was not called.
        CommunicationError: a peer failed during the round.
    """
    pending = _engine.current().handles.pop(handle)
    pending.work.wait()
    with torch.no_grad():
        result = pending.compression.decompress(pending.wire, pending.ctx)
        if result is not pending.output:
            pending.output.copy_(result)
        if pending.divide_after:
            pending.output.copy_(torch.div(pending.output, pending.size, rounding_mode="trunc"))
        elif pending.prescale not in (None, pending.size):
            wide = torch.complex128 if pending.output.is_complex() else torch.float64
            pending.output.copy_(pending.output.to(wide) * pending.prescale / pending.size)
    return pending.output


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _divides_exactly(tensor: torch.Tensor) -> bool:
    """Floating-point and complex tensors are averaged by scaling each worker's value before the
    sum; integers are summed first and then divided with truncation."""
    return tensor.is_floating_point() or tensor.is_complex()


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None,
              version: int = 0, priority: int = 0,
              compression: type[Compressor] = Compression.none) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all workers and return the result as a new tensor.

    Same arguments and errors as :func:`push_pull_async_inplace`; ``tensor`` is not modified.
    """
    return synchronize(push_pull_async(tensor, average, name, version, priority, compression))


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      version: int = 0, priority: int = 0,
                      compression: type[Compressor] = Compression.none) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all workers in place and return it."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority, compression))


def declare(name: str) -> None:
    """Declare a tensor name before its first push_pull (BytePS assigns keys this way).

    Names are matched at each round by negotiation, so this only checks the argument.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare() needs a non-empty tensor name, got {name!r}")
