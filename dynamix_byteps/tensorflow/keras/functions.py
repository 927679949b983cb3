"""``push_pull``, ``broadcast`` and ``load_model`` of ``byteps.tensorflow.keras``, for Keras 3."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import h5py
import keras
import numpy as np
import tensorflow as tf
from keras.src.legacy.saving import legacy_h5_format

from dynamix_byteps.tensorflow import ops as _ops
from dynamix_byteps.tensorflow.keras.optimizer import DistributedOptimizer
from dynamix_byteps.torch.compression import Compression, Compressor


def push_pull(value, name: str | None = None, average: bool = True) -> tf.Tensor:
    """Sum or average a tensor-compatible ``value`` (number, array, tensor) over all workers.

    Args:
        value: converted with ``tf.convert_to_tensor`` (a Python float becomes float32, an int
            int32, which averages with truncating division); same shape and dtype on every worker.
        name: identical on every worker for the same logical value; auto-named by call order if None.
        average: True divides the sum by ``size()``.

    Returns:
        A new ``tf.Tensor`` of ``value``'s shape and dtype.

    Raises:
        TypeError: a dtype the engine cannot sum (bool, string, ...).
        TensorMismatchError: the workers disagree on name, shape, dtype or ``average``.
    """
    return _ops.push_pull(value, average=average, name=name)


def broadcast(value, root_rank: int, name: str | None = None) -> tf.Tensor:
    """``root_rank``'s ``value`` (number, array, tensor), on every worker, as a new ``tf.Tensor``.

    Raises:
        ValueError: ``root_rank`` is not a rank of this job.
        TensorMismatchError: the workers disagree on name, shape, dtype or root.
    """
    return _ops.broadcast(value, root_rank, name=name)


def load_model(filepath, custom_optimizers: Sequence[type] | None = None,
               custom_objects: Mapping[str, object] | None = None,
               compression: type[Compressor] = Compression.none) -> keras.Model:
    """Load a saved Keras model and wrap its optimizer in :func:`DistributedOptimizer`, keeping
    the optimizer's state (slots, iteration count), so training resumes where it stopped; from
    an ``.h5`` file too, where ``keras.models.load_model`` keeps only the iteration count and the
    learning rate.

    Args:
        filepath: what ``keras.models.load_model`` reads (a ``.keras`` or ``.h5`` file).
        custom_optimizers: optimizer classes of your own that the file uses (added to
            ``custom_objects`` under their class names); Keras' own load without them.
        custom_objects: passed on to ``keras.models.load_model``.
        compression: ``Compression.none`` or ``Compression.fp16`` for the wrapped optimizer.

    Returns:
        The model; a model saved without an optimizer (not compiled) is returned as loaded.

    Raises:
        ValueError, TypeError: from ``keras.models.load_model`` (unreadable file, unknown
            custom class).
    """
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    loaded = getattr(model, "optimizer", None)
    if loaded is None:
        return model
    # DistributedOptimizer copies a config, never state: move the saved variables across.
    state = _saved_optimizer_variables(filepath, loaded)
    wrapped = DistributedOptimizer(type(loaded).from_config(loaded.get_config()), compression=compression)
    if len(state) > len(wrapped.variables):  # saved after training, with its slots (momentum, ...)
        wrapped.build(model.trainable_variables)
    wrapped.load_own_variables(state)
    model.optimizer = wrapped
    return model


def _saved_optimizer_variables(filepath, loaded: keras.optimizers.Optimizer) -> dict[str, np.ndarray]:
    """The saved optimizer's variables as ``Optimizer.load_own_variables`` takes them:
    ``{"0": iterations, "1": learning rate, "2": the first slot, ...}``."""
    if str(filepath).endswith((".h5", ".hdf5")):
        # Keras' HDF5 loader builds the optimizer on the model's own variables, which a Sequential
        # or functional model does not have, so it restores only the iteration count and the
        # learning rate; the file holds every variable.
        with h5py.File(filepath, "r") as file:
            if "optimizer_weights" in file:
                values = legacy_h5_format.load_optimizer_weights_from_hdf5_group(file)
                return {str(i): np.asarray(value[()]) for i, value in enumerate(values)}
    state: dict = {}
    loaded.save_own_variables(state)
    return state
