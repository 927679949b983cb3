"""``bpslaunch``'s command line: the flags, parsed and validated into one :class:`LaunchConfig`.

:func:`parse_args` is the whole step (argparse, then :func:`config_from_args`); a bad flag is an
argparse error (``SystemExit(2)``) or a :class:`~dynamix_byteps.errors.UsageError` naming the flag.
Files the flags name are checked here, once: ``--checkpoint``'s directory is created and must be
writable, ``--tls-*`` must be readable PEM files that fit together.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from dynamix_byteps import __version__
from dynamix_byteps.agent.base import MONITORS
from dynamix_byteps.argtypes import float_in, int_in, key_value
from dynamix_byteps.engine.ps_rendezvous import MAX_SERVERS
from dynamix_byteps.env import (
    CHECKPOINT_ENV,
    DEFAULT_DECISION_INTERVAL,
    ENGINES,
    MAX_TIMEOUT_S,
    MAX_WORKERS,
    parse_batch_sizes,
    parse_slowdown,
)
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.config import DEFAULT_GRACE_S, PROG, LaunchConfig
from dynamix_byteps.launcher.supervisor import SETTLE_S
from dynamix_byteps.policy import POLICIES, option_names
from dynamix_byteps.scaling.lr_scaling import RULES

__all__ = ["DEFAULT_GRACE_S", "PROG", "LaunchConfig", "build_parser", "config_from_args", "parse_args", "parse_hosts"]

_positive_int = int_in(1)
_num_workers = int_in(1, MAX_WORKERS, "number of workers")
_seconds = float_in(0.0, MAX_TIMEOUT_S, low_open=True, unit=" seconds (at most 7 days)")
_port = int_in(1, 65535, "TCP port")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage="%(prog)s [--num-workers N] [options] [--] COMMAND [ARGS ...]",
        description=(
            "Start the worker processes of a dynamix_byteps job: COMMAND runs once per worker,\n"
            "with the rendezvous and rank variables set, and its output prefixed with [rank]."
        ),
        epilog=(
            "examples:\n"
            "  bpslaunch --num-workers 4 -- python train.py\n"
            "  bpslaunch -n 2 --batch-size 64 --log-dir runs/a -- python train.py --epochs 3\n\n"
            "environment mode (no --num-workers), as BytePS's bpslaunch:\n"
            "  DMLC_ROLE          worker | server | scheduler\n"
            "  DMLC_NUM_WORKER    number of worker nodes (machines)\n"
            "  DMLC_WORKER_ID     this node's index, 0..DMLC_NUM_WORKER-1 (workers only)\n"
            "  DMLC_PS_ROOT_URI   host of the rendezvous (global rank 0 listens there)\n"
            "  DMLC_PS_ROOT_PORT  its TCP port\n"
            "  BYTEPS_LOCAL_SIZE  worker processes on this node (default: one per\n"
            "                     NVIDIA_VISIBLE_DEVICES entry, else 1)\n\n"
            "each worker gets DMLC_ROLE, DMLC_NUM_WORKER, DMLC_WORKER_ID, BYTEPS_LOCAL_SIZE,\n"
            "BYTEPS_LOCAL_RANK, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DYNAMIX_ENGINE and, when\n"
            "given, DYNAMIX_BATCH_SIZE, DYNAMIX_LOG_DIR, DYNAMIX_TIMEOUT. Global rank =\n"
            "DMLC_WORKER_ID * BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK in environment mode; bpslaunch's\n"
            "own modes also set DYNAMIX_RANK_OFFSET and DYNAMIX_SIZE: global rank =\n"
            "DYNAMIX_RANK_OFFSET + BYTEPS_LOCAL_RANK, of DYNAMIX_SIZE workers.\n\n"
            "exit status: 0 if every worker succeeds; else the first worker's non-zero code;\n"
            "2 bad usage or environment; 127 command not found; 128+N on signal N."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"dynamix_byteps {__version__}")
    parser.add_argument(
        "-n", "-np", "--num-workers", type=_num_workers, metavar="N",
        help=f"run N (at most {MAX_WORKERS}) local worker processes on this machine (local mode; -np as "
        "horovodrun and mpirun spell it); "
        "without it, the DMLC_* environment decides (BytePS environment mode)",
    )
    parser.add_argument(
        "--engine", choices=ENGINES, default=None,
        help="communication engine (default: $DYNAMIX_ENGINE, else gloo): gloo (CPU tensors), nccl (CUDA "
        "tensors, a GPU per worker), auto (nccl when every worker on this host gets a GPU, else gloo), byteps, "
        "ps (parameter servers: see --num-servers)",
    )
    parser.add_argument(
        "--num-servers", type=int_in(1, MAX_SERVERS, "--num-servers"), metavar="K",
        help=f"with --engine ps: K (at most {MAX_SERVERS}) summation servers on node 0 beside the scheduler (or on --server-hosts), each "
        "owning a share of the gradient partitions (default 1; BytePS's DMLC_NUM_SERVER)",
    )
    parser.add_argument(
        "--server-hosts", type=_host_names, metavar="H[,H...]",
        help="with --engine ps and --hosts: server i runs on the (i mod n)-th of these hosts, each one of --hosts "
        "(its bpslaunch starts it); default: the first of --hosts",
    )
    parser.add_argument("--batch-size", type=_batch_sizes, metavar="B[,B...]",
                        help="initial local batch size, one for every worker or one per worker in rank order, e.g. "
                        "32,96 (DYNAMIX_BATCH_SIZE, which dynamix_byteps.assignment.add_batch_arguments reads)")
    parser.add_argument(
        "--log-dir", type=Path, metavar="DIR",
        help="the run's folder, which `dynamix report DIR` reads: each worker's output (DIR/worker-<rank>.log) "
        "and TensorBoard scalars (DIR/tensorboard/; the workers get DYNAMIX_LOG_DIR=DIR), and with --policy the "
        "scheduler's decisions.jsonl, scheduler.log and agent.log (agent-I.log on host I >= 1 of --hosts)",
    )
    parser.add_argument(
        "--port", type=_port, metavar="P",
        help="rendezvous port (local mode default: a free port on 127.0.0.1; overrides DMLC_PS_ROOT_PORT)",
    )
    parser.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="seconds a collective waits for its peers, at most 7 days (DYNAMIX_TIMEOUT)")
    parser.add_argument(
        "--grace-period", type=_seconds, default=DEFAULT_GRACE_S, metavar="SECONDS",
        help=f"seconds between SIGTERM and SIGKILL when stopping workers, at most 7 days (default {DEFAULT_GRACE_S:g}); "
             f"after a worker fails, the others first get half of it, at most {SETTLE_S:g} s, to exit by themselves",
    )
    control = parser.add_argument_group(
        "dynamic batch sizes (a scheduler on node 0 decides them; without --policy none runs)")
    control.add_argument("--policy", type=_policy_name, metavar="NAME",
                         help=f"batch-size policy of the scheduler: {' | '.join(POLICIES)} | ppo:NAME "
                              "(a trained policy of the library, `dynamix policy list`)")
    control.add_argument("--policy-path", type=Path, metavar="DIR", help="trained policy for --policy ppo")
    control.add_argument("--policy-option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                         help=f"option of the policy (repeatable), e.g. scale_down=true for goodput; {_policy_options()}")
    control.add_argument("--fine-tune", nargs="?", type=int_in(2, what="--fine-tune"), const=64, metavar="N",
                         help="with --policy ppo --policy-path DIR: fine-tune the policy online, one update per N "
                         "decisions (default 64), with `dynamix policy finetune` beside the scheduler, which then "
                         "serves and explores with a copy in the run directory, hot-swapping each new generation")
    control.add_argument("--min-batch", metavar="B[,B...]", help="smallest local batch, one or one per worker (DYNAMIX_MIN_BATCH; default 1)")
    control.add_argument("--max-batch", metavar="B[,B...]", help="largest local batch, one or one per worker (DYNAMIX_MAX_BATCH; default: no limit)")
    control.add_argument("--max-change", type=float_in(1.0, low_open=True), metavar="X",
                         help="largest factor a worker's batch size may change by per decision, > 1 (the "
                         "scheduler's; default 2.0)")
    control.add_argument("--hysteresis", type=float_in(0.0), metavar="H",
                         help="change sizes only when the policy's target is predicted to gain more than H (the "
                         "scheduler's; default 0.05)")
    control.add_argument("--decision-interval", type=_positive_int, default=DEFAULT_DECISION_INTERVAL, metavar="K",
                         help=f"steps between reports and decisions (default {DEFAULT_DECISION_INTERVAL})")
    control.add_argument("--lr-scaling", choices=tuple(RULES),
                         help="how the learning rate follows the global batch (DYNAMIX_LR_SCALING)")
    control.add_argument("--scheduler-port", type=_port, metavar="P", help="scheduler's gRPC port (default: a free one)")
    control.add_argument("--bind", metavar="ADDR", help="scheduler's listen address (default 127.0.0.1; the first "
                         "of --hosts on multi-host jobs, which then need DYNAMIX_TOKEN)")
    control.add_argument("--tls-cert", type=Path, metavar="PEM", help="the scheduler serves TLS with this certificate "
                         "(it must name the scheduler's address); needs --tls-key, and --tls-ca on every host")
    control.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert (node 0 only)")
    control.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA certificate the workers and agents verify a TLS "
                         "scheduler with (DYNAMIX_TLS_CA)")
    control.add_argument("--monitor", choices=MONITORS, default="auto",
                         help="node agent per host with --policy: eBPF if it loads, else TCP_INFO and /proc "
                         "(auto, the default); ebpf fails when eBPF cannot load; off runs no agent")
    control.add_argument("--slowdown", action="append", default=[], type=_slowdown, metavar="RANK=FACTOR[@START-END]",
                         help="emulate a straggler: stretch RANK's compute time by FACTOR >= 1, optionally only "
                         "from START to END seconds of training (repeatable; for benchmarks and tests)")
    multi = parser.add_argument_group("several machines (run bpslaunch once per host)")
    multi.add_argument("--hosts", type=parse_hosts, metavar="H0[:S0],H1[:S1],...",
                       help="the worker hosts, each with --num-workers workers, or S0, S1, ... workers when "
                       "given (ranks in host order: H0 gets 0..S0-1); H0 runs rank 0's rendezvous and the "
                       "scheduler (needs --port); gloo binds to the interface that reaches H0 unless "
                       "GLOO_SOCKET_IFNAME names one")
    multi.add_argument("--node-rank", type=int, metavar="I", help="this host's index in --hosts")
    elastic = parser.add_argument_group("elastic restart")
    elastic.add_argument("--restart-on-failure", type=int_in(0, 1000, "number of restarts"), default=0, metavar="N",
                         help="when a worker fails, stop the job and start it again with one worker fewer, up to N "
                         "times (default 0); the command resumes from --checkpoint")
    elastic.add_argument("--restart-port", type=_port, metavar="P",
                         help="with --hosts: node 0's bpslaunch coordinates the restarts of every host on this port "
                         "of the first of --hosts (same value on every host; needs DYNAMIX_TOKEN)")
    elastic.add_argument("--checkpoint", type=Path, metavar="PATH", help="the checkpoint the command saves with "
                         f"bps.save_checkpoint and resumes from when it exists ({CHECKPOINT_ENV}); needed by "
                         "--restart-on-failure")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each worker runs, after '--'")
    return parser


def _batch_sizes(text: str) -> str:
    """``--batch-size``: ``64`` for every worker or ``32,96`` one per rank, kept as text (every worker
    gets the same DYNAMIX_BATCH_SIZE); the count is checked once the job's size is known."""
    try:
        parse_batch_sizes(text, text.count(",") + 1)
    except ConfigurationError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _slowdown(text: str) -> tuple[int, str]:
    rank, sep, spec = text.partition("=")
    try:
        parse_slowdown(spec)
        parsed = int(rank)
    except ValueError:
        parsed = -1
    if not sep or parsed < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not RANK=FACTOR or RANK=FACTOR@START-END with a rank >= 0, 1 <= FACTOR <= 1000 "
            "and 0 <= START < END seconds of training")
    return parsed, spec


