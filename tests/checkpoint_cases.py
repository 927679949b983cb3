"""save_checkpoint called on rank 0 only (the BytePS idiom), or failing on rank 0, run in real workers
(tests/test_checkpoint_collective.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps.errors import TensorMismatchError


def rank0_only_save(directory: str) -> dict:
    """Rank 0 saves alone while the others push_pull; then everyone push_pulls (the job goes on)."""
    path = Path(directory) / "ckpt.pt"
    model = torch.nn.Linear(2, 1)
    try:
        if bps.rank() == 0:
            bps.save_checkpoint(path, model)
        else:
            bps.push_pull(torch.ones(3), name="next")
        error = None
    except TensorMismatchError as exc:
        error = str(exc)
    after = bps.push_pull(torch.ones(2), average=False, name="after").tolist()
    return {"error": error, "after": after, "written": path.exists()}


def rank0_save_fails(directory: str) -> dict:
    """Every rank saves, and rank 0 cannot write: an unpicklable ``extra``, then a path under a
    file. Each rank catches its error and goes on (a script that survives a failed save); per
    case the error each rank raised and how long its call took; then one more collective."""
    directory = Path(directory)
    blocker = directory / "a-file"
    blocker.write_text("")
    model = torch.nn.Linear(2, 1)
    cases = {"unpicklable extra": (directory / "ckpt.pt", {"lock": threading.Lock()}),
             "path under a file": (blocker / "ckpt.pt", {})}
    results = {}
    for label, (path, extra) in cases.items():
        start = time.monotonic()
        try:
            bps.save_checkpoint(path, model, **extra)
            error = None
        except Exception as exc:  # the test asserts which
            error = {"type": type(exc).__name__, "message": str(exc)}
        results[label] = {"path": str(path), "error": error, "seconds": time.monotonic() - start}
    after = bps.push_pull(torch.ones(2), average=False, name="after").tolist()
    return {"cases": results, "after": after}
