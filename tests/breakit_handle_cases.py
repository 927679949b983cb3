"""Run inside a real worker by ``multiworker.run_workers``: what a careless caller gets from
``bps.poll``/``bps.synchronize`` for handles that are no handle of the running session."""

from __future__ import annotations

import torch

import dynamix_byteps.torch as bps


def _outcome(call, handle) -> str:
    try:
        call(handle)
    except Exception as error:  # noqa: BLE001 - the test reads which exception and its message
        return f"{type(error).__name__}: {error}"
    return "accepted"


def bogus_handles() -> dict:
    handle = bps.push_pull_async(torch.ones(2), name="breakit.once")
    bps.synchronize(handle)
    out = {"twice": _outcome(bps.synchronize, handle)}
    for label, bogus in {"int": 12345, "negative": -1, "float": 1.5, "string": "abc", "none": None,
                         "list": [1], "dict": {}, "tensor": torch.ones(1)}.items():
        out[f"poll {label}"] = _outcome(bps.poll, bogus)
        out[f"synchronize {label}"] = _outcome(bps.synchronize, bogus)
    kept = bps.push_pull_async(torch.ones(2), name="breakit.kept")
    bps.shutdown()
    out["after shutdown"] = _outcome(bps.synchronize, kept)
    bps.init()
    out["from before shutdown"] = _outcome(bps.poll, kept)
    return out
