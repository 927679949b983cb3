"""Keras callbacks for ``model.fit`` on dynamix_byteps: the BytePS ones (variable broadcast,
metric averaging, learning-rate schedule and warm-up), and one that applies batch-size assignments.

Every callback here is a collective where it communicates: give every worker the same callbacks
in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import keras
import tensorflow as tf

from dynamix_byteps import batch_plan as _batch_plan
from dynamix_byteps import engine as _engine
from dynamix_byteps.assignment import parse_batch_schedule
from dynamix_byteps.control.step_monitor import report_loss
from dynamix_byteps.errors import ConfigurationError, TensorMismatchError
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
            try:
                broadcast_global_variables(self.root_rank, self.model)
            except TensorMismatchError as error:
                raise TensorMismatchError(
                    f"{error}\nIf one worker resumed from a checkpoint and the others built a fresh model (Horovod's "
                    "Keras examples load it on rank 0 only), load the checkpoint on every worker "
                    "(model = bps_keras.load_model(path), then fit(..., initial_epoch=e)): Keras 3 names a loaded "
                    "model's variables without the model's prefix; see docs/tensorflow.md") from error
            self.broadcast_done = True

    def on_train_begin(self, logs=None):
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each metric in the logs by its mean over all workers,
    weighted by the samples each worker's value covers.

    With per-worker batch sizes that differ, an unweighted mean of the workers' epoch values
    is not the epoch's value: a worker that saw 4 samples would count as much as one that saw
    48. Training metrics are weighted by the samples each worker trained on in the epoch,
    ``val_`` metrics by those it validated on (both as counted by the model's loss tracker,
    which Keras weights by batch size); when no worker's count is known (a ``train_step``
    that does not update the loss tracker), every worker counts equally, as in BytePS.

    Put it before callbacks that read the logs (checkpointing, early stopping, TensorBoard).

    Args:
        device: accepted for BytePS compatibility.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        del device
        self._trained_samples: float | None = None

    def on_epoch_begin(self, epoch, logs=None):
        self._trained_samples = None

    def on_test_begin(self, logs=None):
        # fit's validation starts here, before evaluate resets the metrics: the tracker still
        # counts this epoch's training samples.
        if self._trained_samples is None:
            self._trained_samples = _samples_counted(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        if self._trained_samples is None:
            trained, validated = _samples_counted(self.model), 0.0
        else:
            trained, validated = self._trained_samples, _samples_counted(self.model)
        keys = sorted(logs)
        for key, value in zip(keys, _weighted_means(keys, [float(logs[k]) for k in keys], trained, validated)):
            logs[key] = value


def _samples_counted(model) -> float:
    """Samples the model's loss tracker has counted since its last reset (0.0 when it has none)."""
    count = getattr(getattr(model, "_loss_tracker", None), "count", None)
    return 0.0 if count is None else float(keras.ops.convert_to_numpy(count))


