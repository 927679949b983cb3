"""Worker functions for tests/test_overlap.py: gradients reduced during backward.

Each compares against a single process training on the concatenated global batches in
float64, so every rank checks the exact answer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
import torch.utils.checkpoint

import dynamix_byteps.torch as bps
from dynamix_byteps import timing
from dynamix_byteps.errors import ConfigurationError, TensorMismatchError


class Branchy(torch.nn.Module):
    """Three layers used every pass, one never used (its bucket gets no gradient), one used
    only when ``use_extra`` is true. With ``reentrant`` the layers after ``first`` run under
    reentrant activation checkpointing (their gradients come from a backward nested in another)."""

    def __init__(self, width: int = 8, reentrant: bool = False):
        super().__init__()
        self.reentrant = reentrant
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, width)
        self.middle = torch.nn.Linear(width, width)
        self.extra = torch.nn.Linear(width, width)
        self.last = torch.nn.Linear(width, 3)
        self.unused = torch.nn.Linear(3, 3)
        self.double()

    def forward(self, x, use_extra: bool = False):
        h = torch.tanh(self.first(x))
        if self.reentrant:
            return torch.utils.checkpoint.checkpoint(self._tail, h, use_extra, use_reentrant=True)
        return self._tail(h, use_extra)

    def _tail(self, h, use_extra):
        h = torch.tanh(self.middle(h))
        if use_extra:
            h = torch.tanh(self.extra(h))
        return self.last(h)


def _data(total: int, steps: int, passes: int):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(total, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (total,), generator=g))
             for _ in range(passes)] for _ in range(steps)]


def _reference(data):
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first_grads = None
    for step in data:
        opt.zero_grad()
        for x, y in step:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return model, first_grads


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def exact_weighting(variant: str, sizes: list[int], steps: int) -> dict:
    """Train ``steps`` steps with per-worker batches ``sizes`` through ``variant``:

    ``optimizer`` (set_local_batch_size before backward), ``optimizer_accumulate`` (2 passes per
    step), ``ddp``, ``ddp_no_sync`` (first of 2
    passes inside no_sync); a ``_reentrant`` suffix runs the model's tail under reentrant
    activation checkpointing. Buckets of one parameter each, so several leave during backward.
    """
    os.environ["DYNAMIX_FUSION_BYTES"] = "64"
    rank = bps.rank()
    variant, reentrant = variant.removesuffix("_reentrant"), variant.endswith("_reentrant")
    passes = 2 if variant in ("optimizer_accumulate", "ddp_no_sync") else 1
    data = _data(sum(sizes), steps, passes)
    reference, ref_grads = _reference(data)
    start, b = sum(sizes[:rank]), sizes[rank]
    model = Branchy(reentrant=reentrant)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if variant.startswith("ddp"):
        net, opt = bps.DistributedDataParallel(model), plain
    else:
        net, opt = model, bps.DistributedOptimizer(plain, model.named_parameters(), backward_passes_per_step=passes)
    grad_error, overlapped = None, 0
    for step in data:
        opt.zero_grad()
        timing.ring().drain()
        for index, (x, y) in enumerate(step):
            if variant in ("optimizer", "optimizer_accumulate"):
                opt.set_local_batch_size(b)
            if variant == "ddp_no_sync" and index == 0:
                with net.no_sync():
                    torch.nn.functional.cross_entropy(net(x[start:start + b]), y[start:start + b]).backward()
            else:
                torch.nn.functional.cross_entropy(net(x[start:start + b]), y[start:start + b]).backward()
        backward_end = timing.now_ns()
        if variant.startswith("optimizer"):
            opt.synchronize()
        if grad_error is None:
            grad_error = max(_error(p.grad, ref_grads[n]) for n, p in model.named_parameters() if n in ref_grads)
        if variant.startswith("optimizer"):
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        events = timing.ring().drain()
        names = timing.names()
        overlapped = sum(1 for i, s in zip(events["name_id"], events["start_ns"])
                         if names[i].startswith("Gradient.bucket.") and s < backward_end)
    param_error = max(_error(p, r) for p, r in zip(model.parameters(), reference.parameters()))
    return {"grad_error": grad_error, "param_error": param_error, "overlapped": overlapped,
            "unused_grad_none": model.unused.weight.grad is None}


def unused_on_some_ranks(variant: str) -> dict:
    """``extra`` is used on rank 0 only and ``unused`` nowhere: every rank must finish the step
    with the same gradients, ``extra``'s being rank 0's local gradient weighted by b_0 / Σb, and
    ``unused`` without one (None, as in one process, so momentum and weight decay leave it alone)."""
    os.environ["DYNAMIX_FUSION_BYTES"] = "64"
    rank, sizes = bps.rank(), [5, 7]
    model = Branchy()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    net = bps.DistributedDataParallel(model) if variant == "ddp" else model
    opt = plain if variant == "ddp" else bps.DistributedOptimizer(plain, model.named_parameters())
    x, y = _data(sum(sizes), 1, 1)[0][0]
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    local = Branchy()
    torch.nn.functional.cross_entropy(local(x[:sizes[0]], use_extra=True), y[:sizes[0]]).backward()
    expected_extra = local.extra.weight.grad * sizes[0] / sum(sizes)
    opt.zero_grad()
    if variant != "ddp":
        opt.set_local_batch_size(sizes[rank])
    torch.nn.functional.cross_entropy(net(x[mine], use_extra=rank == 0), y[mine]).backward()
    if variant != "ddp":
        opt.synchronize()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    total = bps.push_pull(grads, average=False, name="check")
    return {"same_on_every_rank": bool(torch.allclose(total, grads * bps.size(), rtol=1e-12, atol=1e-15)),
            "extra_error": _error(model.extra.weight.grad, expected_extra),
            "unused_none": model.unused.weight.grad is None and model.unused.bias.grad is None}


def different_model(variant: str) -> str:
    """Rank 1 has a wider model: every rank must raise TensorMismatchError, none hang."""
    model = Branchy(width=8 if bps.rank() == 0 else 9)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        if variant == "ddp":
            net = bps.DistributedDataParallel(model)
            torch.nn.functional.cross_entropy(net(torch.randn(4, 6, dtype=torch.float64)), torch.zeros(4, dtype=torch.long)).backward()
        else:
            opt = bps.DistributedOptimizer(plain, model.named_parameters())
            torch.nn.functional.cross_entropy(model(torch.randn(4, 6, dtype=torch.float64)), torch.zeros(4, dtype=torch.long)).backward()
            opt.step()
    except TensorMismatchError as exc:
        return str(exc)
    return "no error"


def different_passes_per_step() -> str:
    """Rank 0 accumulates two backward passes per step, rank 1 one: every rank must raise
    TensorMismatchError at the first step instead of weighting the sums wrongly."""
    model = Branchy(width=8)
    passes = 2 if bps.rank() == 0 else 1
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   backward_passes_per_step=passes)
    try:
        for _ in range(passes):
            torch.nn.functional.cross_entropy(model(torch.randn(4, 6, dtype=torch.float64)),
                                              torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
    except TensorMismatchError as exc:
        return str(exc)
    return "no error"


def out_of_step_samplers(variant: str) -> str:
    """Rank 0's sampler resumes three steps ahead of the others' (a checkpoint loaded on rank 0
    only): every rank must raise TensorMismatchError at the first step instead of training."""
    data = torch.randn(48, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    state = None
    if bps.rank() == 0:
        ahead = bps.DynamicBatchSampler(48, 4, seed=1)
        for _, _ in zip(range(3), ahead):
            pass
        state = ahead.state_dict()
    sampler = bps.DynamicBatchSampler(48, 4, seed=1)
    if state is not None:
        sampler.load_state_dict(state)
    model = Branchy(width=8)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    net = bps.DistributedDataParallel(model) if variant == "ddp" else model
    opt = plain if variant == "ddp" else bps.DistributedOptimizer(plain, model.named_parameters())
    try:
        for indices in sampler:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(data[indices]), torch.zeros(len(indices), dtype=torch.long)).backward()
            opt.step()
    except TensorMismatchError as exc:
        return str(exc)
    return "no error"


def frozen_mid_training(variant: str, where: str) -> dict:
    """Two steps, then ``middle`` is frozen on rank 1 only (``where="one"``: every rank must raise
    TensorMismatchError, none abort or hang) or on every rank (``"all"``: the next steps match
    one process that froze it at the same step, where the frozen and the unused parameters get no
    gradient and so no momentum or weight-decay update)."""
    os.environ["DYNAMIX_FUSION_BYTES"] = "64"
    rank, sizes, steps = bps.rank(), [5, 7], 4
    data = _data(sum(sizes), steps, 1)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    reference = Branchy()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    model = Branchy()
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    net = bps.DistributedDataParallel(model) if variant == "ddp" else model
    opt = plain if variant == "ddp" else bps.DistributedOptimizer(plain, model.named_parameters())
    for step, ((x, y),) in enumerate(data):
        if step == 2 and (where == "all" or rank == 1):
            model.middle.weight.requires_grad_(False)
        if step == 2:
            reference.middle.weight.requires_grad_(False)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        if variant != "ddp":
            opt.set_local_batch_size(sizes[rank])
        try:
            torch.nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
            opt.step()
        except TensorMismatchError as exc:
            return {"step": step, "error": str(exc)}
    return {"step": None, "param_error": max(_error(p, r) for p, r in zip(model.parameters(), reference.parameters()))}


def both_wrappers(first: str) -> dict:
    """``bps.DistributedDataParallel`` and ``bps.DistributedOptimizer`` over one model, ``first``
    built first: the second must raise; a second optimizer of the same kind replaces the first."""
    model = Branchy()

    def optimizer():
        return bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())

    build = {"optimizer": optimizer, "ddp": lambda: bps.DistributedDataParallel(model)}
    kept = build[first]()
    try:
        build["ddp" if first == "optimizer" else "optimizer"]()
        mixed = "no error"
    except ConfigurationError as exc:
        mixed = str(exc)
    again = build[first]()
    return {"mixed": mixed, "same_kind_again": type(again).__name__, "first": type(kept).__name__}


def declared_late(late_step: int) -> str:
    """Rank 1 declares its batch size after backward at step ``late_step`` (0: the first step,
    reduced whole at the end of backward; 1: launched during it), rank 0 before, as it should:
    both raise, from backward, at that step."""
    model = Branchy()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    for step in range(2):
        opt.zero_grad()
        late = step == late_step and bps.rank() == 1
        try:
            if not late:
                opt.set_local_batch_size(4)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if late:
                opt.set_local_batch_size(4)
            opt.step()
        except ConfigurationError as exc:
            return f"step {step}: {exc}"
    return "no error"


def declared_after_reduction() -> str:
    """Every rank declares after backward, which reduced with no declared size: the declaration
    raises instead of weighting the next step."""
    model = Branchy()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    torch.nn.functional.cross_entropy(model(torch.randn(4, 6, dtype=torch.float64)),
                                      torch.zeros(4, dtype=torch.long)).backward()
    try:
        opt.set_local_batch_size(4)
    except ConfigurationError as exc:
        return str(exc)
    return "no error"


def found_by_a_tester() -> dict:
    """Cases a tester broke: an evaluation under no_grad on rank 0 only through the DDP wrapper
    (buffers of BatchNorm were broadcast on every forward: a hang), a worker with an empty batch
    under the wrapper (taken for an undeclared size), and fp16 compression with a large declared
    batch on the first step (scaled by b_i, not b_i / Σb: inf)."""
    rank, out = bps.rank(), {}
    torch.manual_seed(0)
    net = bps.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).double())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(8, 6, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        if rank == 0:
            with torch.no_grad():
                net.eval()
                net(x)
                net.train()
    out["evaluated"] = True

    model = Branchy()
    net = bps.DistributedDataParallel(model)
    x, y = _data(5, 1, 1)[0][0]
    mine = slice(0, 0) if rank == 0 else slice(0, 5)
    loss = torch.nn.functional.cross_entropy(net(x[mine]), y[mine], reduction="sum") / max(len(y[mine]), 1)
    loss.backward()
    reference = Branchy()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    out["empty_batch_error"] = max(_error(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters())
                                   if r.grad is not None)

    model = Branchy()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=bps.Compression.fp16)
    opt.set_local_batch_size(1_000_000)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    out["fp16_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    return out


def scheduler_after_load() -> dict:
    """A StepLR built before wrapping keeps halving the learning rate after load_state_dict, and
    warns of nothing: its optimizer's step is the wrapper's."""
    model = Branchy()
    base = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = bps.DistributedOptimizer(base, model.named_parameters())
    x, y = _data(4, 1, 1)[0][0]
    rates = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:
                opt.load_state_dict(opt.state_dict())
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            scheduler.step()
            rates.append(opt.param_groups[0]["lr"])
    return {"rates": rates, "warnings": [str(w.message) for w in caught]}


def _worker_batches(total: int = 10, first: int = 3):
    """The global batch and this rank's part of it (rank 0: ``first`` samples, rank 1: the rest)."""
    x, y = _data(total, 1, 1)[0][0]
    mine = slice(0, first) if bps.rank() == 0 else slice(first, total)
    return x, y, mine, [slice(0, first), slice(first, total)]


