"""PyTorch functions run inside real worker processes by ``multiworker.run_workers`` for
tests/test_parity.py: the BytePS call forms the broadcasts accept, the methods of what
``DistributedOptimizer`` returns, and BytePS's DDP call on a CPU model."""

from __future__ import annotations

import hashlib

import torch
from test_parity import TORCH_OPTIMIZER_METHODS, methods_problems

import dynamix_byteps.torch as bps


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def _scramble(model: torch.nn.Module, seed: int) -> None:
    """Give every floating-point tensor of the model (parameters and buffers) new values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))


def _digests(model: torch.nn.Module) -> dict:
    return {"parameters": _digest(model.parameters()), "buffers": _digest(model.buffers())}


def broadcast_forms() -> dict:
    """Each form of ``params`` BytePS documents, from root 1, on freshly scrambled values; then the
    optimizer state with BytePS's positional ``prefix``; then the arguments that must be refused."""
    rank = bps.rank()
    model = _model()
    forms = {
        "parameters": lambda: model.parameters(),
        "parameter list": lambda: list(model.parameters()),
        "named_parameters": lambda: model.named_parameters(),
        "state_dict": lambda: model.state_dict(),
        "mixed list": lambda: [(name, t) if i % 2 else t for i, (name, t) in enumerate(model.named_parameters())],
    }
    result = {"forms": {}}
    for number, (form, params) in enumerate(forms.items()):
        _scramble(model, 100 * number + rank)
        before = _digests(model)
        bps.broadcast_parameters(params(), root_rank=1)
        result["forms"][form] = {"before": before, "after": _digests(model)}

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    model(torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    bps.broadcast_optimizer_state(optimizer, 1, "Optimizer.")
    state = optimizer.state_dict()
    result["lr"] = state["param_groups"][0]["lr"]
    result["momentum"] = _digest(s["momentum_buffer"] for s in state["state"].values())

    errors = {}
    for case, params in {"tensor": torch.ones(3), "names": ["a", "b"], "number": 3}.items():
        try:
            bps.broadcast_parameters(params, root_rank=0)
            errors[case] = None
        except TypeError as exc:
            errors[case] = str(exc)
    result["errors"] = errors
    return result


def torch_checks() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    return {**broadcast_forms(), "optimizer_methods": methods_problems(type(optimizer), TORCH_OPTIMIZER_METHODS, bps)}


def ddp_with_device_ids_on_cpu() -> dict:
    """BytePS's ``benchmark_byteps_ddp.py --no-cuda``: a CPU model wrapped with
    ``device_ids=[local_rank()]`` (and PyTorch DDP's usual keywords), then one training step."""
    model = torch.nn.Linear(4, 2)
    ddp = bps.parallel.DistributedDataParallel(model, device_ids=[bps.local_rank()], output_device=bps.local_rank(),
                                               find_unused_parameters=True, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(8, 4, generator=torch.Generator().manual_seed(bps.rank()))).sum().backward()
    optimizer.step()
    return {"devices": sorted({str(p.device) for p in model.parameters()}), "device_ids": ddp.device_ids,
            "parameters": _digest(model.parameters())}


def horovod_optimizer_step() -> dict:
    """Horovod's ``DistributedOptimizer(..., op=Average, gradient_predivide_factor=4.0)``: this
    rank's own gradient of one batch and the gradient after the optimizer's reduction."""
    model = torch.nn.Linear(3, 2)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(bps.rank()))
    model(x).square().sum().backward()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()
    model.zero_grad()
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), op=bps.Average,
                                         gradient_predivide_factor=4.0)
    model(x).square().sum().backward()
    optimizer.synchronize()
    return {"local": local, "reduced": torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()}
