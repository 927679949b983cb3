"""A worker for end-to-end control-plane tests: trains a small MLP on synthetic data through
DynamicBatchSampler (20480 samples, a multiple of the 256 global batch, so no epoch ends in a
partial step) and writes, per step, its local and the global batch size to
``<out_dir>/rank<r>.json``. Usage: control_worker.py OUT_DIR STEPS [BATCH]"""

import json
import sys
from pathlib import Path

import torch

import dynamix_byteps.torch as bps

out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
torch.set_num_threads(1)
bps.init()
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(20480, 64, generator=g), torch.randint(0, 10, (20480,), generator=g))
sampler = bps.DynamicBatchSampler(data, batch, seed=1)
# Wide enough that compute grows with the batch (a per-step fixed cost would dominate a tiny model).
model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
log = []
epoch = 0
while len(log) < steps:
    sampler.set_epoch(epoch)
    for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        bps.report_loss(loss)
        log.append([len(y), opt.global_batch_size])
        if len(log) == steps:
            break
    epoch += 1
(out_dir / f"rank{bps.rank()}.json").write_text(json.dumps(log))
bps.shutdown()
