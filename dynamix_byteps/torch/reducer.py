"""Gradients reduced during backward: buckets launched from the post-accumulate-grad hooks.

:class:`BucketReducer` serves both ``DistributedOptimizer`` and ``DistributedDataParallel``.
As PyTorch DDP's reducer does, it groups the parameters into buckets in reverse registration
order (roughly the order backward produces their gradients), up to ``fusion_bytes`` each, and
makes every gradient a view of its bucket, so nothing is copied back after the reduction. When
the last gradient of a bucket has been accumulated, and buckets are launched in plan order, the
bucket's batch-weighted all-reduce starts (:meth:`GradientAggregator.launch`) while backward
goes on; at the end of backward the buckets still open (parameters that got no gradient, which
contribute zeros) are launched; :meth:`finish` only waits.

The plan is agreed with the other workers once, when it is built (the first step, and whenever
the set of parameters requiring gradients changes, which must happen on every worker at the
same step: the round that notices the change still reduces the old plan's buckets and announces
the new plan in its trailer, so a change on some workers only raises ``TensorMismatchError``
everywhere, and a change on all is reduced again with the new plan). Rounds where a hook cannot
launch (no plan yet, or a job whose batch sizes become known only after backward) are reduced
whole in :meth:`finish` instead: correct, without the overlap. A backward nested in another's
node (reentrant activation checkpointing) ends the round only when the outermost one ends.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dynamix_byteps.aggregation import FIRST_BUCKET_BYTES, GradientAggregator, Round, plan_buckets
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.negotiation import describe, fingerprint

# Parameter attribute holding (hook handle, weak reference to its reducer): a new reducer of the
# same kind over the same model removes the old one's, which would otherwise count (and refuse)
# the new passes.
_HOOK_ATTR = "_dynamix_reducer_hook"


@dataclass
class _Bucket:
    buffer: torch.Tensor  # flat, one dtype and device
    params: list[torch.Tensor]
    views: list[torch.Tensor]  # views of buffer shaped like each parameter
    pending: set = field(default_factory=set)  # parameters whose gradient is not in the bucket yet


class _Plan:
    """Buckets over the parameters that require gradients, in reverse registration order."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], limit: int, settings: str):
        self.key = _key(named)
        ordered = list(reversed(named))
        self.params = [p for _, p in ordered]
        self.index = {p: i for i, p in enumerate(self.params)}
        groups = plan_buckets([(p.numel() * p.element_size(), (p.dtype, p.device)) for _, p in ordered], limit,
                              min(limit, FIRST_BUCKET_BYTES))
        self.buckets: list[_Bucket] = []
        self.slot: dict[torch.Tensor, tuple[int, torch.Tensor]] = {}
        for number, group in enumerate(groups):
            params = [ordered[i][1] for i in group]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, offset = [], 0
            for p in params:
                views.append(buffer[offset:offset + p.numel()].view_as(p))
                self.slot[p] = (number, views[-1])
                offset += p.numel()
            self.buckets.append(_Bucket(buffer, params, views))
        digest = fingerprint(describe(name, p) for name, p in ordered)
        self.description = (f"gradient buckets over {len(named)} parameters (digest {digest:016x}), "
                            f"{len(self.buckets)} buckets, {settings}")


def _key(named: list[tuple[str, torch.Tensor]]) -> tuple:
    return tuple((id(p), p.shape, p.dtype, p.device) for _, p in named)


