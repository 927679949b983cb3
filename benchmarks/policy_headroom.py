"""How much sooner than the heuristics can any batch-size policy reach the target on a job? A
search over schedules in the fitted simulator, beside the heuristics and a PPO policy.

For each profile of a profiles file (default: the library policy ``small-cnn-sgd``'s
``profiles.json``, one ``dynamix sim fit`` of real runs per CPU scenario), the simulated seconds to
the target loss of:

* ``static`` (the initial batches kept), ``proportional``, ``goodput`` and ``ppo`` (``--ppo-policy``,
  a library name or a policy directory, which is copied beside the report into
  ``policies/<first 12 hex digits of its ONNX file's SHA-256>/``), each inside the scheduler's guardrails;
* **balanced schedules**, which know the profile's fitted speeds: every worker's local batch set so
  that all finish their compute together (``b_i = θ_i·(T − a_i)`` with ``Σ b_i = G``, at least the
  job's minimum batch), the global batch ``G`` either constant or in two phases (``G0`` until the
  progress fraction reaches ``f``, then ``G1``, the "large early, small late" rhythm and its
  reverse), over ``--grid`` × ``--grid`` × ``--switch``.

The best schedule is chosen on ``--episodes`` tuning episodes (seeds from ``--seed``) and measured,
like every policy, on as many other episodes (the next seeds: the same jitter draws for all).
``headroom`` is the best schedule's mean time over the best heuristic's, with a 90% bootstrap
interval that resamples the evaluation episodes in pairs, and the verdict of
:func:`common.verdict`. A headroom near 1 says no per-worker batch choice of this kind can beat the
heuristic on the job by much: a benchmark of real runs could not tell a better policy apart from
it within its run-to-run spread.

``--initial-batch B`` starts every worker at the local batch ``B`` instead of the fitted runs'
batches: the job as a user who picked another batch size would start it. ``static`` keeps ``B``,
the heuristics and PPO start from it, and the schedules do not depend on it. The simulator's
references to the initial global batch (the batch free of a generalisation gap, the loss noise
at M0) stay the fitted job's, so only the start moves.

    python benchmarks/policy_headroom.py [--profiles FILE] [--ppo-policy NAME|DIR] [--initial-batch B] [--episodes 8] [--quick] [--out PATH]

Prints the table and writes JSON (default ``benchmarks/results/policy_headroom.json``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import (
    RESULTS,
    keep_policy,
    markdown_table,
    paired_ratio_interval,
    policy_identity,
    publish,
    run_main,
    shown_path,
    text_table,
    verdict,
)

from dynamix_byteps.argtypes import int_in, output_path
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import make_policy
from dynamix_byteps.policy.ppo.library import library_root
from dynamix_byteps.policy.ppo.mixture import load_profiles
from dynamix_byteps.policy.sim.dynamics import Simulator
from dynamix_byteps.policy.sim.evaluate import run_episode
from dynamix_byteps.policy.sim.params import SimParams, starting_at

LIBRARY_POLICY = "small-cnn-sgd"
HEURISTICS = ("proportional", "goodput")
GRID = (64, 96, 128, 192, 256, 384, 512, 768)
SWITCH = (0.25, 0.5, 0.75)
QUICK = {"grid": (128, 256, 512), "switch": (0.5,), "episodes": 2}
SEED = 100


def balanced(params: SimParams, global_batch: int) -> np.ndarray:
    """Local batches (int64, shape (N,)) that sum to about ``global_batch`` samples and end every
    worker's compute together under the profile's fitted ``a_i + b/θ_i`` (seconds), clipped to the
    job's bounds as the simulator clips them (then the sum differs: what runs is what is returned)."""
    fixed = np.array([w.fixed_s for w in params.workers])
    rate = np.array([w.samples_per_s for w in params.workers])
    compute_s = (global_batch + (fixed * rate).sum()) / rate.sum()
    return np.clip(np.round(rate * (compute_s - fixed)), params.min_batch, params.max_batch).astype(np.int64)


