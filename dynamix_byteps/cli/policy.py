"""``dynamix policy train | eval | export | finetune | list``: the agent's command-line front end.

Training, export and fine-tuning import torch and Ray only when run; ``eval`` needs neither (it
runs the exported ONNX file, as the scheduler does). ``bpslaunch --policy ppo --fine-tune`` starts
``dynamix policy finetune`` beside the scheduler (:func:`trainer_argv`) and stops it with the job.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from dynamix_byteps.argtypes import float_in, int_in, output_path
from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.env import MAX_WORKERS
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.policy.ppo.imitate import DEADBAND, TEACHERS
from dynamix_byteps.policy.ppo.mdp import LADDERS
from dynamix_byteps.policy.ppo.policy_format import read_metadata, trained_reward
from dynamix_byteps.policy.ppo.served import prepare_served
from dynamix_byteps.scenarios import load_scenarios, scenario

__all__ = ["add_parser", "format_table", "run_eval", "run_export", "run_finetune", "run_list", "run_train", "trainer_argv"]

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
    key, _, raw = text.partition("=")
    try:
        return key.strip(), float(raw)  # no '=': raw is "", which float() refuses
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


def add_parser(sub) -> None:
    """Add ``policy`` with its subcommands to the ``dynamix`` subcommands ``sub``."""
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
    t.add_argument("--out", type=output_path("dir"), required=True, metavar="DIR", help="output directory")
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
    start = t.add_mutually_exclusive_group()
    start.add_argument("--init", type=Path, metavar="CHECKPOINT",
                       help="start from this checkpoint's network (DIR/checkpoint of an earlier training): fine-tuning")
    start.add_argument("--imitate", choices=TEACHERS, metavar="HEURISTIC",
                       help=f"start from a network cloned from this heuristic ({', '.join(TEACHERS)}) in the training "
                            "simulator, so PPO starts at its return and looks for where to differ")
    t.add_argument("--imitation-deadband", type=float, default=None, metavar="FRACTION",
                   help=f"with --imitate: a size change of the heuristic under this fraction is cloned as 'keep' "
                        f"(default {DEADBAND}; keep it under the ladder's smallest rung, 0.18)")
    t.add_argument("--ladder", choices=list(LADDERS), default="coarse",
                   help="action ladder: coarse (÷2, ÷1.4, keep, ×1.4, ×2; default), fine (÷1.4, ÷1.18, keep, ×1.18, "
                        "×1.4) or full (÷2, ÷1.4, ÷1.18, keep, ×1.18, ×1.4, ×2) for jobs whose balanced batches fall "
                        "between the coarse rungs")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(run=run_train)

    e = cmds.add_parser(
        "eval", help="compare a policy with static/proportional/goodput in the simulator",
        description="Run the policy in DIR and the heuristics through the same simulated episodes (same seeds),\n"
                    "all inside the scheduler's guardrails, and print mean return, share of episodes reaching\n"
                    "the target loss, time to target, final accuracy proxy and mean global batch.",
        epilog="exit status: 0 on success, 1 on failure, 2 on bad usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    e.add_argument("policy_dir", metavar="DIR|NAME",
                   help="a policy directory (policy.onnx + features.json) or a library policy (`dynamix policy list`)")
    e.add_argument("--scenario", type=_names, required=True, metavar="NAME[,NAME...]", help=scenario_help)
    e.add_argument("--episodes", type=int_in(1, what="--episodes"), default=5, metavar="E", help="episodes per scenario (default 5)")
    e.add_argument("--seed", type=int_in(0, what="--seed"), default=1000, metavar="S", help="first episode seed (default 1000)")
    e.add_argument("--workers", type=int_in(1, MAX_WORKERS, "--workers"), metavar="N", help="simulated workers (default: the scenario's)")
    e.add_argument("--scenario-file", type=Path, metavar="TOML", help="scenarios file (default: the packaged one)")
    e.add_argument("--sim-params", type=Path, metavar="JSON", help="base simulator parameters (SimParams JSON)")
    e.add_argument("--randomise", action="store_true", help="evaluate on randomised variants of the scenarios")
    e.add_argument("--json", type=output_path("file"), metavar="PATH", help="also write the rows as JSON")
    e.set_defaults(run=run_eval)

    x = cmds.add_parser(
        "export", help="write policy.onnx + features.json from an RLlib checkpoint",
        description="Load the policy module of CHECKPOINT (every weight, strictly), export it to ONNX with a\n"
                    "dynamic worker axis, check ONNX Runtime reproduces it, and write features.json.",
        epilog="exit status: 0 on success, 1 on failure, 2 on bad usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    x.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="DIR/checkpoint from `dynamix policy train`")
    x.add_argument("--out", type=output_path("dir"), required=True, metavar="DIR", help="output directory")
    x.set_defaults(run=run_export)

    _add_finetune(cmds)

    li = cmds.add_parser(
        "list", help="list the trained policies shipped with the package (--policy ppo:NAME)",
        description="List the policy library: name, model family, optimizer, worker counts and scenarios it\n"
                    "was trained on, and whether this version can serve it.",
        epilog="exit status: 0 on success.", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    li.set_defaults(run=run_list)


def _add_finetune(cmds) -> None:
    """Add ``finetune`` to the ``dynamix policy`` subcommands ``cmds``."""
    f = cmds.add_parser(
        "finetune", help="update a served policy from the scheduler's decision log (online fine-tuning)",
        description="Follow RUN/decisions.jsonl of a scheduler serving --policy ppo from --policy-path DIR; every\n"
                    "--every decisions of the generation in force, run RLlib's Learner.update (PPO) on them,\n"
                    "export and check a new ONNX, and publish it as the next generation in DIR (the scheduler\n"
                    "swaps it in). A generation whose mean reward over its first --window decisions falls below\n"
                    "the previous mean - K * std is rolled back. Events go to RUN/finetune.jsonl. Runs until\n"
                    "SIGTERM or Ctrl-C. Needs pip install 'dynamix-byteps[rl]'.",
        epilog="exit status: 0 when stopped by a signal, 1 on failure, 2 on bad usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    f.add_argument("--run-dir", type=Path, required=True, metavar="RUN", help="the scheduler's --run-dir")
    f.add_argument("--policy-path", type=Path, required=True, metavar="DIR",
                   help="the policy directory the scheduler serves; generations are published here")
    f.add_argument("--checkpoint", type=Path, metavar="CKPT",
                   help="RLlib checkpoint of that policy (default DIR/checkpoint)")
    f.add_argument("--every", type=int_in(2, what="--every"), default=64, metavar="N",
                   help="decisions per update (default 64)")
    f.add_argument("--window", type=int_in(1, what="--window"), default=16, metavar="M",
                   help="decisions a new generation is judged on before it is kept (default 16)")
    f.add_argument("--collapse-k", type=float_in(0.0), default=2.0, metavar="K",
                   help="roll back when the window's mean reward < previous mean - K * std (default 2)")
    f.add_argument("--lr", type=float_in(0.0, low_open=True), default=1e-4, metavar="LR", help="learning rate (default 1e-4)")
    f.add_argument("--epochs", type=int_in(1, what="--epochs"), default=4, metavar="E",
                   help="passes over each batch (default 4)")
    f.add_argument("--poll", type=float_in(0.0, low_open=True), default=2.0, metavar="S",
                   help="seconds between reads of the decision log (default 2)")
    f.add_argument("--seed", type=int_in(0, what="--seed"), default=0, metavar="S", help="torch seed (default 0)")
    f.set_defaults(run=run_finetune)


def run_finetune(args: argparse.Namespace) -> int:
    """Fine-tune until SIGTERM/SIGINT; 0 then. UsageError for a run or policy it cannot follow."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        from dynamix_byteps.policy.ppo.finetune import FineTuner
    except ImportError as error:
        raise ConfigurationError(f"fine-tuning needs Ray RLlib and torch ({error}): "
                                 "pip install 'dynamix-byteps[rl]'") from None
    try:
        tuner = FineTuner(args.run_dir, args.policy_path, checkpoint=args.checkpoint, every=args.every,
                          window=args.window, collapse_k=args.collapse_k, lr=args.lr, epochs=args.epochs,
                          seed=args.seed)
    except (ConfigurationError, FileNotFoundError) as error:
        raise UsageError(str(error)) from None
    print(f"fine-tuning {args.policy_path} from {args.run_dir / 'decisions.jsonl'} (generation {tuner.generation})",
          file=sys.stderr, flush=True)
    tuner.run(args.poll, stop)
    return 0


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


