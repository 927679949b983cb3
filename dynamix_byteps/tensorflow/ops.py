"""push_pull and broadcasts on TensorFlow tensors, with the semantics of ``byteps.tensorflow``.

Eager and inside ``tf.function``. Each call crosses to the engine through
:mod:`~dynamix_byteps.tensorflow.bridge` (DLPack, no copy), writes the result into one new
buffer (the input tensor is never modified) and runs the same collective code as the PyTorch
frontend (:mod:`dynamix_byteps.torch.ops`, :mod:`dynamix_byteps.torch.functions`): negotiation
first, so every worker must issue the same collectives with the same names, shapes and dtypes
in the same order, or all of them raise ``TensorMismatchError``.

``push_pull`` and ``broadcast`` of floating-point tensors are differentiable: the gradient of a
push_pull is the push_pull of the gradient, as in BytePS.
"""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf

from dynamix_byteps import rank
from dynamix_byteps.reduce_ops import Average, Sum
from dynamix_byteps.tensorflow.bridge import call, dense, to_tf, to_torch
from dynamix_byteps.torch import ops as _torch_ops
from dynamix_byteps.torch.compression import Compression, Compressor
from dynamix_byteps.torch.functions import broadcast_parameters

_BROADCAST_NAME = "Broadcast"


def _is_average(average: bool | None, op: str | None) -> bool:
    if op is None:
        return True if average is None else bool(average)
    if average is not None:
        raise ValueError("push_pull takes average= or op=, not both; use op=bps.Average or op=bps.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"push_pull op must be bps.Average or bps.Sum, got {op!r} (Adasum is not implemented)")
    return op == Average


SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
                    tf.uint8, tf.int8, tf.int32, tf.int64)


def check_dtype(tensor: tf.Tensor) -> None:
    """Raise TypeError, naming the TensorFlow dtype, unless push_pull can sum ``tensor``'s dtype.

    Checked before the tensor crosses to the engine: TensorFlow aborts the process on a DLPack
    export of a string tensor, and the engine's own message would name a torch dtype.
    """
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"push_pull cannot sum {tensor.dtype.name} tensors; use one of: {names} "
                        "(tf.cast the tensor first)")


def _through_engine(now, backward, tensor: tf.Tensor) -> tf.Tensor:
    """Run ``now`` (a list of tensors in, out: the engine call) as a graph-safe op with gradient ``backward``.

    The result keeps ``tensor``'s static shape; integer tensors get no gradient.
    """

    def forward(t):
        (result,) = call(now, [t], [t.dtype])
        result.set_shape(t.shape)
        return result

    if not (tensor.dtype.is_floating or tensor.dtype.is_complex):
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        return forward(x), backward

    return op(tensor)


def push_pull(tensor, scope: str = "", average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: type[Compressor] = Compression.none, op: str | None = None, enable_async: bool = False,
              name: str | None = None) -> tf.Tensor:
    """Sum or average ``tensor`` over all workers; returns a new tensor of the same shape and dtype.

    Args:
        tensor: ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` (densified); numeric
            dtype (:data:`SUPPORTED_DTYPES`: float16/32/64, bfloat16, complex, int8/32/64, uint8);
            same shape on every worker.
        scope: prefix of ``name``.
        average: True (the default) divides by ``size()``, False sums; integers divide with
            truncation. Or give ``op=Average``/``op=Sum`` (not both).
        device_dense: accepted for BytePS compatibility; tensors stay where they are.
        device_sparse: accepted for BytePS compatibility.
        compression: ``Compression.none`` or ``Compression.fp16`` (what crosses the wire).
        enable_async: BytePS's asynchronous mode, which this library does not offer: must be False.
        name: identical on every worker for the same logical tensor; auto-named by call order if None.

    Raises:
        ValueError: both ``average`` and ``op``, an unknown ``op``, or ``enable_async=True``.
        TypeError: a dtype the engine cannot sum (bool, int16, string, ...), raised on this
            worker before any communication, naming the TensorFlow dtype.
        TensorMismatchError: the workers disagree on name, shape, dtype, mode or compression.
        NotInitializedError: ``init()`` was not called.
    """
    del device_dense, device_sparse
    if enable_async:
        raise ValueError("enable_async=True (BytePS's asynchronous training) is not supported; "
                         "training here is synchronous, so leave enable_async=False")
    mean = _is_average(average, op)
    label = None if name is None else f"{scope}{name}"
    x = dense(tensor)
    check_dtype(x)

    def now(t):
        buffer = to_torch(t).clone()
        _torch_ops.push_pull_inplace(buffer, average=mean, name=label, compression=compression)
        return [to_tf(buffer)]

    def backward(dy):
        return push_pull(dy, average=mean, compression=compression, name=None if label is None else f"{label}.grad")

    return _through_engine(now, backward, x)


