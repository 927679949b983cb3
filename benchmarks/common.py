"""What every benchmark script shares: the machine it ran on, the ns/call table, the JSON file."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from dynamix_byteps.atomic import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def cnn_worker(batch_size: int):
    """Join the job as a worker with one torch thread, and return what the step-time benchmarks
    train: ``(bps, Net, x, y, loss_fn)``, the example's CNN class and one fixed synthetic batch
    (``x`` float32 of shape (batch_size, 1, 28, 28), ``y`` int64 labels 0-9)."""
    import torch

    import dynamix_byteps.torch as bps

    sys.path.insert(0, str(REPO / "examples"))
    from torch_fashion_mnist import Net

    torch.set_num_threads(1)
    bps.init()
    torch.manual_seed(0)
    x = torch.randn(batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (batch_size,))
    return bps, Net, x, y, torch.nn.CrossEntropyLoss()


def timed_steps(bps, step, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step()``, after a barrier so that every worker starts
    timing together."""
    import time

    import torch

    bps.push_pull(torch.zeros(1), name="bench.barrier")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def machine() -> dict:
    """Where the figures come from: CPUs, load, Python and platform."""
    return {"cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
            "python": sys.version.split()[0], "platform": platform.platform()}


def print_ns_table(results: list[dict]) -> None:
    """Rows with ``case``, ``ns_per_call_median`` and ``ns_per_call_min``."""
    width = max(len(r["case"]) for r in results)
    print(f"{'case':<{width}}  {'median ns/call':>14}  {'min ns/call':>11}")
    for r in results:
        print(f"{r['case']:<{width}}  {r['ns_per_call_median']:>14.1f}  {r['ns_per_call_min']:>11.1f}")


def report_ns_per_call(out: Path, benchmark: str, calls: int, runs: int, results: list[dict]) -> None:
    """Print the ns/call table of ``results`` and write it with the run sizes to ``out``."""
    print_ns_table(results)
    write_report(out, {"benchmark": benchmark, "calls_per_run": calls, "runs": runs, "results": results})


def write_report(out: Path, report: dict) -> None:
    """Write ``report`` plus :func:`machine` as indented JSON to ``out`` (atomically)."""
    write_atomic(out, json.dumps({**report, "machine": machine()}, indent=2) + "\n")
    print(f"wrote {out}")


def worker_counts(parser, text: str) -> list[int]:
    """``--workers 4,32,256`` as a list of counts in 1..4096, or ``parser.error`` naming the flag."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--workers {text!r} is not a comma-separated list of integers")
    if not counts or any(not 1 <= c <= 4096 for c in counts):
        parser.error(f"--workers {text!r}: worker counts must be 1..4096")
    return counts
