"""How one epoch is cut into per-worker batches of different sizes (framework-neutral).

Every worker computes the same plan from the same inputs, so no indices ever cross the
network. An epoch is one permutation of ``range(dataset_size)`` seeded by ``(seed, epoch)``,
shared by all workers, and a cursor into it. At each step with batch sizes ``b`` (one per
rank), rank r takes ``b[r]`` indices at offset ``b[0] + ... + b[r-1]`` after the cursor, and
the cursor advances by the global batch ``B = sum(b)``. So every index is drawn exactly
once per epoch and every worker runs the same number of steps.

**End of an epoch**, when ``0 < R < B`` indices remain:

* ``drop_last=True``: the R indices are skipped this epoch (a different random subset each
  epoch when shuffling), and the epoch ends.
* ``drop_last=False``: one last step shares the R indices in proportion to ``b`` (largest
  remainder), every rank getting at least one. If ``R < number of workers``, the ranks
  without a remaining index take one from the start of the permutation instead, so at most
  ``workers - 1`` indices are seen twice in that epoch (as ``DistributedSampler`` pads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Position:
    """Where the sampling of a job stands.

    Attributes:
        epoch: current epoch (seeds the permutation).
        offset: indices of this epoch's permutation already drawn (the shared cursor).
        step: global step about to be drawn, counted from 0 across epochs.
    """

    epoch: int = 0
    offset: int = 0
    step: int = 0


def permutation(dataset_size: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's order of dataset indices: int64 array of shape ``(dataset_size,)``."""
    if not shuffle:
        return np.arange(dataset_size, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(dataset_size).astype(np.int64)


def tail_sizes(remaining: int, batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Per-rank sizes of the last step of an epoch: ``remaining`` shared in proportion to
    ``batch_sizes`` by largest remainder, at least 1 each (so the sum exceeds ``remaining``
    only when ``remaining < len(batch_sizes)``)."""
    n = len(batch_sizes)
    if remaining <= n:
        return (1,) * n
    spare = remaining - n
    total = sum(batch_sizes)
    quotas = [spare * b / total for b in batch_sizes]
    sizes = [1 + int(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda r: (-(quotas[r] - int(quotas[r])), r))
    for r in by_remainder[: remaining - sum(sizes)]:
        sizes[r] += 1
    return tuple(sizes)


def plan_step(position: Position, batch_sizes: Sequence[int], dataset_size: int,
              drop_last: bool) -> tuple[tuple[int, ...], Position] | None:
    """Per-rank sizes of the step at ``position`` and the position after it.

    Returns:
        ``(sizes, next_position)``, or ``None`` when the epoch has no step left
        (``next_position`` of the last step has ``offset == dataset_size``).
    """
    remaining = dataset_size - position.offset
    global_batch = sum(batch_sizes)
    if remaining <= 0 or (remaining < global_batch and drop_last):
        return None
    sizes = tuple(batch_sizes) if remaining >= global_batch else tail_sizes(remaining, batch_sizes)
    taken = min(sum(sizes), remaining)
    return sizes, Position(position.epoch, position.offset + taken, position.step + 1)


def rank_indices(order: np.ndarray, position: Position, sizes: Sequence[int], rank: int) -> np.ndarray:
    """The indices rank ``rank`` draws at the step planned at ``position`` with ``sizes``."""
    start = position.offset + sum(sizes[:rank])
    stop = start + sizes[rank]
    if stop <= len(order):
        return order[start:stop]
    # Fewer indices left than workers (see the module docstring): wrap to the epoch's start.
    wrapped = np.arange(start, stop) % len(order)
    return order[wrapped]
