"""Keras callbacks for ``model.fit`` on dynamix_byteps: the BytePS ones, and one that applies
batch-size assignments.

Every callback here is a collective where it communicates: give every worker the same callbacks
in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import keras
import tensorflow as tf

from dynamix_byteps import batching
from dynamix_byteps import engine as _engine
from dynamix_byteps.assignment import parse_batch_schedule
from dynamix_byteps.control.worker import report_loss
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.tensorflow.ops import broadcast_variables, push_pull


def _without_xla(model) -> None:
    """XLA cannot compile the engine call in the train step: fall back to a plain tf.function."""
    if getattr(model, "_jit_compile", None) is True:
        warnings.warn("jit_compile=True cannot compile the dynamix_byteps gradient reduction; "
                      "training this model with jit_compile=False", stacklevel=3)
        model.jit_compile = False


def broadcast_global_variables(root_rank: int, model: keras.Model | None = None) -> None:
    """Give every worker ``root_rank``'s model and optimizer variables (a collective).

    Keras 3 keeps no global variable collection, so the model is named: its variables and, when
    it is compiled, its optimizer's (the optimizer is built first if needed, so its slots exist).

    Raises:
        ConfigurationError: no model was given, or it is not built yet (no variables exist).
        TensorMismatchError: the workers' models differ.
    """
    if model is None:
        raise ConfigurationError("Keras 3 has no global variables: call broadcast_global_variables(root_rank, model) "
                                 "or pass BroadcastGlobalVariablesCallback(root_rank) to model.fit")
    if not model.built:
        raise ConfigurationError("the model has no variables yet: build it first (keras.Input, model.build or one "
                                 "call), or pass BroadcastGlobalVariablesCallback(root_rank) to model.fit")
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    broadcast_variables(variables, root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of the first ``fit``, give every worker ``root_rank``'s model and optimizer
    variables, so all start from the same weights (random initialisation or a checkpoint). A
    model that Keras builds only in its first step is synchronised after that step instead.

    Args:
        root_rank: the rank whose variables win.
        device: accepted for BytePS compatibility.
    """

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        del device
        self.root_rank = root_rank
        self.broadcast_done = False

    def set_model(self, model):
        super().set_model(model)
        _without_xla(model)

    def _broadcast(self) -> None:
        if not self.broadcast_done and self.model.built:
            broadcast_global_variables(self.root_rank, self.model)
            self.broadcast_done = True

    def on_train_begin(self, logs=None):
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each metric in the logs by its mean over all workers.

    Put it before callbacks that read the logs (checkpointing, early stopping, TensorBoard).

    Args:
        device: accepted for BytePS compatibility.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        del device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(logs)
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = push_pull(values, average=True, name="MetricAverage." + ",".join(keys)).numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


class BatchSizeCallback(keras.callbacks.Callback):
    """Applies batch-size assignments during ``model.fit``, on every worker at the same step.

    A ``DynamicBatchSampler`` must feed the model (``dynamic_batch_dataset``). At the start of
    training the callback schedules ``schedule``'s assignments (``bps.set_batch_sizes`` at their
    steps, all workers together); every batch it also reports the training loss, so a
    ``bpslaunch --policy`` scheduler sees the loss trend. The policy's own assignments are
    applied by ``DistributedOptimizer`` at its decision boundaries.

    Args:
        schedule: global steps at which the per-worker batch sizes change: ``"STEP:SIZES;..."``
            (e.g. ``"300:64;600:96,96,32,32"``, as ``--batch-schedule``), ``{step: sizes}`` or
            ``[(step, sizes), ...]``; sizes one for all workers or one per worker.

    Raises (at the start of training):
        ConfigurationError: no ``DynamicBatchSampler`` exists, or a malformed schedule.
        InvalidAssignmentError: an assignment breaks the sampler's rules (bounds, a step
            already drawn); every worker raises.
    """

    def __init__(self, schedule: str | Mapping[int, Sequence[int] | int] | Sequence | None = None):
        super().__init__()
        self.schedule = schedule
        self._applied: set[int] = set()

    def set_model(self, model):
        super().set_model(model)
        _without_xla(model)

    def _entries(self) -> list[tuple[int, tuple[int, ...]]]:
        size = _engine.current().size
        if self.schedule is None:
            return []
        if isinstance(self.schedule, str):
            return parse_batch_schedule(self.schedule, size)
        pairs = self.schedule.items() if isinstance(self.schedule, Mapping) else self.schedule
        entries = []
        for step, sizes in pairs:
            sizes = (sizes,) * size if isinstance(sizes, int) else tuple(sizes)
            entries.append((int(step), sizes))
        return sorted(entries)

    def on_train_begin(self, logs=None):
        entries = [(step, sizes) for step, sizes in self._entries() if step not in self._applied]
        if entries and batching.schedule() is None:
            raise ConfigurationError("BatchSizeCallback needs a DynamicBatchSampler feeding the model; build the "
                                     "dataset with bps.dynamic_batch_dataset(sampler, data)")
        for step, sizes in entries:
            batching.set_batch_sizes(sizes, at_step=step)
            self._applied.add(step)

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs:
            report_loss(logs["loss"])
