"""Gradients reduced during backward: buckets launched from the gradient accumulators' hooks.

:class:`BucketReducer` serves both ``DistributedOptimizer`` and ``DistributedDataParallel``.
As PyTorch DDP's reducer does, it groups the parameters into buckets in reverse registration
order (roughly the order backward produces their gradients), up to ``fusion_bytes`` each, and
makes every gradient a view of its bucket, so nothing is copied back after the reduction. Its
hook runs after each parameter's gradient accumulator (as DDP's and Horovod's do), so the user's
own ``register_post_accumulate_grad_hook`` hooks see the local gradient first. When the last
gradient of a bucket has been accumulated, and buckets are launched in plan order, the
bucket's batch-weighted all-reduce starts (:meth:`GradientAggregator.launch`) while backward
goes on; at the end of backward the buckets still open (parameters that got no gradient, which
contribute zeros) are launched, and the round is finished (:meth:`finish` waits for it) before
``backward()`` returns, as PyTorch's DDP does: whatever the script does to the gradients between
backward and the optimizer's step (clipping, ``GradScaler.unscale_``, writes through ``.data``)
meets the reduced mean, the same on every worker.

The plan is agreed with the other workers once, when it is built (the first step, and whenever
the set of parameters requiring gradients changes, which must happen on every worker at the
same step: the round that notices the change still sends the old plan's buckets, as zeros, and
announces the new plan in its trailer, so a change on some workers only raises ``TensorMismatchError``
everywhere, and a change on all is then reduced with the new plan; parameters converted to another
dtype or device after wrapping, ``model.double()``, are such a change). The first round, which has
no plan to launch from, is reduced whole at the end of backward, without the overlap. A backward
nested in another's node (reentrant activation checkpointing) ends the round only when the
outermost one ends; a parameter whose gradient came in several parts in one pass of that first
round (a layer shared by several reentrant checkpoints) has its bucket launched at the end of
backward from then on, as PyTorch's DDP with ``static_graph=True`` learns from its first step.

A gradient changed in place or replaced while its bucket is in flight (by another hook during
backward) leaves this worker's reduction different from the others', so :meth:`finish` raises
``GradientReductionError`` instead of returning a wrong mean. A backward pass that raised before
its end (out of memory, an error in a hook) on some workers only would leave the others' buckets
to meet the next step's: the failing worker sends the rest of the step's round at once, marked
failed, so every worker's collectives stay paired and every worker raises
``GradientReductionError`` for that step (the failed ones at their next backward or ``step()``);
``zero_grad()`` of a ``DistributedOptimizer`` then drops the step on each. Where the owner has
collectives of its own (the DDP wrapper's buffer broadcasts, in forward), a worker whose pass
inside ``no_sync()`` raised sends its round while the others may be at one of those: after such a
pass, the next broadcast or round on every worker begins with an announcement (a small all-reduce)
that says whether a worker's pass raised, and one at a broadcast then sends its round failed too.
A pass begins as soon as one of its hooks runs (the first parameter's tensor hook, before the
user's; the DDP wrapper's on its module's outputs, before any parameter's), and begins with it
every other reducer whose parameters it will write (a GAN's generator behind its discriminator);
such a pass reduces each one's whole round at its end, one after the other, so that a worker
whose pass raised can send their rounds in the same order.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from dynamix_byteps.aggregation import (
    FIRST_BUCKET_BYTES,
    GradientAggregator,
    Round,
    SamplerPosition,
    failed_backward_error,
    plan_buckets,
    scale_into,
)
from dynamix_byteps.errors import ConfigurationError, GradientReductionError
from dynamix_byteps.negotiation import describe, fingerprint

# Per parameter, (hook handles, weak reference to its reducer): a new reducer of the same owner
# over the same model removes the old one's, which would otherwise count (and refuse) the new
# passes. Kept beside the parameters, not in their __dict__, which torch.save(model) pickles.
_HOOKS = torch.utils.weak.WeakIdKeyDictionary()

# Every reducer of this process: a backward pass that begins one begins each other whose
# parameters it will write (a GAN's generator behind its discriminator), so that a failure before
# their first gradient sends their rounds too.
_REDUCERS: weakref.WeakSet[BucketReducer] = weakref.WeakSet()

_AccumulateGrad = torch._C._functions.AccumulateGrad  # the autograd node that writes a leaf's .grad


@dataclass(frozen=True)
class ReducerOwner:
    """What a :class:`BucketReducer`'s owner means by a step.

    Attributes:
        name: the owner's class name, for messages.
        passes_end_at_step: True: backward passes count until the owner's step calls :meth:`BucketReducer.end_step`,
            so one more than ``passes_per_step`` before it raises, as with Horovod; False: each finished round
            starts a new count, as PyTorch's DDP reduces every backward pass.
        zero_grad_drops_a_failed_step: True: after a backward pass raised on some worker, clearing every gradient
            (``zero_grad()``) drops that step on every worker and training goes on; False: training cannot go on
            (as with PyTorch's DDP).
    """

    name: str
    passes_end_at_step: bool
    zero_grad_drops_a_failed_step: bool


OPTIMIZER_OWNER = ReducerOwner("DistributedOptimizer", passes_end_at_step=True, zero_grad_drops_a_failed_step=True)
DATA_PARALLEL_OWNER = ReducerOwner("DistributedDataParallel", passes_end_at_step=False,
                                   zero_grad_drops_a_failed_step=False)


@dataclass
class _Bucket:
    buffer: torch.Tensor  # flat, one dtype and device
    params: list[torch.Tensor]
    views: list[torch.Tensor]  # views of buffer shaped like each parameter
    names: list[str]
    indices: list[int]  # each parameter's position in the plan
    pending: set = field(default_factory=set)  # plan positions whose gradient is not in the bucket yet
    # The engine reduces an alias with a version counter of its own, so the buffer's counts only
    # writes through the gradients' views: a change after the launch is a change in flight.
    wire: torch.Tensor = field(init=False)
    launched_version: int = -1

    def __post_init__(self):
        self.wire = self.buffer.data

    def reattach_views(self) -> None:
        """Point each view whose ``.data`` was replaced (``Module._apply`` converting the ``.grad`` it
        was) at its slot of the buffer again, where it still fits the buffer's dtype and device."""
        storage, offset = self.buffer.untyped_storage().data_ptr(), 0
        for param, view in zip(self.params, self.views):
            if (view.untyped_storage().data_ptr() != storage and view.dtype == self.buffer.dtype
                    and view.device == self.buffer.device):
                view.data = _bucket_view(self.buffer, offset, param)
            offset += param.numel()


class _Slot(NamedTuple):
    """Where a parameter's gradient goes: its ``bucket``'s number, its ``index`` in the plan and its ``view`` there."""

    bucket: int
    index: int
    view: torch.Tensor


class _Plan:
    """Buckets over the parameters that require gradients, in reverse registration order.

    ``slot`` finds a parameter's :class:`_Slot` by ``id()``, not by the tensor (whose ``__hash__``
    is Python code, run several times per parameter per step): the plan holds its parameters, so
    their ids stay theirs."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], limit: int, settings: str):
        self.key = _key(named)
        ordered = list(reversed(named))
        self.params = [p for _, p in ordered]
        self.names = [_parameter_name(name) for name, _ in ordered]  # for messages
        groups = plan_buckets([(p.numel() * p.element_size(), (p.dtype, p.device)) for _, p in ordered], limit,
                              min(limit, FIRST_BUCKET_BYTES))
        self.buckets: list[_Bucket] = []
        self.slot: dict[int, _Slot] = {}
        # Buckets launched only at the end of backward: they hold a parameter that gets its gradient in
        # several parts per pass (used in several reentrant checkpoints), see BucketReducer._adopt_plan.
        self.deferred: set[int] = set()
        for number, group in enumerate(groups):
            params = [ordered[i][1] for i in group]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, offset = [], 0
            for i, p in zip(group, params):
                views.append(_bucket_view(buffer, offset, p))
                self.slot[id(p)] = _Slot(number, i, views[-1])
                offset += p.numel()
            self.buckets.append(_Bucket(buffer, params, views, [self.names[i] for i in group], group))
        digest = fingerprint(describe(name, p) for name, p in ordered)
        self.description = (f"gradient buckets over {len(named)} parameters (digest {digest:016x}), "
                            f"{len(self.buckets)} buckets, {settings}")


def _bucket_view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient slot in ``buffer`` from ``offset``: with ``param``'s strides where it is
    dense (a channels_last or transposed weight), since autograd keeps a gradient strided like its
    parameter and warns when a ``.grad`` it accumulates into is not (as DDP lays out its buckets);
    contiguous otherwise."""
    expected = 1
    for size, stride in sorted((d for d in zip(param.shape, param.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return buffer[offset:offset + param.numel()].view_as(param)
        expected *= size
    return buffer.as_strided(param.shape, param.stride(), offset)


def _parameter_name(tensor_name: str) -> str:
    """The name users know a parameter by, from its gradient's tensor name (``Gradient.fc.weight``: ``fc.weight``)."""
    return tensor_name.removeprefix("Gradient.")


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
        trained_position: called right after ``step_samples``; the sampler step and epoch the
            round trains (None without a sampler), checked to be the same on every worker.
        on_reduced: called with the step's local batch size once a round finished at the end of
            its last backward pass.
        owner: what the owner means by a step: :data:`OPTIMIZER_OWNER` or :data:`DATA_PARALLEL_OWNER`.
        passes_per_step: backward passes accumulated before a reduction (``backward_passes_per_step``).
        announces_rounds: whether the owner has collectives of its own that another worker's round
            could meet (the DDP wrapper's buffer broadcasts, each begun with
            :meth:`before_own_collective`). Where it returns True, the first of those or of the rounds
            after a backward pass inside ``no_sync()`` begins with an announcement
            (:meth:`GradientAggregator.announce`), which a worker whose such pass raised sends at once,
            with its round, so that it pairs with the others' whichever they are at.

    Attributes:
        sync: whether the next backward pass reduces (``DistributedDataParallel.no_sync`` clears it).
    """

    def __init__(self, aggregator: GradientAggregator, parameters: Callable[[], list], settings: str,
                 step_samples: Callable[[], int], trained_position: Callable[[], SamplerPosition | None],
                 on_reduced: Callable[[int], None], owner: ReducerOwner, passes_per_step: int = 1,
                 announces_rounds: Callable[[], bool] = lambda: False):
        self.aggregator = aggregator
        self._parameters = parameters
        self._settings = settings
        self._step_samples = step_samples
        self._trained_position = trained_position
        self.passes_per_step = passes_per_step
        self._on_reduced = on_reduced
        self.owner = owner
        self._announces_rounds = announces_rounds
        self._local_pass_unannounced = False  # a pass inside no_sync() began since the last announcement
        self.sync = True
        self._plan: _Plan | None = None
        self._next_plan: _Plan | None = None  # announced when the parameters changed, adopted once all agree
        # Per parameter, by id() (held, so the id stays its own), the parameter and its hooked gradient accumulator.
        self._accumulators: dict[int, tuple[torch.Tensor, object]] = {}
        self._round: Round | None = None
        self._samples: int | None = None  # taken when the round's last backward pass started
        self._launching = False  # this backward pass launches buckets from its hooks
        self._next_bucket = 0
        self._passes = 0  # backward passes completed since the last reduction (or step)
        self._in_backward = False
        self._opening = False  # this backward pass reduces, and its round opens at its first gradient
        self._overlapping = True  # this backward pass launches buckets from its hooks once a plan exists
        self._backward_alive: weakref.ref | None = None  # dies with the backward pass that began the round
        self._failure: str | None = None  # why this step's round is dropped (a backward pass raised), until discard()
        self._failure_ends_the_job = False  # the dropped step left the workers' samplers apart
        self._launched_in_backward = False
        self._warned_create_graph = False
        self._had_gradient: np.ndarray | None = None  # per plan parameter, this round: 1 if it had a gradient
        # Learnt in passes that launch nothing (the first step): parameters accumulated in this pass, and
        # those accumulated twice in one pass (reentrant activation checkpointing), by id() (held by the plan).
        self._accumulated: set[int] = set()
        self._accumulated_twice: set[int] = set()
        self._register_hooks(p for _, p in parameters())
        _REDUCERS.add(self)

    def _register_hooks(self, params) -> None:
        """Hook each of ``params`` not hooked yet."""
        for p in params:
            if id(p) not in self._accumulators:
                previous = _HOOKS.get(p)
                if previous is not None:  # an earlier reducer over this model
                    handles, reducer = previous
                    self._refuse_a_second_owner(reducer())
                    for handle in handles:
                        handle.remove()
                # The accumulator is held: a parameter keeps only a weak reference to it. The
                # tensor hook, first of the parameter's, runs before the user's tensor hooks, the
                # accumulation and the user's post-accumulate hooks, so a backward pass that raises
                # in those, on the first parameter to get its gradient, has begun a round (and
                # sends it failed).
                accumulator = torch.autograd.graph.get_gradient_edge(p).node
                begin = functools.partial(_before_gradient, weakref.ref(self), weakref.ref(p))
                handles = (_register_first_tensor_hook(p, torch.utils.hooks.unserializable_hook(begin)),
                           accumulator.register_hook(functools.partial(self._after_accumulation, p)))
                self._accumulators[id(p)] = (p, accumulator)
                _HOOKS[p] = (handles, weakref.ref(self))

    def _rehook_converted(self, params) -> bool:
        """Move the accumulation hook of each of ``params`` whose gradient accumulator changed (see
        :meth:`_rehook_accumulator`); looking each up costs ~10 us, so this runs off the usual path.

        Returns:
            Whether any had changed."""
        changed = False
        for p in params:
            accumulator = torch.autograd.graph.get_gradient_edge(p).node
            if self._accumulators[id(p)][1] is not accumulator and _HOOKS[p][1]() is self:
                self._rehook_accumulator(p, accumulator)
                changed = True
        return changed

    def _rehook_accumulator(self, p: torch.Tensor, accumulator) -> None:
        """Hook ``accumulator``, autograd's new gradient accumulator of ``p``, in place of the old one.
        Setting ``p.data`` to another dtype or device (``model.double()``, ``.half()``, ``.cpu()`` after
        wrapping, also there and back) makes autograd build a new accumulator, which the old hook never
        sees (the tensor hook stays: autograd keeps a leaf's tensor hooks). ``Module._apply`` also sets
        the ``.data`` of gradients it converts, the plan's views into its buckets among them: those the
        plan keeps (converted there and back, same dtype and device) are pointed at their buckets again."""
        (tensor_hook, old), owner = _HOOKS[p]
        old.remove()
        _HOOKS[p] = ((tensor_hook, accumulator.register_hook(functools.partial(self._after_accumulation, p))), owner)
        self._accumulators[id(p)] = (p, accumulator)
        slot = None if self._plan is None else self._plan.slot.get(id(p))
        if slot is not None:
            self._plan.buckets[slot.bucket].reattach_views()

    def backward_writes_gradients(self) -> bool:
        """Whether the running backward pass writes the ``.grad`` of a parameter being reduced
        (False for ``torch.autograd.grad`` and for ``backward(inputs=...)`` of other tensors)."""
        named = self._parameters()
        self._register_hooks(p for _, p in named)
        if self._backward_executes(self._accumulators[id(p)][1] for _, p in named):
            return True
        # None of the hooked accumulators runs: torch.autograd.grad(), or the model was converted
        return self._rehook_converted(p for _, p in named) and self._backward_executes(
            self._accumulators[id(p)][1] for _, p in named)

    @staticmethod
    def _backward_executes(accumulators) -> bool:
        """Whether the running backward pass runs any of ``accumulators`` (gradient accumulator nodes)."""
        try:
            return any(torch._C._will_engine_execute_node(node) for node in accumulators)
        except RuntimeError:  # torch.autograd.grad(): no parameter's .grad is written
            return False

    def _refuse_a_second_owner(self, other: BucketReducer | None) -> None:
        if other is not None and other is not self and other.owner != self.owner:
            raise ConfigurationError(
                f"this model's gradients are already reduced by a live {other.owner.name}; wrapping it in a "
                f"{self.owner.name} as well would reduce them twice. Use bps.DistributedDataParallel with a plain torch "
                "optimizer, or bps.DistributedOptimizer on the plain model, not both")

    def _on_parameter_gradient(self, param: torch.Tensor) -> None:
        # The running node is the parameter's gradient accumulator (for torch.autograd.grad() too)
        accumulator = torch._C._current_autograd_node()
        if accumulator is not self._accumulators[id(param)][1] and isinstance(accumulator, _AccumulateGrad):
            self._rehook_accumulator(param, accumulator)
        if self._in_backward and not self._opening:
            return  # the pass has begun, and opened its round if it reduces: every gradient after the first
        if not self._backward_executes([self._accumulators[id(param)][1]]):
            return  # torch.autograd.grad(): it runs the parameter's tensor hooks, not its accumulator
        self.begin_pass()
        if self._opening:
            self._open_round()

    def begin_pass(self) -> None:
        """Begin the running backward pass here, unless begun: from the first parameter gradient
        it computes (before the user's tensor hooks on it), or earlier (the DDP wrapper's hooks on
        its module's outputs). From then on the pass raising before its end sends this step's round
        failed (see :meth:`_on_backward_gone`). It also begins every other reducer whose parameters
        this pass will write.

        Raises:
            GradientReductionError: this step's round is dropped (:meth:`refuse_if_incomplete`).
            RuntimeError: more backward passes than ``passes_per_step`` before ``step()``.
        """
        self.refuse_if_incomplete(starting=True)
        if self._in_backward:
            return
        self._begin_pass()
        others = [other for other in list(_REDUCERS)
                  if other is not self and not other._in_backward and other._hooked_gradients_written()]
        for other in others:
            other.refuse_if_incomplete(starting=True)
            other._begin_pass()
        if others:
            # Buckets launched from the hooks would interleave the reducers' collectives in the order
            # the gradients come, which a worker whose pass raises cannot repeat: each reduces its
            # whole round at the end of the pass instead, in the order they began, on every worker.
            for reducer in [self, *others]:
                reducer._overlapping = False

    def _hooked_gradients_written(self) -> bool:
        """Whether the running backward pass writes a gradient whose accumulator this reducer's
        hooks are on (not those a newer reducer over the same model took over). Unlike
        :meth:`backward_writes_gradients` it hooks no new parameter: that would take them back from
        the newer reducer."""
        return self._backward_executes(node for p, node in self._accumulators.values()
                                       if _HOOKS[p][1]() is self)

    def _after_accumulation(self, param: torch.Tensor, grad_inputs, grad_outputs) -> None:
        if not self._launching:
            self._learn_accumulation(param)
            return
        slot = self._plan.slot.get(id(param))
        if slot is None or slot.bucket in self._plan.deferred:
            return  # a deferred bucket's gradients are moved in at the end of backward
        pending = self._plan.buckets[slot.bucket].pending
        if slot.index not in pending:
            raise GradientReductionError(
                f"{self._plan.names[slot.index]} got a gradient twice in one backward pass (a parameter used in "
                "several torch.utils.checkpoint(..., use_reentrant=True) calls, or inside one and outside it), "
                "which the first step did not show; the first part was already scaled for the reduction. Use "
                "use_reentrant=False, or use the parameter so from the first step on (as PyTorch's DDP with "
                "static_graph=True, which learns it from its first step)")
        self._had_gradient[slot.index] = self._move_into_bucket(param, slot.view)
        pending.discard(slot.index)
        if not pending:
            self._launch_ready()

    def _learn_accumulation(self, param: torch.Tensor) -> None:
        """In a pass that launches nothing (the first step's, reduced whole at its end), note a
        parameter whose gradient accumulator runs twice: it is used in several reentrant activation
        checkpoints (each recomputation's nested backward accumulates its part), or inside one and
        outside it. Its bucket is then launched at the end of backward (:meth:`_adopt_plan`), as
        PyTorch's DDP with ``static_graph=True`` learns from its first step."""
        if self._in_backward:
            if id(param) in self._accumulated:
                self._accumulated_twice.add(id(param))
            self._accumulated.add(id(param))

    def _begin_pass(self) -> None:
        if self._passes >= self.passes_per_step and self.reduced_gradients_dropped():
            self._passes = 0  # the step was dropped unapplied (a GradScaler skip, then model.zero_grad())
        if self._passes >= self.passes_per_step:
            raise RuntimeError(
                f"gradients were computed {self._passes + 1} times before step(), more than "
                f"backward_passes_per_step={self.passes_per_step}; call step() (or zero_grad()) after every "
                f"{self.passes_per_step} backward passes or raise backward_passes_per_step")
        self._in_backward = True
        self._accumulated.clear()
        alive = _BackwardPass()  # owned by the queued callback: freed unrun when backward raises
        self._backward_alive = weakref.ref(alive, self._on_backward_gone)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end_backward, alive))
        self._opening = self.sync and self._passes + 1 == self.passes_per_step
        self._overlapping = True
        self._local_pass_unannounced |= not self.sync

    def _open_round(self) -> None:
        """Take the step's weight and open its round, launched from the hooks once a plan exists."""
        self._opening = False
        self._samples = self._step_samples()
        if self._plan is not None and self._overlapping:
            self._notice_new_parameters(self._parameters())
        # A round announcing a new plan is reduced whole at the end of backward (_launch_whole_round).
        self._launching = self._plan is not None and self._overlapping and self._next_plan is None
        if self._launching:
            self._announce_round()
            self._round = self.aggregator.open_round(self._samples, position=self._trained_position())
            self._launched_in_backward = True
            self._had_gradient = np.zeros(len(self._plan.params))
            self._next_bucket = 0
            for bucket in self._plan.buckets:
                bucket.pending = set(bucket.indices)

    def _launch_ready(self) -> None:
        buckets = self._plan.buckets
        while self._next_bucket < len(buckets) and not buckets[self._next_bucket].pending:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, number: int) -> None:
        bucket = self._plan.buckets[number]
        self.aggregator.launch(self._round, number, bucket.wire)
        bucket.launched_version = bucket.buffer._version

    def _on_backward_gone(self, alive: weakref.ref) -> None:
        if alive is self._backward_alive and self._in_backward:  # it raised: its end callback never ran
            # Also a pass inside no_sync(): a loop that goes on with the next batch skips the step's
            # reducing pass here, which the other workers' would then pair with the next step's.
            self._in_backward = self._opening = False
            self._failure = "a backward pass raised before its end on this worker (e.g. out of memory, or an error in a hook)"
            self._send_failed_round()

    def _send_failed_round(self) -> None:
        """Send what is left of this step's round at once, whatever the buckets hold, marked failed:
        the collectives stay paired with the other workers' and every worker's finish raises."""
        try:
            if self._launching:
                self._launching = False
                self._round.failed = True
                for number in range(self._next_bucket, len(self._plan.buckets)):
                    self._launch(number)
                self.aggregator.close(self._round, self._round_description(), self._had_gradient)
            else:  # an earlier pass of the step, or the first step (no plan to launch from yet)
                self._reduce_whole_round(failed=True)
            # The collectives write into the gradients: done before the error reaches the loop,
            # which may zero them in place (model.zero_grad(set_to_none=False)).
            self.aggregator.drain(self._round)
        except Exception as exc:  # raised in a weak reference's callback, which would only print it
            self._failure += f", and sending the rest of its round failed ({type(exc).__name__}: {exc})"

    def _end_backward(self, alive: _BackwardPass) -> None:
        outer_node = torch._C._current_autograd_node()
        if outer_node is not None:
            # This backward ran inside a node of another (reentrant activation checkpointing):
            # the gradients after that node's are still to come.
            _queue_after(outer_node, functools.partial(self._end_backward, alive))
            return
        self._in_backward = self._opening = False
        if not self.sync:
            return
        self._passes += 1
        if self._launching:
            self._launching = False
            for bucket in self._plan.buckets[self._next_bucket:]:
                for i in bucket.pending:  # no gradient this pass: its own, or zeros
                    param = self._plan.params[i]
                    self._had_gradient[i] = self._move_into_bucket(param, self._plan.slot[id(param)].view)
                bucket.pending.clear()
            self._launch_ready()
            self.aggregator.close(self._round, self._round_description(), self._had_gradient)
        if self._passes == self.passes_per_step:
            self._on_reduced(self.finish())

    def refuse_if_incomplete(self, starting: bool = False) -> None:
        """Raise ``GradientReductionError`` while this step's round is dropped: a backward pass raised
        before its end, on this worker or another, and :meth:`discard` was not called since.
        ``starting``: a backward pass or a batch size declaration is starting a new step there; where
        the owner's ``zero_grad_drops_a_failed_step`` (``DistributedOptimizer``) the dropped step is then
        discarded, not refused, once every gradient was cleared (``model.zero_grad()``), as its own
        ``zero_grad()`` would have."""
        if self._failure is None:
            return
        if starting and self.owner.zero_grad_drops_a_failed_step and self._gradients_cleared():
            self.discard()
            return
        raise self._dropped_step_error()

    def reduced_gradients_dropped(self) -> bool:
        """Whether every gradient of the round reduced last was cleared since (``model.zero_grad()``
        after a step the script did not apply): no reduced mean is left for another pass to add to, and
        the next backward pass starts a new step, as after the optimizer's ``zero_grad()``."""
        return self._round is None and self._plan is not None and self._gradients_cleared()

    def _gradients_cleared(self) -> bool:
        """Whether every gradient is None or zeros (``model.zero_grad()``, ``set_to_none`` True or
        False): nothing of an unapplied step is left for the next backward pass to add to. Called
        only off the usual path (a step dropped or not applied): it reads every gradient."""
        return all(p.grad is None or not p.grad.any() for _, p in self._parameters())

    @property
    def reducing(self) -> bool:
        """True from the start of the backward pass whose hooks reduce this step until :meth:`finish`."""
        return self._round is not None

    def finish(self) -> int:
        """Complete this step's reduction: every gradient then holds the batch-weighted global mean.

        Reduces the whole round here when backward did not start it (the first step, or gradients
        the script set without a backward pass), then waits.

        Returns:
            The local batch size the step was weighted by (:data:`UNSET`: none).

        Raises:
            TensorMismatchError: workers have different parameters or settings, or began different
                numbers of steps (``GradientAggregator.steps_begun``).
            ConfigurationError: batch sizes declared on some workers only, or summing to 0.
            TypeError: a gradient is sparse.
            GradientReductionError: a gradient was changed in place or replaced after its bucket
                was launched, or a backward pass of the step raised before its end on any worker
                (again at every call until :meth:`discard`).
            CommunicationError: a peer failed.
        """
        self.refuse_if_incomplete()
        if self._round is None:
            self._reduce_whole_round()
        step = self._round
        try:
            if self._launched_in_backward:
                self._refuse_changes_in_flight(step)
            self._finish_round(step)
            if self._next_plan is not None:  # every worker's parameters changed alike: reduce them again
                self._forget_missing_gradients(step)
                self._adopt_plan(self._next_plan, step.samples)
                self._launch_whole_round(step.samples)
                step = self._round
                self.aggregator.finish(step, self._round_description())
        finally:
            self._round, self._samples = None, None
            self._passes = self._passes if self.owner.passes_end_at_step else 0
            self._launched_in_backward = False
        self._forget_missing_gradients(step)
        return step.samples

    def _finish_round(self, step: Round) -> None:
        try:
            self.aggregator.finish(step, self._round_description())
        except GradientReductionError as exc:  # another worker's backward pass raised: no worker applies the step
            self._failure, self._failure_ends_the_job = str(exc), step.samplers_apart
            raise self._dropped_step_error() from None

    def _forget_missing_gradients(self, step: Round) -> None:
        """``.grad = None`` where no worker had a gradient in ``step`` (its bucket slot held zeros),
        as in one process: an optimizer then leaves the parameter alone (no momentum, no weight decay)."""
        for i in np.flatnonzero(step.counts == 0):
            self._plan.params[i].grad = None

    def _refuse_changes_in_flight(self, step: Round) -> None:
        """Raise when a gradient was written to, or replaced, after its bucket was launched (by a
        hook later in the same backward pass): the sum would hold a partly changed value, and a
        replaced gradient would not get the mean."""
        replaced = [name for bucket in self._plan.buckets for name, p, view in zip(bucket.names, bucket.params, bucket.views)
                    if p.grad is not view]
        written = [name for bucket in self._plan.buckets if bucket.buffer._version != bucket.launched_version
                   for name in bucket.names]
        if not (replaced or written):
            return
        self.aggregator.drain(step)
        what = (f"replaced ({_listed(replaced)})" if replaced else "") + (" and " if replaced and written else "") + (
            f"changed in place ({_listed(written)}, e.g. by clip_grad_norm_)" if written else "")
        raise GradientReductionError(
            f"gradients were {what} during backward after their bucket had started reducing (by a hook on another "
            "tensor): this worker's share of the sum would be partly changed and the result would differ from the "
            "other workers'. Change a gradient in a hook on its own parameter (register_post_accumulate_grad_hook), "
            "or after loss.backward() returns, when it holds the reduced mean")

    def _dropped_step_error(self) -> GradientReductionError:
        if self.owner.zero_grad_drops_a_failed_step and not self._failure_ends_the_job:
            remedy = ("call optimizer.zero_grad() (or model.zero_grad()) on every worker (each raises for this step) "
                      "before the next backward, and go on with the next batch; a worker whose loop let the error "
                      "through has exited, and the next reduction fails with CommunicationError")
        else:
            remedy = ("training cannot go on after that (as with PyTorch's DDP): restart the job (from a checkpoint, "
                      "e.g. bpslaunch --restart-on-failure)")
        return GradientReductionError(f"{self._failure}, so no worker applies that step's gradients; {remedy}")

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

    def _adopt_plan(self, plan: _Plan, samples: int) -> None:
        self._register_hooks(plan.params)
        self._rehook_converted(plan.params)
        plan.deferred = {plan.slot[pid].bucket for pid in self._accumulated_twice if pid in plan.slot}
        self._plan, self._next_plan = plan, None
        self.aggregator.agree_on_plan(self._plan.description, samples)

    def _announce_round(self, failed: bool = False) -> None:
        """Begin the round with an announcement where one is due (see ``announces_rounds``): this
        worker's pass raised (``failed``) or not. Another worker's failure comes in the trailer too."""
        if self._announcement_due():
            self.aggregator.announce(failed)

    def _announcement_due(self) -> bool:
        """Whether the round or owner's collective beginning now begins with an announcement; it
        is then no longer due."""
        due, self._local_pass_unannounced = self._local_pass_unannounced and self._announces_rounds(), False
        return due

    def before_own_collective(self) -> bool:
        """Begin a collective of the owner's own that another worker's round could meet (the DDP
        wrapper's buffer broadcast, in forward) with an announcement where one is due (see
        ``announces_rounds``): a worker whose backward pass raised inside ``no_sync()`` sends its
        round at once, while the others may still have forward passes of the step to run.

        Returns:
            False once this worker's step was dropped: the other workers' steps are dropped too and
            none sends the owner's collectives any more.

        Raises:
            GradientReductionError: another worker's backward pass raised and that worker announced
                its round, failed: this worker sends its own, failed, to pair with it, and drops the
                step (training cannot go on, see :meth:`refuse_if_incomplete`).
            CommunicationError: a peer failed.
        """
        if self._failure is not None:
            return False
        failed = self.aggregator.announce(False) if self._announcement_due() else []
        if not failed:
            return True
        self._failure = str(failed_backward_error(failed))
        self._reduce_whole_round(failed=True)  # announced: its announcement was what came in
        self.aggregator.drain(self._round)
        raise self._dropped_step_error()

    def _reduce_whole_round(self, failed: bool = False) -> None:
        self._announce_round(failed)
        named = self._parameters()
        sparse = [_parameter_name(name) for name, p in named if p.grad is not None and p.grad.layout != torch.strided]
        if sparse:
            raise _sparse_error(sparse)
        if self._samples is None:
            self._samples = self._step_samples()
        if self._plan is None:
            self._adopt_plan(_Plan(named, self.aggregator.fusion_bytes, self._settings), self._samples)
        else:
            self._notice_new_parameters(named)
        self._launch_whole_round(self._samples, failed)

    def _launch_whole_round(self, samples: int, failed: bool = False) -> None:
        if self._next_plan is not None:
            self._launch_announcing_round(samples, failed)
            return
        self._round = self.aggregator.open_round(samples, position=self._trained_position())
        self._round.failed = failed
        self._had_gradient = np.zeros(len(self._plan.params))
        for number, bucket in enumerate(self._plan.buckets):
            for i, param, view in zip(bucket.indices, bucket.params, bucket.views):
                self._had_gradient[i] = self._move_into_bucket(param, view)
            self._launch(number)
        self.aggregator.close(self._round, self._round_description(), self._had_gradient)

    def _launch_announcing_round(self, samples: int, failed: bool) -> None:
        """The round whose trailer announces the new plan: the agreed plan's buckets, so that the
        collectives pair with every worker's, sent as zeros. The gradients stay as they are, to be
        reduced with the new plan (:meth:`finish`): the agreed plan's views may no longer fit their
        parameters (converted to another dtype or device, and ``Module._apply`` then also replaced
        the data of the views that were their ``.grad``)."""
        self._round = self.aggregator.open_round(samples, measure=False, position=self._trained_position())
        self._round.failed = failed
        self._had_gradient = np.array([p.grad is not None for p in self._plan.params], dtype=np.float64)
        for number, bucket in enumerate(self._plan.buckets):
            self.aggregator.launch(self._round, number, torch.zeros_like(bucket.wire))
        self.aggregator.close(self._round, self._round_description(), self._had_gradient)

    def end_step(self) -> None:
        """The owner applied the step: the next backward pass starts a new count."""
        self._passes = 0

    def discard(self) -> None:
        """Drop a round in progress (``zero_grad`` between backward and step): wait for what was
        launched and forget the passes."""
        if self._round is not None:
            self.aggregator.drain(self._round)
        self._round, self._samples, self._passes = None, None, 0
        self._launching = self._in_backward = self._opening = self._launched_in_backward = False
        self._failure, self._failure_ends_the_job = None, False

    def _move_into_bucket(self, param: torch.Tensor, view: torch.Tensor) -> bool:
        """Make ``param.grad`` its bucket ``view``, holding the round's scale times the gradient
        (zeros for a parameter without one, or when the scale is 0), in one pass over the memory;
        returns whether it had one.

        Raises:
            TypeError: the gradient is sparse.
        """
        grad, scale = param.grad, self._round.scale
        if grad is not None and grad.layout != torch.strided:
            raise _sparse_error([self._plan.names[self._plan.slot[id(param)].index]])
        if grad is not None and grad.requires_grad:  # backward(create_graph=True)
            if not self._warned_create_graph:
                self._warned_create_graph = True
                warnings.warn("backward(create_graph=True): the reduced gradients carry no autograd graph (as with "
                              "PyTorch's DDP); take higher-order terms with torch.autograd.grad(..., create_graph=True) "
                              "before the backward pass that reduces", stacklevel=2)
            grad = grad.detach()
        scale_into(view, grad, scale)
        param.grad = view
        return grad is not None


def refuse_compiled_autograd() -> None:
    """Raise ``ConfigurationError`` inside a backward pass that compiled autograd runs
    (``torch._dynamo.config.compiled_autograd``, ``compiled_autograd._enable``): it traces the
    reduction's hooks into a graph, where they cannot begin, launch or end a round (before this
    check it failed in that trace, with dynamo's "queue_callback() is only supported when Compiled
    Autograd is enabled with fullgraph=True"). Read from ``sys.modules``: without it imported,
    compiled autograd cannot be running, and importing it would cost every worker seconds."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled is not None and getattr(compiled, "in_compiled_autograd_region", False):
        raise ConfigurationError(
            "compiled autograd cannot run dynamix_byteps's gradient reduction, which runs from autograd hooks "
            "during backward: turn it off for the backward pass (torch._dynamo.config.compiled_autograd = False, "
            "no compiled_autograd._enable around loss.backward()). torch.compile of the model (its forward and "
            "backward graphs) works with both wrappers")


def _before_gradient(reducer: weakref.ref, param: weakref.ref, grad: torch.Tensor) -> None:
    """A parameter's tensor hook: ``reducer``'s :meth:`BucketReducer._on_parameter_gradient`. Weak
    references: the parameter holds its hooks, and must keep neither its reducer nor itself alive.

    Raises:
        ConfigurationError: compiled autograd runs the backward pass (:func:`refuse_compiled_autograd`).
    """
    refuse_compiled_autograd()
    live, tensor = reducer(), param()
    if live is not None and tensor is not None:
        live._on_parameter_gradient(tensor)


def _register_first_tensor_hook(param: torch.Tensor, hook: Callable) -> torch.utils.hooks.RemovableHandle:
    """``param.register_hook(hook)``, moved before the hooks registered earlier. The engine runs a
    tensor's hooks in the order of its hook dict's storage, which ``OrderedDict.move_to_end``
    leaves as it is: the dict (the object the engine holds) is refilled instead."""
    handle = param.register_hook(hook)
    hooks = param._backward_hooks
    earlier = [(key, value) for key, value in hooks.items() if key != handle.id]
    hooks.clear()
    hooks[handle.id] = hook
    hooks.update(earlier)
    return handle


class _BackwardPass:
    """A token whose life is that of the backward pass holding it (see ``BucketReducer._on_backward_gone``)."""


def _sparse_error(names: list[str]) -> TypeError:
    return TypeError(f"sparse gradients are not supported ({', '.join(names)}); use dense ones, "
                     "e.g. nn.Embedding(..., sparse=False)")


def _listed(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _queue_after(node, callback: Callable[[], None]) -> None:
    """Queue ``callback`` at the end of the backward pass that runs ``node``, once ``node`` has run."""
    handles = []

    def after_node(grad_inputs, grad_outputs):
        handles.pop().remove()
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    handles.append(node.register_hook(after_node))
