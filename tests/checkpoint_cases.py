"""save_checkpoint called on rank 0 only (the BytePS idiom), run in real workers (tests/test_checkpoint_collective.py)."""

from __future__ import annotations

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