def broadcast(tensor, root_rank: int, scope: str = "", name: str | None = None, is_variable: bool = True) -> tf.Tensor:
    """``root_rank``'s value of ``tensor``, on every worker, as a new tensor (``tensor`` is unchanged).

    ``is_variable`` is accepted for BytePS compatibility (BytePS zeroes non-root variables; this
    never modifies its input). The gradient is the sum of the gradients on the root, zero elsewhere.

    Raises:
        ValueError: ``root_rank`` is not a rank of this job.
        TensorMismatchError: the workers disagree on name, shape, dtype or root.
    """
    del is_variable
    label = f"{scope}{name if name is not None else _BROADCAST_NAME}"
    x = dense(tensor)

    def now(t):
        buffer = to_torch(t).clone()
        broadcast_parameters([(label, buffer)], root_rank, prefix="")
        return [to_tf(buffer)]

    def backward(dy):
        summed = push_pull(dy, average=False, name=f"{label}.grad")
        return summed if rank() == root_rank else tf.zeros_like(summed)

    return _through_engine(now, backward, x)


def variable_name(variable, index: int) -> str:
    """A name for a variable or tensor that is the same on every worker: Keras' ``path``, a
    ``tf.Variable``'s name, else its position ``index``."""
    for attribute in ("path", "name"):
        try:
            value = getattr(variable, attribute, None)
        except AttributeError:  # an eager tensor's .name raises
            value = None
        if isinstance(value, str) and value:
            return value
    return str(index)


def broadcast_variables(variables: Iterable, root_rank: int, scope: str = ""):
    """Assign ``root_rank``'s values to ``variables`` (``tf.Variable`` or Keras variables) on every worker.

    One negotiation for the whole list. Eagerly the assignment is done on return (None is
    returned); inside ``tf.function`` or a TensorFlow 1 graph the grouped assign op is returned.

    Raises:
        ValueError: ``root_rank`` is not a rank of this job.
        TensorMismatchError: the workers' variable lists (names, shapes, dtypes) differ.
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.group()
    names = [f"{scope}{variable_name(v, i)}" for i, v in enumerate(variables)]
    values = [tf.convert_to_tensor(v) for v in variables]

    def now(*tensors):
        buffers = [to_torch(t).clone() for t in tensors]
        broadcast_parameters(list(zip(names, buffers)), root_rank, prefix="Variable.")
        return [to_tf(b) for b in buffers]

    results = call(now, values, [v.dtype for v in values])
    assigns = []
    for variable, value, result in zip(variables, values, results):
        result.set_shape(value.shape)
        assigns.append(variable.assign(result))
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int):
    """Broadcast ``root_rank``'s global variables (``tf.compat.v1.global_variables()``) to every worker.

    For TensorFlow 1-style graphs only, as in BytePS: returns the grouped assign op, to run in
    the session on every worker.

    Raises:
        RuntimeError: called eagerly, where no global variable collection exists.
        ValueError: ``root_rank`` is not a rank of this job (when the op runs).
    """
    if tf.executing_eagerly():
        raise RuntimeError("bps.broadcast_global_variables() needs a TensorFlow 1 graph; eagerly, call "
                           "bps.broadcast_variables(model.variables, root_rank) (or, with Keras, "
                           "bps_keras.broadcast_global_variables(root_rank, model))")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