def run_train(args: argparse.Namespace) -> int:
    """Train and export; UsageError for bad scenario/profile/reward flags, ConfigurationError without Ray RLlib."""
    from dynamix_byteps.policy.ppo.mdp import RewardWeights

    if (args.scenario is None) == (args.profiles is None) or (args.profiles and args.sim_params):
        raise UsageError("give either --scenario (with --sim-params, optionally) or --profiles FILE")
    try:  # before Ray's import, which takes seconds
        for name in args.scenario or ():
            scenario(name, args.scenario_file)
    except ConfigurationError as error:
        raise UsageError(f"argument --scenario: {error}") from None
    try:
        weights = RewardWeights.from_dict(dict(args.reward))
        params = _base_params(args.sim_params)
        profiles, held_out = _profiles(args.profiles)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    if args.imitation_deadband is not None and args.imitate is None:
        raise UsageError("argument --imitation-deadband: it sets what a clone of a heuristic counts as 'keep'; "
                         "give --imitate HEURISTIC too, or leave it out")
    try:
        from dynamix_byteps.policy.ppo.train import train
    except ImportError as error:
        raise ConfigurationError(f"training needs Ray RLlib and torch ({error}): pip install 'dynamix-byteps[rl]'") from None
    try:
        summary = train(args.out, args.scenario or [], iterations=args.iterations, seed=args.seed, workers=args.workers,
                        reward=weights, scenario_file=args.scenario_file, params=params,
                        randomise=not args.no_randomise, progress=not args.quiet, init=args.init, ladder=args.ladder,
                        profiles=profiles, held_out=held_out, imitate=args.imitate,
                        imitation_deadband=DEADBAND if args.imitation_deadband is None else args.imitation_deadband)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    final = summary["final_return"]
    if summary["imitation"]:
        cloned = summary["imitation"]
        print(f"started from a clone of {cloned['teacher']}: {cloned['agreement']:.0%} of its decisions "
              f"({cloned['decisions']} in {cloned['episodes']} episodes, mean return {cloned['teacher_mean_return']:.3f})")
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


