"""Worker functions for tests/test_recipes.py: common PyTorch training recipes (mixed precision
with a GradScaler, complex parameters) through both wrappers, checked against PyTorch's own DDP
on the same process group."""

from __future__ import annotations

import copy
import io
import warnings

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import dynamix_byteps.torch as bps


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _batch(step: int, rank: int, size: int = 4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _wrap(wrapper: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(the module to call, the optimizer to step) for ``bps_optimizer`` (also ``bps_optimizer_plain``),
    ``bps_ddp`` or ``torch_ddp``."""
    if wrapper.startswith("bps_optimizer"):
        return model, bps.DistributedOptimizer(optimizer, model.named_parameters())
    if wrapper == "bps_ddp":
        return bps.DistributedDataParallel(model), optimizer
    return torch.nn.parallel.DistributedDataParallel(model), optimizer


def _train_with_grad_scaler(wrapper: str, steps: int, overflow_step: int, zeroed_by: str = "optimizer") -> dict:
    """bfloat16 autocast and a GradScaler with clipping; rank 1's input holds an inf at
    ``overflow_step``. ``bps_optimizer`` follows Horovod's pattern (synchronize, unscale, clip,
    step inside skip_synchronize); the others, ``bps_optimizer_plain`` too, the plain torch loop.
    ``zeroed_by``: whose ``zero_grad()`` clears the gradients, the ``optimizer``'s or the ``model``'s
    (``model_in_place``: ``set_to_none=False``); with the model's, the distributed optimizer also
    declares each batch's size."""
    model = _model()
    net, opt = _wrap(wrapper, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu")
    scales, params = [], []
    for step in range(steps):
        x, y = _batch(step, bps.rank())
        if step == overflow_step and bps.rank() == 1:
            x[0, 0] = float("inf")
        if zeroed_by.startswith("model"):
            model.zero_grad(set_to_none=zeroed_by == "model")
            if wrapper.startswith("bps_optimizer"):
                opt.set_local_batch_size(len(x))
        else:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        if wrapper == "bps_optimizer":
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if wrapper == "bps_optimizer":
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append(_flat(model))
    return {"scales": scales, "params": params}


def grad_scaler_overflow_on_one_worker(wrapper: str, steps: int = 4, overflow_step: int = 2,
                                       zeroed_by: str = "optimizer") -> dict:
    """``wrapper``'s run, and the same run through PyTorch's DDP, as :func:`_train_with_grad_scaler` gives them."""
    return {"mine": _train_with_grad_scaler(wrapper, steps, overflow_step, zeroed_by),
            "torch": _train_with_grad_scaler("torch_ddp", steps, overflow_step, zeroed_by)}


def _train_complex(wrapper: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3, dtype=torch.complex64)
    net, opt = _wrap(wrapper, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(steps):
        x = _batch(step, bps.rank())[0].to(torch.complex64) * (1 + 0.5j)
        opt.zero_grad()
        net(x).abs().square().mean().backward()
        opt.step()
    return torch.cat([torch.view_as_real(p.detach()).reshape(-1) for p in model.parameters()]).tolist()


def complex_parameters(wrapper: str, steps: int = 3) -> dict:
    """Complex64 parameters trained through ``wrapper`` and through PyTorch's DDP."""
    return {"mine": _train_complex(wrapper, steps), "torch": _train_complex("torch_ddp", steps)}


def _scaled_job(state: dict | None = None):
    """A linear model behind ``DistributedOptimizer(lr_scaling="linear")`` with a StepLR and a
    ``DynamicBatchSampler`` of 4 per worker; ``state``: plain torch ``state_dict()``s to resume from,
    loaded after a round trip through ``torch.save``/``torch.load(weights_only=True)``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    sampler = bps.DynamicBatchSampler(128, batch_size=4, seed=1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), lr_scaling="linear")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if state is not None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
    return model, opt, scheduler, sampler


def _train_scaled(job, steps: int, grow_after: int | None = None) -> list[float]:
    """Train ``steps`` steps; the global batch doubles after step ``grow_after``. Returns the
    learning rate each step applied (the scheduler's times the optimizer's scale)."""
    model, opt, scheduler, sampler = job
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(128, 6, generator=g), torch.randint(0, 3, (128,), generator=g)
    applied = []
    for done, indices in zip(range(steps), sampler):
        opt.zero_grad()
        F.cross_entropy(model(x[indices]), y[indices]).backward()
        opt.step()
        applied.append(opt.param_groups[0]["lr"] * opt.lr_scale)
        scheduler.step()
        if done + 1 == grow_after:
            bps.set_batch_sizes([8] * bps.size())
    return applied


def lr_scaling_resumed_from_plain_state_dicts() -> dict:
    """The learning rates of 6 steps in one run, and of the same 6 steps resumed after the 4th
    from plain ``state_dict()``s (the global batch doubled after the 2nd)."""
    whole = _train_scaled(_scaled_job(), 6, grow_after=2)
    model, opt, scheduler, sampler = job = _scaled_job()
    first = _train_scaled(job, 4, grow_after=2)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
             "sampler": sampler.state_dict()}
    return {"whole": whole, "resumed": first + _train_scaled(_scaled_job(state), 2)}


def copies_of_the_ddp_wrapper() -> dict:
    """What copying the DDP wrapper says (``copy.deepcopy``, an EMA's ``AveragedModel``,
    ``torch.save`` of the whole wrapper), and whether the wrapped module's copies work and the
    wrapper still trains after them."""
    model = _model()
    net = bps.DistributedDataParallel(model)
    said = {}
    for how, copy_it in {"deepcopy": lambda: copy.deepcopy(net),
                         "averaged_model": lambda: torch.optim.swa_utils.AveragedModel(net),
                         "torch_save": lambda: torch.save(net, io.BytesIO())}.items():
        try:
            copy_it()
            said[how] = None
        except TypeError as exc:
            said[how] = str(exc)
    ema = torch.optim.swa_utils.AveragedModel(net.module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(0, bps.rank())
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()
    ema.update_parameters(net.module)
    return {"said": said, "ema": _flat(ema.module), "model": _flat(model)}


def compiled_autograd_backward(wrapper: str) -> dict:
    """A backward pass under compiled autograd through ``wrapper`` (what it raises), then two
    eager steps, and the same two steps in one process on both workers' batches."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    model = _model()
    net, opt = _wrap(wrapper, model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(0, bps.rank())
    opt.zero_grad()
    try:
        with compiled_autograd._enable(torch.compile(backend="eager")):
            F.cross_entropy(net(x), y).backward()
        said = None
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    reference = _model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in (1, 2):
        opt.zero_grad()
        F.cross_entropy(net(_batch(step, bps.rank())[0]), _batch(step, bps.rank())[1]).backward()
        opt.step()
        batches = [_batch(step, rank) for rank in range(bps.size())]
        plain.zero_grad()
        F.cross_entropy(reference(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        plain.step()
    return {"said": said, "params": _flat(model), "reference": _flat(reference)}


class _TiedLanguageModel(torch.nn.Module):
    """An embedding whose weight is also the output layer's (weight tying, as GPT-2's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(5, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 5, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embedding(tokens).mean(1))))


def _train_tied(wrapper: str, steps: int) -> list[float]:
    model = _TiedLanguageModel()
    # The tied weight is listed twice, through both modules' parameters(), which torch accepts with a warning.
    params = [*model.embedding.parameters(), *model.hidden.parameters(), *model.head.parameters()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    net, opt = _wrap(wrapper, model, optimizer)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + bps.rank())
        tokens, y = torch.randint(0, 5, (4, 3), generator=g), torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(tokens), y).backward()
        opt.step()
    return _flat(model)


def tied_weight_listed_twice(wrapper: str, steps: int = 3) -> dict:
    """A tied weight listed twice in the optimizer's group, trained through ``wrapper`` and through PyTorch's DDP."""
    return {"mine": _train_tied(wrapper, steps), "torch": _train_tied("torch_ddp", steps)}


class _SharedBlocks(torch.nn.Module):
    """One block applied three times, each under reentrant activation checkpointing (ALBERT's shared
    layers with Hugging Face's gradient_checkpointing_enable(), whose default was use_reentrant=True)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = torch.utils.checkpoint.checkpoint(self._block, h, use_reentrant=True)
        return self.head(h)


def _train_shared_blocks(wrapper: str, steps: int) -> list[float]:
    model = _SharedBlocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrapper == "torch_ddp":
        net, opt = torch.nn.parallel.DistributedDataParallel(model, static_graph=True), optimizer
    else:
        net, opt = _wrap(wrapper, model, optimizer)
    for step in range(steps):
        x, y = _batch(step, bps.rank())
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return _flat(model)


def layer_shared_by_reentrant_checkpoints(wrapper: str, steps: int = 3) -> dict:
    """A layer shared by three reentrant checkpoints, through ``wrapper`` and through PyTorch's DDP
    with ``static_graph=True``."""
    return {"mine": _train_shared_blocks(wrapper, steps), "torch": _train_shared_blocks("torch_ddp", steps)}
