"""Functions run inside real worker processes by ``multiworker.run_workers``.

Each returns JSON-serialisable data; the test in the parent asserts on it. References are
computed inside the worker from the same seeds, so every rank checks against the exact
single-process answer.
"""

from __future__ import annotations

import hashlib

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps.errors import ConfigurationError, TensorMismatchError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
SHAPES = [(17,), (5, 7), (3, 4, 6)]


def _value(rank: int, shape, dtype, round_: int = 0) -> torch.Tensor:
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    return ((base % 11) * (rank + 1) + 3 * round_ + rank).to(dtype)


def push_pull_matrix() -> list[str]:
    """Sum and average, in place, async and out-of-place, for every dtype and shape."""
    n, rank, failures = bps.size(), bps.rank(), []
    for dname, dtype in DTYPES.items():
        for shape in SHAPES:
            expected = sum(_value(r, shape, torch.int64) for r in range(n))
            avg = expected.to(dtype) / n if dtype.is_floating_point else torch.div(expected, n, rounding_mode="trunc")
            mine = _value(rank, shape, dtype)
            tag = f"{dname}{list(shape)}"
            out = bps.push_pull(mine, average=False, name=f"sum.{tag}")
            if not torch.equal(out, expected.to(dtype)) or not torch.equal(mine, _value(rank, shape, dtype)):
                failures.append(f"push_pull sum {tag}")
            inplace = mine.clone()
            bps.push_pull_inplace(inplace, average=True, name=f"avg.{tag}")
            if not torch.allclose(inplace.double(), avg.to(dtype).double(), rtol=1e-6):
                failures.append(f"push_pull_inplace average {tag}")
            handle = bps.push_pull_async_inplace(mine.clone(), average=False, name=f"async.{tag}")
            while not bps.poll(handle):
                pass
            if not torch.equal(bps.synchronize(handle), expected.to(dtype)):
                failures.append(f"push_pull_async_inplace sum {tag}")
    return failures


def back_to_back(rounds: int) -> list[str]:
    """``rounds`` push_pulls of one named tensor with no gap, blocking and all in flight at once."""
    n, rank, failures = bps.size(), bps.rank(), []
    shape = (1000,)
    expect = lambda i: sum(_value(r, shape, torch.float32, i) for r in range(n))  # noqa: E731
    for i in range(rounds):
        out = bps.push_pull_inplace(_value(rank, shape, torch.float32, i), average=False, name="x")
        if not torch.equal(out, expect(i)):
            failures.append(f"blocking round {i}")
    tensors = [_value(rank, shape, torch.float32, i) for i in range(rounds)]
    handles = [bps.push_pull_async_inplace(t, average=False, name="x") for t in tensors]
    for i, handle in enumerate(handles):
        if not torch.equal(bps.synchronize(handle), expect(i)):
            failures.append(f"in-flight round {i}")
    return failures


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _batches(batch_sizes, steps, passes):
    """Per step and pass, the concatenated global batch; worker i owns slice i of it."""
    g = torch.Generator().manual_seed(1)
    total = sum(batch_sizes)
    return [[(torch.randn(total, 6, generator=g, dtype=torch.float64),
              torch.randint(0, 3, (total,), generator=g)) for _ in range(passes)] for _ in range(steps)]


def _own(batch, batch_sizes, rank):
    start = sum(batch_sizes[:rank])
    x, y = batch
    return x[start:start + batch_sizes[rank]], y[start:start + batch_sizes[rank]]


def weighted_training(batch_sizes: list[int], steps: int, passes: int) -> dict:
    """Distributed SGD with per-worker batches vs. single-process SGD on the concatenated batches.

    Returns the largest relative gradient error after the first synchronize and the largest
    relative parameter error after ``steps`` steps.
    """
    rank, loss_fn = bps.rank(), torch.nn.CrossEntropyLoss()
    data = _batches(batch_sizes, steps, passes)

    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_grads = None
    for step in data:
        ref_opt.zero_grad()
        for batch in step:
            loss_fn(reference(batch[0]), batch[1]).backward()
        if ref_grads is None:
            ref_grads = [p.grad.clone() for p in reference.parameters()]
        ref_opt.step()

    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    grad_error = None
    for step in data:
        opt.zero_grad()
        for batch in step:
            x, y = _own(batch, batch_sizes, rank)
            opt.set_local_batch_size(len(x))
            loss_fn(model(x), y).backward()
        if grad_error is None:
            opt.synchronize()
            grad_error = max(float((p.grad - r).norm() / r.norm()) for p, r in zip(model.parameters(), ref_grads))
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    param_error = max(float((p - r).norm() / r.norm()) for p, r in zip(model.parameters(), reference.parameters()))
    return {"grad_error": grad_error, "param_error": param_error}


