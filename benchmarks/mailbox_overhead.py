"""Cost of the shared-memory mailbox from Python, in ns per call.

Times each publish/read of ``dynamix_byteps.control.mailbox.Mailbox`` (and, for the hot
calls, the native handle underneath) in one process, uncontended: a worker handle from
``Mailbox.create`` and an agent handle from ``Mailbox.open`` on the same segment. Each case is
the median of --runs runs of --calls calls, next to an empty Python loop for reference.
"poll" cases ask for a version newer than the newest one, which is what the agent does every
poll when nothing changed (no copy, returns None). Prints a table, writes JSON.

    python benchmarks/mailbox_overhead.py [--calls 100000] [--runs 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from common import report_ns_per_call

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "mailbox_overhead.json"


def _timed(fn, n: int) -> int:
    t0 = time.perf_counter_ns()
    fn(n)
    return time.perf_counter_ns() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls per run (default 100000)")
    parser.add_argument("--runs", type=int, default=5, help="runs per case; the median is reported (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.runs < 1:
        parser.error("--calls and --runs must be >= 1")

    from dynamix_byteps.control.mailbox import Mailbox

    name = f"/dynamix.bench{os.getpid()}.0"
    worker = Mailbox.create(name)
    agent = Mailbox.open(name)
    try:
        metrics_array = np.linspace(0.0, 1.0, 32)
        metrics_list = metrics_array.tolist()

        def loop(n):
            for _ in range(n):
                pass

        def publish_metrics_array(n):
            publish = worker.publish_metrics
            for i in range(n):
                publish(i, metrics_array)

        def publish_metrics_list(n):
            publish = worker.publish_metrics
            for i in range(n):
                publish(i, metrics_list)

        def native_publish_metrics(n):
            publish = worker._mb.publish_metrics
            for i in range(n):
                publish(i, metrics_array)

        def read_metrics_new(n):
            read = agent.read_metrics
            for _ in range(n):
                read(0)

        def read_metrics_poll(n):
            read = agent.read_metrics
            newest = read(0)[0]
            for _ in range(n):
                read(newest)

        worker.publish_metrics(0, metrics_array)
        cases = {
            "empty python loop (reference)": loop,
            "publish_metrics (32 float64, ndarray)": publish_metrics_array,
            "publish_metrics (32 floats, list)": publish_metrics_list,
            "_core publish_metrics (ndarray)": native_publish_metrics,
            "read_metrics (new record, 32 values)": read_metrics_new,
            "read_metrics (poll, nothing newer)": read_metrics_poll,
        }
        results = []
        for case, fn in cases.items():
            fn(min(args.calls, 1000))  # warm-up
            per_call = [_timed(fn, args.calls) / args.calls for _ in range(args.runs)]
            results.append(
                {
                    "case": case,
                    "ns_per_call_median": statistics.median(per_call),
                    "ns_per_call_min": min(per_call),
                    "ns_per_call_runs": per_call,
                }
            )
        busy = worker.busy_reads + agent.busy_reads
    finally:
        agent.close()
        worker.close()
    if busy:
        print(f"warning: {busy} reads gave up on a write in progress (none expected uncontended)", file=sys.stderr)

    report_ns_per_call(args.out, "mailbox_overhead", args.calls, args.runs, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