def _weighted_reference(x, y, parts, change=lambda g: g) -> dict[str, torch.Tensor]:
    """Σ_i b_i · change(g_i) / Σ_i b_i over the workers' parts, g_i each one's mean gradient."""
    total = {}
    for part in parts:
        model = Branchy()
        torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                total[name] = total.get(name, 0) + change(p.grad) * (part.stop - part.start) / len(y)
    return total


def _grad_error(model, expected: dict[str, torch.Tensor]) -> float:
    return max(_error(p.grad, expected[name]) for name, p in model.named_parameters() if name in expected)


def gradients_changed_during_reduction(variant: str) -> dict:
    """From the second step on, buckets leave during backward. A user's gradient hook registered
    after wrapping must see the local gradient (as with PyTorch's DDP); once backward returns the
    gradients hold the reduced mean, so what the script does to them before step() (clipping,
    replacing, writing through .data, as GradScaler.unscale_ does) meets the mean on every worker;
    Horovod's recipe (synchronize, clip, step inside skip_synchronize) stays exact."""
    x, y, mine, parts = _worker_batches()
    model, out = Branchy(), {}
    if variant == "ddp":
        net = bps.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    else:
        net = model
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters())
    def backward():
        if variant != "ddp":
            opt.set_local_batch_size(mine.stop - mine.start)
        torch.nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()

    def clamp(param):
        param.grad.clamp_(-0.01, 0.01)

    handles = [p.register_post_accumulate_grad_hook(clamp) for p in model.parameters()]
    clamped = _weighted_reference(x, y, parts, lambda g: g.clamp(-0.01, 0.01))
    errors = []
    for _ in range(3):
        opt.zero_grad()
        backward()
        opt.step()
        errors.append(_grad_error(model, clamped))
    out["hook_errors"] = errors
    for handle in handles:
        handle.remove()
    if variant == "ddp":
        return out

    plain = _weighted_reference(x, y, parts)
    mean_norm = float(torch.stack([g.norm() for g in plain.values()]).norm())
    opt.zero_grad()
    backward()
    out["norm_after_backward_error"] = abs(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)) - mean_norm)
    opt.step()
    opt.zero_grad()
    backward()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.data.mul_(2)  # unseen by autograd's version counter, as GradScaler.unscale_'s kernel
    out["doubled_error"] = _grad_error(model, {name: 2 * g for name, g in plain.items()})
    opt.step()
    opt.zero_grad()  # the recipe: reduce, clip the mean, step without reducing again
    backward()
    opt.synchronize()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    with opt.skip_synchronize():
        opt.step()
    out["recipe_error"] = _grad_error(model, plain)
    out["recipe_norm_error"] = abs(norm - float(torch.stack([g.norm() for g in plain.values()]).norm()))

    opt.zero_grad()  # a gradient made by hand is reduced when set before backward
    model.unused.bias.grad = torch.full((3,), float(bps.rank() + 1), dtype=torch.float64)
    backward()
    opt.step()
    out["hand_made"] = model.unused.bias.grad.tolist()
    return out


