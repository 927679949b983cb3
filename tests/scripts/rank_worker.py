"""Worker for tests/test_hosts.py and tests/test_netns.py: joins the job, all-reduces its rank, and
writes ``<OUT_DIR>/rank<r>.json`` = {rank, size, local_rank, rank_sum, address}; with STEPS > 0 it
then trains a 64-HIDDEN-10 MLP (default HIDDEN 256: 19k parameters, 76 KB of gradients per step)
for STEPS steps through DynamicBatchSampler, so that a scheduler given with --policy receives
reports. Usage: rank_worker.py OUT_DIR [STEPS [HIDDEN]]"""

import json
import os
import sys
from pathlib import Path

import torch

import dynamix_byteps.torch as bps

out_dir = Path(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 256
torch.set_num_threads(1)
bps.init()
total = bps.push_pull(torch.tensor([float(bps.rank())]), average=False, name="rank_sum")
result = {"rank": bps.rank(), "size": bps.size(), "local_rank": bps.local_rank(), "rank_sum": int(total.item()),
          "interface": os.environ.get("GLOO_SOCKET_IFNAME")}
if steps:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8192, 64, generator=g), torch.randint(0, 10, (8192,), generator=g))
    sampler = bps.DynamicBatchSampler(data, 32, seed=1)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            bps.report_loss(loss)
            done += 1
            if done == steps:
                break
        epoch += 1
    result["steps"] = done
tmp = out_dir / f".rank{bps.rank()}.json.tmp"
tmp.write_text(json.dumps(result))
os.replace(tmp, out_dir / f"rank{bps.rank()}.json")
bps.shutdown()