def schedule_times(params: SimParams, first: int, then: int, switch: float, seeds) -> list[float]:
    """Seconds to the target loss of the balanced schedule ``first`` -> ``then`` (global batches)
    at progress fraction ``switch``, one per seed (inf where the episode ended first)."""
    times = []
    for seed in seeds:
        sim = Simulator(params, rng=np.random.default_rng(seed))
        sim.reset()
        while not sim.done:
            sim.step(balanced(params, first if sim.fraction() < switch else then))
        times.append(np.inf if sim.time_to_target is None else sim.time_to_target)
    return times


def _policy_times(policy, params: SimParams, seeds) -> list[float]:
    return [np.inf if r.time_to_target_s is None else r.time_to_target_s
            for r in (run_episode(policy, params, seed) for seed in seeds)]


def headroom(params: SimParams, ppo, grid, switch, episodes: int, seed: int = SEED) -> dict:
    """One profile's row (module docstring): every policy's and the best schedules' per-episode
    seconds on the evaluation seeds, the schedules chosen on the tuning seeds, and the headroom."""
    tuning, evaluation = range(seed, seed + episodes), range(seed + episodes, seed + 2 * episodes)
    policies = {"static": make_policy("static"), **{name: make_policy(name) for name in HEURISTICS}}
    if ppo is not None:
        policies["ppo"] = ppo
    times = {name: _policy_times(policy, params, evaluation) for name, policy in policies.items()}
    runnable = sorted({int(balanced(params, g).sum()) for g in grid})  # the global batches that run: bounds clip
    candidates = [(g, g, 1.0) for g in runnable] + [(a, b, f) for a, b in itertools.permutations(runnable, 2)
                                                     for f in sorted(set(switch))]
    tuned = {c: float(np.mean(schedule_times(params, *c, tuning))) for c in candidates}
    constant = min((c for c in candidates if c[0] == c[1]), key=tuned.get)
    best = min(candidates, key=tuned.get)
    times["best constant"] = schedule_times(params, *constant, evaluation)
    times["best schedule"] = schedule_times(params, *best, evaluation)
    heuristic = min(HEURISTICS, key=lambda name: np.mean(times[name]))
    row = {"times": {name: [_json_seconds(t) for t in ts] for name, ts in times.items()},
           "best_constant": list(constant[:1]), "best_schedule": list(best), "best_heuristic": heuristic,
           "headroom": None, "headroom_interval": [None, None], "candidates": len(candidates)}
    missed = [name for name in ("best schedule", heuristic) if not np.all(np.isfinite(times[name]))]
    if missed:  # a mean over an episode that never reached the target is no time: nothing to compare
        return {**row, "verdict": f"n/a: {' and '.join(missed)} missed the target in some episode"}
    ratios = paired_ratio_interval(times["best schedule"], times[heuristic], statistic=np.mean)
    return {**row, "headroom": float(np.mean(times["best schedule"]) / np.mean(times[heuristic])),
            "headroom_interval": ratios, "verdict": verdict(ratios)}