def _host_names(text: str) -> tuple[str, ...]:
    """``H1,H2`` -> ``("H1", "H2")``."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of hosts")
    return names


def parse_hosts(text: str) -> list[tuple[str, int | None]]:
    """``H0,H1`` -> ``[(H0, None), (H1, None)]``; ``H0:3,H1:1`` -> ``[(H0, 3), (H1, 1)]`` (slots per host)."""
    hosts = []
    for item in (h.strip() for h in text.split(",")):
        name, sep, slots = item.rpartition(":")
        if not sep or ":" in name:  # no slots (an IPv6 address has colons of its own)
            name, slots = item, None
        elif not slots.isdigit() or int(slots) < 1:
            raise argparse.ArgumentTypeError(f"host {item!r}: the slots after ':' must be a number of workers >= 1")
        if not name:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of hosts H or H:SLOTS")
        hosts.append((name, None if slots is None else int(slots)))
    if len({slots is None for _, slots in hosts}) > 1:
        raise argparse.ArgumentTypeError(f"{text!r} gives slots for some hosts only; give H:SLOTS for every host, "
                                         "or none and --num-workers per host")
    return hosts


def _policy_options() -> str:
    """The keyword options each policy takes, for ``--help``."""
    takes = {name: [key for key in option_names(cls) if key not in ("path", "name")] for name, cls in POLICIES.items()}
    return "; ".join(f"{name}: {', '.join(keys)}" for name, keys in takes.items() if keys)


def _policy_name(text: str) -> str:
    """``--policy``: one of the policies' names or ``ppo:NAME`` (checked against the library later)."""
    key, sep, name = text.strip().partition(":")
    if key in POLICIES and (not sep or (key == "ppo" and name)):
        return text.strip()
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(POLICIES)} or ppo:NAME)")