def hook_writes_a_launched_bucket() -> str:
    """On rank 0 a hook on the first layer's weight (accumulated last) doubles the last layer's
    bias gradient, whose one-parameter bucket left earlier in the same backward: rank 0 raises
    from backward."""
    os.environ["DYNAMIX_FUSION_BYTES"] = "64"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    said = "no error"
    for step in range(2):  # the first step has no plan yet: its buckets leave at the end of backward
        opt.zero_grad()
        opt.set_local_batch_size(4)
        if step == 1 and bps.rank() == 0:
            def double_last_bias(_):
                model[2].bias.grad.mul_(2)

            model[0].weight.register_post_accumulate_grad_hook(double_last_bias)
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        except bps.GradientReductionError as exc:
            said = str(exc)
    return said


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises once when armed: an out-of-memory in the middle of backward."""

    armed = False

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("out of memory (simulated)")
        return grad


def backward_that_raises(variant: str) -> dict:
    """A backward pass raising half-way (after the reduction began) on every worker: the DDP
    wrapper refuses to go on (as PyTorch's DDP does); the optimizer refuses until zero_grad()
    drops the incomplete round, then is exact again."""
    x, y, mine, parts = _worker_batches()
    model, out = Branchy(), {}
    model.middle.register_forward_hook(lambda module, args, output: _FailOnce.apply(output))
    net = bps.DistributedDataParallel(model) if variant == "ddp" else model
    opt = (torch.optim.SGD(model.parameters(), lr=0.0) if variant == "ddp" else
           bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters()))

    def train_step():
        if variant != "ddp":
            opt.set_local_batch_size(mine.stop - mine.start)
        torch.nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
        opt.step()

    train_step()
    opt.zero_grad()
    _FailOnce.armed = True
    try:
        train_step()
    except RuntimeError as exc:
        out["first"] = str(exc)
    try:  # again without zero_grad(): the incomplete round is still there
        train_step()
        out["retry"] = "no error"
    except bps.GradientReductionError as exc:
        out["retry"] = str(exc)
    if variant == "ddp":
        return out
    opt.zero_grad()
    train_step()
    out["after_zero_grad_error"] = _grad_error(model, _weighted_reference(x, y, parts))
    return out



def backward_raising_on_one_worker(variant: str) -> dict:
    """Rank 1's backward pass raises half-way (after some buckets left) at step 1, and each worker's
    loop catches what it raised and goes on with zero_grad(), as a loop skipping a bad batch does.
    ``optimizer``; ``accumulate``: in the first of 2 passes per step; ``first_step``: at step 0,
    before the plan exists; ``ddp``; ``ddp_no_sync``: in the first of 2 passes per step, inside
    ``no_sync()``; ``ddp_no_sync_buffers``: the same with a module buffer, which the wrapper
    broadcasts in each forward; ``ddp_no_sync_buffers_forwards_first``: the same, both forward passes
    run before the first backward; ``hook_first``, ``ddp_hook_first``: raised instead by the
    user's post-accumulate hook on the first parameter to get its gradient (before any bucket
    left); ``tensor_hook_first``, ``ddp_tensor_hook_first``: by the user's tensor hook there
    (``register_hook``, registered before wrapping: it runs before the gradient is accumulated);
    ``model_zero_grad``, ``model_zero_grad_in_place``: the loop zeroes the gradients with
    ``model.zero_grad()`` (``set_to_none=False``: in place), which the optimizer does not see,
    and declares the batch size after. Learning rate 0, so every step's exact mean is the same.
    Returns each step's error on this rank (type, message) and each completed step's gradient error."""
    os.environ["DYNAMIX_FUSION_BYTES"] = "64"  # a bucket per parameter: several leave before the failure
    x, y, mine, parts = _worker_batches()
    expected = _weighted_reference(x, y, parts)
    model = Branchy()
    in_hook = variant.endswith("hook_first")
    if in_hook:
        for param in model.last.parameters():  # the first to get its gradient: whichever runs first raises
            if variant.endswith("tensor_hook_first"):  # runs before the gradient accumulator and its pre-hooks
                param.register_hook(_raise_once_when_armed)
            else:
                param.register_post_accumulate_grad_hook(_raise_once_when_armed)
    else:
        model.middle.register_forward_hook(lambda module, args, output: _FailOnce.apply(output))
    if variant.startswith("ddp_no_sync_buffers"):
        model.register_buffer("seen", torch.zeros(2, dtype=torch.float64))
    passes = 2 if variant == "accumulate" or variant.startswith("ddp_no_sync") else 1
    forwards_first = variant.endswith("forwards_first")
    net = bps.DistributedDataParallel(model) if variant.startswith("ddp") else model
    opt = (torch.optim.SGD(model.parameters(), lr=0.0) if variant.startswith("ddp") else
           bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                    backward_passes_per_step=passes))
    failing_step = 0 if variant == "first_step" else 1
    zero_grad = (functools.partial(model.zero_grad, set_to_none=variant == "model_zero_grad")
                 if variant.startswith("model_zero_grad") else opt.zero_grad)
    out = {"errors": {}, "grad_errors": {}}
    for step in range(4):
        try:
            zero_grad()
            outputs = [net(x[mine]) for _ in range(passes)] if forwards_first else []
            for number in range(passes):
                armed = step == failing_step and number == 0 and bps.rank() == 1
                _FailOnce.armed, _raise_once_when_armed.armed = armed and not in_hook, armed and in_hook
                if not variant.startswith("ddp"):
                    opt.set_local_batch_size(mine.stop - mine.start)
                no_sync = number < passes - 1 and variant.startswith("ddp_no_sync")
                with net.no_sync() if no_sync else contextlib.nullcontext():
                    output = outputs[number] if forwards_first else net(x[mine])
                    (torch.nn.functional.cross_entropy(output, y[mine]) / passes).backward()
            out["grad_errors"][step] = _grad_error(model, expected)
            opt.step()
        except RuntimeError as exc:
            out["errors"][step] = [type(exc).__name__, str(exc)]
    return out


def _gan(mine: slice, distributed: bool, fails_at: int | None) -> tuple[dict, torch.Tensor]:
    """A GAN trained 4 steps on samples ``mine`` of each step's 10: a generator and a discriminator,
    each behind its own optimizer (a DistributedOptimizer when ``distributed``), a discriminator step
    then a generator step. The generator's backward pass goes through the discriminator first
    (filling its gradients too) and raises in the discriminator's first layer at step ``fails_at``;
    the loop catches what it raised and goes on. Returns each step's error (type, message) and the
    parameters at the end (generator's, then discriminator's)."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6)).double()
    critic = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    critic[0].register_forward_hook(lambda module, args, output: _FailOnce.apply(output))
    opt_g, opt_d = (torch.optim.SGD(net.parameters(), lr=0.1) for net in (generator, critic))
    if distributed:
        opt_g, opt_d = (bps.DistributedOptimizer(opt, net.named_parameters())
                        for opt, net in ((opt_g, generator), (opt_d, critic)))
    loss = torch.nn.functional.binary_cross_entropy_with_logits
    errors = {}
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        real = torch.randn(10, 6, generator=g, dtype=torch.float64)[mine]
        noise = torch.randn(10, 4, generator=g, dtype=torch.float64)[mine]
        ones, zeros = torch.ones(len(real), 1, dtype=torch.float64), torch.zeros(len(real), 1, dtype=torch.float64)
        try:
            opt_d.zero_grad()
            fake = generator(noise)
            (loss(critic(real), ones) + loss(critic(fake.detach()), zeros)).backward()
            opt_d.step()
            opt_g.zero_grad()
            _FailOnce.armed = step == fails_at
            loss(critic(fake), ones).backward()
            opt_g.step()
        except RuntimeError as exc:
            errors[step] = [type(exc).__name__, str(exc)]
    return errors, torch.cat([p.detach().reshape(-1) for net in (generator, critic) for p in net.parameters()])


