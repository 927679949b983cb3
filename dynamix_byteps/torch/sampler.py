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

import torch.utils.data

from dynamix_byteps.data import sampler as _neutral


class DynamicBatchSampler(_neutral.DynamicBatchSampler, torch.utils.data.Sampler):
    __doc__ = _neutral.DynamicBatchSampler.__doc__
