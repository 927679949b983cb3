"""``DistributedOptimizer``: batch-weighted gradient aggregation behind any torch optimizer.

Workers may train on different local batch sizes b_i. The average over workers that BytePS and
Horovod compute, (1/n) Σ g_i, then over-weights the samples of small batches. This optimizer
produces the gradient of the mean loss over the global batch instead:

    g = Σ_i b_i · g_i / Σ_i b_i          (DESIGN.md "Aggregation"; research/anchors.md §0.4)

where g_i is worker i's gradient of its own mean loss. Each worker scales its gradient by
b_i / Σ b before one sum all-reduce, so every worker ends with g, exactly once per step. With
equal batches (or when no batch size is given) the weights are 1/n: BytePS's average.

b_i comes from ``set_local_batch_size`` or, when a ``DynamicBatchSampler`` feeds the model,
from the sizes of the batches it drew. Per step the workers exchange one small message (b_i,
the local squared gradient norm |g_i|², and a digest of the gradient names, shapes and
dtypes, so a mismatch raises instead of corrupting), then gradients are fused into one buffer
per dtype (up to ``DYNAMIX_FUSION_BYTES``, default 64 MiB) and reduced. The norms feed the
gradient noise scale (:mod:`dynamix_byteps.data.gradient_noise`) at no extra communication,
and the learning rate follows the global batch by the chosen rule
(:mod:`dynamix_byteps.data.lr_scaling`), applied for the step only, so LR schedulers keep
working on the base rate.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections import defaultdict

import numpy as np
import torch

from dynamix_byteps import batching
from dynamix_byteps import engine as _engine
from dynamix_byteps.control.worker import StepMonitor
from dynamix_byteps.data.gradient_noise import GradientNoiseScale
from dynamix_byteps.data.lr_scaling import get_rule, optimizer_family_of
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.negotiation import describe, fingerprint, negotiate, round_lock
from dynamix_byteps.torch.compression import Compression, Compressor

DEFAULT_FUSION_BYTES = 64 << 20
MAX_SAMPLES = 2**31
_UNSET = -1
# Parameter attribute holding its backward-pass counting hook: a new DistributedOptimizer over
# the same model removes the old one's, which would otherwise count (and refuse) the new passes.
_PASS_HOOK_ATTR = "_dynamix_pass_hook"


def _squared_norm(tensor: torch.Tensor) -> float:
    """|t|², accumulated in float64 (one reduction, not a float64 copy and its square)."""
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64)) ** 2


def _not_count(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1


def _fusion_bytes() -> int:
    raw = os.environ.get("DYNAMIX_FUSION_BYTES", str(DEFAULT_FUSION_BYTES))
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"DYNAMIX_FUSION_BYTES={raw!r} is not an integer number of bytes") from None
    if value < 1:
        raise ConfigurationError(f"DYNAMIX_FUSION_BYTES={value} must be >= 1")
    return value


def batch_weights(local_batch_sizes: np.ndarray) -> np.ndarray:
    """Weights w_i = b_i / Σ b for the batch-weighted mean of per-worker mean gradients.

    Args:
        local_batch_sizes: int array of shape ``(size,)``; -1 marks a worker that gave none.

    Returns:
        float64 array of shape ``(size,)`` summing to 1; uniform 1/n when no worker gave a size.

    Raises:
        ConfigurationError: some workers gave a size and others did not, or all sizes are 0.
    """
    sizes = np.asarray(local_batch_sizes, dtype=np.int64)
    unset = sizes == _UNSET
    if unset.all():
        return np.full(len(sizes), 1.0 / len(sizes))
    if unset.any():
        raise ConfigurationError(
            f"ranks {np.flatnonzero(~unset).tolist()} called set_local_batch_size() for this step but "
            f"ranks {np.flatnonzero(unset).tolist()} did not; call it on every worker or on none"
        )
    total = int(sizes.sum())
    if total == 0:
        raise ConfigurationError("every worker reported a local batch size of 0 for this step; nothing to average")
    return sizes / total


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    def _init_distributed(self, named_parameters, compression, backward_passes_per_step, lr_scaling, base_batch_size):
        if _not_count(backward_passes_per_step):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if base_batch_size is not None and _not_count(base_batch_size):
            raise ValueError(f"base_batch_size must be an integer >= 1, got {base_batch_size!r}")
        self.backward_passes_per_step = int(backward_passes_per_step)
        if lr_scaling is None:
            lr_scaling = os.environ.get("DYNAMIX_LR_SCALING") or "none"
        self.lr_scaling = get_rule(lr_scaling, optimizer_family_of(self))
        self.base_batch_size = None if base_batch_size is None else int(base_batch_size)
        self.gradient_noise = GradientNoiseScale()
        self.global_batch_size: int | None = None
        self.lr_scale = 1.0
        self.next_step: int | None = None
        self._step_samples: int | None = None
        engine = _engine.current()
        self._monitor = StepMonitor(engine, engine.env, optimizer_family_of(self))
        batching.register_noise(self.gradient_noise)
        self._compression = compression
        self._names = self._name_parameters(named_parameters)
        self._fusion_bytes = _fusion_bytes()
        self._descriptions: dict[tuple, str] = {}
        self._passes: dict[torch.Tensor, int] = {}
        self._hooks: dict[torch.Tensor, object] = {}
        self._samples = _UNSET
        self._synchronized = False
        self._skip_sync = False
        self._gradient_params()  # registers the backward-pass counting hooks

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
        """Parameters to reduce this step: every one in ``param_groups`` that requires grad now
        (so parameters unfrozen or groups added after wrapping are reduced too)."""
        named = []
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad:
                    named.append((self._names.get(p, f"Gradient.group{g}.{i}"), p))
                    if p not in self._hooks:
                        previous = getattr(p, _PASS_HOOK_ATTR, None)
                        if previous is not None:  # an earlier DistributedOptimizer of this model
                            previous.remove()
                        self._hooks[p] = p.register_post_accumulate_grad_hook(self._count_pass)
                        setattr(p, _PASS_HOOK_ATTR, self._hooks[p])
        return named

    def _step_description(self, named) -> str:
        key = tuple((name, tuple(p.shape), p.dtype) for name, p in named)
        if key not in self._descriptions:
            digest = fingerprint(describe(name, p) for name, p in named)
            self._descriptions[key] = (
                f"DistributedOptimizer step over {len(named)} gradients (digest {digest:016x}), "
                f"compression={self._compression.name}, backward_passes_per_step={self.backward_passes_per_step}, "
                f"fusion_bytes={self._fusion_bytes}"
            )
        return self._descriptions[key]

    def _count_pass(self, param: torch.Tensor) -> None:
        self._passes[param] = self._passes.get(param, 0) + 1
        if self._passes[param] > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradients were computed {self._passes[param]} times before step(), more than "
                f"backward_passes_per_step={self.backward_passes_per_step}; call step() (or zero_grad()) after every "
                f"{self.backward_passes_per_step} backward passes or raise backward_passes_per_step"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; also starts a new count of backward passes
        (a GAN's generator backward may fill the discriminator's gradients, then zero them)."""
        self._passes.clear()
        self._synchronized = False
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_local_batch_size(self, samples: int) -> None:
        """Declare how many samples this worker's last backward pass used (call once per pass).

        Not needed when a ``DynamicBatchSampler`` feeds the model: its batch sizes are used.
        Over ``backward_passes_per_step`` passes the counts add up. The step's weight is this
        worker's total over the global total; pass sizes within one step are assumed equal on
        a worker, since the accumulated gradient is a sum of per-pass mean gradients.

        Raises:
            ValueError: ``samples`` is not an integer >= 0.
        """
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or not 0 <= samples < MAX_SAMPLES:
            raise ValueError(f"set_local_batch_size needs an integer number of samples in [0, {MAX_SAMPLES}), got {samples!r}")
        self._samples = int(samples) + max(self._samples, 0)

    def synchronize(self) -> None:
        """Replace every gradient with the batch-weighted global mean (blocking).

        Parameters without a gradient on this worker contribute zeros, so all workers reduce
        the same buffers. Called by :meth:`step`; call it yourself to clip gradients first,
        then step inside :meth:`skip_synchronize`.

        Raises:
            TensorMismatchError: workers have different parameters or settings.
            ConfigurationError: batch sizes were declared on some workers only, or sum to 0.
            TypeError: a gradient is sparse (e.g. ``nn.Embedding(sparse=True)``).
        """
        engine = _engine.current()
        named = self._gradient_params()
        sparse = [name for name, p in named if p.grad is not None and p.grad.layout != torch.strided]
        if sparse:
            raise TypeError(f"sparse gradients are not supported ({', '.join(sparse)}); use dense ones, "
                            "e.g. nn.Embedding(..., sparse=False)")
        self._monitor.before_aggregation()
        samples = self._take_samples()
        self._step_samples = None if samples == _UNSET else samples
        with round_lock, torch.no_grad():
            for p in (p for _, p in named if p.grad is None):
                p.grad = torch.zeros_like(p)
            local_sq = sum(_squared_norm(p.grad) for _, p in named)
            table = negotiate(engine, "DistributedOptimizer step", self._step_description(named),
                              samples, int(np.float64(local_sq).view(np.int64)))
            sizes, local_sq_norms = table[:, 0], np.ascontiguousarray(table[:, 1]).view(np.float64)
            weight = float(batch_weights(sizes)[engine.rank])
            global_sq = 0.0
            in_flight = [self._start_bucket(engine, i, bucket, weight)
                         for i, bucket in enumerate(self._buckets([p for _, p in named]))]
            for work, wire, ctx, bucket in in_flight:
                work.wait()
                flat = self._compression.decompress(wire, ctx)
                global_sq += _squared_norm(flat)
                offset = 0
                for p in bucket:
                    n = p.grad.numel()
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                    offset += n
        known = bool((sizes != _UNSET).all())
        self.global_batch_size = int(sizes.sum()) if known else None
        if known:
            self.gradient_noise.update(local_sq_norms, sizes, global_sq)
        self._passes.clear()
        self._synchronized = True

    def _take_samples(self) -> int:
        """This step's local sample count: declared, else the sampler's draws, else unset."""
        drawn = [batching.take_draw() for _ in range(self.backward_passes_per_step)]
        drawn = [d for d in drawn if d is not None]
        if drawn:
            self.next_step = drawn[-1][0] + 1
        if self._samples != _UNSET:
            return self._samples
        return sum(samples for _, samples in drawn) if drawn else _UNSET

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = defaultdict(lambda: [[]])
        filled: dict[torch.dtype, int] = defaultdict(int)
        for p in params:
            nbytes = p.grad.numel() * p.grad.element_size()
            buckets = by_dtype[p.grad.dtype]
            if buckets[-1] and filled[p.grad.dtype] + nbytes > self._fusion_bytes:
                buckets.append([])
                filled[p.grad.dtype] = 0
            buckets[-1].append(p)
            filled[p.grad.dtype] += nbytes
        return [bucket for buckets in by_dtype.values() for bucket in buckets]

    def _start_bucket(self, engine, index, bucket, weight):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        flat.mul_(weight)
        wire, ctx = self._compression.compress(flat)
        return engine.all_reduce_async(wire, f"Gradient.fused.{index}"), wire, ctx, bucket

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block :meth:`step` does not reduce gradients (use after :meth:`synchronize`)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        """Reduce gradients (unless already done this step) and apply the wrapped optimizer's
        update with each group's learning rate multiplied by :attr:`lr_scale` for this step.

        A ``closure`` is evaluated once, before the gradients are reduced; its loss is returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not (self._synchronized or self._skip_sync):
            self.synchronize()
        self.lr_scale = self._lr_factor()
        base_lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * self.lr_scale
        try:
            super(self.__class__, self).step()
        finally:
            for group, lr in zip(self.param_groups, base_lrs):
                group["lr"] = lr
        self._synchronized = False
        self._samples = _UNSET
        self._monitor.after_step(self._step_samples, self.gradient_noise, self.lr_scale, self.next_step)
        return loss

    def _lr_factor(self) -> float:
        if self.global_batch_size is None:
            return 1.0
        if self.base_batch_size is None:
            self.base_batch_size = self.global_batch_size
        return self.lr_scaling.factor(self.global_batch_size, self.base_batch_size, self.gradient_noise)

    def dynamix_state_dict(self) -> dict:
        """What a checkpoint needs beyond ``state_dict()``: base batch, noise statistics, step."""
        return {"base_batch_size": self.base_batch_size, "gradient_noise": self.gradient_noise.state_dict(),
                "next_step": self.next_step}

    def load_dynamix_state_dict(self, state: dict) -> None:
        self.base_batch_size = state["base_batch_size"]
        self.gradient_noise.load_state_dict(state["gradient_noise"])
        self.next_step = state["next_step"]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, lr_scaling: str | None = None,
                         base_batch_size: int | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that :meth:`step` first averages gradients over all workers,
    weighted by each worker's local batch size (``optimizer.set_local_batch_size(n)``).

    The result is an instance of a subclass of ``optimizer``'s class, with its state and
    hyper-parameters, so LR schedulers and ``isinstance`` checks keep working.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
        named_parameters: ``model.named_parameters()``; names appear in errors and timing.
        compression: ``Compression.none`` or ``Compression.fp16`` (applied after weighting).
        backward_passes_per_step: backward passes accumulated locally before each reduction.
        lr_scaling: how the learning rate follows the global batch B: ``none``, ``linear``
            (B/B0), ``sqrt`` (√(B/B0)) or ``adascale`` (AdaScale gain; AdamScale for Adam/AdamW);
            default: ``bpslaunch --lr-scaling`` through ``DYNAMIX_LR_SCALING``, else ``none``.
        base_batch_size: B0, the global batch the base learning rate was tuned for; default:
            the global batch of the first step.

    With ``torch.amp.GradScaler``, reduce before unscaling, so every worker sees the same
    overflow and skips the same steps: ``optimizer.synchronize(); scaler.unscale_(optimizer);
    with optimizer.skip_synchronize(): scaler.step(optimizer)``.

    Raises:
        ValueError: duplicate or missing parameter names, ``backward_passes_per_step`` not an
            integer >= 1, an unknown ``lr_scaling`` rule, a ``base_batch_size`` below 1, or an
            optimizer that re-evaluates its closure (``LBFGS``).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS re-evaluates its closure several times per step, which cannot be "
                         "aggregated across workers; use a first-order optimizer")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    # An LR scheduler built on ``optimizer`` patched its instance ``step``; that copy would bypass
    # the aggregation. The scheduler keeps working: it edits the shared ``param_groups``.
    wrapped.__dict__.pop("step", None)
    wrapped._init_distributed(named_parameters, compression, backward_passes_per_step, lr_scaling, base_batch_size)
    return wrapped
