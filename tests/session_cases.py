"""Functions run inside real worker processes by ``multiworker.run_workers``: what a session
(``bps.init()`` to ``bps.shutdown()``) leaves behind, in the engine and at module level."""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import threading

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps import timing

# The module-level state the step path may change: the running engine, which owns the session's
# timing and handles, and the default batch plan (issue 21).
ALLOWED = {("dynamix_byteps.engine", "_current"), ("dynamix_byteps.batch_plan", "_default")}
_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def fresh_session_after_shutdown() -> dict:
    """Leave a push_pull handle and timing events in a first session, shut down, init again and
    report what the second session sees of the first."""
    stale = bps.push_pull_async(torch.ones(3), name="first.session.tensor")  # never synchronized
    while not bps.poll(stale):  # seen complete: timed
        pass
    bps.synchronize(bps.push_pull_async(torch.ones(2)))  # an auto-named one
    first_names = timing.names()
    bps.shutdown()
    bps.init()
    names_at_start = timing.names()
    events_at_start = int(timing.ring().size)
    pending = [bps.push_pull_async(torch.ones(1), name=f"second.session.{i}") for i in range(3)]  # handles in use
    try:
        bps.poll(stale)
        stale_handle = "visible"
    except ValueError as error:
        stale_handle = str(error)
    for handle in pending:
        bps.synchronize(handle)
    bps.synchronize(bps.push_pull_async(torch.ones(2)))
    return {"first_names": first_names, "stale_handle": stale_handle, "names_at_start": names_at_start,
            "events_at_start": events_at_start, "second_names": timing.names()}


def _fingerprint(value, depth: int = 0):
    """What a value holds, down to ``depth`` 4: equal fingerprints before and after a step mean the
    binding was not replaced and its contents were not changed. Locks and loggers count as constant."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, _LOCKS + (logging.Logger,)):
        return type(value).__name__
    if isinstance(value, itertools.count):
        return repr(value)  # count(n): the next number it hands out
    key = (type(value).__name__, id(value))
    if depth >= 4:
        return key
    if isinstance(value, (tuple, list, frozenset, set)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return key, tuple(_fingerprint(v, depth + 1) for v in items)
    if isinstance(value, dict):
        return key, tuple((repr(k), _fingerprint(v, depth + 1)) for k, v in value.items())
    if hasattr(value, "__dict__") and not inspect.isroutine(value):  # an object: its attributes
        return key, tuple((k, _fingerprint(v, depth + 1)) for k, v in vars(value).items())
    return key


def _module_state() -> dict:
    """Fingerprint of every module-level binding of every loaded dynamix_byteps module, bar
    modules, classes, functions and :data:`ALLOWED`."""
    state = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "dynamix_byteps" or module_name.startswith("dynamix_byteps.")):
            continue
        namespace = vars(module)
        for name, value in list(namespace.items()):
            if (name.startswith("__") or (module_name, name) in ALLOWED or value is namespace
                    or inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)):
                continue
            state[f"{module_name}.{name}"] = _fingerprint(value)
    return state


def _train_step(model, optimizer, step: int) -> None:
    """One step as a training script runs it: a batch, backward, the optimizer's step (gradient
    reduction, step monitor, TensorBoard scalars), a metric averaged with push_pull and an async one."""
    optimizer.zero_grad()
    optimizer.set_local_batch_size(8)
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / (step + 1)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    bps.report_loss(loss)
    bps.push_pull(loss.detach(), name="metric.loss")
    bps.synchronize(bps.push_pull_async(torch.ones(2)))
    bps.log_scalar("test/loss", float(loss))


def module_state_across_a_step() -> list[str]:
    """The module-level bindings (outside :data:`ALLOWED`) that a training step changed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    _train_step(model, optimizer, 0)  # the first step builds the bucket plan and imports what it uses
    before = _module_state()
    _train_step(model, optimizer, 1)
    after = _module_state()
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