def _json_seconds(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None  # JSON has no infinity: None is "never reached"


def _seconds(times: list[float | None]) -> str:
    return "-" if None in times else f"{np.mean(times):.1f}"


def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per profile, each policy's mean seconds to the target, the best schedules
    and the headroom against the best heuristic."""
    names = report["policies"]
    header = ["profile", *(f"{name} s" for name in names), "best constant s (G)", "best schedule s (G0 -> G1 at f)",
              "best / best heuristic [90%]"]
    lines = []
    for row in report["rows"]:
        t = row["times"]
        first, then, switch = row["best_schedule"]
        plan = f"{first}" if first == then else f"{first} -> {then} at {switch:g}"
        if row["headroom"] is None:
            compared = row["verdict"]
        else:
            low, high = row["headroom_interval"]
            compared = f"{row['headroom']:.3f} [{low:.3f}, {high:.3f}] {row['verdict']} vs {row['best_heuristic']}"
        lines.append([row["profile"], *(_seconds(t[name]) for name in names),
                      f"{_seconds(t['best constant'])} ({row['best_constant'][0]})", f"{_seconds(t['best schedule'])} ({plan})",
                      compared])
    return header, lines


def markdown(report: dict) -> str:
    """The table as GitHub markdown."""
    return markdown_table(*table(report))


def _global_batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of global batches, e.g. 128,256") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every global batch must be >= 1 sample")
    return values


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of fractions, e.g. 0.25,0.5") from None
    if not values or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every progress fraction must be in (0, 1)")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, default=library_root() / LIBRARY_POLICY / "profiles.json",
                        help=f"profiles file (default: {LIBRARY_POLICY}'s)")
    parser.add_argument("--ppo-policy", default=LIBRARY_POLICY, metavar="NAME|DIR",
                        help="library name or policy directory ('none' to leave ppo out)")
    parser.add_argument("--grid", type=_global_batches, default=None, help=f"global batches (default {','.join(map(str, GRID))})")
    parser.add_argument("--switch", type=_fractions, default=None, help="progress fractions of the two-phase switch")
    parser.add_argument("--episodes", type=int_in(1, 1000, "episodes"), default=None,
                        help="tuning episodes, and as many evaluation ones (default 8)")
    parser.add_argument("--seed", type=int_in(0, what="seed"), default=SEED, help="first episode seed, >= 0")
    parser.add_argument("--initial-batch", type=int_in(1, what="initial batch"), default=None, metavar="B",
                        help="every worker's starting local batch (default: the fitted runs')")
    parser.add_argument("--quick", action="store_true", help="a small grid and 2 episodes (a smoke test)")
    parser.add_argument("--out", type=output_path("file", "policy_headroom.json"), default=None,
                        help="report file (default benchmarks/results/policy_headroom.json; with --quick, "
                             "policy_headroom_quick.json in the temporary directory)")
    args = parser.parse_args(argv)
    grid = args.grid or (QUICK["grid"] if args.quick else GRID)
    switch = args.switch or (QUICK["switch"] if args.quick else SWITCH)
    episodes = args.episodes or (QUICK["episodes"] if args.quick else 8)
    out = args.out or (Path(tempfile.gettempdir()) / "policy_headroom_quick.json" if args.quick
                       else RESULTS / "policy_headroom.json")
    try:
        profiles, held_out = load_profiles(args.profiles)
        ppo = None
        if args.ppo_policy != "none":
            from dynamix_byteps.policy.ppo import PPOPolicy

            is_dir = Path(args.ppo_policy).is_dir()
            ppo = PPOPolicy(path=args.ppo_policy) if is_dir else PPOPolicy(name=args.ppo_policy)
    except ConfigurationError as error:
        print(f"policy_headroom: {error}", file=sys.stderr)
        return 2
    outside = [p.name for p in profiles if args.initial_batch is not None
               and not p.params.min_batch <= args.initial_batch <= p.params.max_batch]
    if outside:
        print(f"policy_headroom: --initial-batch {args.initial_batch} is outside the local batch bounds of "
              f"profile(s) {outside}; choose one within them", file=sys.stderr)
        return 2
    rows = []
    for profile in profiles:
        params = (profile.params if args.initial_batch is None
                  else starting_at(profile.params, (args.initial_batch,) * profile.params.num_workers))
        row = headroom(params, ppo, grid, switch, episodes, args.seed)
        rows.append({"profile": profile.name, "scenario": profile.scenario, **row})
        print(f"{profile.name}: {row['candidates']} schedules searched", file=sys.stderr, flush=True)
    report = {"benchmark": "policy_headroom", "profiles_file": shown_path(args.profiles), "held_out": held_out,
              "ppo_policy": keep_policy(policy_identity(args.ppo_policy), out.parent) if ppo is not None else None, "quick": args.quick,
              "initial_batch": args.initial_batch, "grid": list(grid), "switch": list(switch), "episodes": episodes,
              "seed": args.seed, "policies": ["static", *HEURISTICS, *(["ppo"] if ppo is not None else [])],
              "rows": rows}
    return publish("policy_headroom", out, report, text_table(*table(report)))


if __name__ == "__main__":
    run_main(main)
