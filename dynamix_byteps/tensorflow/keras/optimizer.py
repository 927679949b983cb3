"""``DistributedOptimizer`` for Keras 3 optimizers (TensorFlow backend).

``apply`` / ``apply_gradients`` (what ``model.fit``'s train step and custom loops call) first
replace the gradients by their batch-weighted mean over all workers
(:class:`~dynamix_byteps.tensorflow.gradients.GradientReducer`), then run the wrapped
optimizer's update with its learning rate multiplied by the step's LR-scaling factor. The factor
applies inside that update only: ``optimizer.learning_rate``, schedules and the
``LearningRateScheduler`` callback keep seeing the base rate.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dynamix_byteps.reduce_ops import Average, check_gradient_op, check_gradient_predivide_factor
from dynamix_byteps.scaling.lr_scaling import optimizer_family_of
from dynamix_byteps.tensorflow.gradients import GradientReducer
from dynamix_byteps.tensorflow.ops import variable_name
from dynamix_byteps.torch.compression import Compression, Compressor


class _DistributedOptimizer(keras.optimizers.Optimizer):
    """Methods mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    def _dynamix_init(self, compression, lr_scaling, base_batch_size, batch_plan) -> None:
        updater = self.inner_optimizer if isinstance(self, keras.optimizers.LossScaleOptimizer) else self
        self.dynamix = GradientReducer(optimizer_family_of(updater), compression, lr_scaling, base_batch_size,
                                       batch_plan)
        self._dynamix_lr_scale = tf.Variable(1.0, trainable=False, dtype=tf.float32, name="dynamix_lr_scale")
        self._dynamix_scaling = False
        if updater is not self:
            updater._dynamix_scaled_rate = self._scaled_rate

    @property
    def global_batch_size(self) -> int | None:
        """Σ b_i of the last step (None when batch sizes were not known)."""
        return self.dynamix.aggregator.global_batch_size

    @property
    def next_step(self) -> int | None:
        """The sampler step after the last one trained on (None without a sampler)."""
        return self.dynamix.next_step

    @property
    def lr_scale(self) -> float:
        """The learning-rate factor of the last step."""
        return self.dynamix.aggregator.lr_scale

    def build(self, variables):
        """Keras' ``build``, refused under ``mixed_float16`` without loss scaling inside
        (:func:`_check_loss_scaled`)."""
        _check_loss_scaled(self)
        super(self.__class__, self).build(variables)

    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` over all workers (batch-weighted), then apply them with the learning
        rate scaled for this step's global batch. Arguments as Keras' ``Optimizer.apply``."""
        grads = list(grads)
        if not grads:
            return super(self.__class__, self).apply(grads, trainable_variables)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        names = [f"Gradient.{variable_name(v, i)}" for i, v in enumerate(variables)]
        reduced, lr_scale = self.dynamix.reduce(grads, names)
        self._dynamix_lr_scale.assign(lr_scale)
        self._dynamix_scaling = True
        try:
            return super(self.__class__, self).apply(reduced, trainable_variables)
        finally:
            self._dynamix_scaling = False

    def _get_current_learning_rate(self):
        return self._scaled_rate(super(self.__class__, self)._get_current_learning_rate())

    def _scaled_rate(self, rate):
        """``rate`` times the step's learning-rate factor inside ``apply``, else ``rate``; in
        ``rate``'s dtype (a float64 model's rate stays float64)."""
        if not self._dynamix_scaling:
            return rate
        rate = tf.convert_to_tensor(rate)
        return rate * tf.cast(self._dynamix_lr_scale, rate.dtype)


def _check_loss_scaled(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuse a distributed ``optimizer`` that is not a ``LossScaleOptimizer`` under the global
    ``mixed_float16`` policy. ``model.compile`` would wrap it in a ``LossScaleOptimizer`` of its
    own, whose overflow check reads each worker's gradients before the reduction: a worker whose
    gradients overflow alone would skip that step's reduction and pair its later ones with the
    others' earlier steps. The policy is global, so every worker raises here, before any collective.

    Raises:
        ValueError: the policy is ``mixed_float16`` and ``optimizer`` is not a ``LossScaleOptimizer``.
    """
    if keras.mixed_precision.global_policy().name != "mixed_float16":
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return
    name = type(optimizer).__name__
    raise ValueError(
        f"DistributedOptimizer({name}) under the mixed_float16 dtype policy has no loss scaling inside: "
        "model.compile wraps it in a LossScaleOptimizer of its own, which checks each worker's gradients for "
        "overflow before they are averaged, so a worker whose gradients overflow alone skips that step's averaging "
        "and the workers fall out of step (wrong weights, or CommunicationError). Put the loss-scale optimizer "
        f"inside: bps.DistributedOptimizer(keras.optimizers.LossScaleOptimizer({name}(...))); compile then "
        "leaves it as it is, and an overflow on any worker skips the step on every worker")


class _ScaledUpdate(keras.optimizers.Optimizer):
    """Mixed into the inner optimizer of a wrapped ``LossScaleOptimizer``: the inner one makes
    the update, so it is the one whose learning rate the step's factor multiplies."""

    def _get_current_learning_rate(self):
        return self._dynamix_scaled_rate(super(self.__class__, self)._get_current_learning_rate())


def _mixed(cls: type, mixin: type) -> type:
    """A subclass of ``cls`` with ``mixin``'s methods, which saved models name as ``cls``."""
    namespace = dict(mixin.__dict__)
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    return type(cls.__name__, (cls,), namespace)


def _rebuilt(optimizer: keras.optimizers.Optimizer, name: str | None) -> keras.optimizers.Optimizer:
    """A new ``optimizer`` of the distributed class, from its config; a ``LossScaleOptimizer``'s
    inner optimizer is rebuilt with :class:`_ScaledUpdate`."""
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    cls = _mixed(optimizer.__class__, _DistributedOptimizer)
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return cls.from_config(config)
    inner = optimizer.inner_optimizer
    config["inner_optimizer"] = _mixed(inner.__class__, _ScaledUpdate).from_config(inner.get_config())
    return cls(**config)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: str = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         lr_scaling: str | None = None, base_batch_size: int | None = None,
                         batch_plan=None) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that every update first averages the gradients over all
    workers, weighted by each worker's local batch size, and scales the learning rate with the
    global batch.

    The result is an instance of a subclass of ``optimizer``'s class built from its config, so
    ``model.compile(optimizer=...)``, ``isinstance`` checks and saving work as before. The local
    batch sizes come from a ``DynamicBatchSampler`` feeding the model (``dynamic_batch_dataset``);
    without one the gradients are BytePS's plain average and the learning rate is not scaled.
    Compile with ``jit_compile=False`` on GPU machines, where Keras's default ``"auto"`` turns XLA
    on: XLA cannot compile the call into the engine (the first step raises ``ConfigurationError``).

    Args:
        optimizer: a Keras 3 optimizer not yet used (its config is copied, not its state).
        name: a new name for the optimizer (default: the wrapped one's).
        device_dense: accepted for BytePS compatibility.
        device_sparse: accepted for BytePS compatibility.
        sparse_as_dense: accepted for BytePS compatibility (sparse gradients are always densified).
        compression: ``Compression.none`` or ``Compression.fp16``.
        gradient_predivide_factor: Horovod's argument, a number > 0; it splits Horovod's average
            into a division before the sum and one after it, so the average, and the result here,
            are the same whatever it is.
        op: Horovod's argument; must be ``Average`` (gradients are always averaged).
        backward_passes_per_step: Horovod's argument; must be 1: every step's gradients are
            reduced (to accumulate N batches, train on batches N times larger).
        average_aggregated_gradients: Horovod's argument; it applies to more than one backward
            pass per step only, so it has no effect.
        lr_scaling: ``none``, ``linear`` (B/B0), ``sqrt`` or ``adascale`` (AdamScale for
            Adam/AdamW); default ``bpslaunch --lr-scaling`` through ``DYNAMIX_LR_SCALING``, else ``none``.
        base_batch_size: B0, the global batch the learning rate was tuned for; default: the
            first step's global batch.
        batch_plan: the ``DynamicBatchSampler``'s :class:`~dynamix_byteps.batch_plan.BatchPlan`
            (``sampler.batch_plan``) whose batch sizes weight the gradients; default: the
            process's default plan, the newest sampler's.

    Attributes of the result: ``global_batch_size`` and ``lr_scale`` of the last step,
    ``next_step`` (the sampler step after it), and
    ``dynamix`` (its :class:`~dynamix_byteps.tensorflow.gradients.GradientReducer`).

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer, or ``batch_plan`` is not a ``BatchPlan``.
        ValueError: the optimizer was already built (its state would be lost: wrap it before
            training), ``op`` is not ``Average``, ``gradient_predivide_factor`` is not a finite
            number > 0, ``backward_passes_per_step`` is not 1, an unknown ``lr_scaling`` rule, or a
            ``base_batch_size`` below 1. At its first ``build`` (``model.fit``'s start, or the
            first ``apply``): the global dtype policy is ``mixed_float16`` and ``optimizer`` is not a
            ``LossScaleOptimizer`` (wrap it as ``DistributedOptimizer(LossScaleOptimizer(opt))``).
    """
    del device_dense, device_sparse, sparse_as_dense, average_aggregated_gradients
    check_gradient_op(op)
    check_gradient_predivide_factor(gradient_predivide_factor)
    if backward_passes_per_step != 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is not supported: the Keras "
                         "DistributedOptimizer reduces the gradients of every step (BytePS refuses more than 1 too); "
                         "leave it at 1 and train on batches that many times larger instead")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), got "
                        f"{type(optimizer).__name__}")
    if optimizer.built:
        raise ValueError("the optimizer was already used, and wrapping copies its config, not its state; "
                         "wrap it with DistributedOptimizer before training or restoring it")
    wrapped = _rebuilt(optimizer, name)
    wrapped._dynamix_init(compression, lr_scaling, base_batch_size, batch_plan)
    return wrapped
