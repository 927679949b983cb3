"""``dynamix report``: plots and a summary table of a recorded run (:mod:`dynamix_byteps.report`, imported when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynamix_byteps.argtypes import output_path
from dynamix_byteps.errors import UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Add ``report`` to the ``dynamix`` subcommands ``sub``."""
    p = sub.add_parser(
        "report",
        help="draw PNG plots and print a summary table of a recorded run",
        description=(
            "Read the TensorBoard scalars of a run recorded with `bpslaunch --log-dir RUN_DIR` (under torchrun:\n"
            "DYNAMIX_LOG_DIR=RUN_DIR in the workers' environment, `dynamix scheduler --run-dir RUN_DIR`) and write\n"
            "batch_size.png (batch size per worker over wall time), loss_accuracy.png (loss and logged\n"
            "accuracy against wall time) and step_time.png (step time per worker); print per-worker means\n"
            "and the job's wall time, steps and final accuracy/loss."
        ),
        epilog="exit status: 0 on success, 1 when the plots cannot be written, 2 when RUN_DIR holds no run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's --log-dir or DYNAMIX_LOG_DIR (or its tensorboard/ folder)")
    p.add_argument("--out", type=output_path("dir"), metavar="DIR", help="where the PNGs go (default: RUN_DIR)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Write the plots and print the table; UsageError when RUN_DIR holds no run."""
    from dynamix_byteps.report import RunDirError, write_report

    try:
        paths, table = write_report(args.run_dir, args.out)
    except RunDirError as error:
        raise UsageError(f"argument RUN_DIR: {error}") from None
    print(table)
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0
