"""Worker functions for tests/test_ddp_sample_counting.py: how ``bps.DistributedDataParallel``
weights each worker without a sampler ("a forward pass counts for the backward passes that go
through its outputs").

Every case runs the same local computation twice per rank: once on the wrapped model, and, for
every rank, on a plain copy in this process, which gives each rank's local gradient G_i and the
weight w_i the rule assigns it. The wrapped gradients must equal Σ w_i G_i / Σ w_i in float64.
"""

from __future__ import annotations

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps.errors import ConfigurationError

SIZES = [2, 7]  # the batch of rank 0 and rank 1
METRIC_BATCH = 100


class Net(torch.nn.Module):
    """Linear, BatchNorm (``norm``), tanh, Linear in float64; the same weights in every instance.
    With ``dict_output`` it returns ``{"logits", "features"}``; ``temperature`` is used only by
    ``forward(x, scaled=True)``. Without buffers, a forward with gradients on one rank only is no collective (the
    buffer broadcast is skipped), so the cases where rank 0 alone runs one use ``norm=False``."""

    def __init__(self, dict_output: bool = False, norm: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.dict_output = dict_output
        self.first = torch.nn.Linear(5, 8)
        self.norm = torch.nn.BatchNorm1d(8) if norm else torch.nn.Identity()
        self.last = torch.nn.Linear(8, 3)
        self.temperature = torch.nn.Parameter(torch.ones(()))
        self.double()

    def forward(self, x, scaled: bool = False):
        features = torch.tanh(self.norm(self.first(x)))
        logits = self.last(features) * self.temperature if scaled else self.last(features)
        return {"logits": logits, "features": features} if self.dict_output else logits


def _batch(rank: int, size: int, salt: int, width: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(size, width, generator=g, dtype=torch.float64), torch.randint(0, 3, (size,), generator=g)


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out, y)


# Each case: (build the models, run one rank's step on them and return that rank's weight w_i).
# ``models`` are wrapped (in the job) or plain (the reference); ``net(m)`` is what forward calls.

def _plain_step(models, rank):
    x, y = _batch(rank, SIZES[rank], 1)
    _loss(models[0](x), y).backward()
    return SIZES[rank]


def _metric(models, rank):
    """Rank 0 evaluates with gradients enabled: a discarded output before the training forward,
    and one kept alive through backward; neither is reached by the backward."""
    net = models[0]
    x, y = _batch(rank, SIZES[rank], 2)
    val, _ = _batch(rank, METRIC_BATCH, 3)
    kept = None
    if rank == 0:
        net(val).sum().item()
    out = net(x)
    if rank == 0:
        kept = net(val)
        kept.argmax(1)
    _loss(out, y).backward()
    del kept
    return SIZES[rank]


def _eval_mode(models, rank):
    """Fine-tuning in eval() mode (BatchNorm on its running statistics)."""
    models[0].eval()
    x, y = _batch(rank, SIZES[rank], 4)
    _loss(models[0](x), y).backward()
    return SIZES[rank]


def _two_backward(models, rank):
    """Two backward passes through one forward (retain_graph): each reduces, each is weighted."""
    x, y = _batch(rank, SIZES[rank], 5)
    out = models[0](x)
    out.square().mean().backward(retain_graph=True)
    _loss(out, y).backward()
    return SIZES[rank]


def _two_forwards(models, rank):
    """Two forwards (batches b_i and 3 + rank) summed into one loss: weighted by both."""
    sizes = [SIZES[rank], 3 + rank]
    (x1, y1), (x2, y2) = _batch(rank, sizes[0], 6), _batch(rank, sizes[1], 7)
    (_loss(models[0](x1), y1) + _loss(models[0](x2), y2)).backward()
    return sum(sizes)


def _no_sync(models, rank, wrapped):
    """A pass inside no_sync(), then the one that reduces: weighted by both batches."""
    sizes = [SIZES[rank], 4 - rank]
    (x1, y1), (x2, y2) = _batch(rank, sizes[0], 8), _batch(rank, sizes[1], 9)
    with models[0].no_sync() if wrapped else torch.enable_grad():
        _loss(models[0](x1), y1).backward()
    _loss(models[0](x2), y2).backward()
    return sum(sizes)


def _dict_output(models, rank):
    x, y = _batch(rank, SIZES[rank], 10)
    out = models[0](x)
    (_loss(out["logits"], y) + 0.1 * out["features"].square().mean()).backward()
    return SIZES[rank]


def _two_models(models, rank):
    """Two wrapped models in one loss (the second takes the first's output)."""
    x, y = _batch(rank, SIZES[rank], 11, width=3)
    _loss(models[1](models[0](x)), y).backward()
    return SIZES[rank]


def _input_gradient(models, rank):
    """Rank 0 takes an input gradient through a separate forward with torch.autograd.grad: it
    computes no parameter gradient, so that forward counts for nothing."""
    x, y = _batch(rank, SIZES[rank], 12)
    if rank == 0:
        probe = x.clone().requires_grad_()
        torch.autograd.grad(models[0](probe).logsumexp(1).sum(), probe)
    _loss(models[0](x), y).backward()
    return SIZES[rank]


def _learnable_loss_weight(models, rank):
    """A parameter used only in the loss (a learnable loss weight, as in uncertainty weighting):
    its gradient is complete before the backward reaches the forward's output."""
    x, y = _batch(rank, SIZES[rank], 14)
    temperature = getattr(models[0], "module", models[0]).temperature
    (_loss(models[0](x), y) * torch.exp(-temperature) + temperature).backward()
    return SIZES[rank]


def _head(width_in: int = 3):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(width_in, 5), torch.nn.Tanh()).double()