def run_eval(args: argparse.Namespace) -> int:
    """Compare the policy with the heuristics and print the table; UsageError for a bad policy, scenario or parameters."""
    from dynamix_byteps.policy import make_policy
    from dynamix_byteps.policy.ppo import library
    from dynamix_byteps.policy.ppo.serve import PPOPolicy
    from dynamix_byteps.policy.sim.env import scenario_params
    from dynamix_byteps.policy.sim.evaluate import compare
    from dynamix_byteps.policy.sim.params import SimParams, from_scenario

    try:
        ppo = PPOPolicy(path=library.resolve(args.policy_dir))
        base = SimParams.from_json(args.sim_params) if args.sim_params else None
        if args.workers:
            jobs = scenario_params(args.scenario, args.workers, base, args.scenario_file)
        else:
            jobs = [from_scenario(scenario(n, args.scenario_file), base=base) for n in args.scenario]
        weights = trained_reward(ppo.directory, ppo.metadata)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    policies = {"ppo": ppo, **{name: make_policy(name) for name in BASELINES}}
    rows = compare(policies, jobs, args.episodes, args.seed, weights, args.randomise)
    print(format_table(rows))
    if args.json is not None:
        write_atomic(args.json, json.dumps({"policy": args.policy_dir, "episodes": args.episodes,
                                            "seed": args.seed, "randomise": args.randomise, "rows": rows},
                                           indent=2) + "\n")
    return 0


def run_list(args: argparse.Namespace) -> int:
    """Print the policy library."""
    from dynamix_byteps.policy.ppo.library import entries, library_root, policy_dir

    known = entries()
    width = max([16, *map(len, known)])
    print(f"{'name':<{width}} {'model':<10} {'optimizer':<9} {'workers':<12} {'usable':<6} scenarios / description")
    for name, info in known.items():
        try:
            policy_dir(name)
            usable = "yes"
        except ConfigurationError:
            usable = "no"
        workers = ",".join(str(n) for n in info.get("workers", []))
        print(f"{name:<{width}} {info.get('model', '?'):<10} {info.get('optimizer', '?'):<9} {workers:<12} {usable:<6} "
              f"{','.join(info.get('scenarios', []))}")
        if info.get("description"):
            print(f"{'':<{width}} {info['description']}")
    print(f"{len(known)} policies in {library_root()}; use one with --policy ppo:NAME")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Export the checkpoint; UsageError for an unloadable CHECKPOINT, ConfigurationError without Ray/torch/onnx."""
    try:
        from dynamix_byteps.policy.ppo.export import export_module, load_module
    except ImportError as error:
        raise ConfigurationError(f"export needs Ray RLlib, torch and onnx ({error}): pip install 'dynamix-byteps[rl]'") from None
    try:
        module = load_module(args.checkpoint)
    except ConfigurationError as error:
        raise UsageError(f"argument CHECKPOINT: {error}") from None
    export_module(module, args.out)
    print(f"exported {args.checkpoint} to {args.out} (policy.onnx, features.json)")
    return 0


def trainer_argv(source: Path, run_dir: Path, every: int = 64) -> tuple[list[str], Path]:
    """``(argv, served directory)`` of the trainer ``bpslaunch --fine-tune`` runs for the trained
    policy ``source`` (which must hold the RLlib ``checkpoint/``), one update per ``every`` decisions.

    Raises:
        ConfigurationError: ``source`` has no checkpoint or is not a valid policy directory.
    """
    source = Path(source)
    directory, _ = read_metadata(source)
    checkpoint = directory / "checkpoint"
    if not checkpoint.is_dir():
        raise ConfigurationError(f"{directory} has no RLlib checkpoint/ to fine-tune from; use the directory written by "
                                 "`dynamix policy train --out DIR`")
    served = prepare_served(directory, run_dir)
    argv = [sys.executable, "-m", "dynamix_byteps.cli", "policy", "finetune", "--run-dir", str(run_dir),
            "--policy-path", str(served), "--checkpoint", str(checkpoint.resolve()), "--every", str(every),
            "--window", str(max(1, every // 4))]
    return argv, served
