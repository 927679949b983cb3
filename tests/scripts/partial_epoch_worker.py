"""A worker whose epochs end in a partial step: 1000 samples, 16 per worker on 2 workers, so each
epoch's last step holds 4 samples per worker. Usage: partial_epoch_worker.py sampler|declared
(``declared``: the README's minimal port, no DynamicBatchSampler, only set_local_batch_size)."""

import sys

import torch

import dynamix_byteps.torch as bps

torch.set_num_threads(1)
bps.init()
data = torch.utils.data.TensorDataset(torch.randn(1000, 8), torch.randint(0, 2, (1000,)))
if sys.argv[1] == "sampler":
    sampler = bps.DynamicBatchSampler(data, 16, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
else:
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=bps.size(), rank=bps.rank(), seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler)
model = torch.nn.Linear(8, 2)
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        if sys.argv[1] == "declared":
            opt.set_local_batch_size(len(y))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        bps.report_loss(loss)
bps.shutdown()
