"""One worker of tests/test_torchrun.py and tests/test_mpirun.py: joins the job its launcher (torchrun,
mpirun, mpiexec) describes and writes OUT_DIR/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node 3 tests/scripts/torchrun_worker.py OUT_DIR

Each rank contributes ``rank + 1`` (float64) to a summing push_pull; the file holds the rank, size,
local rank and size, the engine's name and device, and the sum.
"""

import json
import sys
from pathlib import Path

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps import engine

bps.init()
total = bps.push_pull(torch.tensor([bps.rank() + 1.0], dtype=torch.float64), average=False, name="rank_sum")
result = {"rank": bps.rank(), "size": bps.size(), "local_rank": bps.local_rank(), "local_size": bps.local_size(),
          "engine": engine.current().name, "device": str(engine.current().device), "sum": total.item()}
(Path(sys.argv[1]) / f"rank{bps.rank()}.json").write_text(json.dumps(result))
bps.shutdown()