class _BatchMeanGain(torch.nn.Module):
    """A learned gain on the batch's mean input, added to a linear layer's output: its gradient is
    the batch mean, NaN for an empty batch (as TensorFlow's BatchNormalization's gamma)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3).double()
        self.gain = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))

    def forward(self, x):
        return self.linear(x) + (self.gain * x.mean(0)).sum()


def worker_without_samples() -> float:
    """Rank 0 declares 0 samples and has an empty batch, whose gradient of the gain is NaN; the
    other workers have equal batches. The error of the reduced gradients against the mean of each
    batch's gradients in one process."""
    rank, per_worker = bps.rank(), 4
    torch.manual_seed(1)
    samples = per_worker * (bps.size() - 1)
    x_all, y_all = torch.randn(samples, 6, dtype=torch.float64), torch.randn(samples, 3, dtype=torch.float64)
    batches = list(zip(x_all.split(per_worker), y_all.split(per_worker)))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return _BatchMeanGain()

    reference, per_batch = model(), []
    for x, y in batches:
        reference.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        per_batch.append(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))
    expected = torch.stack(per_batch).mean(0)
    net = model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    x, y = (x_all[:0], y_all[:0]) if rank == 0 else batches[rank - 1]
    opt.set_local_batch_size(len(x))
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.synchronize()
    got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    return float((got - expected).norm() / expected.norm())


def too_many_passes() -> str:
    model = _model()
    _opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x = torch.randn(4, 6, dtype=torch.float64)
    model(x).sum().backward()
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def batch_size_on_some_ranks() -> None:
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    if bps.rank() == 0:
        opt.set_local_batch_size(4)
    model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    opt.step()


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def broadcasts() -> dict:
    """Rank-dependent model and optimizer state, then the three broadcasts from rank 1."""
    rank = bps.rank()
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (rank + 1))
    model(torch.randn(8, 5)).sum().backward()
    opt.step()
    before = _digest(model.state_dict().values())
    bps.broadcast_parameters(model.state_dict(), root_rank=1)
    bps.broadcast_optimizer_state(opt, root_rank=1)
    obj = bps.broadcast_object({"rank": rank, "tensor": torch.arange(3) * rank, "text": "é" * rank}, root_rank=1)
    state = opt.state_dict()
    return {
        "before": before,
        "params": _digest(model.state_dict().values()),
        "opt": _digest([t for s in state["state"].values() for t in s.values()]),
        "lr": state["param_groups"][0]["lr"],
        "obj": [obj["rank"], obj["tensor"].tolist(), obj["text"]],
    }


def mismatches() -> dict:
    """Name, shape and dtype mismatches must raise on every rank; the job must go on afterwards."""
    rank, errors = bps.rank(), {}
    cases = {
        "name": lambda: bps.push_pull(torch.ones(4), name=f"t{rank}"),
        "shape": lambda: bps.push_pull(torch.ones(4 + rank), name="t"),
        "dtype": lambda: bps.push_pull(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32), name="t"),
        "root": lambda: bps.broadcast_parameters({"w": torch.ones(3)}, root_rank=rank % 2),
    }
    for case, call in cases.items():
        try:
            call()
            errors[case] = None
        except TensorMismatchError as exc:
            errors[case] = str(exc)
    errors["after"] = bps.push_pull(torch.ones(2), average=False, name="after").tolist()
    return errors


def fp16_compression() -> list[float]:
    t = torch.full((8,), 0.5 * (bps.rank() + 1))
    return bps.push_pull(t, average=True, name="c", compression=bps.Compression.fp16).tolist()