CASES = {
    "plain": (lambda: [Net()], _plain_step),
    "metric_forward_on_rank_0": (lambda: [Net(norm=False)], _metric),
    "eval_mode": (lambda: [Net()], _eval_mode),
    "two_backward_one_forward": (lambda: [Net()], _two_backward),
    "two_forwards_one_loss": (lambda: [Net()], _two_forwards),
    "no_sync": (lambda: [Net()], _no_sync),
    "dict_output": (lambda: [Net(dict_output=True)], _dict_output),
    "two_models_one_loss": (lambda: [_head(), Net()], _two_models),
    "input_gradient_on_rank_0": (lambda: [Net(norm=False)], _input_gradient),
    "learnable_loss_weight": (lambda: [Net()], _learnable_loss_weight),
}


def _run(step, models, rank, wrapped):
    if step is _no_sync:
        return step(models, rank, wrapped)
    return step(models, rank)


def _grads(models) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for m in models for p in m.parameters() if p.grad is not None])


def _expected(build, step) -> torch.Tensor:
    """Σ w_i G_i / Σ w_i over the ranks, in float64, from plain copies of the models."""
    total, weights = None, 0
    for rank in range(len(SIZES)):
        models = build()
        w = _run(step, models, rank, wrapped=False)
        total = w * _grads(models) if total is None else total + w * _grads(models)
        weights += w
    return total / weights


def weighting(names: list[str], steps: int = 2) -> dict[str, float]:
    """For each case in ``names``: the largest relative error of the wrapped gradients over
    ``steps`` steps (the first builds the bucket plan, the next reduce during backward)."""
    rank, errors = bps.rank(), {}
    for name in names:
        build, step = CASES[name]
        expected = _expected(build, step)
        models = build()
        wrapped = [bps.DistributedDataParallel(m) for m in models]
        worst = 0.0
        for _ in range(steps):
            for m in models:
                m.train()
                m.zero_grad(set_to_none=True)
            _run(step, wrapped, rank, wrapped=True)
            worst = max(worst, float((_grads(models) - expected).norm() / expected.norm()))
        errors[name] = worst
    return errors


def parameter_used_only_in_the_loss() -> dict:
    """``temperature`` scales only the second of two forwards summed into one loss
    (``"later_forward"``): its gradient is complete once the backward reached that forward's
    output only, so the step's weight missed the other. Or it scales the loss outside the
    module's forward while the output of another forward with gradients is kept
    (``"kept_output"``): the weight, taken before any output was reached, counted that one too.
    Every rank must raise after the reduction; the wrapper then trains on exactly."""
    rank = bps.rank()
    model = Net(norm=False)
    net = bps.DistributedDataParallel(model)
    x, y = _batch(rank, SIZES[rank], 13)
    messages = {}
    for case in ("later_forward", "kept_output"):
        model.zero_grad(set_to_none=True)
        try:
            if case == "later_forward":
                (_loss(net(x), y) + _loss(net(x, scaled=True), y)).backward()
            else:
                kept = net(x)  # noqa: F841 - an output no backward goes through, alive during it
                (_loss(net(x), y) * model.temperature).backward()
            messages[case] = "no error"
        except ConfigurationError as exc:
            messages[case] = str(exc)
    model.zero_grad(set_to_none=True)
    _loss(net(x), y).backward()
    got = _grads([model])
    expected = _expected(lambda: [Net(norm=False)], lambda models, r: _plain_step_on(models, r, 13))
    return {"messages": messages, "error_after": float((got - expected).norm() / expected.norm())}


def _plain_step_on(models, rank, salt):
    x, y = _batch(rank, SIZES[rank], salt)
    _loss(models[0](x), y).backward()
    return SIZES[rank]


def all_cases(names: list[str]) -> dict:
    """One job for the tests: :func:`weighting` of ``names``, then
    :func:`parameter_used_only_in_the_loss`."""
    return {"errors": weighting(names), "late": parameter_used_only_in_the_loss()}