def gan_with_two_optimizers(fails: bool) -> dict:
    """:func:`_gan` on 5 samples of each step per worker, rank 1's generator backward raising at
    step 1 when ``fails``, against one process on all 10 (its generator backward raising there too).
    Returns this worker's errors and the parameters' greatest difference from the one process's."""
    fails_at = 1 if fails else None
    errors, trained = _gan(slice(5 * bps.rank(), 5 * bps.rank() + 5), True, fails_at if bps.rank() == 1 else None)
    _, expected = _gan(slice(0, 10), False, fails_at)
    return {"errors": errors, "param_error": _error(trained, expected)}


def backward_raising_before_the_last_pass_with_a_sampler() -> dict:
    """A DynamicBatchSampler feeds 2 backward passes per step; rank 1's first pass of step 1 raises
    and its loop goes on with the next step, so it never draws that step's second batch. Returns
    each step's error on this rank (type, message)."""
    x, y = _data(64, 1, 1)[0][0]
    model = Branchy()
    model.middle.register_forward_hook(lambda module, args, output: _FailOnce.apply(output))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                   backward_passes_per_step=2)
    batches = iter(bps.DynamicBatchSampler(64, [3, 5], seed=1))
    errors = {}
    for step in range(3):
        try:
            opt.zero_grad()
            for number in range(2):
                indices = next(batches)
                _FailOnce.armed = step == 1 and number == 0 and bps.rank() == 1
                (torch.nn.functional.cross_entropy(model(x[indices]), y[indices]) / 2).backward()
            opt.step()
        except RuntimeError as exc:
            errors[step] = [type(exc).__name__, str(exc)]
    return errors


