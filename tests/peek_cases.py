"""Peeking at a batch before training, run in real workers (tests/test_peek_before_training.py)."""

from __future__ import annotations

import torch

import dynamix_byteps.torch as bps


def _dataset(size: int) -> torch.utils.data.TensorDataset:
    """Sample i is (features, label i % 3, i), so every batch says which indices it holds."""
    x = torch.randn(size, 6, generator=torch.Generator().manual_seed(2))
    return torch.utils.data.TensorDataset(x, torch.arange(size) % 3, torch.arange(size))


def train_after_peeking(dataset_size: int, sizes: list[int], peeking_ranks: list[int], loader_workers: int,
                        epochs: int) -> list[list[int]]:
    """Peek with ``next(iter(loader))`` on ``peeking_ranks`` (the shapes idiom), then train
    ``epochs`` epochs with DistributedOptimizer; returns the indices this rank trained, by epoch."""
    torch.manual_seed(0)
    dataset = _dataset(dataset_size)
    sampler = bps.DynamicBatchSampler(dataset, sizes, seed=7)
    prefetch = {"num_workers": loader_workers, "prefetch_factor": 2} if loader_workers else {}
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **prefetch)
    if bps.rank() in peeking_ranks:
        features, _, _ = next(iter(loader))
        assert features.shape[1] == 6
    model = torch.nn.Linear(6, 3)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    trained = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seen = []
        for x, y, index in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            seen += index.tolist()
        trained.append(seen)
    return trained
