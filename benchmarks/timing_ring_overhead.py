"""Cost of recording one timing event from Python, in ns per call.

Measures ``TimingRing.record`` called directly (with the default kind, push_pull, and with an
explicit kind, as the ps engine's pushes and pulls are recorded) and ``CommTiming.record``, the
path every engine records through (name interning + the engine's ring), each as the median of --runs runs of --calls calls, next to an
empty Python loop of the same length for reference. The ring is sized to hold every call
and drained between runs, so only the success path is timed. Prints a table, writes JSON.

    python benchmarks/timing_ring_overhead.py [--calls 200000] [--runs 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import report_ns_per_call

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "timing_ring_overhead.json"


def _loop_baseline(n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t0


def _raw_record(ring, n: int) -> int:
    record = ring.record
    t0 = time.perf_counter_ns()
    for _ in range(n):
        record(7, 4096, 1_000, 2_000)
    elapsed = time.perf_counter_ns() - t0
    if ring.dropped:
        raise RuntimeError("ring overflowed during the benchmark; the drop path was timed")
    return elapsed


def _raw_record_kind(ring, n: int) -> int:
    record = ring.record
    t0 = time.perf_counter_ns()
    for _ in range(n):
        record(7, 4096, 1_000, 2_000, 1)
    elapsed = time.perf_counter_ns() - t0
    if ring.dropped:
        raise RuntimeError("ring overflowed during the benchmark; the drop path was timed")
    return elapsed


def _timing_record(owner, n: int) -> int:
    record = owner.record
    t0 = time.perf_counter_ns()
    for _ in range(n):
        record("model.layer1.weight", 4096, 1_000, 2_000)
    elapsed = time.perf_counter_ns() - t0
    if owner.ring.dropped:
        raise RuntimeError("ring overflowed during the benchmark; the drop path was timed")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="record calls per run (default 200000)")
    parser.add_argument("--runs", type=int, default=5, help="runs per case; the median is reported (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.runs < 1:
        parser.error("--calls and --runs must be >= 1")

    from dynamix_byteps import _core, timing

    raw_ring = _core.TimingRing(args.calls)
    owner = timing.CommTiming(args.calls)  # an engine's, holding one run's calls
    cases = {
        "empty python loop (reference)": lambda: _loop_baseline(args.calls),
        "TimingRing.record (raw)": lambda: _raw_record(raw_ring, args.calls),
        "TimingRing.record (raw, kind=push)": lambda: _raw_record_kind(raw_ring, args.calls),
        "CommTiming.record (name + engine's ring)": lambda: _timing_record(owner, args.calls),
    }
    drains = {"TimingRing.record (raw)": raw_ring.drain, "TimingRing.record (raw, kind=push)": raw_ring.drain,
              "CommTiming.record (name + engine's ring)": owner.ring.drain}

    results = []
    for name, run in cases.items():
        per_call = []
        for _ in range(args.runs):
            per_call.append(run() / args.calls)
            if name in drains:
                drains[name]()
        results.append(
            {
                "case": name,
                "ns_per_call_median": statistics.median(per_call),
                "ns_per_call_min": min(per_call),
                "ns_per_call_runs": per_call,
            }
        )

    report_ns_per_call(args.out, "timing_ring_overhead", args.calls, args.runs, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
