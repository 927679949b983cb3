"""Where TensorFlow tensors meet the engine's ``torch.Tensor`` buffers.

Both directions go through DLPack, so no bytes are copied: a TensorFlow tensor becomes a torch
view of its buffer (:func:`to_torch`, read it only: TensorFlow tensors are immutable) and a
torch buffer becomes a TensorFlow tensor that keeps it alive (:func:`to_tf`). TensorFlow's
kernels abort the process on a buffer that is not aligned to :data:`ALIGNMENT` bytes, so views
handed to TensorFlow start on such a boundary (:func:`aligned_offsets`), and :func:`to_tf`
copies any that does not. The engine calls
run in Python: eagerly they are plain calls, inside ``tf.function`` (and Keras' compiled train
step) :func:`call` wraps them in ``tf.py_function``, a stateful op that TensorFlow runs in
program order, so every worker issues its collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf
import torch

from dynamix_byteps.errors import ConfigurationError

try:
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla_context
except ImportError:  # private: should a later TensorFlow move it, XLA fails with its own error
    _in_xla_context = None

ALIGNMENT = 64  # bytes; EIGEN_MAX_ALIGN_BYTES of TensorFlow's CPU kernels


def aligned_offsets(numels: Sequence[int], element_size: int) -> tuple[list[int], int]:
    """Offsets (in elements) that place tensors of ``numels`` elements one after another in a
    flat buffer, each starting on an :data:`ALIGNMENT`-byte boundary; and the buffer's length."""
    step = max(ALIGNMENT // element_size, 1)
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end += -(-n // step) * step
    return offsets, end


def to_torch(tensor: tf.Tensor) -> torch.Tensor:
    """A torch view of an eager tensor's buffer (no copy; do not write to it).

    Raises:
        TypeError: the dtype has no DLPack form (e.g. ``tf.string``, ``tf.resource``).
    """
    if not (tensor.dtype.is_floating or tensor.dtype.is_complex or tensor.dtype.is_integer or tensor.dtype.is_bool):
        # TensorFlow aborts the process (a CHECK in TFE_HandleToDLPack) on string, resource and
        # variant tensors instead of raising, so they must never reach the DLPack export.
        raise TypeError(f"a {tensor.dtype.name} tensor cannot reach the communication engine; "
                        "use a numeric dtype (float16/32/64, bfloat16, int8/32/64, uint8)")
    try:
        return torch.from_dlpack(tensor)
    except (RuntimeError, TypeError, ValueError, tf.errors.InvalidArgumentError) as exc:
        raise TypeError(f"a {tensor.dtype.name} tensor cannot reach the communication engine ({exc}); "
                        "use a numeric dtype (float16/32/64, bfloat16, int8/32/64, uint8)") from None


def to_tf(tensor: torch.Tensor) -> tf.Tensor:
    """An eager tensor over a contiguous torch buffer (no copy when it is aligned; the buffer
    lives as long as the tensor)."""
    if tensor.data_ptr() % ALIGNMENT:
        tensor = tensor.clone()
    return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))


def dense(tensor) -> tf.Tensor:
    """``tensor`` as a dense tensor: ``tf.IndexedSlices`` (embedding gradients) are densified."""
    return tf.convert_to_tensor(tensor)


def _refuse_xla() -> None:
    """Raise ConfigurationError, naming the remedy, when the graph being traced is compiled by XLA.

    XLA has no kernel for ``tf.py_function``: without this, the first step fails on every worker
    with TensorFlow's "Detected unsupported operations ... EagerPyFunc". Keras 3 compiles
    ``model.fit``'s train step with XLA by default (``jit_compile="auto"``) wherever a GPU is
    visible, so a plain ``model.compile(optimizer=DistributedOptimizer(...))`` gets there too.
    """
    if _in_xla_context is not None and _in_xla_context(tf.compat.v1.get_default_graph()):
        raise ConfigurationError(
            "XLA (jit_compile=True) cannot compile dynamix_byteps's communication (gradient reduction, push_pull, "
            "broadcast): compile the model with model.compile(..., jit_compile=False) (Keras's default "
            "jit_compile='auto' turns XLA on wherever a GPU is visible), or use tf.function(jit_compile=False) "
            "for the step that reduces")


def call(fn: Callable[..., list], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType]) -> list[tf.Tensor]:
    """``fn(*inputs)`` now when executing eagerly, else as a ``tf.py_function`` op in the graph.

    ``fn`` receives eager tensors and returns a list of eager tensors of ``out_dtypes``; in a
    graph the outputs have unknown shapes until the caller sets them.

    Raises:
        ConfigurationError: the graph is being compiled with XLA (``jit_compile=True``), which
            cannot run the engine call; raised while tracing, before any communication.
    """
    if tf.executing_eagerly():
        return list(fn(*inputs))
    _refuse_xla()
    outputs = tf.py_function(fn, list(inputs), list(out_dtypes))
    return list(outputs) if out_dtypes else []
