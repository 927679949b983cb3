"""push_pull round trip of the ``ps`` engine against the gloo ring, and back-to-back rounds under ``ps``.

Round trip: one job per (engine, workers, size); every worker sums a float32 tensor of the size
in place ``--repeats`` times, each after a barrier, and rank 0's seconds are kept (the first sum,
which sets up connections and keys, is not timed). ``ps`` runs with ``--servers`` summation
servers (BytePS's 4,096,000-byte partitions), ``ring`` is the gloo engine's all-reduce over the
same workers. Reported per case: median, 10th and 90th percentile and min-max of the repeats.

Rounds (``--rounds N``, 0 to skip): 3 workers and 2 servers sum N rounds back to back, one tensor
per round cycling float32 (3 partitions), float64 (1), float16 (2), int64 (2) and a float32 scalar,
with 4,096-byte partitions; every result is compared with the exact sum. BytePS 0.2.5 returned
partial sums in exactly this pattern.

Workers and servers are started on loopback by the test suite's harness (tests/multiworker.py),
one torch thread each.

    python benchmarks/ps_engine.py --workers 2,4 --sizes 1.7MB,36MB --repeats 20 --rounds 10000
    python benchmarks/ps_engine.py --repeats 3 --sizes 1.7MB --rounds 0       # a quick look

Prints a table and writes JSON (``--out``) with every repeat's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from common import REPO, RESULTS, worker_counts, write_report

sys.path.insert(0, str(REPO / "tests"))
from multiworker import run_workers  # noqa: E402

SIZES = {"1.7MB": 1_700_000, "36MB": 36_000_000}
ENGINES = ("ps", "ring")


def _ok(results: list[dict]) -> list:
    for result in results:
        if "ok" not in result:
            raise SystemExit(f"a worker failed: {result.get('traceback', result)}")
    return [result["ok"] for result in results]


def round_trip(engine: str, workers: int, servers: int, nbytes: int, repeats: int) -> list[float]:
    """Rank 0's seconds per in-place sum of ``nbytes`` under ``engine``."""
    times = run_workers(workers, "ps_cases:round_trip", nbytes, repeats, timeout=900,
                        servers=servers if engine == "ps" else 0,
                        env={"DYNAMIX_TIMEOUT": "300"})
    return _ok(times)[0]


def summary(times: list[float]) -> dict:
    ms = np.asarray(times) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()), "max_ms": float(ms.max())}


def back_to_back(rounds: int) -> dict:
    start = time.perf_counter()
    results = _ok(run_workers(3, "ps_cases:sums", rounds, 1, servers=2, timeout=3600,
                              env={"BYTEPS_PARTITION_BYTES": "4096", "DYNAMIX_TIMEOUT": "120"}))
    return {"rounds": rounds, "workers": 3, "servers": 2, "wrong": sum(r["wrong"] for r in results),
            "examples": [e for r in results for e in r["examples"]][:5],
            "rounds_per_s": min(r["rounds_per_s"] for r in results), "job_s": time.perf_counter() - start}


def markdown(report: dict) -> str:
    """The README table of a written report: ps against the ring per worker count and size."""
    by_key = {(r["engine"], r["workers"], r["size"]): r for r in report["round_trip"]}
    lines = ["| workers | size | ps median ms [p10, p90] | ring median ms [p10, p90] |", "|---|---|---|---|"]
    for (engine, workers, size), row in by_key.items():
        ring = by_key.get(("ring", workers, size))
        if engine != "ps" or ring is None:
            continue
        cells = [f"{r['median_ms']:.1f} [{r['p10_ms']:.1f}, {r['p90_ms']:.1f}]" for r in (row, ring)]
        lines.append(f"| {workers} | {size} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", type=lambda text: worker_counts(parser, text),
                        help="comma-separated worker counts of the round-trip jobs (default 2,4)")
    parser.add_argument("--servers", type=int, default=2, help="summation servers of the ps jobs (default 2)")
    parser.add_argument("--sizes", default="1.7MB,36MB", help=f"comma-separated, of {', '.join(SIZES)} (default 1.7MB,36MB)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated, of {', '.join(ENGINES)} (default {','.join(ENGINES)})")
    parser.add_argument("--repeats", type=int, default=20, help="timed round trips per case (default 20)")
    parser.add_argument("--rounds", type=int, default=10000, help="back-to-back rounds to check; 0 skips (default 10000)")
    parser.add_argument("--out", default=RESULTS / "ps_engine.json",
                        help="JSON to write (default benchmarks/results/ps_engine.json, the one the docs show: "
                        "give another path for a look that should not replace it)")
    parser.add_argument("--table-only", action="store_true", help="run nothing: print --out's table as markdown")
    args = parser.parse_args()
    if args.table_only:
        print(markdown(json.loads(Path(args.out).read_text())))
        return
    sizes = args.sizes.split(",")
    if any(size not in SIZES for size in sizes):
        parser.error(f"--sizes must be of {', '.join(SIZES)}")
    load_before = os.getloadavg()[0]
    rows = []
    print(f"{'engine':<6} {'workers':>7} {'size':>6} {'median ms':>10} {'p10-p90 ms':>16} {'min-max ms':>16}")
    for workers in args.workers:
        for size in sizes:
            for engine in args.engines.split(","):
                times = round_trip(engine, workers, args.servers, SIZES[size], args.repeats)
                row = {"engine": engine, "workers": workers, "servers": args.servers if engine == "ps" else 0,
                       "size": size, "bytes": SIZES[size], **summary(times), "times_s": times}
                rows.append(row)
                print(f"{engine:<6} {workers:>7} {size:>6} {row['median_ms']:>10.1f} "
                      f"{row['p10_ms']:>7.1f}-{row['p90_ms']:<8.1f} {row['min_ms']:>7.1f}-{row['max_ms']:<8.1f}",
                      flush=True)
    rounds = back_to_back(args.rounds) if args.rounds else None
    if rounds:
        print(f"back-to-back: {rounds['rounds']} rounds, 3 workers, 2 servers: {rounds['wrong']} wrong results, "
              f"{rounds['rounds_per_s']:.0f} rounds/s")
    write_report(args.out, {"benchmark": "ps_engine", "repeats": args.repeats, "partition_bytes": 4096000,
                            "load_average_1min_before": load_before, "round_trip": rows, "back_to_back": rounds})
    if rounds and rounds["wrong"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
