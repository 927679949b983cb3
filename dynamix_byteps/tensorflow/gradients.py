"""Batch-weighted gradient reduction for TensorFlow, and ``DistributedGradientTape``.

:class:`GradientReducer` hands a step's gradients to the framework-neutral
:class:`~dynamix_byteps.aggregation.GradientAggregator`, the same code the PyTorch optimizer
runs: gradients cross to the engine through DLPack without a copy, are fused into one buffer per
dtype (the one copy, each gradient starting on a 64-byte boundary as TensorFlow's kernels
require; the buffer is then scaled by b_i/Σb and reduced in place), and come back as
TensorFlow tensors that are views of that buffer. The local batch size b_i comes from
``local_batch_size`` or from the batches a :class:`~dynamix_byteps.data.sampler.DynamicBatchSampler`
handed out (its ``batch_plan``); the step also feeds the gradient noise scale, and it ends, for
the scheduler's step monitor, as soon as the reduction completes, as in the PyTorch frontend
(:class:`~dynamix_byteps.training_step.TrainingStep`).
"""

from __future__ import annotations

import tensorflow as tf
import torch

from dynamix_byteps import batch_plan as _batch_plan
from dynamix_byteps.aggregation import (
    UNSET,
    GradientAggregator,
    plan_buckets,
    scale_into,
)
from dynamix_byteps.env import MAX_BATCH
from dynamix_byteps.negotiation import describe, fingerprint
from dynamix_byteps.reduce_ops import Average, check_gradient_op
from dynamix_byteps.tensorflow.bridge import (
    aligned_offsets,
    call,
    dense,
    to_tf,
    to_torch,
)
from dynamix_byteps.tensorflow.ops import variable_name
from dynamix_byteps.torch.compression import Compression, Compressor
from dynamix_byteps.training_step import TrainingStep


def _checked_samples(value) -> int:
    samples = int(value)
    if not 0 <= samples <= MAX_BATCH:
        raise ValueError(f"local_batch_size must be an integer number of samples in [0, {MAX_BATCH}], got {samples}")
    return samples


def _fuse(views: list[torch.Tensor], offsets: list[int], length: int, scale: float) -> torch.Tensor:
    """One flat buffer holding ``scale`` times ``views`` at ``offsets`` (zeros in the alignment
    gaps, and everywhere for a worker without samples: :func:`scale_into`)."""
    flat = torch.empty(length, dtype=views[0].dtype)
    end = 0
    for view, offset in zip(views, offsets):
        flat[end:offset].zero_()
        scale_into(flat[offset:offset + view.numel()], view.reshape(-1), scale)
        end = offset + view.numel()
    flat[end:].zero_()
    return flat


class _Plan:
    """How one set of gradients (names, shapes, dtypes) is fused and reduced: buckets of indices
    into the gradients, each bucket's aligned offsets and length, and the description every
    worker must share."""

    def __init__(self, names: list[str], views: list[torch.Tensor], aggregator: GradientAggregator):
        self.buckets = plan_buckets([(v.numel() * v.element_size(), v.dtype) for v in views], aggregator.fusion_bytes)
        self.layouts = [aligned_offsets([views[i].numel() for i in bucket], views[bucket[0]].element_size())
                        for bucket in self.buckets]
        self.dtypes = [views[bucket[0]].dtype for bucket in self.buckets]
        digest = fingerprint(describe(name, v) for name, v in zip(names, views))
        self.description = (f"DistributedOptimizer step over {len(views)} gradients (digest {digest:016x}), "
                            f"compression={aggregator.compression.name}, fusion_bytes={aggregator.fusion_bytes}")


