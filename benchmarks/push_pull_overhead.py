"""Per-step cost of ``DistributedOptimizer`` against a hand-written all-reduce loop.

Both variants train the example's CNN on the same workers and the same gloo process group:

* ``all_reduce``: ``loss.backward()``, then ``torch.distributed.all_reduce`` of every gradient
  (all started asynchronously, then awaited), division by the worker count, ``opt.step()``;
* ``DistributedOptimizer``: ``loss.backward()``, ``set_local_batch_size``, ``opt.step()``
  (negotiation, batch weighting, fusion and timing included).

Runs alternate between the two (A B B A ...) so drift in machine load hits both alike; the
figure is the median step time of each. Target: DistributedOptimizer at most 3% slower.

    python benchmarks/push_pull_overhead.py --workers 2 --steps 40 --repeats 6

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, cnn_worker, write_report


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    bps, Net, x, y, loss_fn = cnn_worker(args.batch_size)

    def hand_written(model, opt):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
        for work in works:
            work.wait()
        for p in model.parameters():
            p.grad.div_(bps.size())
        opt.step()

    def distributed_optimizer(model, opt):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.set_local_batch_size(args.batch_size)
        opt.step()

    variants = {
        "all_reduce": (hand_written, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)),
        "DistributedOptimizer": (distributed_optimizer, lambda m: bps.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), named_parameters=m.named_parameters())),
    }
    step_times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for repeat in range(args.repeats):
        for name in order if repeat % 2 == 0 else reversed(order):
            step, make_opt = variants[name]
            model = Net()
            opt = make_opt(model)
            for _ in range(args.warmup):
                step(model, opt)
            bps.push_pull(torch.zeros(1), name="bench.barrier")
            for _ in range(args.steps):
                start = time.perf_counter()
                step(model, opt)
                step_times[name].append(time.perf_counter() - start)
    if bps.rank() == 0:
        Path(args.result).write_text(json.dumps(step_times))
    bps.shutdown()


def _table(result: dict) -> str:
    rows = [f"{'variant':<22}{'median step (ms)':>18}{'p90 (ms)':>12}{'steps':>8}"]
    for name, stats in result["variants"].items():
        rows.append(f"{name:<22}{stats['median_ms']:>18.2f}{stats['p90_ms']:>12.2f}{stats['steps']:>8}")
    rows.append(f"overhead of DistributedOptimizer: {result['overhead_pct']:+.2f}% (target <= 3%)")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--repeats", type=int, default=6, help="runs per variant, interleaved")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/push_pull_overhead.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "steps.json")
        command = [sys.executable, "-m", "dynamix_byteps.launcher", "--num-workers", str(args.workers), "--",
                   sys.executable, __file__, "--worker", "--result", result_file,
                   "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
        code = subprocess.call(command, stdout=subprocess.DEVNULL)
        if code != 0:
            print(f"benchmark workers failed with exit code {code}", file=sys.stderr)
            return 1
        step_times = json.loads(Path(result_file).read_text())

    variants = {}
    for name, times in step_times.items():
        times_ms = sorted(t * 1e3 for t in times)
        variants[name] = {"median_ms": statistics.median(times_ms),
                          "p90_ms": times_ms[int(0.9 * (len(times_ms) - 1))], "steps": len(times_ms)}
    overhead = variants["DistributedOptimizer"]["median_ms"] / variants["all_reduce"]["median_ms"] - 1
    result = {"benchmark": "push_pull_overhead", "workers": args.workers, "batch_size": args.batch_size,
              "model": "examples/torch_fashion_mnist.py:Net", "variants": variants,
              "overhead_pct": 100 * overhead, "target_pct": 3.0}
    print(_table(result))
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
