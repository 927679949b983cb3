"""A worker for the observability tests: a small MLP on the first 4096 Fashion-MNIST training
images through DynamicBatchSampler, for EPOCHS epochs; after each epoch it evaluates on 1000
test images, logs ``test/accuracy`` and ``test/loss`` with ``bps.log_scalar`` and (rank 0)
prints ``epoch E test_accuracy=A``. Writes its local batch size per step to
``<out_dir>/rank<r>.json``. Usage: observed_worker.py OUT_DIR EPOCHS"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import dynamix_byteps.torch as bps
from dynamix_byteps.data import load_fashion_mnist


def tensors(split, n):
    x, y = load_fashion_mnist(split)
    return torch.from_numpy(x[:n]).flatten(1).float().div_(255), torch.from_numpy(y[:n])


out_dir, epochs = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
torch.manual_seed(0)
bps.init()
train = torch.utils.data.TensorDataset(*tensors("train", 4096))
test_x, test_y = tensors("test", 1000)
sampler = bps.DynamicBatchSampler(train, 64, seed=1)
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)
sizes = []
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for x, y in torch.utils.data.DataLoader(train, batch_sampler=sampler):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        bps.report_loss(loss)
        sizes.append(len(y))
    with bps.untimed(), torch.no_grad():
        logits = model(test_x)
        accuracy = float((logits.argmax(1) == test_y).float().mean())
        bps.log_scalar("test/accuracy", accuracy)
        bps.log_scalar("test/loss", F.cross_entropy(logits, test_y))
    if bps.rank() == 0:
        print(f"epoch {epoch} test_accuracy={accuracy:.4f}", flush=True)
(out_dir / f"rank{bps.rank()}.json").write_text(json.dumps(sizes))
bps.shutdown()
