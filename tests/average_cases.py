"""push_pull averages of values near float16's maximum, run in real workers (tests/test_average_overflow.py)."""

from __future__ import annotations

import torch

import dynamix_byteps.torch as bps

LARGE = 30000.0  # three of them sum past float16's maximum, 65504; their mean does not


def torch_large_averages() -> dict:
    """The mean of LARGE on every worker, over an fp16 wire, out of place and in place, and of a
    float16 tensor without compression."""
    fp16 = bps.Compression.fp16
    in_place = torch.full((4,), LARGE)
    bps.push_pull_inplace(in_place, average=True, name="inplace", compression=fp16)
    return {
        "fp16_wire": bps.push_pull(torch.full((4,), LARGE), average=True, name="fp16", compression=fp16).tolist(),
        "fp16_wire_in_place": in_place.tolist(),
        "half_tensor": bps.push_pull(torch.full((4,), LARGE, dtype=torch.float16), average=True,
                                     name="half").float().tolist(),
        "int_average_truncates": bps.push_pull(torch.tensor([bps.rank() + 1]), average=True, name="int").tolist(),
    }
