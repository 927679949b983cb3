"""Scheduler decision latency: report -> decision -> assignment round trip on loopback.

The scheduler runs in its own process (as in a job) with a trivial policy that changes every
worker's batch by one sample each decision, so every round publishes a new version and policy
time is negligible; the simulated workers are gRPC clients (one channel each) in this process.
Decision interval K = 1, one report per worker per round. For each worker count:

* ``trigger``: the N-1 other reports of the round are sent and answered first, then the
  report that completes the interval is timed alone: its round trip carries the decision (state
  snapshot, policy, JSONL log line, metrics) and returns the new version. This is the headline.
* ``round``: all N reports of a round are sent at once; time from the first send to the last
  answer (how long until every worker has been answered).
* ``floor``: the same report sent again right after the trigger; the scheduler ignores it as
  a duplicate, so this is the bare gRPC round trip of one report without a decision.
* ``cpu/decision``: scheduler process CPU (user+sys) over the trigger rounds / rounds; this
  covers handling all N reports of the interval, not just the decision.
* ``decide`` and ``policy``: the scheduler's own measurement of the decision and of the policy
  call, read from the decision log.

    python benchmarks/decision_latency.py [--workers 4,32,256] [--rounds 1000] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import worker_counts, write_report

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no GOAWAY chatter when a server stops

import grpc  # noqa: E402
import psutil  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc  # noqa: E402
from dynamix_byteps.policy.base import Decision, Policy  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "decision_latency.json"
BATCH = 32
WARMUP = 20


class FlipPolicy(Policy):
    """Every decision: all sizes +1, then back (a new version each time, ~1 µs of policy)."""

    name = "flip"

    def __init__(self):
        self.up = True

    def decide(self, state):
        delta = 1 if self.up else -1
        self.up = not self.up
        return Decision(tuple(b + delta for b in state.batch_sizes), "flip")


def _serve(conn, n: int, run_dir: str) -> None:
    from dynamix_byteps.control.scheduler import SchedulerServer

    server = SchedulerServer(FlipPolicy(), num_workers=n, decision_interval=1, run_dir=run_dir)
    conn.send(server.start())
    conn.recv()  # "stop"
    server.stop(grace=None)
    conn.send("stopped")


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _stats_ms(values: list[float]) -> dict:
    return {
        "p50_ms": 1e3 * statistics.median(values),
        "p99_ms": 1e3 * _quantile(values, 0.99),
        "max_ms": 1e3 * max(values),
        "mean_ms": 1e3 * statistics.fmean(values),
    }


def _report(rank: int, step: int, batch: int) -> dynamix_pb2.Report:
    compute = 0.05 * (1 + rank % 4)
    return dynamix_pb2.Report(rank=rank, step=step, local_batch_size=batch, compute_s=compute, push_pull_s=0.01,
                              samples_per_s=batch / compute, loss=1.0 / step, grad_sq=1.0, trace_cov=4.0)


def bench(n: int, rounds: int) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dynamix-bench-") as run_dir:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, n, run_dir), daemon=True)
        proc.start()
        channels = []
        try:
            port = parent.recv()
            channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(n)]
            stubs = [dynamix_pb2_grpc.SchedulerStub(c) for c in channels]
            for r, stub in enumerate(stubs):
                stub.Register(dynamix_pb2.WorkerInfo(rank=r, world_size=n, host="127.0.0.1", engine="gloo",
                                                     min_batch=1, max_batch=1024, batch_size=BATCH), timeout=30)
            step, version, batch = 0, 0, BATCH
            floor: list[float] = []

            def one_round(timed_trigger: bool) -> float:
                nonlocal step, version, batch
                step += 1
                if timed_trigger:
                    pending = [stubs[r].ReportMetrics.future(_report(r, step, batch), timeout=30) for r in range(1, n)]
                    for f in pending:
                        f.result()
                    t0 = time.perf_counter()
                    answer = stubs[0].ReportMetrics(_report(0, step, batch), timeout=30)
                    elapsed = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    pending = [stubs[r].ReportMetrics.future(_report(r, step, batch), timeout=30) for r in range(n)]
                    answer = max((f.result() for f in pending), key=lambda a: a.version)
                    elapsed = time.perf_counter() - t0
                if answer.version != version + 1:
                    raise RuntimeError(f"round {step}: expected version {version + 1}, got {answer.version}")
                version, batch = answer.version, answer.batch_sizes[0]
                if timed_trigger:  # the same call again: ignored as a duplicate, so no decision
                    t0 = time.perf_counter()
                    stubs[0].ReportMetrics(_report(0, step, batch), timeout=30)
                    floor.append(time.perf_counter() - t0)
                return elapsed

            for _ in range(WARMUP):
                one_round(True)
            del floor[:]
            gc.collect()
            gc.freeze()  # the clients' garbage collector is not what is measured
            server = psutil.Process(proc.pid)
            cpu0 = sum(server.cpu_times()[:2])
            trigger = [one_round(True) for _ in range(rounds)]
            cpu = sum(server.cpu_times()[:2]) - cpu0
            concurrent = [one_round(False) for _ in range(rounds)]
            for c in channels:
                c.close()
            parent.send("stop")
            parent.recv()
            logged = [json.loads(line) for line in Path(run_dir, "decisions.jsonl").read_text().splitlines()]
        finally:
            gc.unfreeze()
            for c in channels:
                c.close()
            if proc.is_alive():
                proc.kill()
            proc.join(10)
    timing = [d["timing"] for d in logged[WARMUP:]]
    return {
        "workers": n,
        "rounds": rounds,
        "trigger": _stats_ms(trigger),
        "rpc_floor": _stats_ms(floor),
        "round": _stats_ms(concurrent),
        "scheduler_cpu_ms_per_decision": 1e3 * cpu / rounds,
        "decide": _stats_ms([t["decision_s"] for t in timing]),
        "policy": _stats_ms([t["policy_s"] for t in timing]),
        "decisions_logged": len(logged),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="4,32,256", help="comma-separated simulated worker counts (default 4,32,256)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default: 2000/1000/200 by size)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    counts = worker_counts(parser, args.workers)
    if (args.rounds is not None and args.rounds < 1):
        parser.error("--rounds must be >= 1")
    results = []
    for n in counts:
        rounds = args.rounds or (2000 if n <= 8 else 1000 if n <= 64 else 200)
        results.append(bench(n, rounds))
    head = (f"{'workers':>7} {'rounds':>6} | {'trigger p50':>11} {'p99':>6} | {'floor p50':>9} {'p99':>6} | "
            f"{'round p50':>9} {'p99':>6} | {'decide p50':>10} {'policy p50':>10} | {'CPU/decision':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        t, f, rd = r["trigger"], r["rpc_floor"], r["round"]
        print(f"{r['workers']:>7} {r['rounds']:>6} | {t['p50_ms']:>8.3f} ms {t['p99_ms']:>6.2f} | {f['p50_ms']:>6.3f} ms {f['p99_ms']:>6.2f} | "
              f"{rd['p50_ms']:>6.2f} ms {rd['p99_ms']:>6.2f} | {r['decide']['p50_ms']:>7.3f} ms "
              f"{1e3 * r['policy']['p50_ms']:>7.1f} µs | {r['scheduler_cpu_ms_per_decision']:>9.3f} ms")
    print("times in ms unless marked; CPU/decision = scheduler process CPU per round of N reports + 1 decision")
    report = {
        "benchmark": "decision_latency",
        "description": "report -> decision -> assignment round trip on loopback; scheduler in its own process, "
                       "clients in one process (one gRPC channel each); trivial policy; K=1",
        "target": "trigger p99 < 2 ms at 32 workers",
        "grpcio": grpc.__version__,
        "results": results,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