def _raise_once_when_armed(tensor: torch.Tensor) -> None:
    """A user's post-accumulate-grad hook (or tensor hook) that raises once when armed."""
    if _raise_once_when_armed.armed:
        _raise_once_when_armed.armed = False
        raise RuntimeError("error in a gradient hook (simulated)")


_raise_once_when_armed.armed = False


def step_skipped_on_one_worker(variant: str) -> dict:
    """Rank 1 skips step 1 (no sampler feeds the workers): an exception its loop catches before it goes
    on with the next batch. ``forward``: raised in forward, ``zero_grad()`` begins each step;
    ``forward_zero_grad_last``: raised in forward, ``zero_grad()`` ends each step and the except
    clause calls it; ``backward``: raised in backward before any parameter got its gradient.
    Each worker stops at its first other error. Returns the step that raised and the error (type, message)."""
    x, y, mine, _ = _worker_batches()
    model = Branchy()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    zero_grad_first = variant != "forward_zero_grad_last"
    for step in range(4):
        skips = step == 1 and bps.rank() == 1
        try:
            if zero_grad_first:
                opt.zero_grad()
            if skips and variant.startswith("forward"):
                raise _SkippedBatch("bad batch (simulated)")
            _FailOnce.armed = skips
            torch.nn.functional.cross_entropy(_FailOnce.apply(model(x[mine])), y[mine]).backward()
            opt.step()
            if not zero_grad_first:
                opt.zero_grad()
        except (_SkippedBatch, RuntimeError) as exc:
            if not skips:
                return {"step": step, "error": [type(exc).__name__, str(exc)]}
            if not zero_grad_first:
                opt.zero_grad()
    return {"step": None, "error": None}


