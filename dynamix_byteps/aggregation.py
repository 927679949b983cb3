"""Batch-weighted gradient aggregation, shared by the PyTorch and TensorFlow frontends.

Workers may train on different local batch sizes b_i. The average over workers that BytePS and
Horovod compute, (1/n) Σ g_i, then over-weights the samples of small batches. Aggregation here
produces the gradient of the mean loss over the global batch instead:

    g = Σ_i b_i · g_i / Σ_i b_i

where g_i is worker i's gradient of its own mean loss.

A step is one :class:`Round`. Gradients arrive in flat buckets (torch tensors on the engine's
device, one dtype each, :func:`plan_buckets`), already multiplied by s_i = b_i / R while they were
copied in, where R is a reference every worker knows (the global batch of the previous step, so
with steady batch sizes the sums need no division afterwards). Each bucket's sum all-reduce
starts as soon as the bucket is full (the PyTorch frontend does this from the backward hooks,
while backward goes on). The last collective of the round, issued right behind the last bucket,
is a small float64 *trailer*, one row per worker: its batch size, its local squared gradient
norm |g_i|², the digest of its bucket plan, the sampler step it trains with that step's
epoch, the digest of the sampler's settings and the sampler's rank (:class:`SamplerPosition`;
epoch, seed, dataset size, shuffling, ``drop_last``, the number of workers and their initial
batch sizes fix the permutation the batch came from and its cut, the rank this worker's slice).
A sampler drawing its own shard (``num_replicas=1``) sends only :data:`INDEPENDENT` as its rank.
The row ends with the steps the worker's training loop began
(:attr:`GradientAggregator.steps_begun`).
When the round finishes every worker divides the sums by Σ b_i / R (when that is not 1) and so
holds g exactly; the trailer's digests turn a mismatched plan or samplers built differently
(``seed=rank``), its sampler ranks two workers drawing one slice (``rank=bps.local_rank()``) or
shared samplers mixed with ones drawing their own shard (``num_replicas=1`` on some workers), and
its steps and epochs workers out of step with each other (a checkpoint loaded on one worker only,
``set_epoch`` called with different epochs), and its steps begun a worker that skipped a step
the others trained (an exception caught by its loop, which went on with the next batch), into
:class:`TensorMismatchError` on every worker: the collectives pair up in order, so such workers
would otherwise sum one worker's step with another's, silently, from then on.
One collective per bucket and one trailer per step. A worker whose backward pass raised before its
end still sends the round's every bucket and its trailer, with :data:`FAILED` as its batch size
(:attr:`Round.failed`), so the collectives stay paired step for step, and every worker raises
``GradientReductionError`` for that step.

The gradient noise scale (:mod:`dynamix_byteps.scaling.gradient_noise`) needs |g_i|² and |g|², two
extra passes over every gradient. They are measured on every ``noise_every``-th round only
(default 4, ``DYNAMIX_NOISE_EVERY``): on a communication-heavy model with more workers than cores
the two passes cost 4% of a step, while the noise scale feeds decisions made every ~20 steps.

The names, shapes and dtypes behind a plan are negotiated once, when the plan is built
(:meth:`GradientAggregator.agree_on_plan`), not on every step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.batch_plan import SamplerSettings
from dynamix_byteps.env import optional_int
from dynamix_byteps.errors import ConfigurationError, GradientReductionError, TensorMismatchError
from dynamix_byteps.negotiation import fingerprint, gather_text, negotiate, round_lock
from dynamix_byteps.scaling.gradient_noise import GradientNoiseScale
from dynamix_byteps.scaling.lr_scaling import get_rule
from dynamix_byteps.timing import now_ns

DEFAULT_FUSION_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20
DEFAULT_NOISE_EVERY = 4
UNSET = -1  # a worker that declared no batch size for the step
INDEPENDENT = -2  # the sampler rank of a sampler drawing its own shard (num_replicas=1)
FAILED = -3  # the batch size a worker sends for a round its backward pass left incomplete
DIGEST_MASK = (1 << 52) - 1  # digests travel as float64, exact below 2**53

_SAMPLES, _SQ_NORM, _DIGEST, _STEP, _EPOCH, _SAMPLER, _SAMPLER_RANK, _BEGUN = range(8)  # the trailer's columns
_COLUMNS = 8
_AGREED = [_DIGEST, _STEP, _EPOCH, _SAMPLER, _BEGUN]  # the columns every rank's row holds alike


@dataclass(frozen=True)
class SamplerPosition:
    """What a round trains (:attr:`TrainingStep.trained_position
    <dynamix_byteps.training_step.TrainingStep>`): the sampler's global ``step``, the ``epoch``
    whose permutation its batches came from, the ``sampler``'s
    :class:`~dynamix_byteps.batch_plan.SamplerSettings` that fix that permutation and its cut,
    and the sampler's ``rank``, the slice this worker draws. Workers at the same step of
    different epochs or samplers draw different samples, so for a shared sampler the trailer
    carries the step, the epoch (below 2**53: the sampler refuses larger epochs, exact in
    float64), the 52-bit digest of the settings' canonical text (a seed may be any integer) and
    the rank, which must be the worker's own; for one drawing its own shard only
    :data:`INDEPENDENT`."""

    step: int
    epoch: int
    sampler: SamplerSettings
    rank: int

    def trailer_columns(self) -> tuple[int, int, int, int]:
        """The trailer's sampler step, epoch, settings digest and sampler rank for this position."""
        if not self.sampler.shared:
            return UNSET, UNSET, UNSET, INDEPENDENT
        return self.step, self.epoch, _settings_digest(self.sampler), self.rank


