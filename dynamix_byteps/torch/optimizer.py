"""``DistributedOptimizer``: batch-weighted gradient aggregation behind any torch optimizer.

Each step the gradients are replaced by Σ_i b_i · g_i / Σ_i b_i, the gradient of the mean loss
over the global batch (plain BytePS averaging when no batch sizes are known), the learning rate
follows the global batch for that step only, and the gradient noise scale is updated. The
reduction runs during backward, bucket by bucket, from the gradient hooks
(:class:`~dynamix_byteps.torch.reducer.BucketReducer`), and ends before ``loss.backward()``
returns, as with PyTorch's DDP: what the script does to the gradients before ``step()``
(clipping, ``GradScaler.unscale_``) sees the reduced mean, alike on every worker. b_i comes
from the batches a ``DynamicBatchSampler`` drew (its ``batch_plan``, handed to the optimizer or
followed as the process's default) or from ``set_local_batch_size``, which must then be called
before ``loss.backward()``. The step ends, for the step monitor, when the reduction completes
(:class:`~dynamix_byteps.training_step.TrainingStep`).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import weakref

import numpy as np
import torch

from dynamix_byteps.aggregation import UNSET, GradientAggregator
from dynamix_byteps.env import MAX_BATCH
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.reduce_ops import Average, check_gradient_op, check_gradient_predivide_factor
from dynamix_byteps.scaling.lr_scaling import optimizer_family_of
from dynamix_byteps.torch.compression import Compression, Compressor
from dynamix_byteps.torch.reducer import OPTIMIZER_OWNER, BucketReducer
from dynamix_byteps.training_step import TrainingStep, check_state_dict


def _not_count(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    def _init_distributed(self, named_parameters, compression, backward_passes_per_step, lr_scaling, base_batch_size,
                          batch_plan):
        if _not_count(backward_passes_per_step):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if base_batch_size is not None and _not_count(base_batch_size):
            raise ValueError(f"base_batch_size must be an integer >= 1, got {base_batch_size!r}")
        family = optimizer_family_of(self)
        self._aggregator = GradientAggregator(family, compression, lr_scaling,
                                              None if base_batch_size is None else int(base_batch_size))
        self._step_path = TrainingStep(self._aggregator, family, batch_plan)
        self._names = self._name_parameters(named_parameters)
        self._named: tuple[tuple, list] = ((), [])  # (param_groups' layout, every parameter named), see _gradient_params
        self._samples = UNSET
        self._synchronized = False
        self._skip_sync = False
        self._reducer = BucketReducer(
            self._aggregator, self._gradient_params, f"compression={compression.name}", self._take_samples,
            lambda: self._step_path.trained_position, self._reduced, OPTIMIZER_OWNER, int(backward_passes_per_step))

    # The step's statistics, kept by the shared aggregator.
    gradient_noise = property(lambda self: self._aggregator.gradient_noise,
                              doc="The :class:`GradientNoiseScale` updated every step.")
    global_batch_size = property(lambda self: self._aggregator.global_batch_size,
                                 doc="Σ b_i of the last step; None when batch sizes were not known.")
    lr_scale = property(lambda self: self._aggregator.lr_scale, doc="The learning-rate factor of the last step.")
    lr_scaling = property(lambda self: self._aggregator.lr_scaling, doc="The LR-scaling rule.")
    base_batch_size = property(lambda self: self._aggregator.base_batch_size,
                               doc="B0, the global batch of factor 1 (the first step's unless given).")
    next_step = property(lambda self: self._step_path.next_step,
                         doc="The sampler step after the last one trained on (None without a sampler).")
    backward_passes_per_step = property(lambda self: self._reducer.passes_per_step,
                                        doc="Backward passes accumulated locally before each reduction.")

    def _name_parameters(self, named_parameters) -> dict:
        if named_parameters is None:
            return {}
        named = list(named_parameters)
        names = [name for name, _ in named]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"named_parameters has duplicate names {dupes}; each parameter needs its own name")
        by_param = {p: f"Gradient.{name}" for name, p in named}
        unnamed = [p for group in self.param_groups for p in group["params"] if p not in by_param]
        if unnamed:
            raise ValueError(
                f"{len(unnamed)} optimizer parameters are missing from named_parameters; "
                "pass model.named_parameters() of the model the optimizer was built from"
            )
        return by_param

    def _gradient_params(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters to reduce: every one in ``param_groups`` that requires grad now (so
        parameters unfrozen or groups added after wrapping are reduced too), each once: a group
        may list a parameter twice (a tied weight through both of its modules' ``parameters()``,
        which torch accepts with a warning), and its one gradient is reduced once. Named again only
        when the groups' layout changed: the names' lookup hashes every tensor, in Python."""
        groups = self.param_groups
        layout = tuple(len(group["params"]) for group in groups), tuple(id(p) for group in groups for p in group["params"])
        if layout != self._named[0]:
            named, seen = [], set()
            for g, group in enumerate(groups):
                for i, p in enumerate(group["params"]):
                    if id(p) not in seen:
                        seen.add(id(p))
                        named.append((self._names.get(p, f"Gradient.group{g}.{i}"), p))
            self._named = layout, named
        return [(name, p) for name, p in self._named[1] if p.requires_grad]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before each reduction (as BytePS's and
        Horovod's optimizers); every worker must set the same value at the same step.

        Raises:
            ValueError: ``passes`` is not an integer >= 1.
        """
        if _not_count(passes):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self._reducer.passes_per_step = int(passes)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; also drops a reduction that backward started
        for this step (a GAN's generator backward may fill the discriminator's gradients, then
        zero them) and starts a new count of backward passes. Each call counts a step begun
        (:attr:`GradientAggregator.steps_begun <dynamix_byteps.aggregation.GradientAggregator>`):
        the next reduction raises ``TensorMismatchError`` on every worker when the workers' counts
        differ (a step skipped on some workers only), so call it alike on every worker."""
        self._aggregator.steps_begun += 1
        self._reducer.discard()
        self._synchronized = False
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_local_batch_size(self, samples: int) -> None:
        """Declare how many samples this worker's next backward pass uses; call it before
        ``loss.backward()`` (the reduction starts during backward, weighted by it).

        Not needed when a ``DynamicBatchSampler`` feeds the model: its batch sizes are used.
        Over ``backward_passes_per_step`` passes the counts add up (declare before each pass).
        The step's weight is this worker's total over the global total; pass sizes within one
        step are assumed equal on a worker, since the accumulated gradient is a sum of per-pass
        mean gradients.

        Raises:
            ValueError: ``samples`` is not an integer >= 0.
            ConfigurationError: this step's gradients were already reduced, or started reducing,
                during backward with the size known then; declare before ``loss.backward()``.
            GradientReductionError: a backward pass of the step raised before its end, on this
                worker or another; ``zero_grad()`` (or ``model.zero_grad()``) drops that step.
        """
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or not 0 <= samples <= MAX_BATCH:
            raise ValueError(f"set_local_batch_size needs an integer number of samples in [0, {MAX_BATCH}], got {samples!r}")
        self._reducer.refuse_if_incomplete(starting=True)
        if self._reducer.reducing or (self._synchronized and not self._reducer.reduced_gradients_dropped()):
            raise ConfigurationError(
                "set_local_batch_size() was called after this step's gradients had started reducing during "
                "backward(), before step() or zero_grad(): declare a step's batch size before its loss.backward() "
                "(for the next step, after zero_grad())")
        self._samples = int(samples) + max(self._samples, 0)

    def synchronize(self) -> None:
        """Make sure every gradient holds the batch-weighted global mean: nothing to do after the
        backward pass that reduced them (the usual case), else the blocking reduction of the
        gradients as they are (set without a backward pass, or after fewer passes than
        ``backward_passes_per_step``). The reduction ends the step for the step monitor and
        fixes its learning-rate factor (:attr:`lr_scale`). Parameters without a gradient on this
        worker contribute zeros, so all workers reduce the same buckets. Called by :meth:`step`;
        kept for Horovod's pattern (synchronize, clip, then step inside :meth:`skip_synchronize`).

        Raises:
            TensorMismatchError: workers have different parameters or settings, or called
                :meth:`zero_grad` different numbers of times (a step skipped on some workers only).
            ConfigurationError: batch sizes were declared on some workers only, or sum to 0.
            TypeError: a gradient is sparse (e.g. ``nn.Embedding(sparse=True)``).
            GradientReductionError: the backward pass that started the reduction raised before
                its end.
            CommunicationError: a peer failed.
        """
        if not self._synchronized:
            self._reduced(self._reducer.finish())

    def _take_samples(self) -> int:
        """This worker's samples in the step, once all its passes' sizes are declared."""
        declared, self._samples = self._samples, UNSET
        return self._step_path.take_samples(declared, self._reducer.passes_per_step)

    def _reduced(self, samples: int) -> None:
        """This step's gradients hold the global mean, weighted by ``samples`` here."""
        self._synchronized = True
        self._step_path.end(samples)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block :meth:`step` does not reduce gradients (use after :meth:`synchronize`)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        """Wait for the gradients' reduction (unless already done this step) and apply the wrapped
        optimizer's update with each group's learning rate multiplied by :attr:`lr_scale` for this step.

        A ``closure`` is evaluated once, before the gradients are reduced; its loss is returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not (self._synchronized or self._skip_sync):
            self.synchronize()
        lr_scale = self._aggregator.lr_scale
        base_lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            super(self.__class__, self).step()
        finally:
            for group, lr in zip(self.param_groups, base_lrs):
                group["lr"] = lr
        self._synchronized = False
        self._reducer.end_step()
        return loss

    def dynamix_state_dict(self) -> dict:
        """What a checkpoint needs beyond the wrapped optimizer's state: base batch, noise
        statistics, step (also in :meth:`state_dict`, under ``"dynamix"``)."""
        return self._step_path.state_dict()

    def load_dynamix_state_dict(self, state: dict) -> None:
        self._step_path.load_state_dict(state)

    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()`` with :meth:`dynamix_state_dict` under
        ``"dynamix"`` (plain ints, floats and lists), so that a resume through plain torch
        checkpoints (``torch.save(optimizer.state_dict())``, then ``load_state_dict``) keeps the
        base batch the learning rate is scaled from: without it the first global batch after the
        resume became the base, and a run whose batch had grown went on at a smaller learning rate.
        A plain torch optimizer loading it ignores that key."""
        state = super(self.__class__, self).state_dict()
        state["dynamix"] = self.dynamix_state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; also restores the ``"dynamix"`` part
        :meth:`state_dict` adds, where ``state_dict`` has one (a plain optimizer's has none).

        Raises:
            ValueError: the ``"dynamix"`` part is not one :meth:`state_dict` wrote; raised before
                anything is loaded.
        """
        dynamix = state_dict.get("dynamix")
        if dynamix is not None:
            try:
                check_state_dict(dynamix)
            except ValueError as error:
                raise ValueError(f"the 'dynamix' part of this optimizer state_dict is not one that "
                                 f"DistributedOptimizer.state_dict() wrote ({error}); nothing was loaded") from None
        super(self.__class__, self).load_state_dict(state_dict)
        if dynamix is not None:
            self.load_dynamix_state_dict(dynamix)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: str = Average, gradient_predivide_factor: float = 1.0,
                         lr_scaling: str | None = None, base_batch_size: int | None = None,
                         batch_plan=None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that :meth:`step` first averages gradients over all workers,
    weighted by each worker's local batch size (``optimizer.set_local_batch_size(n)``).

    The result is an instance of a subclass of ``optimizer``'s class, with its state and
    hyper-parameters, so LR schedulers and ``isinstance`` checks keep working.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
        named_parameters: ``model.named_parameters()``; names appear in errors and timing, and a
            worker whose names differ raises TensorMismatchError. Without them parameters are
            matched across workers by position and shape (as in BytePS and Horovod): list them
            in the same order on every worker.
        compression: ``Compression.none`` or ``Compression.fp16`` (applied after weighting).
        backward_passes_per_step: backward passes accumulated locally before each reduction.
            Bucket size: ``DYNAMIX_FUSION_BYTES`` (default 25 MiB).
        op: Horovod's argument; must be ``Average`` (gradients are always averaged).
        gradient_predivide_factor: Horovod's argument, a number > 0; it splits Horovod's average
            into a division before the sum and one after it, so the average, and the result here,
            are the same whatever it is.
        lr_scaling: how the learning rate follows the global batch B: ``none``, ``linear``
            (B/B0), ``sqrt`` (√(B/B0)) or ``adascale`` (AdaScale gain; AdamScale for Adam/AdamW);
            default: ``bpslaunch --lr-scaling`` through ``DYNAMIX_LR_SCALING``, else ``none``.
        base_batch_size: B0, the global batch the base learning rate was tuned for; default:
            the global batch of the first step.
        batch_plan: the :class:`~dynamix_byteps.batch_plan.BatchPlan` of the
            ``DynamicBatchSampler`` feeding this optimizer (``sampler.batch_plan``), whose batch
            sizes weight the gradients; default: the process's default plan, the newest
            sampler's at each step (one sampler per job). Give it when one process trains
            several models on separate samplers.

    ``loss.backward()`` returns with the gradients reduced, so ``torch.amp.GradScaler``'s loop
    (``scaler.step(optimizer)``, with ``scaler.unscale_`` and clipping before it or not) sees the
    same overflow on every worker, and every worker skips the same steps.

    Raises:
        ValueError: duplicate or missing parameter names, ``backward_passes_per_step`` not an
            integer >= 1, ``op`` not ``Average`` (``Sum``, ``Adasum``), ``gradient_predivide_factor``
            not a finite number > 0, an unknown ``lr_scaling`` rule, a ``base_batch_size`` below 1,
            or an optimizer that re-evaluates its closure (``LBFGS``).
        TypeError: ``batch_plan`` is not a ``BatchPlan``.
    """
    check_gradient_op(op)
    check_gradient_predivide_factor(gradient_predivide_factor)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS re-evaluates its closure several times per step, which cannot be "
                         "aggregated across workers; use a first-order optimizer")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    wrapped = cls.__new__(cls)
    # One attribute dict for both objects: an LR scheduler built on ``optimizer`` keeps editing the
    # learning rates the wrapper steps with, also after ``load_state_dict`` rebinds ``param_groups``
    # (a copy of the dict lost the schedule there). The scheduler's patched instance ``step``
    # would bypass the aggregation, so it is replaced by one that steps the wrapper.
    wrapped.__dict__ = optimizer.__dict__
    if hasattr(wrapped.__dict__.pop("step", None), "_wrapped_by_lr_sched"):
        wrapped.step = _step_seen_by_lr_scheduler(wrapped)
    wrapped._init_distributed(named_parameters, compression, backward_passes_per_step, lr_scaling, base_batch_size,
                              batch_plan)
    return wrapped


def _step_seen_by_lr_scheduler(optimizer: torch.optim.Optimizer):
    """``optimizer``'s own ``step``, marked as torch's LR schedulers mark the ``step`` of the
    optimizer they were built on: they check both marks, and without them their first ``step()``
    warns that ``optimizer.step()`` was overridden or not called (PyTorch issue 20124)."""
    owner = weakref.ref(optimizer)

    @functools.wraps(type(optimizer).step)
    def step(*args, **kwargs):
        wrapped = owner()
        wrapped._opt_called = True
        return type(wrapped).step(wrapped, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step