class BucketReducer:
    """Batch-weighted, bucketed, overlapped gradient reduction of a set of parameters.

    Args:
        aggregator: the step statistics and collectives (:class:`GradientAggregator`).
        parameters: called at each plan check; returns ``[(name, parameter)]`` in registration
            order, only those requiring gradients.
        settings: what must also match across workers (e.g. compression), for the plan's description.
        step_samples: called once per round, when its last backward pass starts (or at
            :meth:`finish` when none did); returns this worker's samples in the step
            (:data:`UNSET` when unknown).
        trained_step: called right after ``step_samples``; the sampler's global step the round
            trains (None without a sampler), checked to be the same on every worker.
        passes_per_step: backward passes accumulated before a reduction (``backward_passes_per_step``).
        on_backward_end: when given, the round is finished at the end of its last backward pass
            (as DDP does) and this is called afterwards with the step's local batch size; else
            the owner calls :meth:`finish`.

    Attributes:
        sync: whether the next backward pass reduces (``DistributedDataParallel.no_sync`` clears it).
    """

    def __init__(self, aggregator: GradientAggregator, parameters: Callable[[], list], settings: str,
                 step_samples: Callable[[], int], trained_step: Callable[[], int | None],
                 passes_per_step: int = 1, on_backward_end: Callable[[int], None] | None = None):
        self.aggregator = aggregator
        self._parameters = parameters
        self._settings = settings
        self._step_samples = step_samples
        self._trained_step = trained_step
        self.passes_per_step = passes_per_step
        self._on_backward_end = on_backward_end
        self.sync = True
        self._plan: _Plan | None = None
        self._next_plan: _Plan | None = None  # announced when the parameters changed, adopted once all agree
        self._overlap = True  # False once some worker's batch size came after backward: reduce in finish()
        self._hooks: dict[torch.Tensor, object] = {}
        self._round: Round | None = None
        self._samples: int | None = None  # taken when the round's last backward pass started
        self._launching = False  # this backward pass launches buckets from its hooks
        self._next_bucket = 0
        self._passes = 0  # backward passes completed since the last reduction
        self._in_backward = False
        self._had_gradient: np.ndarray | None = None  # per plan parameter, this round: 1 if it had a gradient
        self._register_hooks(p for _, p in parameters())

    def _register_hooks(self, params) -> None:
        for p in params:
            if p not in self._hooks:
                previous = getattr(p, _HOOK_ATTR, None)
                if previous is not None:  # an earlier reducer over this model
                    handle, reducer = previous
                    self._refuse_a_second_kind(reducer())
                    handle.remove()
                self._hooks[p] = p.register_post_accumulate_grad_hook(self._on_gradient)
                setattr(p, _HOOK_ATTR, (self._hooks[p], weakref.ref(self)))

    @property
    def kind(self) -> str:
        return "DistributedOptimizer" if self._on_backward_end is None else "DistributedDataParallel"

    def _refuse_a_second_kind(self, other: BucketReducer | None) -> None:
        if other is not None and other is not self and other.kind != self.kind:
            raise ConfigurationError(
                f"this model's gradients are already reduced by a live {other.kind}; wrapping it in a "
                f"{self.kind} as well would reduce them twice. Use bps.DistributedDataParallel with a plain torch "
                "optimizer, or bps.DistributedOptimizer on the plain model, not both")

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()
        if not self._launching or param not in self._plan.slot:
            return
        number, view = self._plan.slot[param]
        self._had_gradient[self._plan.index[param]] = _move_into_bucket(param, view, self._round.scale)
        self._plan.buckets[number].pending.discard(param)
        self._launch_ready()

    def _begin_backward(self) -> None:
        if self._passes >= self.passes_per_step:
            raise RuntimeError(
                f"gradients were computed {self._passes + 1} times before step(), more than "
                f"backward_passes_per_step={self.passes_per_step}; call step() (or zero_grad()) after every "
                f"{self.passes_per_step} backward passes or raise backward_passes_per_step")
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not (self.sync and self._passes + 1 == self.passes_per_step):
            return
        self._samples = self._step_samples()
        self._launching = self._overlap and self._plan is not None
        if self._launching:
            self._notice_new_parameters(self._parameters())
            self._round = self.aggregator.open_round(self._samples, step=self._trained_step())
            self._had_gradient = np.zeros(len(self._plan.params))
            self._next_bucket = 0
            for bucket in self._plan.buckets:
                bucket.pending = set(bucket.params)

    def _launch_ready(self) -> None:
        buckets = self._plan.buckets
        while self._next_bucket < len(buckets) and not buckets[self._next_bucket].pending:
            self.aggregator.launch(self._round, self._next_bucket, buckets[self._next_bucket].buffer)
            self._next_bucket += 1

    def _end_backward(self) -> None:
        outer_node = torch._C._current_autograd_node()
        if outer_node is not None:
            # This backward ran inside a node of another (reentrant activation checkpointing):
            # the gradients after that node's are still to come.
            _queue_after(outer_node, self._end_backward)
            return
        self._in_backward = False
        if not self.sync:
            return
        self._passes += 1
        if self._launching:
            self._launching = False
            for bucket in self._plan.buckets[self._next_bucket:]:
                for param in bucket.pending:  # no gradient this pass: its own, or zeros
                    self._had_gradient[self._plan.index[param]] = _move_into_bucket(
                        param, self._plan.slot[param][1], self._round.scale)
                bucket.pending.clear()
            self._launch_ready()
            self.aggregator.close(self._round, self._round_description(), self._had_gradient)
        if self._on_backward_end is not None and self._passes == self.passes_per_step:
            self._on_backward_end(self.finish())

    @property
    def reducing(self) -> bool:
        """True from the start of the backward pass whose hooks reduce this step until :meth:`finish`."""
        return self._round is not None

    def finish(self, declared: int | None = None) -> int:
        """Complete this step's reduction: every gradient then holds the batch-weighted global mean.

        Reduces the whole round here when backward could not start it, then waits.

        Args:
            declared: this worker's batch size as declared by now (``set_local_batch_size``), if
                any; used when the round is reduced here.

        Returns:
            The local batch size the step was weighted by (:data:`UNSET`: none).

        Raises:
            TensorMismatchError: workers have different parameters or settings.
            ConfigurationError: batch sizes declared on some workers only, or summing to 0.
            TypeError: a gradient is sparse.
            CommunicationError: a peer failed.
        """
        if self._round is None:
            self._reduce_whole_round(declared)
        step = self._round
        try:
            self.aggregator.finish(step, self._round_description())
            if self._next_plan is not None:  # every worker's parameters changed alike: reduce them again
                self._adopt_plan(self._next_plan, step.samples, late=not self._overlap)
                self._launch_whole_round(step.samples)
                step = self._round
                self.aggregator.finish(step, self._round_description())
        finally:
            self._round, self._samples, self._passes = None, None, 0
        for i in np.flatnonzero(step.counts == 0):  # no worker had a gradient: None, as in one process
            self._plan.params[i].grad = None
        return step.samples

    def _notice_new_parameters(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """When the parameters requiring gradients changed, this round still reduces the agreed
        plan's buckets, so the collectives line up on every worker, but its trailer announces the
        new plan: :meth:`finish` then raises ``TensorMismatchError`` unless every worker changed alike."""
        if self._next_plan is None and self._plan.key != _key(named):
            self._next_plan = _Plan(named, self.aggregator.fusion_bytes, self._settings)

    def _announced(self) -> _Plan:
        return self._next_plan or self._plan

    def _round_description(self) -> str:
        """What every worker's round must match: the announced plan, and the backward passes it
        accumulates (different counts would weight the workers' gradients wrongly)."""
        return f"{self._announced().description}, backward_passes_per_step={self.passes_per_step}"

    def _adopt_plan(self, plan: _Plan, samples: int, late: bool) -> None:
        self._register_hooks(plan.params)
        self._plan, self._next_plan = plan, None
        self._overlap = not self.aggregator.agree_on_plan(self._plan.description, samples, int(late)).any()

    def _reduce_whole_round(self, declared: int | None) -> None:
        named = self._parameters()
        sparse = [name for name, p in named if p.grad is not None and p.grad.layout != torch.strided]
        if sparse:
            raise TypeError(f"sparse gradients are not supported ({', '.join(sparse)}); use dense ones, "
                            "e.g. nn.Embedding(..., sparse=False)")
        if self._samples is None:
            self._samples = self._step_samples()
        samples = self._samples if declared is None else declared
        if self._plan is None:
            late = declared is not None and declared != self._samples
            self._adopt_plan(_Plan(named, self.aggregator.fusion_bytes, self._settings), samples, late)
            if late:
                warnings.warn("set_local_batch_size() was called after backward(): gradients are now reduced "
                              "in step(), after backward, instead of during it; call it before loss.backward()",
                              stacklevel=4)
        else:
            self._notice_new_parameters(named)
        self._launch_whole_round(samples)

    def _launch_whole_round(self, samples: int) -> None:
        self._round = self.aggregator.open_round(samples, step=self._trained_step())
        self._had_gradient = np.zeros(len(self._plan.params))
        for number, bucket in enumerate(self._plan.buckets):
            for param, view in zip(bucket.params, bucket.views):
                self._had_gradient[self._plan.index[param]] = _move_into_bucket(param, view, self._round.scale)
            self.aggregator.launch(self._round, number, bucket.buffer)
        self.aggregator.close(self._round, self._round_description(), self._had_gradient)

    def discard(self) -> None:
        """Drop a round in progress (``zero_grad`` between backward and step): wait for what was
        launched and forget the passes."""
        if self._round is not None:
            self.aggregator.drain(self._round)
        self._round, self._samples, self._passes = None, None, 0
        self._launching = self._in_backward = False


def _queue_after(node, callback: Callable[[], None]) -> None:
    """Queue ``callback`` at the end of the backward pass that runs ``node``, once ``node`` has run."""
    handles = []

    def after_node(grad_inputs, grad_outputs):
        handles.pop().remove()
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    handles.append(node.register_hook(after_node))


def _move_into_bucket(param: torch.Tensor, view: torch.Tensor, scale: float) -> bool:
    """Make ``param.grad`` its bucket ``view``, holding ``scale`` times the gradient (zeros for a
    parameter without one), in one pass over the memory; returns whether it had one."""
    grad = param.grad
    if grad is view:
        if scale != 1.0:
            view.mul_(scale)
    elif grad is None:
        view.zero_()
    elif scale == 1.0:
        view.copy_(grad)
    else:
        torch.mul(grad, scale, out=view)
    param.grad = view
    return grad is not None

