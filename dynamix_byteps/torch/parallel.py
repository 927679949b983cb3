"""``DistributedDataParallel``: BytePS's module wrapper, gradients reduced during backward.

Like ``byteps.torch.parallel.DistributedDataParallel`` and PyTorch's DDP: wrap the model, train
it with any plain torch optimizer, and ``loss.backward()`` returns with every gradient replaced
by its mean over the workers. It runs on the same reducer as ``DistributedOptimizer``
(:class:`~dynamix_byteps.torch.reducer.BucketReducer`), so the mean is batch-weighted,
Σ b_i · g_i / Σ b_i, with b_i from the ``DynamicBatchSampler``, or else counted by the rule
"a forward pass counts for the backward passes that go through its outputs": b_i is the sum of
the batch sizes (leading dimension of the first tensor input) of the forward passes whose
outputs the backward passes since the last reduction reached, in training or eval mode. The
learning rate is not scaled (use ``DistributedOptimizer`` for ``lr_scaling``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Iterator, Mapping

import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.aggregation import UNSET, GradientAggregator
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.torch.compression import Compression, Compressor
from dynamix_byteps.torch.functions import broadcast_parameters
from dynamix_byteps.torch.module_tensors import ModuleTensors
from dynamix_byteps.torch.reducer import DATA_PARALLEL_OWNER, BucketReducer, refuse_compiled_autograd
from dynamix_byteps.training_step import TrainingStep


def _leading_dimension(inputs, kwargs) -> int | None:
    """Size of dimension 0 of the first tensor among the forward inputs; None when there is none."""
    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _output_tensors(value, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: itself, or inside tuples, lists, dicts and dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth >= 16:
        return
    if isinstance(value, Mapping):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return
    for item in items:
        yield from _output_tensors(item, depth + 1)


class _Forward:
    """One forward pass's count, owned by the hooks on its outputs' autograd nodes: it is freed
    with the graph (a discarded output, or after backward), so nothing accumulates."""

    __slots__ = ("samples", "task", "seen", "after_take", "__weakref__")

    def __init__(self, samples: int | None, after_take: bool):
        self.samples = samples  # None: no input had a batch dimension
        self.task = -1  # the last backward pass (graph task) that counted it
        self.seen = -1  # the last backward pass that reached its outputs
        self.after_take = after_take  # run inside the reducing backward, after its weight was taken


@dataclasses.dataclass
class _Count:
    """Forward passes counted, and their samples (None: no input of theirs had a batch dimension)."""

    forwards: int = 0
    samples: int | None = None

    def add(self, record: _Forward) -> None:
        self.forwards += 1
        if record.samples is not None:
            self.samples = (self.samples or 0) + record.samples


@dataclasses.dataclass
class _Weight:
    """A step's weight, taken when its reducing backward pass completed its first parameter gradient."""

    task: int  # that backward pass (graph task); -1 when taken outside one
    taken_at: object  # the gradient accumulator whose hook took it
    from_sampler: bool  # the sampler's batch sizes, not the counted forwards
    counted: int  # forward passes it counted
    assumed: list[_Forward]  # counted without being reached: taken before any output was
    late: _Count = dataclasses.field(default_factory=_Count)  # reached by that pass after the take


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` for data-parallel training: gradients are reduced during ``backward()``.

    The constructor is a collective: rank 0's parameters and buffers are broadcast to every worker.

    Each worker's gradient is weighted by its batch size b_i (Σ b_i · g_i / Σ b_i): the
    ``DynamicBatchSampler``'s batches when one feeds the job, else the forward passes it counted
    since the last reduction. A forward pass counts for the backward passes that go through its
    outputs: its batch size (dimension 0 of its first tensor input, in samples) is added for
    every ``backward()`` that reaches one of its outputs (a tensor, or tensors in tuples, lists,
    dicts or dataclasses) and computes gradients of the module's parameters, in ``train()`` and
    ``eval()`` mode alike. A forward under ``torch.no_grad()``, one whose outputs no backward
    reaches (a metric computed with gradients enabled), or one reached only by
    ``torch.autograd.grad`` counts for nothing; a forward reached by two backward passes
    (``retain_graph=True``) counts for each; passes inside :meth:`no_sync` add up until the
    backward that reduces. A step no worker counted anything for gets BytePS's plain mean; one
    that only some workers counted for raises ``ConfigurationError`` on every worker.

    Args:
        module: the model; its parameters must be the same on every worker (names, shapes, dtypes).
        device_ids: the one device the module lives on (``[local_rank()]``) or None; only
            recorded, as BytePS does: the module and the inputs stay where the script put them
            (move the model with ``model.cuda()`` before wrapping it). Accepted for a CPU module
            too, where PyTorch's DDP refuses it, because BytePS's examples pass
            ``[local_rank()]`` also with ``--no-cuda``.
        broadcast_buffers: give every worker rank 0's buffers (e.g. BatchNorm statistics) before
            each forward pass that records gradients, as DDP; a forward under ``torch.no_grad()``,
            e.g. an evaluation on one rank, is not a collective (PyTorch's DDP broadcasts there too).
        compression: ``Compression.none`` or ``Compression.fp16``.
        bucket_cap_mb: bucket size in MiB (default ``DYNAMIX_FUSION_BYTES``, else 25, as DDP).
        batch_plan: the ``DynamicBatchSampler``'s :class:`~dynamix_byteps.batch_plan.BatchPlan`
            (``sampler.batch_plan``) whose batch sizes weight the gradients; default: the
            process's default plan, the newest sampler's.
        output_device: PyTorch DDP's argument, recorded only (as ``device_ids``).
        find_unused_parameters: PyTorch DDP's argument, no effect: parameters that get no
            gradient in a step are always handled (zeros in the sum; None where no worker had one).
        gradient_as_bucket_view: PyTorch DDP's argument, no effect: gradients always are views
            of their bucket.
        static_graph: PyTorch DDP's argument, no effect.

    Attributes:
        module: the wrapped model.
        device_ids: ``device_ids`` as a list, or None.
        output_device: ``output_device`` as given.
        gradient_noise: the :class:`~dynamix_byteps.scaling.gradient_noise.GradientNoiseScale` it feeds.

    Raises:
        ValueError: ``device_ids`` has more than one entry, or ``bucket_cap_mb`` is not > 0.
        TypeError: ``batch_plan`` is not a ``BatchPlan``.
        TensorMismatchError: the workers' modules differ.
        NotInitializedError: ``init()`` was not called.
        ConfigurationError: from ``backward()``, once its reduction has completed, when that
            backward reached a forward's outputs only after a parameter's gradient was complete
            and the step's weight taken (two forward passes summed into one loss, the later one
            using parameters the earlier does not, or checkpointing them with
            ``use_reentrant=True``): the step was weighted without that forward (with a
            ``DynamicBatchSampler``, raised only when that changed the number of sampler draws
            the step took). A parameter whose gradient comes from the loss alone (a learnable
            loss weight) is complete before any output is reached: the weight then counts the
            forward passes alive and not yet counted, and this is raised if the backward did not
            go through one of them (an output kept from a forward this loss does not use).
    """

    def __init__(self, module: torch.nn.Module, device_ids=None, broadcast_buffers: bool = True,
                 compression: type[Compressor] = Compression.none, bucket_cap_mb: float | None = None,
                 batch_plan=None, *, output_device=None, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False):
        super().__init__()
        if device_ids is not None and len(device_ids) != 1:
            raise ValueError(f"device_ids must hold exactly one device (this process's), got {device_ids!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.device_ids = None if device_ids is None else list(device_ids)
        self.output_device = output_device
        del find_unused_parameters, gradient_as_bucket_view, static_graph
        self.module = module
        self._tensors = ModuleTensors(module)
        self.broadcast_buffers = broadcast_buffers
        self._aggregator = GradientAggregator("sgd", compression, "none")
        self._step_path = TrainingStep(self._aggregator, "sgd", batch_plan)
        if bucket_cap_mb is not None:
            self._aggregator.fusion_bytes = max(int(bucket_cap_mb * 2**20), 1)
        self._reached_count = _Count()  # reached by the backward passes since the last reduction
        self._weight: _Weight | None = None  # of the reducing backward pass, from its take to its end
        self._checked_task, self._task_updates_parameters = -1, False
        # Forward passes whose graphs are alive; a weight taken before the backward reached any
        # (a parameter whose gradient comes from the loss only, e.g. a learnable loss weight, is
        # complete first) counts those never counted, and the end of backward checks it reached them.
        self._live: weakref.WeakSet[_Forward] = weakref.WeakSet()
        self._warned_output = False
        self._warned_learning_rate = False
        broadcast_parameters(self.module.state_dict(), root_rank=0)
        self._reducer = BucketReducer(self._aggregator, self._trained_parameters, f"compression={compression.name}",
                                      self._take_samples, lambda: self._step_path.trained_position,
                                      self._backward_ended, DATA_PARALLEL_OWNER, announces_rounds=self._syncs_buffers)

    gradient_noise = property(lambda self: self._aggregator.gradient_noise)

    def _trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"Gradient.{name}", p) for name, p in self._tensors.parameters() if p.requires_grad]

    def _take_samples(self) -> int:
        """This step's weight, when the reducing backward starts (its first parameter gradient)."""
        task = torch._C._current_graph_task_id()
        assumed = [r for r in self._live if r.task == -1 and not r.after_take] if (
            task >= 0 and self._reached_count.forwards == 0) else []
        for record in assumed:
            record.task = task
            self._reached_count.add(record)
        reached, self._reached_count = self._reached_count, _Count()
        samples = self._step_path.take_samples(UNSET, max(reached.forwards, 1))
        self._weight = _Weight(task, torch._C._current_autograd_node(), samples != UNSET, reached.forwards, assumed)
        if samples == UNSET and reached.samples is not None:
            samples = reached.samples
        return samples

    def _after_take(self) -> bool:
        """Inside the reducing backward pass (or one nested in it), after its weight was taken."""
        return self._weight is not None and self._weight.task >= 0

    def _syncs_buffers(self) -> bool:
        """Whether a forward pass that records gradients broadcasts rank 0's buffers."""
        return self.broadcast_buffers and bool(self._tensors.buffers())

    def forward(self, *inputs, **kwargs):
        counting = torch.is_grad_enabled()
        if counting and self._syncs_buffers():
            self._broadcast_buffers()
        output = self.module(*inputs, **kwargs)
        if counting:
            self._count_through(output, _leading_dimension(inputs, kwargs))
        return output

    def _count_through(self, output, samples: int | None) -> None:
        """Hook the autograd nodes of ``output``'s tensors: the backward passes reaching them count
        this forward pass's ``samples``, once each."""
        nodes, found = {}, False
        for tensor in _output_tensors(output):
            found = True
            if tensor.requires_grad and tensor.grad_fn is not None:  # not a leaf: its hooks would outlive the pass
                nodes.setdefault(id(tensor.grad_fn), tensor.grad_fn)
        if not found and not self._warned_output and any(p.requires_grad for p in self.module.parameters()):
            self._warned_output = True
            warnings.warn(f"DistributedDataParallel found no tensor in the module's output ({type(output).__name__}), "
                          "so its batch cannot weight the backward passes through it: return tensors, or tuples, "
                          "lists, dicts or dataclasses of them", stacklevel=3)
        if not nodes:
            return
        if torch._C._current_graph_task_id() < 0:  # outside every backward: the last reducing one has ended
            self._weight = None
        record = _Forward(samples, after_take=self._after_take())
        self._live.add(record)
        hook = functools.partial(self._reached, record)
        for node in nodes.values():
            node.register_prehook(hook)

    def _reached(self, record: _Forward, grad_outputs) -> None:
        """A backward pass reached an output of ``record``'s forward pass: count it for that pass.

        Raises:
            ConfigurationError: compiled autograd runs the backward pass (:func:`refuse_compiled_autograd`).
        """
        refuse_compiled_autograd()
        task = torch._C._current_graph_task_id()
        if record.seen == task or not self._updates_parameters(task):
            return
        # Begun here, before any parameter's gradient: a pass that raises from now on (out of
        # memory in the module's last layer, a user's tensor hook) sends the step's round failed.
        self._reducer.begin_pass()
        record.seen = task
        if record.task == task:  # counted when the weight was taken
            return
        record.task = task
        if not (record.after_take or self._after_take()):
            self._reached_count.add(record)
        elif self._weight is not None:
            self._weight.late.add(record)

    def _updates_parameters(self, task: int) -> bool:
        """Whether backward pass ``task`` computes gradients of the module's parameters."""
        if task != self._checked_task:
            self._checked_task, self._task_updates_parameters = task, self._reducer.backward_writes_gradients()
        return self._task_updates_parameters

    def _backward_ended(self, samples: int) -> None:
        """The reducing backward pass and its reduction are complete: end the step, then refuse a
        weight that left out forward passes this backward reached after the weight was taken."""
        self._step_path.end(samples)
        self._warn_if_the_global_batch_changed()
        weight, self._weight = self._weight, None
        unreached = [r for r in weight.assumed if r.seen != weight.task]
        if unreached:
            raise ConfigurationError(
                f"DistributedDataParallel: this backward pass's weight was taken before it reached any forward "
                f"pass's outputs (a parameter got its gradient from the loss alone), so it counted the "
                f"{len(unreached)} uncounted forward pass(es) still alive, and did not reach "
                f"{'it' if len(unreached) == 1 else 'them'}: a kept output of a forward pass this loss does not "
                "use (e.g. a metric). Compute such outputs under torch.no_grad(), or give the batch sizes with a "
                "DynamicBatchSampler")
        late, taken = weight.late, weight.counted
        if weight.from_sampler:  # its batch sizes weight the step; only its draw count can be off
            if max(taken, 1) == max(taken + late.forwards, 1):
                return
            effect = f"{max(taken, 1)} sampler draw(s) were taken for this step instead of {taken + late.forwards}"
        else:
            if late.samples is None:
                return
            had = "no count (the plain mean)" if samples == UNSET else f"{samples} samples"
            effect = (f"the step weighted this worker's gradient by {had} instead of "
                      f"{(0 if samples == UNSET else samples) + late.samples} samples")
        names = [name for name, p in self.module.named_parameters() if p is getattr(weight.taken_at, "variable", None)]
        where = f"the gradient of parameter {names[0]!r}" if names else "a parameter's gradient"
        raise ConfigurationError(
            f"DistributedDataParallel: this backward pass reached the outputs of {late.forwards} forward "
            f"pass(es) only after {where} was complete and the step's weight was taken, so {effect}. This "
            "happens when several forward passes are summed into one loss and the later one uses parameters the "
            "earlier does not, or checkpoints them with use_reentrant=True. Run one backward per forward pass "
            "(all but the last inside no_sync())" + ("" if weight.from_sampler else ", or give the batch sizes with a DynamicBatchSampler"))

    def _warn_if_the_global_batch_changed(self) -> None:
        """Once: the sampler's global batch for the step just taken differs from its first step's,
        and this wrapper does not scale the learning rate."""
        schedule = self._step_path.plan().schedule
        if self._warned_learning_rate or schedule is None or self._step_path.next_step is None:
            return
        first = schedule.at(0).global_batch_size
        now = schedule.at(self._step_path.next_step - 1).global_batch_size
        if now != first:
            self._warned_learning_rate = True
            warnings.warn(f"the global batch is now {now} samples ({first} at the first step) and "
                          "bps.DistributedDataParallel keeps the learning rate as it is: scale it yourself, use "
                          "bps.DistributedOptimizer(..., lr_scaling='linear', 'sqrt' or 'adascale') with a plain "
                          "model, or a policy that keeps the global batch (proportional)", stacklevel=2)

    def _broadcast_buffers(self) -> None:
        """One broadcast per buffer dtype and device, of the buffers fused into one tensor, after the
        announcement that a worker whose backward pass raised inside ``no_sync()`` sends instead
        (:meth:`BucketReducer.before_own_collective`): nothing once the step was dropped."""
        engine = _engine.current()
        if engine.size == 1 or not self._reducer.before_own_collective():
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for _, b in self._tensors.buffers():
            groups.setdefault((b.dtype, b.device), []).append(b)
        with torch.no_grad():
            for buffers in groups.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                engine.broadcast(flat, 0, "Buffers")
                # Unseen by autograd, as PyTorch's DDP writes them: an earlier forward pass whose
                # backward is still to come saved BatchNorm's running statistics (two forward passes
                # in one loss), and training-mode BatchNorm's backward does not read them.
                with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    offset = 0
                    for b in buffers:
                        b.copy_(flat[offset:offset + b.numel()].view_as(b))
                        offset += b.numel()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this block backward passes accumulate gradients locally; the first backward
        after it reduces everything accumulated (as PyTorch's and BytePS's ``no_sync``).

        Use it alike on every worker, as with PyTorch's DDP: reductions pair up in order, so a
        worker that skips one the others make pairs each later step with their previous one
        (with a ``DynamicBatchSampler`` feeding the workers, that step raises
        ``TensorMismatchError`` on every worker, naming each one's sampler step). A backward pass
        that raises inside it on one worker (out of memory, an error in a hook) sends that step's
        reduction at once, marked failed: every worker's reducing backward of that step raises
        ``GradientReductionError``, as for a failure outside it, or its forward pass before that,
        where the module's buffers are broadcast (so there the first forward pass or reducing
        backward after each pass inside this block begins with a small all-reduce that says whether
        a worker's raised)."""
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def synchronize(self) -> None:
        """BytePS's explicit wait after ``backward()``; the reduction already completes inside
        backward here, so this only exists for compatibility."""

    def __getstate__(self):
        """Refused, for ``copy.deepcopy`` (``torch.optim.swa_utils.AveragedModel``), ``pickle`` and
        ``torch.save`` of the wrapper: it holds this job's reduction (hooks on the module's
        parameters, the engine's collectives, the step monitor the scheduler hears from), which
        no copy can take along. PyTorch's DDP rebuilds a second reducer in the copy instead.

        Raises:
            TypeError: always, naming what to copy or save instead: the wrapped ``module``.
        """
        raise TypeError(
            "bps.DistributedDataParallel cannot be copied or pickled: it holds this job's gradient reduction. "
            "Copy or save the wrapped model instead: copy.deepcopy(model.module), "
            "torch.optim.swa_utils.AveragedModel(model.module), torch.save(model.module.state_dict())")
