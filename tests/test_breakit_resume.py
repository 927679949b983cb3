"""Resuming training without losing work: the sampler position a checkpoint keeps, whatever
frontend trains on the sampler's batches."""

import pytest
import torch


@pytest.mark.timeout(15)
def test_a_checkpoint_of_the_ddp_wrapper_with_a_plain_optimizer_keeps_the_prefetched_batches(
        single_process_job, tmp_path):
    """With the DDP wrapper the optimizer is torch's: the checkpoint saved the sampler's own
    position, two steps ahead of training under a prefetching loader, and the resumed epoch
    silently skipped those batches (90 of 100 samples trained)."""
    bps = single_process_job
    torch.manual_seed(0)
    sampler = bps.DynamicBatchSampler(100, batch_size=5, seed=1)
    model = bps.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches, trained = iter(sampler), []
    prefetched = [next(batches), next(batches)]  # what a DataLoader with workers draws ahead
    for _ in range(4):
        prefetched.append(next(batches))
        indices = prefetched.pop(0)
        optimizer.zero_grad()
        model(torch.tensor(indices, dtype=torch.float32).unsqueeze(1)).sum().backward()
        optimizer.step()
        trained += indices
    path = tmp_path / "ckpt.pt"
    bps.save_checkpoint(path, model=model, optimizer=optimizer, sampler=sampler)

    resumed = bps.DynamicBatchSampler(100, batch_size=5, seed=1)
    bps.load_checkpoint(path, sampler=resumed)
    rest = [i for batch in resumed for i in batch]
    assert sorted(trained + rest) == list(range(100))