def _index_dataset(size: int):
    """Sample i is (features derived from i, label i % 3, i) so batches reveal their indices."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(size, 6, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.arange(size) % 3, torch.arange(size))


def _sgd_job(sampler_sizes, dataset_size, lr_scaling="none", seed=0):
    dataset = _index_dataset(dataset_size)
    sampler = bps.DynamicBatchSampler(dataset, sampler_sizes, seed=seed)
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                   lr_scaling=lr_scaling)
    return dataset, sampler, model, opt


def switch_at_step(change_step: int, steps: int) -> dict:
    """Batch sizes change at ``change_step`` by a collective set_batch_sizes issued up front."""
    dataset, sampler, model, opt = _sgd_job([4, 6, 8], 500, lr_scaling="linear")
    bps.set_batch_sizes([8, 8, 8], at_step=change_step)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    local, global_, scale = [], [], []
    for step, (x, y, _) in zip(range(steps), loader):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        local.append(len(y))
        global_.append(opt.global_batch_size)
        scale.append(opt.lr_scale)
    return {"local": local, "global": global_, "lr_scale": scale,
            "noise_scale": bps.gradient_noise_scale(), "stats": bps.gradient_statistics()}


def two_plans(steps: int) -> dict:
    """Two models in one process, each fed by its own sampler and stepped by an optimizer handed
    that sampler's batch plan, interleaved step by step; each plan changes its sizes on its own."""
    dataset = _index_dataset(400)
    jobs = []
    for seed, sizes in enumerate(([3, 5], [7, 2])):
        sampler = bps.DynamicBatchSampler(dataset, sizes, seed=seed)
        model = _model()
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                       batch_plan=sampler.batch_plan)
        jobs.append((opt, model, iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler)), sampler))
    jobs[0][3].batch_plan.set_batch_sizes([6, 6], at_step=4)  # the first plan, through the plan
    bps.set_batch_sizes([2, 2], at_step=6)  # the module function: the default plan, the newest sampler's
    result = {"local": [[], []], "global": [[], []], "next_step": [[], []]}
    for _ in range(steps):
        for k, (opt, model, batches, _) in enumerate(jobs):
            x, y, _ = next(batches)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            result["local"][k].append(len(y))
            result["global"][k].append(opt.global_batch_size)
            result["next_step"][k].append(opt.next_step)
    stats = bps.step_statistics()
    result["default_monitor"] = {"steps": stats.steps, "samples": stats.samples}
    result["separate_noise"] = jobs[0][0].gradient_noise is not jobs[1][0].gradient_noise
    return result


def rejected_assignment() -> dict:
    dataset, sampler, model, opt = _sgd_job([4, 4, 4], 100)
    before = sampler.schedule.latest.batch_sizes
    try:
        bps.set_batch_sizes([4, 0, 4], at_step=3)
        error = None
    except ConfigurationError as exc:
        error = type(exc).__name__
    try:  # only rank 2 asks for a different step: every rank must refuse, none may hang
        bps.set_batch_sizes([5, 5, 5], at_step=3 if bps.rank() != 2 else 4)
        mismatch = None
    except TensorMismatchError:
        mismatch = "TensorMismatchError"
    return {"error": error, "mismatch": mismatch, "kept": list(sampler.schedule.latest.batch_sizes) == list(before)}


def train_then_checkpoint(path: str, steps: int) -> list[int]:
    """4 workers with a prefetching DataLoader train ``steps`` steps, then checkpoint."""
    dataset, sampler, model, opt = _sgd_job([5, 6, 7, 8], 203, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=1, prefetch_factor=2)
    trained = []
    for step, (x, y, index) in zip(range(steps), loader):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        trained += index.tolist()
    bps.save_checkpoint(path, model=model, optimizer=opt, sampler=sampler, note="mid-epoch")
    return trained