class GradientReducer:
    """Reduces one step's gradients at a time; keeps the step statistics between steps.

    Args:
        optimizer_family: as :class:`~dynamix_byteps.aggregation.GradientAggregator`.
        compression: as :class:`~dynamix_byteps.aggregation.GradientAggregator`.
        lr_scaling: as :class:`~dynamix_byteps.aggregation.GradientAggregator`.
        base_batch_size: as :class:`~dynamix_byteps.aggregation.GradientAggregator`.
        batch_plan: as :class:`~dynamix_byteps.training_step.TrainingStep`.

    Attributes:
        aggregator: the :class:`~dynamix_byteps.aggregation.GradientAggregator`.
        monitor: the :class:`~dynamix_byteps.control.step_monitor.StepMonitor` it owns.
    """

    next_step = property(lambda self: self._step.next_step,
                         doc="The sampler step after the last one trained on (None without a sampler).")

    def __init__(self, optimizer_family: str, compression: type[Compressor] = Compression.none,
                 lr_scaling=None, base_batch_size: int | None = None, batch_plan=None):
        self.aggregator = GradientAggregator(optimizer_family, compression, lr_scaling, base_batch_size)
        self._step = TrainingStep(self.aggregator, optimizer_family, batch_plan)
        self.monitor = self._step.monitor
        self._plans: dict[tuple, _Plan] = {}
        self._agreed: _Plan | None = None  # the plan last agreed with the other workers
        self._agree_every_step = False  # set once the gradient set has changed on every worker

    def reduce(self, grads: list, names: list[str], local_batch_size=None) -> tuple[list, tf.Tensor]:
        """Replace ``grads`` by the batch-weighted mean over all workers.

        Args:
            grads: one ``tf.Tensor``/``tf.IndexedSlices`` (densified) or None per variable;
                None stays None and is not reduced. A gradient must be None on every worker
                alike: when the set of None gradients changes on some workers only, every
                worker raises ``TensorMismatchError`` (with each worker's gradient count and
                digest); when it changes on every worker at the same step, the new set is
                reduced. The first change costs one extra round the size of the previous set;
                from then on each step first checks its set with the other workers (one small
                exchange), so tapes that alternate between two sets of variables (a GAN's
                generator and discriminator) pay no more than that.
            names: one name per gradient, identical on every worker.
            local_batch_size: this worker's samples in the step (int or integer tensor); default:
                the batch the sampler handed out, else BytePS's plain average.

        Returns:
            ``(reduced gradients, lr_scale)``: the gradients in the same order, and the
            learning-rate factor for the step as a float32 scalar tensor.

        Raises:
            TensorMismatchError, ConfigurationError, CommunicationError: as ``GradientAggregator.finish``
            (inside ``tf.function`` they reach the caller as TensorFlow errors carrying the message).
            ValueError: ``local_batch_size`` is negative or too large.
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        tensors = [dense(grads[i]) for i in present]
        present_names = [names[i] for i in present]
        inputs = list(tensors)
        declared = local_batch_size is not None
        if declared:
            inputs.append(tf.cast(local_batch_size, tf.int64))

        def now(*values):
            samples = _checked_samples(values[-1]) if declared else UNSET
            reduced = self._reduce_now(values[:len(tensors)], present_names, samples)
            return reduced + [tf.constant(self.aggregator.lr_scale, tf.float32)]

        outputs = call(now, inputs, [t.dtype for t in tensors] + [tf.float32])
        result = list(grads)
        for index, tensor, output in zip(present, tensors, outputs):
            output.set_shape(tensor.shape)
            result[index] = output
        lr_scale = outputs[-1]
        lr_scale.set_shape(())
        return result, lr_scale

    def _reduce_now(self, grads, names: list[str], declared: int) -> list[tf.Tensor]:
        samples = self._step.take_samples(declared)
        views = [to_torch(g) for g in grads]
        plan = self._plan(names, views)
        if self._agreed is None or self._agree_every_step:
            self.aggregator.agree_on_plan(plan.description, samples)
        elif plan is not self._agreed:
            # This worker's gradients changed (one is None now and was not before, or the
            # reverse). Its collectives must still line up with the others': it announces the
            # new plan in a round of the agreed one (zeros, not measured). Unless every worker
            # changed alike, every worker's finish then raises TensorMismatchError naming both plans.
            step = self.aggregator.open_round(samples, measure=False, position=self._step.trained_position)
            zeros = [torch.zeros(length, dtype=dtype) for dtype, (_, length) in
                     zip(self._agreed.dtypes, self._agreed.layouts)]
            self._reduce_round(step, zeros, plan.description)
            self.aggregator.agree_on_plan(plan.description, samples)
            # Sets that changed once may change again (a GAN's two tapes alternate on every
            # step): from now on every step agrees on its set first, one small exchange, instead
            # of paying a round of the previous set's size at each change.
            self._agree_every_step = True
        self._agreed = plan
        step = self.aggregator.open_round(samples, position=self._step.trained_position)
        flats = [_fuse([views[i] for i in bucket], offsets, length, step.scale)
                 for bucket, (offsets, length) in zip(plan.buckets, plan.layouts)]
        self._reduce_round(step, flats, plan.description)
        results: list = [None] * len(views)
        for bucket, (offsets, _), flat in zip(plan.buckets, plan.layouts, flats):
            for i, offset in zip(bucket, offsets):
                results[i] = to_tf(flat[offset:offset + views[i].numel()].view(views[i].shape))
        self._step.end(samples)
        return results

    def _reduce_round(self, step, flats: list[torch.Tensor], description: str) -> None:
        for number, flat in enumerate(flats):
            self.aggregator.launch(step, number, flat)
        self.aggregator.close(step, description)
        self.aggregator.finish(step, description)

    def _plan(self, names: list[str], views) -> _Plan:
        key = tuple((name, tuple(v.shape), v.dtype) for name, v in zip(names, views))
        if key not in self._plans:
            self._plans[key] = _Plan(names, views, self.aggregator)
        return self._plans[key]


def _tape_reducer(compression: type[Compressor], lr_scaling, base_batch_size, batch_plan) -> GradientReducer:
    """Tapes are built anew every step; their statistics live in one reducer per setting, kept by
    the batch plan they train on (the default one when none was given: ``shutdown`` drops them)."""
    plan = _batch_plan.default() if _batch_plan.checked(batch_plan) is None else batch_plan
    key = (GradientReducer, compression, lr_scaling, base_batch_size, batch_plan is None)
    return plan.shared(key, lambda: GradientReducer("sgd", compression, lr_scaling, base_batch_size, batch_plan),
                       follows_default=batch_plan is None)


class _DistributedGradientTape(tf.GradientTape):
    """Methods mixed into the user's tape class by :func:`DistributedGradientTape`."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """As ``tf.GradientTape.gradient``, then every gradient is replaced by its batch-weighted
        mean over all workers (one fused reduction for all of them); :attr:`lr_scale` is set."""
        grads = super(self.__class__, self).gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        names = [f"Gradient.{variable_name(s, i)}" for i, s in enumerate(flat_sources)]
        reducer = _tape_reducer(*self._dynamix_settings)
        reduced, self.lr_scale = reducer.reduce(flat_grads, names, self._dynamix_batch)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                            op: str = Average, local_batch_size=None, lr_scaling: str | None = None,
                            base_batch_size: int | None = None, batch_plan=None) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged over all workers,
    weighted by each worker's local batch size: Σ b_i g_i / Σ b_i.

    Build it every step from the step's tape, as with BytePS. A tape has no learning rate: after
    ``gradient()``, ``tape.lr_scale`` (float32 scalar tensor) holds the step's factor by the
    ``lr_scaling`` rule, to multiply your base learning rate with, e.g.
    ``optimizer.learning_rate.assign(base_lr * tape.lr_scale)``. Or apply plain-tape gradients
    with :func:`~dynamix_byteps.tensorflow.keras.DistributedOptimizer`, which scales by itself
    (not both: that would reduce twice).

    Args:
        gradtape: the step's ``tf.GradientTape`` (eager or inside ``tf.function``).
        device_dense: accepted for BytePS compatibility.
        device_sparse: accepted for BytePS compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: accepted for BytePS compatibility; sparse gradients are always densified.
        op: must be ``Average`` (BytePS's tape averaged whatever ``op`` said).
        local_batch_size: this worker's samples in the step (int or integer tensor, e.g.
            ``tf.shape(x)[0]``); 0: this worker's gradients count for nothing (even NaN ones of
            an empty batch); default: the batch a ``DynamicBatchSampler`` handed out, else
            BytePS's plain average over workers.
        lr_scaling: the rule behind ``tape.lr_scale``: ``none``, ``linear``, ``sqrt`` or
            ``adascale``; default ``DYNAMIX_LR_SCALING`` (``bpslaunch --lr-scaling``), else ``none``.
        base_batch_size: B0, the global batch of factor 1; default: the first step's.
        batch_plan: the ``DynamicBatchSampler``'s :class:`~dynamix_byteps.batch_plan.BatchPlan`
            (``sampler.batch_plan``) whose batch sizes weight the gradients, and which keeps the
            step statistics between tapes; default: the process's default plan, the newest sampler's.

    Raises:
        ValueError: ``op`` is not ``Average``; an unknown ``lr_scaling`` rule or a
            ``base_batch_size`` below 1 (at the first ``gradient()`` call).
        TypeError: ``batch_plan`` is not a ``BatchPlan`` (at the first ``gradient()`` call).
        ConfigurationError: ``gradient()`` is traced in a ``tf.function(jit_compile=True)``: XLA
            cannot compile the reduction.
    """
    del device_dense, device_sparse, sparse_as_dense
    check_gradient_op(op)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), dict(_DistributedGradientTape.__dict__))
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._dynamix_settings = (compression, lr_scaling, base_batch_size, batch_plan)
    tape._dynamix_batch = local_batch_size
    tape.lr_scale = None
    return tape
