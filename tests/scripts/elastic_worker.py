"""A worker for elastic-restart tests and benchmarks: one epoch of a synthetic dataset through
DynamicBatchSampler, with ``bps.save_checkpoint`` after every step to ``$DYNAMIX_CHECKPOINT``,
resuming from it when it exists (``bpslaunch --restart-on-failure`` restarts the job).

It appends one JSON line per event to ``OUT_DIR/rank<r>.run<k>.jsonl`` (``k`` = ``$DYNAMIX_RESTART``):
``{"resumed_at": S}`` first on a resumed run (the steps the checkpoint holds), then per trained and
trained step ``{"step": s, "indices": [...], "time": wall}``.

Usage: elastic_worker.py OUT_DIR SAMPLES [KILL_RANK KILL_STEP [STEP_SLEEP_S [EVERY]]]; KILL_RANK SIGKILLs
itself just before training KILL_STEP, in the first run only (with ``ELASTIC_WORKER_RAISE=1`` it
raises RuntimeError there instead: a failure of its own, which breaks the others' collectives);
EVERY (default 1): checkpoint every EVERY steps (the steps since the last checkpoint are trained
again after a restart).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import dynamix_byteps.torch as bps

out_dir, samples = Path(sys.argv[1]), int(sys.argv[2])
kill_rank, kill_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, -1)
step_sleep = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
every = int(sys.argv[6]) if len(sys.argv) > 6 else 1
checkpoint = Path(os.environ["DYNAMIX_CHECKPOINT"])
run = int(os.environ.get("DYNAMIX_RESTART", "0"))
torch.set_num_threads(1)
bps.init()
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(samples, 16, generator=g), torch.randint(0, 4, (samples,), generator=g),
                                      torch.arange(samples))
sampler = bps.DynamicBatchSampler(data, int(os.environ.get("DYNAMIX_BATCH_SIZE", "6")), seed=7)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
with open(out_dir / f"rank{bps.rank()}.run{run}.jsonl", "a", buffering=1) as log:
    step = 0
    if checkpoint.exists():
        step = bps.load_checkpoint(checkpoint, model=model, optimizer=opt, sampler=sampler)["steps"]
        log.write(json.dumps({"resumed_at": step, "time": time.time()}) + "\n")
    else:
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y, index in torch.utils.data.DataLoader(data, batch_sampler=sampler):
        if run == 0 and bps.rank() == kill_rank and step == kill_step:
            if os.environ.get("ELASTIC_WORKER_RAISE") == "1":
                raise RuntimeError(f"rank {kill_rank} fails at step {kill_step}")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(step_sleep)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step % every == 0:
            bps.save_checkpoint(checkpoint, model=model, optimizer=opt, sampler=sampler, steps=step)
        log.write(json.dumps({"step": step - 1, "indices": index.tolist(), "time": time.time()}) + "\n")
bps.shutdown()