def resume_and_finish_epoch(path: str) -> dict:
    dataset, sampler, model, opt = _sgd_job([1] * bps.size(), 203, seed=3)
    extra = bps.load_checkpoint(path, model=model, optimizer=opt, sampler=sampler)
    first_step_sizes = list(sampler.schedule.at(sampler._position.step).batch_sizes)
    trained = []
    for x, y, index in torch.utils.data.DataLoader(dataset, batch_sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        trained += index.tolist()
    return {"trained": trained, "extra": extra, "sizes": first_step_sizes}


def optimizer_patterns() -> dict:
    """Patterns a tester found broken: unfreezing after wrapping, closures, GAN-style zero_grad; and a
    parameter group added after wrapping."""
    rank, out = bps.rank(), {}
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model[0].weight.requires_grad_(True)
    x = torch.full((2, 6), float(rank + 1), dtype=torch.float64)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    out["unfrozen"] = _digest([model[0].weight])

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss
    out["closure_loss"] = float(opt.step(closure))
    out["after_closure"] = _digest(model.parameters())

    for _ in range(3):  # a generator's backward also fills the discriminator's gradients
        model(x).sum().backward()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    out["gan_loop"] = _digest(model.parameters())

    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt.add_param_group({"params": [extra]})  # after steps were reduced: from its first step on
    opt.zero_grad()
    (model(x).sum() + (extra * (rank + 1)).sum()).backward()
    opt.step()
    out["added_group"] = _digest([extra])
    return out


def thread_safety_and_types() -> dict:
    import threading

    rank, results, errors = bps.rank(), [], []

    def worker(tag):
        for i in range(15):
            try:
                results.append(bps.push_pull(torch.full((3 + i,), float(rank + 1)), average=False, name=f"{tag}{i}")
                               .tolist())
            except TensorMismatchError:
                errors.append(tag)
    threads = [threading.Thread(target=worker, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = float(sum(r + 1 for r in range(bps.size())))
    types = {}
    for label, value in {"int16": torch.ones(2, dtype=torch.int16), "bool": torch.ones(2, dtype=torch.bool),
                         "list": [1.0, 2.0]}.items():
        try:
            bps.push_pull(value)
            types[label] = None
        except TypeError as exc:
            types[label] = str(exc)
    try:
        bps.broadcast_object(threading.Lock() if rank == 0 else None, root_rank=0)
        unpicklable = None
    except Exception as exc:
        unpicklable = type(exc).__name__
    return {"all_correct": all(all(v == expected for v in r) for r in results), "done": len(results) + len(errors),
            "types": types, "unpicklable": unpicklable,
            "after": bps.push_pull(torch.ones(1), average=False, name="after").tolist()}


def fusion_mismatch() -> None:
    import os

    if bps.rank() == 0:
        os.environ["DYNAMIX_FUSION_BYTES"] = "100"
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    opt.step()


def warmup_after_wrapping() -> dict:
    """A gradual warm-up (LinearLR) built on the wrapped optimizer, as the torch example does: each
    step's update is the averaged gradient times the warmed-up rate. The gradient is the same at
    every step (a linear loss), so the updates stand in the ratio of the rates."""
    weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = bps.DistributedOptimizer(torch.optim.SGD([weight], lr=0.4), [("weight", weight)])
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    updates = []
    for _ in range(4):
        before = weight.detach().clone()
        opt.zero_grad()
        (weight * float(bps.rank() + 1)).sum().backward()
        opt.step()
        warmup.step()
        updates.append((before - weight.detach()).tolist())
    return {"updates": updates}


def second_break_test() -> dict:
    """Found by a tester: LR scheduler built before wrapping, a new optimizer for the same model,
    and leaving an epoch early with a prefetching loader."""
    rank, out = bps.rank(), {}
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = bps.DistributedOptimizer(base, model.named_parameters())
    x = torch.full((2, 6), float(rank + 1), dtype=torch.float64)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    scheduler.step()
    out["scheduler_first"] = _digest(model.parameters())
    out["lr_after_scheduler"] = opt.param_groups[0]["lr"]

    opt2 = bps.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters())
    for _ in range(2):
        opt2.zero_grad()
        model(x).sum().backward()
        opt2.step()
    out["second_optimizer"] = _digest(model.parameters())

    dataset, sampler, model3, opt3 = _sgd_job([4, 4], 64)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=1, prefetch_factor=2)
    seen = []
    for step, (x, y, index) in enumerate(loader):
        opt3.zero_grad()
        torch.nn.functional.cross_entropy(model3(x), y).backward()
        opt3.step()
        seen += index.tolist()
        if step == 1:
            break
    for x, y, index in loader:
        opt3.zero_grad()
        torch.nn.functional.cross_entropy(model3(x), y).backward()
        opt3.step()
        seen += index.tolist()
    out["epoch_indices"] = sorted(seen)
    return out


def converted_after_wrapping(frontend: str, grads_during_conversion: bool, conversion: str = "double") -> dict:
    """A float32 model converted after wrapping, at step 2 of 4: ``conversion`` "double" (``model.double()``),
    "there and back" (``model.double(); model.float()``: the dtypes end as before) or "first layer there and
    back" (its gradients come last in backward, after buckets were launched), in ``frontend`` ("ddp": the module wrapper, "optimizer": DistributedOptimizer), against the same
    training in one process on every rank's batch. ``grads_during_conversion``: the step's gradients
    (the buckets' views) are still set when it converts, so ``Module._apply`` converts them too.

    Returns the largest parameter difference from the reference and a digest of the parameters."""
    rank, size = bps.rank(), bps.size()

    def batch(r: int, step: int):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)

    def train(distributed: bool) -> list[torch.Tensor]:
        model = _model().float()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        net = model
        if distributed and frontend == "ddp":
            net = bps.DistributedDataParallel(model)
        elif distributed:
            opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        def convert():
            converted = model[0] if conversion.startswith("first layer") else model
            converted.double()
            if conversion != "double":
                converted.float()

        for step in range(4):
            if step == 2 and grads_during_conversion:
                convert()
            opt.zero_grad()
            if step == 2 and not grads_during_conversion:
                convert()
            dtype = next(model.parameters()).dtype
            for r in [rank] if distributed else range(size):
                x, y = batch(r, step)
                loss = torch.nn.functional.cross_entropy(net(x.to(dtype)), y)
                (loss if distributed else loss / size).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    got, reference = train(True), train(False)
    return {"error": max(float((p - r).abs().max()) for p, r in zip(got, reference)), "digest": _digest(got)}
