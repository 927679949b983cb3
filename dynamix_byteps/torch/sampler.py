"""``DynamicBatchSampler`` for torch: the framework-neutral sampler as a DataLoader ``batch_sampler``::

    sampler = bps.DynamicBatchSampler(train_set, batch_size=64, seed=42)
    loader = DataLoader(train_set, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...

Everything else (the epoch plan, assignments, resuming) is
:class:`dynamix_byteps.data.sampler.DynamicBatchSampler`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch.utils.data

from dynamix_byteps.data import sampler as _neutral
from dynamix_byteps.errors import ConfigurationError

_BATCH_SAMPLER_ITER = torch.utils.data.BatchSampler.__iter__.__code__


class DynamicBatchSampler(_neutral.DynamicBatchSampler, torch.utils.data.Sampler):
    __doc__ = _neutral.DynamicBatchSampler.__doc__

    def __iter__(self) -> Iterator[list[int]]:
        # Given as DataLoader(..., batch_size=64, sampler=sampler), DistributedSampler's place, the
        # DataLoader's BatchSampler would batch these batches again, and torch's collate would fail on
        # the epoch's shorter last batch (or the model on 5-dimensional input) without naming the cause.
        if sys._getframe(1).f_code is _BATCH_SAMPLER_ITER:
            raise ConfigurationError("DynamicBatchSampler draws whole batches: pass it to the DataLoader as "
                                     "batch_sampler=, without batch_size= (DataLoader(dataset, batch_sampler=sampler)), "
                                     "not as sampler=, where a DataLoader batches its batches again")
        return super().__iter__()
