"""``dynamix``: the command-line tool of dynamix_byteps.

Subcommands, one module each with the same shape: ``add_parser(subparsers)`` adds the subcommand
and sets ``run``, the function :func:`main` calls with the parsed arguments; bad usage raises
:class:`~dynamix_byteps.errors.UsageError`::

    dynamix scheduler --num-workers 4 --policy proportional --run-dir runs/a --port-file runs/a/port
    dynamix agent --job J --scheduler HOST:PORT                           (this host's node agent)
    dynamix policy train --scenario straggler,two-speed --out policies/p   (also: policy eval, export, finetune, list)
    dynamix sim fit runs/a                                                (simulator parameters of a run)
    dynamix report runs/a

Only argparse and the flags' types are imported here; each run function imports what it runs
(gRPC, torch, Ray), so ``dynamix --help`` stays light.

Exit status: 0 on success (and on SIGTERM/SIGINT after a graceful stop), 1 on failure
(a port that cannot be bound, a policy that cannot be loaded), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from dynamix_byteps import __version__
from dynamix_byteps.cli import agent, policy, report, scheduler, sim
from dynamix_byteps.errors import DynamixError, UsageError

__all__ = ["PROG", "build_parser", "main"]

PROG = "dynamix"


def build_parser() -> argparse.ArgumentParser:
    """The ``dynamix`` parser with every subcommand; the parsed namespace's ``run(args)`` runs it."""
    parser = argparse.ArgumentParser(prog=PROG, description="dynamix_byteps: per-worker dynamic batch sizes for data-parallel training.")
    parser.add_argument("--version", action="version", version=f"dynamix_byteps {__version__}")
    # not required=True: argparse would then answer `dynamix --bogus` with "required: COMMAND"
    # instead of naming --bogus; main() asks for the command itself
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (scheduler, agent, policy, sim, report):
        command.add_parser(sub)
    for command_parser in sub.choices.values():  # a run's usage error shows its subcommand's usage
        command_parser.set_defaults(usage=command_parser.format_usage)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dynamix``; returns the exit code (0 ok, 1 failure, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.command is None:
            parser.error("the following arguments are required: COMMAND")
    except SystemExit as stop:  # --help (0) or bad usage (2)
        return stop.code if isinstance(stop.code, int) else 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except UsageError as error:
        print(args.usage(), end="", file=sys.stderr)
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (DynamixError, OSError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 1
