"""Policy decision time: ``Guarded(policy).decide(state)`` as the scheduler calls it, per policy and N.

The scheduler runs the policy in its own process on every decision (``policy_s`` in
``decisions.jsonl``); this measures that call alone, in one process with one ONNX Runtime thread,
for ``static``, ``proportional``, ``goodput`` and ``ppo`` (observation features + ONNX Runtime +
ladder + guardrails). States come from the simulator (two-speed scenario, mid-training), so
throughput, push_pull, loss history and B_noise are realistic. Target: ppo p99 < 1 ms.

Without ``--policy-path`` an untrained network is exported to a temporary directory (weights do
not change the cost); that needs ``pip install 'dynamix-byteps[rl]'``.

    python benchmarks/policy_latency.py [--policy-path DIR] [--workers 4,32,256] [--calls 2000] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import worker_counts, write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dynamix_byteps.policy import Guarded, make_policy  # noqa: E402
from dynamix_byteps.policy.sim import Simulator, from_scenario  # noqa: E402
from dynamix_byteps.scenarios import scenario  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "policy_latency.json"
POLICIES = ("static", "proportional", "goodput", "ppo")


def states(workers: int, count: int = 50) -> list:
    """``count`` ClusterStates of a simulated two-speed job, from about a third of the way on."""
    sim = Simulator(from_scenario(scenario("two-speed"), workers=workers), rng=np.random.default_rng(0))
    out = [sim.reset()]
    while len(out) < count + 10 and not sim.done:
        sim.step(sim.batch)
        out.append(sim.cluster_state())
    return out[10:]


def untrained_policy_dir(tmp: Path) -> Path:
    import gymnasium as gym

    from dynamix_byteps.policy.ppo.export import export_module
    from dynamix_byteps.policy.ppo.features import NUM_FEATURES
    from dynamix_byteps.policy.ppo.mdp import LADDER
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    module = PerWorkerPPOModule(observation_space=gym.spaces.Box(-5, 5, (4 * NUM_FEATURES,), np.float32),
                                action_space=gym.spaces.MultiDiscrete([len(LADDER)] * 4), model_config={"hidden": 64})
    return export_module(module, tmp)


def bench(policy, cases: list, calls: int) -> dict:
    guarded = Guarded(policy)
    for s in cases[:20]:
        guarded.decide(s)
    gc.collect()
    gc.disable()
    try:
        times = []
        for i in range(calls):
            s = dataclasses.replace(cases[i % len(cases)])  # a new state, as the scheduler builds every decision
            t0 = time.perf_counter()
            guarded.decide(s)
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    times.sort()
    return {"p50_us": 1e6 * statistics.median(times), "p99_us": 1e6 * times[int(0.99 * (len(times) - 1))],
            "max_us": 1e6 * times[-1], "calls": calls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy-path", type=Path, help="a trained policy directory (default: an untrained network)")
    parser.add_argument("--workers", default="4,32,256", help="comma-separated worker counts (default 4,32,256)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per policy and size (default 2000)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    counts = worker_counts(parser, args.workers)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    with tempfile.TemporaryDirectory(prefix="dynamix-policy-") as tmp:
        path = args.policy_path or untrained_policy_dir(Path(tmp))
        policies = {name: make_policy(name, **({"path": path} if name == "ppo" else {})) for name in POLICIES}
        results = []
        for n in counts:
            cases = states(n)
            for name, policy in policies.items():
                calls = args.calls if name != "goodput" or n <= 32 else max(1, args.calls // 10)
                results.append({"policy": name, "workers": n, **bench(policy, cases, calls)})
    print(f"{'policy':<13} {'workers':>7} {'p50 µs':>9} {'p99 µs':>9} {'max µs':>9}")
    for r in results:
        print(f"{r['policy']:<13} {r['workers']:>7} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} {r['max_us']:>9.1f}")
    write_report(args.out, {"benchmark": "policy_latency", "description": __doc__.splitlines()[0],
                            "target": "ppo p99 < 1 ms", "policy_path": str(args.policy_path or "untrained"),
                            "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