@functools.lru_cache(maxsize=16)
def _settings_digest(settings: SamplerSettings) -> int:
    """:func:`trailer_digest` of ``settings``' canonical text, built once per sampler, not per round."""
    return trailer_digest(settings.to_json())


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """|t|² of a 1-D buffer as a 0-dim float64 tensor on its device (read without a host sync):
    a BLAS dot product for float32/float64 (relative error ~4e-7 for 421k float32 values, 14x
    faster than a float64 reduction), else accumulated in float64; Σ|z|² for a complex buffer."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor).reshape(-1)
    if tensor.dtype in (torch.float32, torch.float64):
        return torch.dot(tensor, tensor).double()
    return torch.linalg.vector_norm(tensor, dtype=torch.float64) ** 2


def scale_into(out: torch.Tensor, grad: torch.Tensor | None, scale: float) -> None:
    """Write ``scale * grad`` into ``out`` (same shape and dtype; ``grad`` may be ``out`` itself):
    a worker's share s_i g_i of the batch-weighted sum (:class:`Round`).

    Zeros for a missing gradient and for a worker without samples (``scale`` 0): its empty
    batch's gradient can be NaN (a batch statistic over no samples), and NaN times 0 is NaN,
    which the sum would carry to every worker.
    """
    if grad is None or scale == 0.0:
        out.zero_()
    elif scale == 1.0:
        if grad is not out:
            out.copy_(grad)
    else:
        torch.mul(grad, scale, out=out)


def _timed_wait(device: torch.device, wait) -> tuple[float, tuple[int, int]]:
    """Seconds ``wait()`` holds up this worker's work (host time on the CPU, CUDA events on the
    current stream on a GPU, where waiting makes the stream, not the host, wait) and the host's
    ``(begin, end)`` of the call in :func:`~dynamix_byteps.timing.now_ns` nanoseconds."""
    begin_ns = now_ns()
    if device.type != "cuda":
        wait()
        end_ns = now_ns()
        return (end_ns - begin_ns) * 1e-9, (begin_ns, end_ns)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    wait()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3, (begin_ns, now_ns())


def noise_every() -> int:
    """Rounds per gradient-noise measurement, from ``DYNAMIX_NOISE_EVERY`` (default 4; 1 measures
    every step).

    Raises:
        ConfigurationError: the variable is not an integer >= 1.
    """
    return optional_int(os.environ, "DYNAMIX_NOISE_EVERY", 1) or DEFAULT_NOISE_EVERY


def fusion_bytes() -> int:
    """Bytes per gradient bucket, from ``DYNAMIX_FUSION_BYTES`` (default 25 MiB, as DDP's
    ``bucket_cap_mb``; 4 and 8 MiB measured the same in ``benchmarks/ddp_comparison.py``).

    Raises:
        ConfigurationError: the variable is not an integer >= 1.
    """
    return optional_int(os.environ, "DYNAMIX_FUSION_BYTES", 1) or DEFAULT_FUSION_BYTES


def global_batch(local_batch_sizes: np.ndarray) -> int | None:
    """Σ b_i of one step, or None when no worker declared a size (BytePS's plain average).

    Args:
        local_batch_sizes: int array of shape ``(size,)``; :data:`UNSET` marks a worker that gave none.

    Raises:
        ConfigurationError: some workers gave a size and others did not, or all sizes are 0.
    """
    sizes = np.asarray(local_batch_sizes, dtype=np.int64)
    unset = sizes == UNSET
    if unset.all():
        return None
    if unset.any():
        raise ConfigurationError(
            f"ranks {np.flatnonzero(~unset).tolist()} declared a local batch size for this step but "
            f"ranks {np.flatnonzero(unset).tolist()} did not when the reduction started; declare it on every "
            "worker (in PyTorch before loss.backward()) or on none"
        )
    total = int(sizes.sum())
    if total == 0:
        raise ConfigurationError("every worker reported a local batch size of 0 for this step; nothing to average")
    return total


def plan_buckets(items: Sequence[tuple[int, Hashable]], limit: int, first_limit: int | None = None) -> list[list[int]]:
    """Group tensors into buckets: one kind (dtype, or dtype and device) per bucket, each closed
    as soon as it holds ``limit`` bytes or more (PyTorch DDP's rule: the tensor that crosses the
    limit joins the bucket, so the last bucket, whose communication backward cannot hide, stays small).

    Args:
        items: ``(nbytes, kind)`` per tensor, in the order every worker uses (the order backward
            produces them, for overlap).
        limit: bytes per bucket.
        first_limit: bytes of each kind's first bucket (default ``limit``); a small one lets
            communication start early in backward, as DDP's 1 MiB first bucket does.

    Returns:
        Lists of indices into ``items``, in order within each kind, kinds by first appearance.
    """
    by_kind: dict[Hashable, list[list[int]]] = {}
    filled: dict[Hashable, int] = {}
    for index, (nbytes, kind) in enumerate(items):
        buckets = by_kind.setdefault(kind, [[]])
        buckets[-1].append(index)
        filled[kind] = filled.get(kind, 0) + nbytes
        if filled[kind] >= (first_limit if first_limit is not None and len(buckets) == 1 else limit):
            buckets.append([])
            filled[kind] = 0
    return [bucket for buckets in by_kind.values() for bucket in buckets if bucket]


@functools.lru_cache(maxsize=64)
def trailer_digest(description: str) -> int:
    """The 52-bit digest of a description (a bucket plan's, a sampler's settings) that the
    trailer carries, exact in float64. Cached: every round sends the same few."""
    return fingerprint([description]) & DIGEST_MASK


@dataclass
class Round:
    """One step's reduction, from its first bucket to :meth:`GradientAggregator.finish`.

    Attributes:
        samples: this worker's local batch size b_i (:data:`UNSET`: none declared, counted as 1).
        scale: s_i = b_i / reference: the factor every gradient is multiplied by on its way into
            its bucket.
        reference: R, the same on every worker.
        measure: whether this round measures the squared norms for the gradient noise scale
            (decided by the round count, so the same on every worker).
        position: the sampler step, epoch and settings the round trains; None without a sampler.
        failed: this worker's gradients for the round are incomplete (its backward pass raised):
            set before :meth:`GradientAggregator.close`, it makes every worker's ``finish`` raise.
    """

    samples: int
    scale: float
    reference: float
    measure: bool = True
    position: SamplerPosition | None = None
    failed: bool = False
    samplers_apart: bool = False  # set by finish: the round failed and its workers' sampler steps differ
    local_sq: torch.Tensor | float = 0.0  # |s_i g_i|² so far, on the buckets' device
    in_flight: list = field(default_factory=list)  # (bucket, handle, wire, ctx) in launch order
    trailer: tuple | None = None  # (tensor, handle) once closed
    counts: np.ndarray | None = None  # after finish: the per-tensor counts of close(), summed over workers


def _differing_settings(settings: dict[int, SamplerSettings]) -> str:
    """Each field whose value differs between ranks, as ``'rank 0: seed 42, rank 1: seed 1'``,
    joined by ``'; '`` in the fields' order. ``settings``: rank -> its sampler's settings."""
    names = [each.name for each in fields(SamplerSettings)]
    return "; ".join(", ".join(f"rank {rank}: {each.describe(name)}" for rank, each in settings.items())
                     for name in names if len({getattr(each, name) for each in settings.values()}) > 1)


def _check_samplers(digests: np.ndarray, gather_settings: Callable[[], list[str]]) -> None:
    """Raise TensorMismatchError unless the workers whose shared sampler feeds the round built it
    with the same settings; :data:`UNSET` marks a worker without one. ``digests``: int64, one per
    rank (:func:`trailer_digest` of its settings' :meth:`~SamplerSettings.to_json`);
    ``gather_settings()``: every rank's settings text, a collective called only on a mismatch
    (which every worker sees in the same trailer)."""
    known = np.flatnonzero(digests != UNSET)
    if np.all(digests[known] == digests[known[:1]]):
        return
    texts = gather_settings()
    listed = _differing_settings({int(rank): SamplerSettings.from_json(texts[rank]) for rank in known})
    raise TensorMismatchError(
        f"workers drew the same round's batches from samplers built with different settings ({listed}), so "
        "they cut different permutations of the dataset: some samples are trained twice per epoch, others never. "
        "Build the DynamicBatchSampler with the same dataset (length), seed, shuffle, drop_last, num_replicas and "
        "batch_size (one size, or the same per-rank list) on every worker: a fixed seed (seed=42), not seed=rank "
        "or a random one; to shuffle a shard of its own on each worker, give num_replicas=1, rank=0")


def _check_failures(samples: np.ndarray, steps: np.ndarray) -> None:
    """Raise GradientReductionError when some workers sent :data:`FAILED` as their batch size
    (``samples``: float64, one per rank): their gradients for the round are incomplete. ``steps``:
    int64, each rank's sampler step (:data:`UNSET`: none); the message says when they differ."""
    failed = np.flatnonzero(samples == FAILED).tolist()
    if not failed:
        return
    apart = ""
    if _differ(steps):
        listed = ", ".join(f"rank {rank}: step {s}" for rank, s in enumerate(steps) if s != UNSET)
        apart = (f", and before the step's last backward pass: its loop has not drawn all of the step's batches from "
                 f"its DynamicBatchSampler ({listed}), so the workers' samplers stay a draw apart and every later "
                 "step would raise TensorMismatchError")
    raise failed_backward_error(failed, apart)


def failed_backward_error(failed: list[int], apart: str = "") -> GradientReductionError:
    """The error for a round that the backward passes of ranks ``failed`` left incomplete;
    ``apart``: what else the message says (it follows the ranks' cause)."""
    whose = (f"rank {failed[0]}'s backward pass raised before its end" if len(failed) == 1 else
             f"the backward passes of ranks {failed} raised before their end")
    return GradientReductionError(f"{whose} (e.g. out of memory, or an error in a hook), leaving the step's "
                                  f"gradients incomplete there{apart}")


def _differ(values: np.ndarray) -> bool:
    """Whether the known (not :data:`UNSET`) values differ."""
    known = values[values != UNSET]
    return bool(known.size) and not np.all(known == known[0])


def _rows_agree(table: np.ndarray) -> bool:
    """Whether the trailer's ``table`` (float64, one row per rank) passes every check of
    :meth:`GradientAggregator.finish` at a glance, as on almost every step: no round failed, the
    plan and sampler digests, sampler steps, epochs and steps begun the same on every row, and the
    sampler ranks each row's own (or every row without a shared sampler). A dozen small numpy
    calls fewer per step; any other table goes through the checks one by one."""
    ranks = table[:, _SAMPLER_RANK]
    return (not (table[:, _SAMPLES] == FAILED).any() and (table[:, _AGREED] == table[0, _AGREED]).all()
            and ((ranks == np.arange(ranks.size)).all() or (ranks[0] < 0 and (ranks == ranks[0]).all())))


def _check_steps_begun(begun: np.ndarray) -> None:
    """Raise TensorMismatchError unless every worker began as many steps of its training loop
    (``begun``: float64, each rank's :attr:`GradientAggregator.steps_begun` when it closed the round)."""
    if not _differ(begun):
        return
    listed = ", ".join(f"rank {rank}: {int(count)}" for rank, count in enumerate(begun))
    raise TensorMismatchError(
        f"workers reduced the same round from different steps of their training loops (steps begun, counted by "
        f"optimizer.zero_grad(): {listed}): some skipped a step the others trained, or ran an extra one, and the "
        "reductions pair up in order, so each later step would sum one worker's step with another's. Likely "
        "causes: an exception (in forward, or in backward before any parameter got its gradient) caught by the "
        "training loop on some workers only, which went on with the next batch; unequal numbers of batches per "
        "worker; or gradients zeroed by optimizer.zero_grad() on some workers and by model.zero_grad() on others "
        "(use one alike everywhere). Give every worker the same number of steps (a DynamicBatchSampler, or a "
        "DistributedSampler with drop_last=True), and skip a step on every worker or on none: let such an exception "
        "end the job (restart it from a checkpoint); a GradientReductionError, which every worker raises, is dropped "
        "by calling optimizer.zero_grad() on every worker")


def _check_sampler_modes(sampler_ranks: np.ndarray) -> None:
    """Raise TensorMismatchError when some workers draw from a shared sampler and others from one
    drawing their own shard; ``sampler_ranks``: int64, each rank's sampler rank (:data:`UNSET`: no
    sampler, allowed with either; :data:`INDEPENDENT`: a sampler drawing its own shard)."""
    shared, independent = np.flatnonzero(sampler_ranks >= 0), np.flatnonzero(sampler_ranks == INDEPENDENT)
    if not shared.size or not independent.size:
        return
    raise TensorMismatchError(
        f"ranks {shared.tolist()} draw their slices of a sampler shared by all {sampler_ranks.size} workers "
        f"(num_replicas={sampler_ranks.size}) while ranks {independent.tolist()} draw a shard of their own "
        "(num_replicas=1): the shared permutation's slices of the latter are never trained, and what they train "
        "instead is not cut from it. Build the DynamicBatchSampler with the same num_replicas on every worker: leave "
        "num_replicas out everywhere (it defaults to bps.size()), or give num_replicas=1, rank=0 everywhere to "
        "shuffle a shard of its own on each worker. A sampler built later on some workers only (a validation "
        "sampler on rank 0) replaces the training one there: use a plain DataLoader for it, or hand each optimizer "
        "its sampler's batch_plan")


def _check_sampler_ranks(sampler_ranks: np.ndarray) -> None:
    """Raise TensorMismatchError unless every worker whose shared sampler feeds the round draws
    the slice of its own rank; ``sampler_ranks``: int64, each rank's sampler rank (:data:`UNSET`:
    no sampler, :data:`INDEPENDENT`: one drawing its own shard, neither compared)."""
    known = np.flatnonzero(sampler_ranks >= 0)
    if np.all(sampler_ranks[known] == known):
        return
    listed = ", ".join(f"rank {rank}: sampler rank {sampler_ranks[rank]}" for rank in known)
    raise TensorMismatchError(
        f"workers drew the slices of other ranks from their samplers ({listed}): a slice two workers draw is "
        "trained twice per epoch, one no worker draws never, and each batch size goes to another worker. Leave "
        "the DynamicBatchSampler's rank= out (it defaults to bps.rank(), the worker's rank in the whole job), "
        "not rank=bps.local_rank() or a constant; to shuffle a shard of its own on each worker, give "
        "num_replicas=1, rank=0")


def _check_sampler_positions(steps: np.ndarray, epochs: np.ndarray) -> None:
    """Raise TensorMismatchError unless the workers that know the sampler step (epoch) of the
    round agree on it; :data:`UNSET` marks a worker that does not (no sampler feeds it)."""
    if _differ(epochs):
        listed = ", ".join(f"rank {rank}: " + (f"epoch {e} step {s}" if e != UNSET else f"step {s}")
                           for rank, (s, e) in enumerate(zip(steps, epochs)) if s != UNSET)
        raise TensorMismatchError(
            f"workers drew the same round's batches from different epochs of their samplers ({listed}), so "
            "they draw from different permutations: some samples twice, others never. Call set_epoch with "
            "the same epoch at the same point on every worker (set_epoch(epoch), not set_epoch(epoch + rank)), "
            "or on none, and load a checkpoint on every worker, not only on rank 0")
    if _differ(steps):
        listed = ", ".join(f"rank {rank}: step {s}" for rank, s in enumerate(steps) if s != UNSET)
        raise TensorMismatchError(
            f"workers reduced different steps of their samplers in the same round ({listed}); every worker "
            "must train the same steps: load a checkpoint on every worker, not only on rank 0, and use "
            "no_sync() (or backward passes) alike on every worker. After a GradientReductionError for a backward "
            "pass that raised before its step's last one (backward_passes_per_step > 1, or no_sync()), the failing "
            "worker's loop skipped the rest of the step's batches: the job cannot go on, restart it from a checkpoint")


class GradientAggregator:
    """The per-step reduction and its statistics for one distributed optimizer (any frontend).

    Math and collectives only: where a step's batch sizes come from and what happens when a
    step ends belong to the frontend (:class:`~dynamix_byteps.training_step.TrainingStep`).

    Args:
        optimizer_family: ``"sgd"`` or ``"adam"`` (:func:`~dynamix_byteps.scaling.lr_scaling.optimizer_family_of`).
        compression: a compressor class with ``name``, ``compress`` and ``decompress`` on torch tensors.
        lr_scaling: ``none``, ``linear``, ``sqrt``, ``adascale`` or an ``LRScaling``; default
            ``DYNAMIX_LR_SCALING`` (``bpslaunch --lr-scaling``), else ``none``.
        base_batch_size: B0, the global batch the base learning rate was tuned for; default: the
            global batch of the first step.
        before_send: called before each bucket and each trailer leaves this worker (the step
            monitor's straggler emulation); None: nothing.

    Attributes:
        gradient_noise: the :class:`GradientNoiseScale` fed every step.
        global_batch_size: Σ b_i of the last step, None when batch sizes were not known.
        lr_scale: the learning-rate factor of the last step.
        wait_s: seconds the last :meth:`finish` blocked on communication (the exposed push_pull time).
        wait_ns: ``(begin, end)`` of that wait on the host, :func:`~dynamix_byteps.timing.now_ns` nanoseconds.
        steps_begun: the steps of the training loop this worker began, as its frontend counts them
            (torch's ``DistributedOptimizer``: its ``zero_grad()`` calls; 0 where it counts none);
            every round's trailer checks it is the same on every worker. Not checkpointed: a fresh
            process starts at 0 on every worker, and a checkpoint loaded on rank 0 only, then
            broadcast (Horovod's way), leaves the workers in step.

    Raises:
        ValueError: an unknown ``lr_scaling`` rule or a ``base_batch_size`` below 1.
        NotInitializedError: ``init()`` was not called.
    """

    def __init__(self, optimizer_family: str, compression, lr_scaling=None, base_batch_size: int | None = None,
                 before_send: Callable[[], None] | None = None):
        if base_batch_size is not None and (isinstance(base_batch_size, bool) or not isinstance(base_batch_size, int)
                                            or base_batch_size < 1):
            raise ValueError(f"base_batch_size must be an integer >= 1, got {base_batch_size!r}")
        self.engine = _engine.current()
        self.lr_scaling = get_rule(lr_scaling or os.environ.get("DYNAMIX_LR_SCALING") or "none", optimizer_family)
        self.base_batch_size = base_batch_size
        self.compression = compression
        self.fusion_bytes = fusion_bytes()
        self.noise_every = noise_every()
        self._rounds = 0
        self.steps_begun = 0
        self.gradient_noise = GradientNoiseScale()
        self.global_batch_size: int | None = None
        self.lr_scale = 1.0
        self.wait_s = 0.0
        self.wait_ns = (0, 0)
        self.before_send = before_send or (lambda: None)
        self._reference = 1.0

    def agree_on_plan(self, description: str, samples: int) -> None:
        """Check that every worker built the same bucket plan (a blocking collective, run when
        a plan is built, not per step), and take the reference R of the round about to open from
        every worker's ``samples`` (so even the first round is scaled by b_i / Σb, not by b_i: no
        float16 overflow from a large batch).

        Raises:
            TensorMismatchError: on every worker, when the descriptions differ.
        """
        with round_lock:
            table = negotiate(self.engine, "gradient reduction", description, samples)
        self._reference = float(np.where(table[:, 0] == UNSET, 1, table[:, 0]).sum() or 1)

    def announce(self, failed: bool) -> list[int]:
        """The small blocking all-reduce that begins a round where a frontend's collectives of its
        own (the DDP wrapper's buffer broadcasts) could meet it on another worker: there each worker
        announces whether its backward pass raised (``failed``: the rest of its round follows, marked
        failed), so that a worker at such a collective learns it there. Nothing is sent with one worker.

        Returns:
            The ranks that announced a failed round, ascending.

        Raises:
            CommunicationError: a peer failed.
        """
        engine = self.engine
        if engine.size == 1:
            return []
        flags = torch.zeros(engine.size, dtype=torch.float64, device=engine.device)
        flags[engine.rank] = float(failed)
        with round_lock:
            handle = engine.all_reduce_async(flags, "Gradient.announcement")
        handle.wait()
        return np.flatnonzero(flags.cpu().numpy()).tolist()

    def open_round(self, samples: int, measure: bool = True, position: SamplerPosition | None = None) -> Round:
        """Start a step's reduction for ``samples`` local samples (:data:`UNSET`: undeclared);
        ``measure=False`` keeps it out of the gradient noise statistics even on a measuring round;
        ``position``: the sampler step, epoch and settings the round trains (None: no sampler),
        which must be the same on every worker that has one."""
        effective = 1 if samples == UNSET else samples
        measure = measure and self._rounds % self.noise_every == 0
        self._rounds += 1
        return Round(samples, effective / self._reference, self._reference, measure, position)

    def launch(self, step: Round, bucket: int, flat: torch.Tensor) -> None:
        """Start the sum all-reduce of bucket number ``bucket`` of the plan: ``flat`` (contiguous,
        1-D) holds this worker's gradients times ``step.scale``. Buckets must be launched in the
        same order on every worker."""
        self.before_send()
        if step.measure:
            step.local_sq = step.local_sq + squared_norm(flat)
        wire, ctx = self.compression.compress(flat)
        with round_lock:
            handle = self.engine.all_reduce_async(wire, f"Gradient.bucket.{bucket}")
        step.in_flight.append((flat, handle, wire, ctx))

    def close(self, step: Round, description: str, counts: np.ndarray | None = None) -> None:
        """Start the round's trailer, after its last bucket: this worker's batch size, local
        squared norm, plan digest (``description``'s), sampler step, epoch, settings digest and rank,
        :attr:`steps_begun`, and ``counts``
        (float64, one per tensor, e.g. 1 for a gradient this worker had), summed over the workers
        into ``step.counts``."""
        self.before_send()
        engine = self.engine
        # Filled in numpy (an element write into a torch tensor costs ~7 us, ~60 us a step in all)
        # and sent to the device in one copy: element writes into a CUDA tensor each wait for the
        # device. Only the squared norm, a device value, is written there.
        host = np.zeros(engine.size * _COLUMNS + (0 if counts is None else counts.size))
        row = host[engine.rank * _COLUMNS:(engine.rank + 1) * _COLUMNS]
        row[_SAMPLES] = FAILED if step.failed else step.samples
        row[_DIGEST] = trailer_digest(description)
        row[_STEP:_SAMPLER_RANK + 1] = (UNSET,) * 4 if step.position is None else step.position.trailer_columns()
        row[_BEGUN] = self.steps_begun
        local_sq = step.local_sq / (step.scale * step.scale) if step.measure and step.scale > 0 else 0.0
        if not step.measure:
            row[_SQ_NORM] = float("nan")
        elif not isinstance(local_sq, torch.Tensor):
            row[_SQ_NORM] = local_sq
        if counts is not None:
            host[engine.size * _COLUMNS:] = counts
        trailer = torch.from_numpy(host)
        if engine.device.type != "cpu":
            trailer = trailer.pin_memory().to(engine.device, non_blocking=True)
        if isinstance(local_sq, torch.Tensor):
            trailer[engine.rank * _COLUMNS + _SQ_NORM] = local_sq
        with round_lock:
            step.trailer = (trailer, engine.all_reduce_async(trailer, "Gradient.trailer"))

    def drain(self, step: Round) -> None:
        """Wait for a round's collectives and drop its results (``zero_grad`` before ``step``)."""
        for _, handle, _, _ in step.in_flight:
            handle.wait()
        if step.trailer is not None:
            step.trailer[1].wait()

    def finish(self, step: Round, description: str) -> None:
        """Wait for the closed round and leave the global mean g in each launched buffer.

        Args:
            step: the round, every bucket launched and the trailer started (:meth:`close`).
            description: the plan's description, gathered only to explain a mismatch.

        Raises:
            GradientReductionError: the round failed on some workers (:attr:`Round.failed`); no
                worker's buffers hold the mean.
            TensorMismatchError: workers began different numbers of steps (:attr:`steps_begun`),
                reduced different plans, or drew from samplers with different settings, steps or
                epochs, from other ranks' slices, or some from a shared sampler and others from
                their own shards (every worker raises).
            ConfigurationError: batch sizes declared on some workers only, or summing to 0.
            CommunicationError: a peer failed.
        """
        trailer = step.trailer[0]
        self.wait_s, self.wait_ns = _timed_wait(self.engine.device, lambda: self.drain(step))
        values = trailer.cpu().numpy()
        cells = self.engine.size * _COLUMNS
        table, step.counts = values[:cells].reshape(self.engine.size, _COLUMNS), values[cells:]
        if not _rows_agree(table):
            self._check_rows(step, table, description)
        sizes = table[:, _SAMPLES].astype(np.int64)
        total = global_batch(sizes)
        effective_total = self.engine.size if total is None else total
        divisor = effective_total / step.reference
        global_sq = 0.0
        for flat, _, wire, ctx in step.in_flight:
            reduced = self.compression.decompress(wire, ctx)
            if step.measure:
                global_sq = global_sq + squared_norm(reduced)
            if reduced is not flat:
                torch.mul(reduced, 1.0 / divisor, out=flat)
            elif divisor != 1.0:
                flat.mul_(1.0 / divisor)
        global_sq = float(global_sq) / (divisor * divisor)
        self._reference = float(effective_total)
        self.global_batch_size = total
        if step.measure and total is not None and (sizes > 0).all():
            self.gradient_noise.update(table[:, _SQ_NORM], sizes, global_sq)

    def _check_rows(self, step: Round, table: np.ndarray, description: str) -> None:
        """Raise the error that the trailer's ``table`` (float64, one row of :data:`_COLUMNS` per
        rank) calls for, if any (see :meth:`finish`), and set ``step.samplers_apart``; the collectives
        that explain a mismatch are run only then, on every worker alike."""
        steps = table[:, _STEP].astype(np.int64)
        step.samplers_apart = _differ(steps)
        _check_failures(table[:, _SAMPLES], steps)
        digests = table[:, _DIGEST]
        if not np.all(digests == digests[0]):
            texts = gather_text(self.engine, description)
            lines = "\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(texts))
            raise TensorMismatchError(
                "workers reduced different gradients in the same step; every worker must have the same "
                f"parameters (names, shapes, dtypes) requiring gradients and the same settings:\n{lines}")
        sampler_ranks = table[:, _SAMPLER_RANK].astype(np.int64)
        _check_sampler_modes(sampler_ranks)
        settings = "" if step.position is None else step.position.sampler.to_json()
        _check_samplers(table[:, _SAMPLER].astype(np.int64), lambda: gather_text(self.engine, settings))
        _check_sampler_ranks(sampler_ranks)
        _check_sampler_positions(steps, table[:, _EPOCH].astype(np.int64))
        _check_steps_begun(table[:, _BEGUN])

    def update_lr_scale(self) -> float:
        """Set and return :attr:`lr_scale` for the step just reduced (1 when batch sizes are unknown)."""
        if self.global_batch_size is None:
            self.lr_scale = 1.0
        else:
            if self.base_batch_size is None:
                self.base_batch_size = self.global_batch_size
            self.lr_scale = self.lr_scaling.factor(self.global_batch_size, self.base_batch_size, self.gradient_noise)
        return self.lr_scale

    def state_dict(self) -> dict:
        """What a checkpoint needs: base batch and noise statistics."""
        return {"base_batch_size": self.base_batch_size, "gradient_noise": self.gradient_noise.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.base_batch_size = state["base_batch_size"]
        self.gradient_noise.load_state_dict(state["gradient_noise"])