def parse_args(argv: Sequence[str], parser: argparse.ArgumentParser | None = None,
               env: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parse ``[options] [--] COMMAND ...`` (everything after the first ``--`` is the command) into a
    validated config; ``env`` is the launcher's environment (``DYNAMIX_TOKEN``), default none.

    Raises:
        SystemExit: argparse's, for ``--help``/``--version`` (0) or a malformed flag (2).
        UsageError: flags that do not go together, or a file a flag names is unusable.
    """
    parser = parser or build_parser()
    argv = [str(a) for a in argv]
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        if args.command:
            parser.error(f"unexpected argument {args.command[0]!r} before '--'")
        args.command = argv[cut + 1 :]
    else:
        args = parser.parse_args(argv)
    return config_from_args(args, {} if env is None else env)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchConfig:
    """The :class:`LaunchConfig` of parsed flags ``args``, with every path made absolute.

    Raises:
        UsageError: see :func:`parse_args`.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchConfig) if hasattr(args, f.name)}
    for name in ("command", "slowdown", "policy_option"):
        values[name] = tuple(values[name])
    if args.hosts is not None:
        values["hosts"] = tuple(args.hosts)
    for name in ("log_dir", "tls_cert", "tls_key", "tls_ca", "checkpoint"):
        if values[name] is not None:
            values[name] = values[name].expanduser().resolve()
    config = LaunchConfig(**values)
    _check_elastic(config, env)
    _check_tls(config)
    return config


