"""``dynamix policy finetune``: the online fine-tuning trainer process (:mod:`.finetune`).

Only argparse here: torch and Ray are imported when the command runs. ``bpslaunch --policy ppo
--fine-tune`` starts this command beside the scheduler (:func:`trainer_argv`) and stops it with
the job.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading
from pathlib import Path

from dynamix_byteps.argtypes import float_in, int_in
from dynamix_byteps.errors import ConfigurationError

__all__ = ["SERVED_DIR", "add_finetune_parser", "prepare_served", "trainer_argv"]

#: Where ``bpslaunch --fine-tune`` keeps the policy the scheduler serves, inside the run directory.
SERVED_DIR = "policy"


def add_finetune_parser(cmds, usage_error: type[Exception]) -> None:
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
    f.set_defaults(func=lambda args: _finetune(args, usage_error))


def _finetune(args, usage_error) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
        raise usage_error(str(error)) from None
    print(f"fine-tuning {args.policy_path} from {args.run_dir / 'decisions.jsonl'} (generation {tuner.generation})",
          file=sys.stderr, flush=True)
    tuner.run(args.poll, stop)
    return 0


def prepare_served(source: Path, run_dir: Path) -> Path:
    """Copy the policy files of ``source`` to ``run_dir/policy`` (kept if already there: a
    restarted job goes on from its newest generation); return that directory. The trained
    policy itself is never modified.

    Raises:
        ConfigurationError: ``source`` is not a policy directory, or ``run_dir/policy`` holds a
            copy of another policy (a reused --log-dir).
    """
    from dynamix_byteps.policy.ppo.policy_format import (
        FEATURES_FILE,
        POLICY_FILE,
        read_metadata,
    )

    served = Path(run_dir) / SERVED_DIR
    directory, _ = read_metadata(source)
    if (served / FEATURES_FILE).is_file():
        if (served / FEATURES_FILE).read_bytes() != (directory / FEATURES_FILE).read_bytes():
            raise ConfigurationError(f"{served} holds the fine-tuning of another policy than {directory}; give this "
                                     f"job a new --log-dir, or remove {served} to start again from {directory}")
    else:
        staging = served.with_name(f".{SERVED_DIR}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in (POLICY_FILE, FEATURES_FILE):
            shutil.copy2(directory / name, staging / name)
        shutil.rmtree(served, ignore_errors=True)
        staging.rename(served)
    return served


def trainer_argv(source: Path, run_dir: Path, every: int = 64) -> tuple[list[str], Path]:
    """``(argv, served directory)`` of the trainer ``bpslaunch --fine-tune`` runs for the trained
    policy ``source`` (which must hold the RLlib ``checkpoint/``), one update per ``every`` decisions.

    Raises:
        ConfigurationError: ``source`` has no checkpoint or is not a valid policy directory.
    """
    source = Path(source)
    from dynamix_byteps.policy.ppo.policy_format import read_metadata

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