def _weighted_means(keys: list[str], values: list[float], trained: float, validated: float) -> list[float]:
    """Each value's mean over the workers weighted by ``validated`` (``val_`` keys) or
    ``trained`` (the others); the plain mean where the weights of every worker sum to 0.

    A collective: every worker must pass the same ``keys``.
    """
    weights = [validated if key.startswith("val_") else trained for key in keys]
    local = [w * v if w else 0.0 for w, v in zip(weights, values)] + values + [trained, validated]
    summed = push_pull(tf.constant(local, dtype=tf.float64), average=False,
                       name="MetricAverage." + ",".join(keys)).numpy().tolist()
    count = len(keys)
    weighted, plain, (trained_total, validated_total) = summed[:count], summed[count:2 * count], summed[2 * count:]
    means = []
    for key, weighted_sum, plain_sum in zip(keys, weighted, plain):
        total = validated_total if key.startswith("val_") else trained_total
        means.append(weighted_sum / total if total > 0 else plain_sum / _engine.current().size)
    return means


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
        batch_plan: the ``DynamicBatchSampler``'s :class:`~dynamix_byteps.batch_plan.BatchPlan`
            (``sampler.batch_plan``); default: the process's default plan, the newest sampler's.

    Raises (at the start of training):
        ConfigurationError: no ``DynamicBatchSampler`` exists, or a malformed schedule.
        InvalidAssignmentError: an assignment breaks the sampler's rules (bounds, a step
            already drawn); every worker raises.
    """

    def __init__(self, schedule: str | Mapping[int, Sequence[int] | int] | Sequence | None = None,
                 batch_plan: _batch_plan.BatchPlan | None = None):
        super().__init__()
        self.schedule = schedule
        self.batch_plan = batch_plan
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
        plan = self.batch_plan if self.batch_plan is not None else _batch_plan.default()
        if entries and plan.schedule is None:
            raise ConfigurationError("BatchSizeCallback needs a DynamicBatchSampler feeding the model; build the "
                                     "dataset with bps.dynamic_batch_dataset(sampler, data)")
        for step, sizes in entries:
            plan.set_batch_sizes(sizes, at_step=step)
            self._applied.add(step)

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs:
            report_loss(logs["loss"])


def _learning_rate(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the optimizer's learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch``
    up to, not including, ``end_epoch`` (BytePS's and Horovod's callback, for Keras 3).

    With ``staircase=True`` the rate is set at the start of each epoch and ``multiplier`` gets
    the epoch (int, 0-based); with ``staircase=False`` it is set before every batch and gets the
    fractional epoch ``epoch + batch / steps_per_epoch``. Outside the range the rate is left as
    it is. The rate at the end of each epoch goes into the logs as ``lr``. Under
    ``DistributedOptimizer(lr_scaling=...)`` this is the base rate the scaling multiplies.

    Args:
        multiplier: a number (then always staircase) or a function of the epoch returning the factor.
        start_epoch: the first epoch adjusted.
        end_epoch: the first epoch no longer adjusted; None: every epoch from ``start_epoch`` on.
        staircase: set the rate per epoch (True) or per batch (False).
        momentum_correction: when the rate changes from η to η', scale the momentum buffers of a
            ``keras.optimizers.SGD`` (its velocity carries the rate) by η'/η, so the next update
            follows the new rate at once (Goyal et al. 2017, arXiv 1706.02677, "momentum
            correction"). Other optimizers are left alone.
        steps_per_epoch: batches per epoch, for ``staircase=False``; default: what ``model.fit``
            knows (its ``steps_per_epoch`` or the dataset's length). When neither is known, as
            for ``dynamic_batch_dataset`` whose steps follow the batch sizes, the rate is set
            once per epoch, with a warning.
        initial_lr: the base rate; default: the optimizer's rate when training starts.

    Raises (at the start of training):
        ValueError: the model has no optimizer, or its rate is a ``LearningRateSchedule``,
            which cannot be set.
    """

    def __init__(self, multiplier, start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 initial_lr: float | None = None):
        super().__init__()
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.staircase = staircase or not callable(multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.initial_lr = initial_lr
        self._epoch_step = 1.0  # epochs between two settings of the rate: 1, or 1/steps_per_epoch per batch
        self._per_batch = False
        self._epoch = 0

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError(f"{type(self).__name__} needs a compiled model: call model.compile(optimizer=...) first")
        if not isinstance(optimizer.learning_rate, keras.Variable):
            raise ValueError(f"{type(self).__name__} sets the learning rate itself, but this optimizer's is a "
                             "LearningRateSchedule; give the optimizer a float learning_rate")
        if self.initial_lr is None:
            self.initial_lr = _learning_rate(optimizer)
        steps = self.steps_per_epoch or self.params.get("steps")
        self._per_batch = not self.staircase and bool(steps)
        if self._per_batch:
            self._epoch_step = 1.0 / steps
        elif not self.staircase:
            name = type(self).__name__
            warnings.warn(f"{name}: the number of steps per epoch is unknown (a dataset of unknown length, such as "
                          f"dynamic_batch_dataset's), so the learning rate changes once per epoch{self._per_epoch_note()}; "
                          f"pass {name}(..., steps_per_epoch=N), e.g. the training samples // the global batch, to change "
                          "it every batch (to this callback, not model.fit's steps_per_epoch, which stays out with "
                          "dynamic_batch_dataset)", stacklevel=2)

    def _per_epoch_note(self) -> str:
        return ""

    def _in_range(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, factor) -> None:
        optimizer = self.model.optimizer
        old, new = _learning_rate(optimizer), self.initial_lr * float(factor)
        optimizer.learning_rate = new
        if self.momentum_correction and old > 0 and new != old and isinstance(optimizer, keras.optimizers.SGD):
            for velocity in getattr(optimizer, "momentums", ()):
                velocity.assign(velocity * (new / old))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if not self._per_batch and self._in_range(epoch):
            self._set(self.multiplier(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if self._per_batch and self._in_range(self._epoch):
            self._set(self.multiplier(self._epoch + batch * self._epoch_step))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual learning-rate warm-up from ``initial_lr / size()`` to ``initial_lr`` over the first
    ``warmup_epochs`` epochs (Goyal et al. 2017, arXiv 1706.02677; BytePS's and Horovod's callback).

    After ``p`` epochs of training (fractional) the rate is
    ``initial_lr / size() * (1 + p * (size() - 1) / warmup_epochs)``, set before each batch for
    the ``p`` at that batch's end, so the last warm-up batch runs at ``initial_lr``. When the
    steps per epoch are unknown (see :class:`LearningRateScheduleCallback`) it is set per epoch,
    for ``p`` at the epoch's end.

    Args:
        warmup_epochs: length of the warm-up, in epochs. BytePS's first argument; Horovod's is
            ``initial_lr``, so a Horovod script's ``LearningRateWarmupCallback(scaled_lr)`` would warm up
            over ``scaled_lr`` epochs: a fraction of an epoch without ``initial_lr`` warns
            (``UserWarning``) and asks for ``initial_lr=`` by name.
        momentum_correction: as for :class:`LearningRateScheduleCallback`.
        steps_per_epoch: as for :class:`LearningRateScheduleCallback`.
        initial_lr: as for :class:`LearningRateScheduleCallback`.
        verbose: 1 prints a line when the warm-up is done.

    Raises (at the start of training): as :class:`LearningRateScheduleCallback`.
    """

    def __init__(self, warmup_epochs: int = 5, momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0, initial_lr: float | None = None):
        if initial_lr is None and 0 < warmup_epochs < 1:
            warnings.warn(f"LearningRateWarmupCallback: a warm-up of {warmup_epochs:g} epochs. The first argument is "
                          f"warmup_epochs (BytePS's order); Horovod's is initial_lr: if {warmup_epochs:g} is the "
                          f"learning rate, pass LearningRateWarmupCallback(initial_lr={warmup_epochs:g}, "
                          "warmup_epochs=...)", stacklevel=2)
        super().__init__(self._warmup, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         initial_lr=initial_lr)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _per_epoch_note(self) -> str:
        return (", each epoch at the rate it reaches at its end: the first epoch already runs at "
                f"{'initial_lr, no warm-up at all' if self.warmup_epochs <= 1 else 'more than initial_lr / size()'}")

    def _warmup(self, epoch: float) -> float:
        size = _engine.current().size
        # An epoch longer than steps_per_epoch (dynamic_batch_dataset's last, partial step) must not
        # carry the rate past initial_lr, where it would stay after the warm-up.
        done = min(epoch + self._epoch_step, self.warmup_epochs)
        return (1 + done * (size - 1) / self.warmup_epochs) / size

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.warmup_epochs - 1:
            rate = _learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")