class _SkippedBatch(Exception):
    """What a loop skips a batch for."""


def sparse_gradient_after_the_first_step() -> str:
    """An embedding with sparse gradients first used on the second step is refused by name."""
    emb, lin = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)
    named = [("emb." + n, p) for n, p in emb.named_parameters()] + [("lin." + n, p) for n, p in lin.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named)
    try:
        for step in range(3):
            opt.zero_grad()
            h = emb(torch.tensor([1, 2])) if step else torch.ones(2, 4)
            lin(h).sum().backward()
            opt.step()
    except TypeError as exc:
        return f"step {step}: {exc}"
    return "no error"


def create_graph_backward() -> dict:
    """backward(create_graph=True) (second-order optimizers) reduces exactly, with a warning."""
    import warnings

    x, y, mine, parts = _worker_batches()
    model = Branchy()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters())
    expected = _weighted_reference(x, y, parts)
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            opt.set_local_batch_size(mine.stop - mine.start)
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward(create_graph=True)
            opt.step()
            errors.append(_grad_error(model, expected))
    return {"errors": errors, "warnings": [str(w.message) for w in caught if "carry no autograd graph" in str(w.message)]}


def parameter_inside_and_outside_a_reentrant_checkpoint(first_double_use: int = 0) -> str | list[float]:
    """A layer used before a reentrant checkpoint and inside it gets two gradients in one backward,
    from step ``first_double_use`` on (only the one inside before it). Used so from the first step,
    which the reducer learns from, it trains: each step's largest difference from one process's
    gradient on both workers' inputs. From a later step (reduced during backward) it is refused by
    name, not summed twice scaled: what that step raised."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4).double()
    reference = torch.nn.Linear(4, 4).double()
    reference.load_state_dict(layer.state_dict())
    opt = bps.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0), layer.named_parameters())
    inputs = [torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
              for r in range(bps.size())]

    def loss(model, x, double):
        h = model(x) if double else x.clone().requires_grad_(True)  # a reentrant checkpoint needs an input with grad
        return torch.utils.checkpoint.checkpoint(lambda t: model(torch.tanh(t)), h, use_reentrant=True).sum()

    differences = []
    try:
        for step in range(3):
            double = step >= first_double_use
            opt.zero_grad()
            loss(layer, inputs[bps.rank()], double).backward()
            got = [p.grad.clone() for p in layer.parameters()]
            opt.step()
            reference.zero_grad()
            (sum(loss(reference, x, double) for x in inputs) / bps.size()).backward()
            differences.append(max(float((a - p.grad).abs().max()) for a, p in zip(got, reference.parameters())))
    except bps.GradientReductionError as exc:
        return f"step {step}: {exc}"
    return differences


class _ChannelsLastConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.head = torch.nn.Linear(4, 3)
        self.double()
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def channels_last_gradients_kept_between_steps(variant: str) -> dict:
    """A channels_last conv whose gradients are zeroed in place (``zero_grad(set_to_none=False)``):
    every gradient keeps its parameter's strides, autograd warns of nothing, and each is the
    batch-weighted mean (rank 0: 3 samples, rank 1: 7)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 2, 5, 5, generator=g, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 3, (10,), generator=g)
    parts = [slice(0, 3), slice(3, 10)]
    mine = parts[bps.rank()]
    expected = {}
    for part in parts:
        reference = _ChannelsLastConv()
        torch.nn.functional.cross_entropy(reference(x[part]), y[part]).backward()
        for name, p in reference.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad * (part.stop - part.start) / len(y)
    model = _ChannelsLastConv()
    if variant == "ddp":
        net, opt = bps.DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.0)
    else:
        net = model
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters())
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            if variant != "ddp":
                opt.set_local_batch_size(mine.stop - mine.start)
            torch.nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
            opt.step()
            errors.append(_grad_error(model, expected))
    return {"errors": errors, "warnings": [str(w.message) for w in caught],
            "strides_kept": all(p.grad.stride() == p.stride() for p in model.parameters())}


def ddp_global_batch_changes(later_sizes: list[int]) -> list[str]:
    """bps.DistributedDataParallel trained from a sampler of 4 samples per worker whose assignment
    changes to ``later_sizes`` at step 2; returns the warnings about the learning rate."""
    from dynamix_byteps.assignment import Assignment

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, dtype=torch.float64), torch.randint(0, 3, (64,)))
    sampler = bps.DynamicBatchSampler(data, batch_size=4, seed=3)
    sampler.schedule.apply(Assignment(tuple(later_sizes), 2, 1))
    net = bps.DistributedDataParallel(Branchy())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in zip(range(4), torch.utils.data.DataLoader(data, batch_sampler=sampler)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return [str(w.message) for w in caught if "learning rate" in str(w.message)]
