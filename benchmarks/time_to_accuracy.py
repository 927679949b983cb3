"""Time to accuracy on real Fashion-MNIST: static batches against the batch-size policies.

For one scenario of ``dynamix_byteps/scenarios.toml`` (who is slow, when, behind which link), every
configuration trains the example's model (``examples/torch_fashion_mnist.py``, 4 workers through
``bpslaunch``) for the same budget of training seconds, evaluating on the 10,000 test images every
``--eval-every`` seconds. Configurations: static uniform batches (32, 64, 128, 256 per worker),
``proportional`` (LB-BSP), ``goodput`` (Pollux) and, when a trained policy is given, ``ppo``.

Columns of the table:

* ``time to X%``: training seconds until test accuracy first reaches the target, interpolated
  linearly between evaluations (``-`` if never within the budget).
* ``acc@budget``: test accuracy at the end of the budget.
* ``samples/s``: global training samples per second of training time.
* ``straggler eff.``: achieved global samples/s ÷ Σ θ_i, where θ_i is worker i's compute-only
  throughput (its samples per second of its own compute time, from the timing ring, same run).
  1.0 is the physical limit; a uniform batch with 1 of 4 workers 3x slower sits near 0.4
  (4 / (3 + 1/3) ÷ 3 = 0.4 without communication).
* ``mean batch``: mean global batch per step.

    python benchmarks/time_to_accuracy.py --scenario straggler            # full: ~12 min here
    python benchmarks/time_to_accuracy.py --scenario straggler --quick    # CI: ~3 min
    python benchmarks/time_to_accuracy.py --scenario homogeneous --configs static64,proportional

With ``--repeats N`` every configuration runs N times, round-robin over the configurations (a
drift in the machine's load hits them alike), run r with the example's ``--seed`` at ``--seed + r``
(model initialisation and data order). Each column is the median over the runs (a time to target
never reached counts as longer than any other); the JSON keeps every run and its seed. Runs of one
configuration on this shared 2-core machine differ by up to ~50% in time to target, so one run
each cannot settle a comparison within a few percent; and with one seed for every repeat, two
policies that choose nearly the same batches still differed by ~20% (one data order plateaued
just under the target), which only other seeds average out.

Writes ``benchmarks/results/time_to_accuracy_<scenario>[_quick].json`` and ``.png`` (accuracy
against training time), and keeps each run's log directory (TensorBoard files, decisions.jsonl)
under ``--runs-dir`` for ``dynamix report``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, RESULTS, machine, write_report

from dynamix_byteps.argtypes import float_in, int_in
from dynamix_byteps.policy.ppo import library
from dynamix_byteps.scenarios import Scenario, load_scenarios

EXAMPLE = REPO / "examples" / "torch_fashion_mnist.py"
STATIC_SIZES = (32, 64, 128, 256)
POLICY_START = 64  # every dynamic policy starts from the example's default local batch
BOUNDS = ["--min-batch", "16", "--max-batch", "512"]


def configurations(ppo_policy: str | None, decision_interval: int) -> dict[str, dict]:
    """Every configuration by name: its local batch and its extra bpslaunch flags."""
    configs = {f"static{b}": {"batch": b, "launch": []} for b in STATIC_SIZES}
    policy_flags = ["--decision-interval", str(decision_interval), *BOUNDS]
    for policy in ("proportional", "goodput"):
        configs[policy] = {"batch": POLICY_START, "launch": ["--policy", policy, *policy_flags]}
    if ppo_policy:
        chosen = ["--policy", "ppo", "--policy-path", str(ppo_policy)] if Path(ppo_policy).is_dir() \
            else ["--policy", f"ppo:{ppo_policy}"]  # a policy of the library
        configs["ppo"] = {"batch": POLICY_START, "launch": [*chosen, *policy_flags]}
    return configs


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Training seconds at which accuracy first reaches ``target``, linear between evaluations.

    ``curve``: points with ``train_s`` and ``test_accuracy``, in time order; the run starts at
    (0 s, 0.1), the accuracy of chance on 10 classes. None if the target is never reached.
    """
    previous = (0.0, 0.1)
    for point in curve:
        t, acc = point["train_s"], point["test_accuracy"]
        if acc >= target:  # and the previous point was below it
            t0, a0 = previous
            return t0 + (t - t0) * (target - a0) / (acc - a0)
        previous = (t, acc)
    return None


