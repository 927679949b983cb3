"""``DistributedDataParallel``: BytePS's module wrapper, gradients reduced during backward.

Like ``byteps.torch.parallel.DistributedDataParallel`` and PyTorch's DDP: wrap the model, train
it with any plain torch optimizer, and ``loss.backward()`` returns with every gradient replaced
by its mean over the workers. It runs on the same reducer as ``DistributedOptimizer``
(:class:`~dynamix_byteps.torch.reducer.BucketReducer`), so the mean is batch-weighted,
Σ b_i · g_i / Σ b_i, with b_i from the ``DynamicBatchSampler`` or else the leading dimension
of the inputs each forward pass saw. The learning rate is not scaled (use
``DistributedOptimizer`` for ``lr_scaling``).
"""

from __future__ import annotations

import contextlib

import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.aggregation import UNSET, GradientAggregator
from dynamix_byteps.torch.compression import Compression, Compressor
from dynamix_byteps.torch.functions import broadcast_parameters
from dynamix_byteps.torch.reducer import BucketReducer
from dynamix_byteps.training_step import TrainingStep


def _leading_dimension(inputs, kwargs) -> int | None:
    """Size of dimension 0 of the first tensor among the forward inputs; None when there is none."""
    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` for data-parallel training: gradients are reduced during ``backward()``.

    The constructor is a collective: rank 0's parameters and buffers are broadcast to every worker.

    Args:
        module: the model; its parameters must be the same on every worker (names, shapes, dtypes).
        device_ids: the one device the module lives on (``[local_rank()]``) or None; only
            recorded, as BytePS does: the module and the inputs stay where the script put them
            (move the model with ``model.cuda()`` before wrapping it). Accepted for a CPU module
            too, where PyTorch's DDP refuses it, because BytePS's examples pass
            ``[local_rank()]`` also with ``--no-cuda``.
        broadcast_buffers: give every worker rank 0's buffers (e.g. BatchNorm statistics) before
            each forward pass that records gradients (as DDP: a forward under ``torch.no_grad()``,
            e.g. an evaluation on one rank, is not a collective).
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
        self.broadcast_buffers = broadcast_buffers
        self._aggregator = GradientAggregator("sgd", compression, "none")
        self._step_path = TrainingStep(self._aggregator, "sgd", batch_plan)
        if bucket_cap_mb is not None:
            self._aggregator.fusion_bytes = max(int(bucket_cap_mb * 2**20), 1)
        self._forward_samples: int | None = None  # None: no forward input had a batch dimension
        self._forwards = 0
        broadcast_parameters(self.module.state_dict(), root_rank=0)
        self._reducer = BucketReducer(self._aggregator, self._trained_parameters, f"compression={compression.name}",
                                      self._take_samples, lambda: self._step_path.trained_step,
                                      on_backward_end=self._step_path.end)

    gradient_noise = property(lambda self: self._aggregator.gradient_noise)

    def _trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"Gradient.{name}", p) for name, p in self.module.named_parameters() if p.requires_grad]

    def _take_samples(self) -> int:
        samples = self._step_path.take_samples(UNSET, max(self._forwards, 1))
        if samples == UNSET and self._forward_samples is not None:
            samples = self._forward_samples
        self._forward_samples, self._forwards = None, 0
        return samples

    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            if self.broadcast_buffers:
                self._broadcast_buffers()
            if self.training:
                batch = _leading_dimension(inputs, kwargs)
                if batch is not None:
                    self._forward_samples = (self._forward_samples or 0) + batch
                self._forwards += 1
        return self.module(*inputs, **kwargs)

    def _broadcast_buffers(self) -> None:
        """One broadcast per buffer dtype and device, of the buffers fused into one tensor."""
        engine = _engine.current()
        if engine.size == 1:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for b in self.module.buffers():
            groups.setdefault((b.dtype, b.device), []).append(b)
        with torch.no_grad():
            for buffers in groups.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                engine.broadcast(flat, 0, "Buffers")
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
        ``TensorMismatchError`` on every worker, naming each one's sampler step)."""
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def synchronize(self) -> None:
        """BytePS's explicit wait after ``backward()``; the reduction already completes inside
        backward here, so this only exists for compatibility."""