def _check_elastic(config: LaunchConfig, env: Mapping[str, str]) -> None:
    """--restart-on-failure/--checkpoint/--restart-port: local mode or --hosts; a usable checkpoint path."""
    if config.restart_on_failure:
        if not config.local:
            raise UsageError("--restart-on-failure needs --num-workers N or --hosts: BytePS environment mode jobs "
                             "are not restarted")
        if config.checkpoint is None:
            raise UsageError("--restart-on-failure needs --checkpoint PATH: the file the command saves with "
                             "bps.save_checkpoint and resumes from")
        if config.multi_host_elastic:
            if config.restart_port is None:
                raise UsageError("--hosts with --restart-on-failure needs --restart-port P (the same on every host): "
                                 "node 0's bpslaunch coordinates the restarts there")
            if config.restart_port in (config.port, config.scheduler_port):
                raise UsageError(f"--restart-port {config.restart_port} is also --port or --scheduler-port; give it a "
                                 "port of its own")
            if not env.get("DYNAMIX_TOKEN"):
                raise UsageError("--hosts with --restart-on-failure: set DYNAMIX_TOKEN to a shared secret on every "
                                 "host (node 0 listens for the other hosts' reports beyond loopback)")
    elif config.restart_port is not None:
        raise UsageError("--restart-port needs --restart-on-failure N")
    checkpoint = config.checkpoint
    if checkpoint is not None:
        if checkpoint.is_dir():
            raise UsageError(f"--checkpoint {checkpoint} is a directory; give the path of a file in it")
        try:  # like --log-dir, its folder is created (a run's checkpoint usually lives in its log dir)
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--checkpoint {checkpoint}: cannot create {checkpoint.parent}: "
                             f"{error.strerror}") from None
        if not os.access(checkpoint.parent, os.W_OK | os.X_OK):
            raise UsageError(f"--checkpoint {checkpoint}: the directory {checkpoint.parent} is not "
                             "writable (the command saves the checkpoint there)")


def _check_tls(config: LaunchConfig) -> None:
    """--tls-cert/--tls-key/--tls-ca: readable PEM files, the first two together, a key that matches
    the certificate and a CA that verifies it (else every report would fail)."""
    from dynamix_byteps.control.security import check_tls_files, read_pem

    if (config.tls_cert is None) != (config.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: give the scheduler's certificate and its private key")
    if config.tls_cert is not None and config.tls_ca is None:
        raise UsageError("--tls-cert needs --tls-ca: the workers and agents verify the scheduler with that CA certificate")
    for flag, what in (("tls_cert", "TLS certificate"), ("tls_key", "TLS private key"), ("tls_ca", "TLS CA certificate")):
        path = getattr(config, flag)
        if path is not None:
            try:
                read_pem(path, what)
            except ConfigurationError as error:
                raise UsageError(f"argument --{flag.replace('_', '-')}: {error}") from None
    if config.tls_cert is not None:
        try:
            check_tls_files(config.tls_cert, config.tls_key, config.tls_ca)
        except ConfigurationError as error:
            raise UsageError(str(error)) from None