def straggler_efficiency(result: dict) -> float:
    """Achieved global samples/s ÷ Σ θ_i (θ_i: each worker's compute-only samples/s)."""
    total = sum(w["samples_per_s"] for w in result["worker_statistics"])
    return result["samples_per_s"] / total if total > 0 else math.nan


def run_config(name: str, config: dict, scenario: Scenario, args: argparse.Namespace, repeat: int = 0) -> dict:
    """Train one configuration through bpslaunch; the example's metrics plus run facts."""
    run_dir = args.runs_dir / scenario.name / name / (f"run{repeat + 1}" if args.repeats > 1 else "")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    output = run_dir / "result.json"
    launch = [*config["launch"], "--log-dir", str(run_dir)]
    launch += [flag for s in scenario.slowdowns for flag in ("--slowdown", s.launch_flag(args.budget))]
    seed = args.seed + repeat
    command = [sys.executable, str(EXAMPLE), "--batch-size", str(config["batch"]), "--epochs", "1000", "--seed", str(seed),
               "--time-budget", str(args.budget), "--eval-every", str(args.eval_every),
               "--model", args.model, "--output", str(output)]
    started = time.perf_counter()
    timeout = args.budget * 4 + 300
    with open(run_dir / "launcher.log", "wb") as log:
        if scenario.links:
            returncode = run_behind_links(scenario, launch, command, timeout, log)
        else:
            argv = [sys.executable, "-m", "dynamix_byteps.launcher", "-n", str(scenario.workers), *launch, "--", *command]
            returncode = subprocess.run(argv, check=False, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if returncode != 0 or not output.exists():
        raise RuntimeError(f"{name} on {scenario.name} failed with exit code {returncode}; see {run_dir}")
    result = json.loads(output.read_text())
    result["run_wall_s"] = time.perf_counter() - started
    result["seed"] = seed
    result["run_dir"] = str(run_dir)
    return result


def run_behind_links(scenario: Scenario, launch: list[str], command: list[str], timeout: float, log) -> int:
    """Run the job with the linked workers in network namespaces behind their rate limits."""
    from dynamix_byteps.testing import netns

    reason = netns.available()
    if reason:
        raise RuntimeError(f"scenario {scenario.name!r} needs network namespaces: {reason}")
    slots, rates = scenario.host_layout()
    with netns.Testbed(len(slots), rates) as bed:
        job = netns.run_job(bed, slots, command, launch, timeout_s=timeout, cwd=REPO)
    for host, output in enumerate(job.outputs):
        log.write(f"---- host {host} ----\n{output}".encode())
    return 0 if job.ok else max(job.returncodes, key=abs) or 1


def summarise(name: str, result: dict, target: float) -> dict:
    """One table row; with ``result["runs"]`` (``--repeats``), the median of each column over the runs."""
    if "runs" in result:
        rows = [summarise(name, run, target) for run in result["runs"]]
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0] if key not in ("config", "time_to_target_s")}
        times = [row["time_to_target_s"] for row in rows]
        ttt = statistics.median(map(_never_last, times))
        return {"config": name, "time_to_target_s": None if ttt == math.inf else ttt, **median, "runs": len(rows),
                "time_to_target_runs_s": times}
    steps = max(result["steps"], 1)
    return {
        "config": name,
        "time_to_target_s": time_to_target(result["curve"], target),
        "accuracy_at_budget": result["test_accuracy"],
        "samples_per_s": result["samples_per_s"],
        "straggler_efficiency": straggler_efficiency(result),
        "mean_global_batch": result["samples"] / steps,
        "train_s": result["train_s"],
        "run_wall_s": result["run_wall_s"],
    }


