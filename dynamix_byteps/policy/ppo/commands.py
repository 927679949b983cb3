"""``dynamix policy train | eval | export | list``: the agent's command-line front end.

``dynamix_byteps.cli`` registers :func:`add_policy_parser`. Training and export import torch and
Ray only when run; ``eval`` needs neither (it runs the exported ONNX file, as the scheduler does).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dynamix_byteps.argtypes import int_in
from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.env import MAX_WORKERS
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.finetune_cli import add_finetune_parser
from dynamix_byteps.policy.ppo.mdp import LADDERS
from dynamix_byteps.scenarios import load_scenarios

__all__ = ["add_policy_parser", "format_table"]

BASELINES = ("static", "proportional", "goodput")


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no scenario")
    return names


def _counts(text: str) -> list[int]:
    """``--workers 4,8,16,32``: worker counts in 1..MAX_WORKERS."""
    parse = int_in(1, MAX_WORKERS, "--workers")
    counts = [parse(x.strip()) for x in text.split(",") if x.strip()]
    if not counts:
        raise argparse.ArgumentTypeError(f"{text!r} names no worker count")
    return counts


def _weight(text: str) -> tuple[str, float]:
    key, sep, raw = text.partition("=")
    try:
        return key.strip(), float(raw) if sep else math.nan
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


def add_policy_parser(sub, usage_error: type[Exception]) -> None:
    """Add ``policy`` with its subcommands to ``sub``; bad usage raises ``usage_error``."""
    p = sub.add_parser("policy", help="train, evaluate and export the PPO batch-size agent",
                       description="Train the DYNAMIX agent (RLlib PPO) in the simulator, compare it with the "
                                   "heuristics, export it for the scheduler (--policy ppo --policy-path DIR).")
    cmds = p.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", required=True)
    scenario_help = f"comma-separated scenario names ({', '.join(load_scenarios())}) or names from --scenario-file"

    t = cmds.add_parser(
        "train", help="train a policy in the simulator (RLlib PPO)",
        description="Train with RLlib PPO (new API stack, sampling in this process, one torch thread) in the\n"
                    "simulator of the given scenarios (or of the fitted profiles of --profiles); write\n"
                    "DIR/checkpoint (RLlib format), DIR/policy.onnx, DIR/features.json and DIR/training.json.\n"
                    "Needs pip install 'dynamix-byteps[rl]'.",
        epilog="exit status: 0 on success, 1 on failure, 2 on bad usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    t.add_argument("--scenario", type=_names, metavar="NAME[,NAME...]", help=scenario_help)
    t.add_argument("--profiles", type=Path, metavar="JSON",
                   help="instead of --scenario and --sim-params: a profiles file (fitted jobs, scenarios held out; "
                        "scripts/build_policy_library.py fit); one profile per episode, perturbed unless --no-randomise")
    t.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    t.add_argument("--iterations", type=int_in(1, what="--iterations"), default=150, metavar="N",
                   help="PPO iterations of 2000 simulated decisions each (default 150, ~5-15 min on 2 cores)")
    t.add_argument("--seed", type=int_in(0, what="--seed"), default=0, metavar="S", help="random seed (default 0)")
    t.add_argument("--workers", type=_counts, default=[4], metavar="N[,N...]",
                   help="simulated workers (default 4); several counts: one is drawn per episode "
                        "(e.g. 4,8,16,32). The policy serves any number either way")
    t.add_argument("--scenario-file", type=Path, metavar="TOML", help="scenarios file (default: the packaged one)")
    t.add_argument("--sim-params", type=Path, metavar="JSON", help="base simulator parameters (SimParams JSON)")
    t.add_argument("--no-randomise", action="store_true", help="train on the scenarios exactly (no domain randomisation)")
    t.add_argument("--reward", type=_weight, action="append", default=[], metavar="KEY=VALUE",
                   help="reward weight: progress, step_time, batch_change or accuracy (repeatable)")
    t.add_argument("--init", type=Path, metavar="CHECKPOINT",
                   help="start from this checkpoint's network (DIR/checkpoint of an earlier training): fine-tuning")
    t.add_argument("--ladder", choices=list(LADDERS), default="coarse",
                   help="action ladder: coarse (÷2, ÷1.4, keep, ×1.4, ×2; default), fine (÷1.4, ÷1.18, keep, ×1.18, "
                        "×1.4) or full (÷2, ÷1.4, ÷1.18, keep, ×1.18, ×1.4, ×2) for jobs whose balanced batches fall "
                        "between the coarse rungs")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=lambda args: _train(args, usage_error))

    e = cmds.add_parser(
        "eval", help="compare a policy with static/proportional/goodput in the simulator",
        description="Run the policy in DIR and the heuristics through the same simulated episodes (same seeds),\n"
                    "all inside the scheduler's guardrails, and print mean return, share of episodes reaching\n"
                    "the target loss, time to target, final accuracy proxy and mean global batch.",
        epilog="exit status: 0 on success, 1 on failure, 2 on bad usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    e.add_argument("policy_dir", type=Path, metavar="DIR", help="a policy directory (policy.onnx + features.json)")
    e.add_argument("--scenario", type=_names, required=True, metavar="NAME[,NAME...]", help=scenario_help)
    e.add_argument("--episodes", type=int_in(1, what="--episodes"), default=5, metavar="E", help="episodes per scenario (default 5)")
    e.add_argument("--seed", type=int_in(0, what="--seed"), default=1000, metavar="S", help="first episode seed (default 1000)")
    e.add_argument("--workers", type=int_in(1, MAX_WORKERS, "--workers"), metavar="N", help="simulated workers (default: the scenario's)")
    e.add_argument("--scenario-file", type=Path, metavar="TOML", help="scenarios file (default: the packaged one)")
    e.add_argument("--sim-params", type=Path, metavar="JSON", help="base simulator parameters (SimParams JSON)")
    e.add_argument("--randomise", action="store_true", help="evaluate on randomised variants of the scenarios")
    e.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    e.set_defaults(func=lambda args: _eval(args, usage_error))

    x = cmds.add_parser(
        "export", help="write policy.onnx + features.json from an RLlib checkpoint",
        description="Load the policy module of CHECKPOINT (every weight, strictly), export it to ONNX with a\n"
                    "dynamic worker axis, check ONNX Runtime reproduces it, and write features.json.",
        epilog="exit status: 0 on success, 1 on failure, 2 on bad usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    x.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="DIR/checkpoint from `dynamix policy train`")
    x.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    x.set_defaults(func=lambda args: _export(args, usage_error))

    add_finetune_parser(cmds, usage_error)

    li = cmds.add_parser(
        "list", help="list the trained policies shipped with the package (--policy ppo:NAME)",
        description="List the policy library: name, model family, optimizer, worker counts and scenarios it\n"
                    "was trained on, and whether this version can serve it.",
        epilog="exit status: 0 on success.", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    li.set_defaults(func=lambda args: _list())


def _base_params(path: Path | None) -> dict | None:
    if path is None:
        return None
    from dynamix_byteps.policy.sim.params import SimParams

    return SimParams.from_json(path).to_dict()


def _profiles(path: Path | None) -> tuple[list, list[str]]:
    if path is None:
        return [], []
    from dynamix_byteps.policy.ppo.mixture import load_profiles

    return load_profiles(path)


def _train(args, usage_error) -> int:
    from dynamix_byteps.policy.ppo.mdp import RewardWeights

    if (args.scenario is None) == (args.profiles is None) or (args.profiles and args.sim_params):
        raise usage_error("give either --scenario (with --sim-params, optionally) or --profiles FILE")
    try:
        weights = RewardWeights.from_dict(dict(args.reward))
        params = _base_params(args.sim_params)
        profiles, held_out = _profiles(args.profiles)
    except ConfigurationError as error:
        raise usage_error(str(error)) from None
    try:
        from dynamix_byteps.policy.ppo.train import train
    except ImportError as error:
        raise ConfigurationError(f"training needs Ray RLlib and torch ({error}): pip install 'dynamix-byteps[rl]'") from None
    try:
        summary = train(args.out, args.scenario or [], iterations=args.iterations, seed=args.seed, workers=args.workers,
                        reward=weights, scenario_file=args.scenario_file, params=params,
                        randomise=not args.no_randomise, progress=not args.quiet, init=args.init, ladder=args.ladder,
                        profiles=profiles, held_out=held_out)
    except ConfigurationError as error:
        raise usage_error(str(error)) from None
    final = summary["final_return"]
    print(f"trained {summary['iterations']} iterations in {summary['seconds']:.0f} s; mean episode return "
          f"{'n/a' if final is None else f'{final:.3f}'} (last iteration)")
    print(f"policy: {args.out} (policy.onnx, features.json); checkpoint: {summary['checkpoint']}")
    return 0


def format_table(rows: list[dict]) -> str:
    """Rows of :func:`~dynamix_byteps.policy.sim.evaluate.compare` as a fixed-width table."""
    head = (f"{'scenario':<14} {'N':>3} {'policy':<13} {'return':>8} {'reached':>7} {'time to target s':>16} "
            f"{'accuracy':>8} {'global batch':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ttt = r["mean_time_to_target_s"]
        lines.append(f"{r['scenario']:<14} {r['workers']:>3} {r['policy']:<13} {r['mean_return']:>8.3f} "
                     f"{100 * r['reached_target']:>6.0f}% {'-' if ttt is None else f'{ttt:.1f}':>16} "
                     f"{r['mean_accuracy']:>8.4f} {r['mean_global_batch']:>12.0f}")
    return "\n".join(lines)


def _eval(args, usage_error) -> int:
    from dynamix_byteps.policy import make_policy
    from dynamix_byteps.policy.ppo.mdp import RewardWeights
    from dynamix_byteps.policy.ppo.serve import PPOPolicy
    from dynamix_byteps.policy.sim.env import scenario_params
    from dynamix_byteps.policy.sim.evaluate import compare
    from dynamix_byteps.policy.sim.params import SimParams, from_scenario
    from dynamix_byteps.scenarios import scenario

    try:
        ppo = PPOPolicy(path=args.policy_dir)
        base = SimParams.from_json(args.sim_params) if args.sim_params else None
        if args.workers:
            jobs = scenario_params(args.scenario, args.workers, base, args.scenario_file)
        else:
            jobs = [from_scenario(scenario(n, args.scenario_file), base=base) for n in args.scenario]
        weights = RewardWeights.from_dict(ppo.metadata.get("training", {}).get("reward"))
    except ConfigurationError as error:
        raise usage_error(str(error)) from None
    policies = {"ppo": ppo, **{name: make_policy(name) for name in BASELINES}}
    rows = compare(policies, jobs, args.episodes, args.seed, weights, args.randomise)
    print(format_table(rows))
    if args.json is not None:
        write_atomic(args.json, json.dumps({"policy": str(args.policy_dir), "episodes": args.episodes,
                                            "seed": args.seed, "randomise": args.randomise, "rows": rows},
                                           indent=2) + "\n")
    return 0


def _list() -> int:
    from dynamix_byteps.policy.ppo.library import entries, library_root, policy_dir

    known = entries()
    print(f"{'name':<16} {'model':<10} {'optimizer':<9} {'workers':<12} {'usable':<6} scenarios / description")
    for name, info in known.items():
        try:
            policy_dir(name)
            usable = "yes"
        except ConfigurationError:
            usable = "no"
        workers = ",".join(str(n) for n in info.get("workers", []))
        print(f"{name:<16} {info.get('model', '?'):<10} {info.get('optimizer', '?'):<9} {workers:<12} {usable:<6} "
              f"{','.join(info.get('scenarios', []))}")
        if info.get("description"):
            print(f"{'':<16} {info['description']}")
    print(f"{len(known)} policies in {library_root()}; use one with --policy ppo:NAME")
    return 0


def _export(args, usage_error) -> int:
    try:
        from dynamix_byteps.policy.ppo.export import export_module, load_module
    except ImportError as error:
        raise ConfigurationError(f"export needs Ray RLlib, torch and onnx ({error}): pip install 'dynamix-byteps[rl]'") from None
    try:
        module = load_module(args.checkpoint)
    except ConfigurationError as error:
        raise usage_error(f"argument CHECKPOINT: {error}") from None
    export_module(module, args.out)
    print(f"exported {args.checkpoint} to {args.out} (policy.onnx, features.json)")
    return 0