def print_table(rows: list[dict], target: float) -> None:
    head = f"{'config':<13} {f'time to {target:.0%}':>12} {'acc@budget':>10} {'samples/s':>10} {'straggler eff.':>14} {'mean batch':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
        print(f"{r['config']:<13} {ttt:>12} {r['accuracy_at_budget']:>10.4f} {r['samples_per_s']:>10.0f} "
              f"{r['straggler_efficiency']:>14.2f} {r['mean_global_batch']:>10.0f}")
    for r in (r for r in rows if "runs" in r):
        times = ", ".join("-" if t is None else f"{t:.1f}" for t in r["time_to_target_runs_s"])
        print(f"{r['config']}: median of {r['runs']} runs; time to {target:.0%} per run: {times} s")


def plot(results: dict[str, dict], scenario: str, target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        points = [(0.0, 0.1)] + [(p["train_s"], p["test_accuracy"]) for p in result["curve"]]
        style = "-" if name.startswith("static") else "-o"
        ax.plot(*zip(*points), style, label=name, linewidth=2 if not name.startswith("static") else 1, markersize=3)
    ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="training time (s)", ylabel="test accuracy", title=f"Fashion-MNIST, 4 workers, scenario {scenario}",
           ylim=(max(0.0, target - 0.25), min(1.0, target + 0.07)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def parse_args() -> argparse.Namespace:
    scenarios = load_scenarios()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(scenarios), default="straggler")
    p.add_argument("--quick", action="store_true", help="short budget and four configurations, for CI")
    p.add_argument("--configs", default=None, help="comma-separated subset of the configurations (default: all; "
                   "--quick: static32,static64,proportional,goodput)")
    p.add_argument("--budget", type=float_in(0, 86400, low_open=True, unit="s"), default=None, help="training seconds per configuration (default 150; --quick 30)")
    p.add_argument("--eval-every", type=float_in(0, 86400, low_open=True, unit="s"), default=None, help="seconds of training between evaluations (default 10)")
    p.add_argument("--target", type=float_in(0.1, 1.0, low_open=True), default=None, help="target test accuracy (default 0.88; --quick 0.6)")
    p.add_argument("--model", choices=("cnn", "resnet8"), default="cnn")
    p.add_argument("--decision-interval", type=int_in(1), default=None, help="steps between policy decisions (default 10; --quick 5)")
    p.add_argument("--ppo-policy", default=None, metavar="NAME|DIR", help="also run --policy ppo with this trained policy: a directory or a library name (`dynamix policy list`)")
    p.add_argument("--repeats", type=int_in(1, 20), default=1, metavar="N",
                   help="run every configuration N times and report the median of each column (default 1)")
    p.add_argument("--seed", type=int, default=42, help="the example's --seed for the first run; run r of --repeats "
                   "uses SEED + r (default 42)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "time_to_accuracy",
                   help="where each run's log directory is kept (default: runs/time_to_accuracy)")
    p.add_argument("--table-only", action="store_true", help="run nothing: redo the table, plot and rows of --out "
                   "(e.g. for another --target)")
    p.add_argument("--append", action="store_true", help="keep the other configurations already in --out "
                   "(same scenario, budget and model), replacing those run now; the table is recomputed for --target")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/time_to_accuracy_<scenario>[_quick].json)")
    args = p.parse_args()
    args.scenario = scenarios[args.scenario]
    if args.ppo_policy and args.ppo_policy.startswith("ppo:"):
        args.ppo_policy = args.ppo_policy[len("ppo:"):]  # bpslaunch's spelling of a library policy
    if args.ppo_policy and not Path(args.ppo_policy).is_dir() and args.ppo_policy not in library.entries():
        p.error(f"--ppo-policy {args.ppo_policy}: neither a policy directory (dynamix policy train --out DIR writes "
                f"one) nor a library policy ({', '.join(library.entries()) or 'none installed'})")
    args.budget = args.budget or (30.0 if args.quick else 150.0)
    args.eval_every = args.eval_every or 10.0
    args.target = args.target or (0.6 if args.quick else 0.88)
    args.decision_interval = args.decision_interval or (5 if args.quick else 10)
    known = configurations(args.ppo_policy, args.decision_interval)
    quick = ["static32", "static64", "proportional", "goodput"] + (["ppo"] if args.ppo_policy else [])
    wanted = [c for c in args.configs.split(",") if c] if args.configs is not None else (quick if args.quick else list(known))
    if args.table_only:
        wanted, args.append = [], True
    elif not wanted:
        p.error("--configs is empty; name at least one configuration")
    unknown = [c for c in wanted if c not in known]
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(known)}"
                + ("" if args.ppo_policy else " (ppo needs --ppo-policy)"))
    args.configs = {c: known[c] for c in wanted}
    suffix = "_quick" if args.quick else ""
    args.out = args.out or RESULTS / f"time_to_accuracy_{args.scenario.name}{suffix}.json"
    if args.table_only and not args.out.exists():
        p.error(f"--table-only: no earlier report {args.out}")
    if args.append and args.out.exists():
        try:
            args.earlier = earlier_results(args)
            args.measured_on = json.loads(args.out.read_text()).get("measured_on")
        except ValueError as error:  # json.JSONDecodeError is one too
            p.error(f"--append: {args.out}: {error}")
        except (KeyError, AttributeError):
            p.error(f"--append: {args.out} is not a time_to_accuracy report")
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"scenario {args.scenario.name}: {args.scenario.description}; budget {args.budget:g} s of training, "
          f"evaluation every {args.eval_every:g} s, target {args.target:.0%}, model {args.model}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    for repeat in range(args.repeats):  # round-robin, so a drift in the machine's load hits every configuration
        for name, config in args.configs.items():
            runs[name].append(run_config(name, config, args.scenario, args, repeat))
            r = summarise(name, runs[name][-1], args.target)
            print(f"  {name} (seed {runs[name][-1]['seed']}): accuracy {r['accuracy_at_budget']:.4f}, "
                  f"{r['samples_per_s']:.0f} samples/s, efficiency {r['straggler_efficiency']:.2f} "
                  f"({runs[name][-1]['run_wall_s']:.0f} s)", flush=True)
    results = {name: done[0] if args.repeats == 1 else {**median_run(done, args.target), "runs": done}
               for name, done in runs.items()}
    if args.append and args.out.exists():
        results = {**args.earlier, **results}
        order = list(configurations("any", args.decision_interval))
        results = dict(sorted(results.items(), key=lambda item: order.index(item[0])))
    rows = [summarise(name, result, args.target) for name, result in results.items()]
    print()
    print_table(rows, args.target)
    png = args.out.with_suffix(".png")
    plot(results, args.scenario.name, args.target, png)
    write_report(args.out, {
        "benchmark": "time_to_accuracy", "scenario": args.scenario.name, "description": args.scenario.description,
        "quick": args.quick, "budget_s": args.budget, "eval_every_s": args.eval_every, "target_accuracy": args.target,
        "model": args.model, "workers": args.scenario.workers, "repeats": args.repeats, "rows": rows, "plot": str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png),
        "results": results,
        "measured_on": args.measured_on if args.table_only else machine(),
    })


def _never_last(seconds: float | None) -> float:
    """A time to target for ordering: never reaching it counts as slower than any time."""
    return math.inf if seconds is None else seconds


def median_run(runs: list[dict], target: float) -> dict:
    """The run whose time to target is the median (its curve is the one plotted)."""
    return sorted(runs, key=lambda run: _never_last(time_to_target(run["curve"], target)))[(len(runs) - 1) // 2]


def earlier_results(args: argparse.Namespace) -> dict[str, dict]:
    """The per-configuration results of an earlier run in ``--out``, if it is the same experiment."""
    earlier = json.loads(args.out.read_text())
    same = tuple(earlier.get(key) for key in ("scenario", "budget_s", "eval_every_s", "model", "quick"))
    if same != (args.scenario.name, args.budget, args.eval_every, args.model, args.quick):
        raise ValueError(f"it holds another experiment (scenario, budget, eval-every, model, quick) = {same}; "
                         "use another --out")
    return {name: r for name, r in earlier["results"].items() if name not in args.configs}


if __name__ == "__main__":
    main()
