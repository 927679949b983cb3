"""``bpslaunch``: start the worker processes of a dynamix_byteps job.

Local mode, one machine, N workers (global ranks 0..N-1)::

    bpslaunch --num-workers 4 -- python train.py --epochs 3
    bpslaunch --num-workers 2 --engine gloo --batch-size 64 --log-dir runs/a -- python train.py

Several hosts, one ``bpslaunch`` on each, with this host's ``--node-rank``; ``H:S`` gives host H
S workers, ranks in host order (here 0-2 on h0, 3 on h1)::

    bpslaunch --hosts h0:3,h1:1 --node-rank 0 --port 29500 -- python train.py    # on h0
    bpslaunch --hosts h0:3,h1:1 --node-rank 1 --port 29500 -- python train.py    # on h1

BytePS environment mode, when ``--num-workers`` is not given: the ``DMLC_*`` variables name
the cluster exactly as for BytePS's own ``bpslaunch``::

    DMLC_ROLE=worker DMLC_NUM_WORKER=2 DMLC_WORKER_ID=0 \\
    DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=1234 bpslaunch python train.py

A worker node starts ``BYTEPS_LOCAL_SIZE`` processes (default: one per entry of
``NVIDIA_VISIBLE_DEVICES``, else 1). The ``server`` and ``scheduler`` roles need no process
with the default gloo engine; with ``--engine byteps`` they run BytePS's server.

Elastic restart: with ``--restart-on-failure N --checkpoint PATH``, when a worker fails the others
are stopped and the job starts again with one worker fewer (ranks 0..size-2, a fresh scheduler
for the new size; logs are appended to), up to N times. With ``--hosts``, every host's bpslaunch
reports how its run ended to node 0's on ``--restart-port`` (needs ``DYNAMIX_TOKEN``), which
decides for all (:mod:`.restart`): the host of each lost worker runs one fewer, a host left with
none leaves the job (exit 0), and the next run rendezvouses on a fresh port; PATH must be on a file
system every host sees. Every
child sees ``DYNAMIX_CHECKPOINT`` (PATH) and ``DYNAMIX_RESTART`` (0 on the first run, then 1, 2,
...); the script resumes with ``bps.load_checkpoint(PATH, ...)`` when PATH exists. PATH's
directory must exist and be writable (else exit 2 before the start). When the job fails before
any worker got through ``bps.init`` (an import error, a bad argument: each worker tells the
launcher through ``DYNAMIX_STARTED_DIR``), or every worker exits with a code > 0 by itself at
once, that is an error in the command, not a lost worker: the job is not restarted and the
launcher exits with the failure's code::

    bpslaunch -n 4 --restart-on-failure 2 --checkpoint runs/a/ckpt.pt -- python train.py
    DYNAMIX_TOKEN=s bpslaunch --hosts h0:2,h1:2 --node-rank I --port 29500 --restart-port 29501 \
        --restart-on-failure 1 --checkpoint /shared/ckpt.pt -- python train.py     # on each host I

TLS: ``--tls-cert/--tls-key`` (node 0) make the scheduler serve TLS only; ``--tls-ca`` (every
host) is passed to the workers as ``DYNAMIX_TLS_CA`` and to the node agent as ``--tls-ca``.

With ``--policy``, the workers of this launcher name their monitoring mailboxes
``/dev/shm/dynamix.job<port>-<random>.<rank>`` (``DYNAMIX_JOB_ID``); whatever ends a run (success,
a worker's death, SIGTERM, SIGINT or SIGHUP to the launcher), the launcher removes what is left
of them.

Every worker gets the environment contract of :mod:`dynamix_byteps.env`. Output lines are
prefixed with the worker's global rank (``[0] ...``). The exit code is the first non-zero
code of any worker (the others are then stopped; with restarts left, the job restarts instead
and the last run's code counts), 0 when all succeed, 2 on bad usage or a
missing/invalid variable, 127 when the command cannot be found, ``128 + N`` on signal N.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from dynamix_byteps import __version__
from dynamix_byteps.agent.base import MONITORS
from dynamix_byteps.argtypes import float_in, int_in
from dynamix_byteps.assignment import BatchBounds, parse_batch_sizes
from dynamix_byteps.control.mailbox import remove_job_mailboxes
from dynamix_byteps.env import (
    DEFAULT_DECISION_INTERVAL,
    DEFAULT_ENGINE,
    ENGINES,
    JOB_ID_ENV,
    MAX_TIMEOUT_S,
    MAX_WORKERS,
    STARTED_DIR_ENV,
    WorkerEnv,
    parse_slowdown,
    resolve_engine,
)
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.restart import (
    REPORT_TIMEOUT_S,
    Coordinator,
    RunReport,
    decide,
    report_and_wait,
    tell,
)
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
from dynamix_byteps.progress import PROGRESS_ENV, PROGRESS_FILE, ConsoleProgress

PROG = "bpslaunch"
POLICIES = ("static", "proportional", "goodput", "ppo")
LOCAL_HOST = "127.0.0.1"
DEFAULT_GRACE_S = 5.0
CHECKPOINT_ENV = "DYNAMIX_CHECKPOINT"
RESTART_ENV = "DYNAMIX_RESTART"
_ENV_MODE_HINT = (
    "pass --num-workers N to run N local workers, or set the BytePS variables DMLC_ROLE, "
    "DMLC_NUM_WORKER, DMLC_WORKER_ID, DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT"
)


# ---- argument parsing -----------------------------------------------------------------------


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
        "-n", "--num-workers", type=_num_workers, metavar="N",
        help=f"run N (at most {MAX_WORKERS}) local worker processes on this machine (local mode); "
        "without it, the DMLC_* environment decides (BytePS environment mode)",
    )
    parser.add_argument(
        "--engine", choices=ENGINES, default=None,
        help="communication engine (default: $DYNAMIX_ENGINE, else gloo): gloo (CPU tensors), nccl (CUDA "
        "tensors, a GPU per worker), auto (nccl when every worker on this host gets a GPU, else gloo), byteps, "
        "ps (parameter servers: see --num-servers)",
    )
    parser.add_argument(
        "--num-servers", type=_positive_int, metavar="K",
        help="with --engine ps: K summation servers on node 0 beside the scheduler, each owning a share of "
        "the gradient partitions (default 1; BytePS's DMLC_NUM_SERVER)",
    )
    parser.add_argument("--batch-size", type=_positive_int, metavar="B", help="initial local batch size per worker (DYNAMIX_BATCH_SIZE)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR", help="write each worker's output to DIR/worker-<rank>.log (DYNAMIX_LOG_DIR)")
    parser.add_argument(
        "--port", type=_port, metavar="P",
        help="rendezvous port (local mode default: a free port on 127.0.0.1; overrides DMLC_PS_ROOT_PORT)",
    )
    parser.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="seconds a collective waits for its peers, at most 7 days (DYNAMIX_TIMEOUT)")
    parser.add_argument(
        "--grace-period", type=_seconds, default=DEFAULT_GRACE_S, metavar="SECONDS",
        help=f"seconds between SIGTERM and SIGKILL when stopping workers, at most 7 days (default {DEFAULT_GRACE_S:g})",
    )
    control = parser.add_argument_group(
        "dynamic batch sizes (a scheduler on node 0 decides them; without --policy none runs)")
    control.add_argument("--policy", type=_policy_name, metavar="NAME",
                         help=f"batch-size policy of the scheduler: {' | '.join(POLICIES)} | ppo:NAME "
                              "(a trained policy of the library, `dynamix policy list`)")
    control.add_argument("--policy-path", type=Path, metavar="DIR", help="trained policy for --policy ppo")
    control.add_argument("--fine-tune", nargs="?", type=int_in(2, what="--fine-tune"), const=64, metavar="N",
                         help="with --policy ppo --policy-path DIR: fine-tune the policy online, one update per N "
                         "decisions (default 64), with `dynamix policy finetune` beside the scheduler, which then "
                         "serves and explores with a copy in the run directory, hot-swapping each new generation")
    control.add_argument("--min-batch", metavar="B[,B...]", help="smallest local batch, one or one per worker (DYNAMIX_MIN_BATCH)")
    control.add_argument("--max-batch", metavar="B[,B...]", help="largest local batch, one or one per worker (DYNAMIX_MAX_BATCH)")
    control.add_argument("--decision-interval", type=_positive_int, default=DEFAULT_DECISION_INTERVAL, metavar="K",
                         help=f"steps between reports and decisions (default {DEFAULT_DECISION_INTERVAL})")
    control.add_argument("--lr-scaling", choices=("none", "linear", "sqrt", "adascale"),
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
    multi.add_argument("--hosts", type=_hosts, metavar="H0[:S0],H1[:S1],...",
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


def _hosts(text: str) -> list[tuple[str, int | None]]:
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


def parse_args(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse ``[options] [--] COMMAND ...``; everything after the first ``--`` is the command."""
    parser = parser or build_parser()
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        if args.command:
            parser.error(f"unexpected argument {args.command[0]!r} before '--'")
        args.command = argv[cut + 1 :]
    else:
        args = parser.parse_args(argv)
    return args


# ---- the job's environment -------------------------------------------------------------------


def _env_int(env: Mapping[str, str], name: str, what: str, minimum: int, maximum: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        raise UsageError(f"environment variable {name} is not set; set it to {what}, or {_ENV_MODE_HINT}")
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer; set it to {what}") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise UsageError(f"environment variable {name}={value} must be {bound}; set it to {what}")
    return value


def _visible_gpu_count(env: Mapping[str, str]) -> int:
    """Worker processes per node when BYTEPS_LOCAL_SIZE is unset: one per visible GPU, else 1."""
    devices = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if devices in ("", "none", "void"):
        return 1
    if devices == "all":
        try:
            return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
        except OSError:
            return 1
    return len([d for d in devices.split(",") if d.strip()])


def _free_port(host: str = LOCAL_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _check_port_free(port: int, host: str = LOCAL_HOST, flag: str = "--port") -> None:
    """Raises UsageError naming ``flag`` when ``host:port`` cannot be bound now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise UsageError(f"argument {flag}: {host}:{port} is not available ({error.strerror}); choose another "
                             f"port or omit {flag}") from None


def _engine(args: argparse.Namespace, env: Mapping[str, str], local_size: int) -> str:
    """--engine, else $DYNAMIX_ENGINE, else gloo, with ``auto`` resolved for ``local_size`` workers on this host."""
    engine = args.engine
    if engine is None:
        engine = env.get("DYNAMIX_ENGINE", "").strip() or DEFAULT_ENGINE
        if engine not in ENGINES:
            raise UsageError(f"environment variable DYNAMIX_ENGINE={engine!r} is not an engine; set it to one of {', '.join(ENGINES)} or pass --engine")
    return resolve_engine(engine, local_size)


def _require_byteps(role: str) -> None:
    if importlib.util.find_spec("byteps") is None:
        raise ConfigurationError(
            f"the byteps engine needs the byteps package for the {role} role, and {sys.executable} cannot import it. "
            "BytePS requires CUDA and NCCL: install it on a GPU machine (see docker/ for the GPU image), "
            "or use the embedded default engine: --engine gloo / DYNAMIX_ENGINE=gloo"
        )


def worker_specs(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    engine: str,
    num_nodes: int,
    node_rank: int,
    local_size: int,
    root_addr: str,
    root_port: int,
    notes: list[str],
    scheduler: str | None = None,
    rank_offset: int | None = None,
    world_size: int | None = None,
) -> list[ChildSpec]:
    """One :class:`ChildSpec` per local worker, with the environment contract filled in.

    ``rank_offset``/``world_size`` (local mode) number the workers ``rank_offset + local_rank``
    of ``world_size`` (``DYNAMIX_RANK_OFFSET``, ``DYNAMIX_SIZE``); None keeps BytePS's formula.
    """
    if engine == "byteps":
        _require_byteps("worker")
    base = dict(env)
    base.update(
        DMLC_ROLE="worker",
        DMLC_NUM_WORKER=str(num_nodes),
        DMLC_WORKER_ID=str(node_rank),
        BYTEPS_LOCAL_SIZE=str(local_size),
        DMLC_PS_ROOT_URI=root_addr,
        DMLC_PS_ROOT_PORT=str(root_port),
        DYNAMIX_ENGINE=engine,
        PYTHONUNBUFFERED="1",
    )
    for variable in ("DYNAMIX_RANK_OFFSET", "DYNAMIX_SIZE"):
        base.pop(variable, None)
    if rank_offset is not None:
        base.update(DYNAMIX_RANK_OFFSET=str(rank_offset), DYNAMIX_SIZE=str(world_size))
    if args.batch_size is not None:
        base["DYNAMIX_BATCH_SIZE"] = str(args.batch_size)
    if args.timeout is not None:
        base["DYNAMIX_TIMEOUT"] = repr(args.timeout)
    if args.log_dir is not None:
        base["DYNAMIX_LOG_DIR"] = str(args.log_dir)
    for flag, variable in (("min_batch", "DYNAMIX_MIN_BATCH"), ("max_batch", "DYNAMIX_MAX_BATCH"),
                           ("lr_scaling", "DYNAMIX_LR_SCALING")):
        if getattr(args, flag, None) is not None:
            base[variable] = getattr(args, flag)
    if scheduler is not None:
        base.update(DYNAMIX_SCHEDULER=scheduler, DYNAMIX_DECISION_INTERVAL=str(args.decision_interval))
        if args.tls_ca is not None:
            base["DYNAMIX_TLS_CA"] = str(args.tls_ca)
        if args.monitor != "off":
            base[JOB_ID_ENV] = _job_id(args, root_port)
    slowdowns = dict(args.slowdown)
    if local_size > 1 and not env.get("OMP_NUM_THREADS"):
        base["OMP_NUM_THREADS"] = "1"
        notes.append(
            f"setting OMP_NUM_THREADS=1 for each of the {local_size} workers so they do not "
            "oversubscribe the CPU; set OMP_NUM_THREADS yourself to change it"
        )
    specs = []
    for local_rank in range(local_size):
        child_env = dict(base, BYTEPS_LOCAL_RANK=str(local_rank))
        rank = (node_rank * local_size if rank_offset is None else rank_offset) + local_rank
        if rank in slowdowns:
            child_env["DYNAMIX_SLOWDOWN"] = slowdowns[rank]
        try:
            WorkerEnv.from_environ(child_env)  # the contract a worker will read
        except ConfigurationError as error:
            raise UsageError(str(error)) from None
        log_path = None if args.log_dir is None else args.log_dir / f"worker-{rank}.log"
        specs.append(ChildSpec(label=str(rank), argv=list(args.command), env=child_env, log_path=log_path))
    return specs


def _require_command(args: argparse.Namespace) -> None:
    if not args.command:
        raise UsageError("no command to run; put it after '--', e.g. bpslaunch --num-workers 2 -- python train.py")


def local_mode(args: argparse.Namespace, env: Mapping[str, str], notes: list[str]) -> list[ChildSpec]:
    """``--num-workers N``: N workers on this machine (and, with ``--hosts``, on each host, or
    the host's slots of ``--hosts H:S,...``); with ``--policy``, the scheduler first, on node 0."""
    _require_command(args)
    topology = _topology(args)
    engine = _engine(args, env, topology.local_size)
    hosts, node_rank, total = topology.hosts, topology.node_rank, topology.size
    if len(hosts) > 1 and args.port is None:
        raise UsageError("--hosts needs --port: every host must use the same rendezvous port")
    if engine == "byteps" and len(set(topology.slots)) > 1:
        raise UsageError("--hosts with different slots per host needs --engine gloo: BytePS numbers ranks as "
                         "node_rank * local_size + local_rank, which needs the same number of workers on every host")
    if node_rank == 0 and args.port is not None:
        _check_port_free(args.port, hosts[0] if len(hosts) > 1 else LOCAL_HOST)
    port = args.port if args.port is not None else _free_port()
    if len(hosts) > 1 and engine == "gloo" and not env.get("GLOO_SOCKET_IFNAME"):
        env = dict(env, GLOO_SOCKET_IFNAME=_interface_towards(hosts[0]))
        notes.append(f"gloo binds to {env['GLOO_SOCKET_IFNAME']}, the interface that reaches {hosts[0]}; "
                     "set GLOO_SOCKET_IFNAME to choose another")
    _check_bounds(args, total)
    seen = set()
    for rank, _ in args.slowdown:
        if rank >= total:
            raise UsageError(f"argument --slowdown: rank {rank} is not in this job of {total} workers")
        if rank in seen:
            raise UsageError(f"argument --slowdown: rank {rank} is given twice; one slowdown (and window) per rank")
        seen.add(rank)
    services, scheduler = _scheduler_specs(args, env, hosts, node_rank, total)
    if engine == "ps":
        # Every host must name the same rendezvous port for the servers: --port's next one across hosts.
        ps_port = _free_port() if len(hosts) == 1 else port + 1
        env = dict(env, DMLC_NUM_SERVER=str(args.num_servers or 1), DYNAMIX_PS_PORT=str(ps_port))
        if node_rank == 0:
            services += _ps_server_specs(args, env, total, hosts[0] if len(hosts) > 1 else LOCAL_HOST, ps_port)
    elif args.num_servers is not None:
        raise UsageError("--num-servers is for --engine ps")
    if scheduler is not None and args.monitor != "off":
        services.append(_agent_spec(args, env, scheduler, port, _run_dir(args)))
    return services + worker_specs(
        args, env, engine=engine, num_nodes=len(hosts), node_rank=node_rank, local_size=topology.local_size,
        root_addr=hosts[0] if len(hosts) > 1 else LOCAL_HOST, root_port=port, notes=notes, scheduler=scheduler,
        rank_offset=topology.rank_offset, world_size=total,
    )


def _ps_server_specs(args: argparse.Namespace, env: Mapping[str, str], workers: int, addr: str,
                     port: int) -> list[ChildSpec]:
    """The summation servers of ``--engine ps`` (``python -m dynamix_byteps.engine.ps_server``, node 0):
    services, started before the workers and stopped once every worker has exited."""
    servers = args.num_servers or 1
    specs = []
    for index in range(servers):
        argv = [sys.executable, "-m", "dynamix_byteps.engine.ps_server", "--server-id", str(index),
                "--num-servers", str(servers), "--num-workers", str(workers), "--addr", addr, "--port", str(port)]
        if args.timeout is not None:
            argv += ["--timeout", repr(args.timeout)]
        log_path = None if args.log_dir is None else args.log_dir / f"server-{index}.log"
        specs.append(ChildSpec(label=f"server{index}", argv=argv, env=dict(env, DMLC_ROLE="server", PYTHONUNBUFFERED="1"),
                               log_path=log_path, service=True, ends_with_workers=True))
    return specs


def _check_bounds(args: argparse.Namespace, total: int) -> None:
    """--min-batch/--max-batch/--batch-size agree, so a bad combination is a usage error here."""
    bounds = {}
    for flag in ("min_batch", "max_batch"):
        if getattr(args, flag) is not None:
            try:
                bounds[flag] = BatchBounds.build(total, **{flag: parse_batch_sizes(getattr(args, flag), total)})
            except ConfigurationError as error:
                raise UsageError(f"argument --{flag.replace('_', '-')}: {error}") from None
    try:
        bounds = BatchBounds.build(total, bounds["min_batch"].min_batch if "min_batch" in bounds else 1,
                                   bounds["max_batch"].max_batch if "max_batch" in bounds else None)
    except ConfigurationError as error:
        raise UsageError(f"arguments --min-batch/--max-batch: {error}") from None
    if args.batch_size is not None:
        for rank, (low, high) in enumerate(zip(bounds.min_batch, bounds.max_batch)):
            if not low <= args.batch_size <= (high or args.batch_size):
                raise UsageError(f"argument --batch-size: {args.batch_size} is outside rank {rank}'s bounds "
                                 f"[{low}, {high or 'unbounded'}]")


def _run_dir(args: argparse.Namespace) -> Path:
    """Where the scheduler and agent write: ``--log-dir``, else a temporary folder removed at exit."""
    if args.log_dir is not None:
        return args.log_dir
    if getattr(args, "temp_run_dir", None) is None:
        args.temp_run_dir = Path(tempfile.mkdtemp(prefix="dynamix-run-"))
    return args.temp_run_dir


def _job_id(args: argparse.Namespace, root_port: int) -> str:
    """Names the job's mailboxes on this host (``/dev/shm/dynamix.<job>.<rank>``), the same for the
    whole life of this launcher: the port and a random part, so two jobs on one host with the
    same ``--port`` never share a name."""
    if getattr(args, "job_id", None) is None:
        args.job_id = f"job{root_port}-{secrets.token_hex(4)}"
    return args.job_id


def _agent_spec(args: argparse.Namespace, env: Mapping[str, str], scheduler: str, root_port: int,
                run_dir: Path) -> ChildSpec:
    ready = run_dir / f".agent-{os.getpid()}.ready"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "dynamix_byteps.cli", "agent", "--job", _job_id(args, root_port), "--scheduler", scheduler,
            "--monitor", args.monitor, "--ready-file", str(ready)]
    log_path = None if args.log_dir is None else args.log_dir / "agent.log"
    if args.tls_ca is not None:
        argv += ["--tls-ca", str(args.tls_ca)]
    return ChildSpec(label="agent", argv=argv, env=dict(env, PYTHONUNBUFFERED="1"), log_path=log_path,
                     service=True, ready_file=ready)


@dataclass(frozen=True)
class Topology:
    """The job's hosts, this host's index among them, and the workers on each (ranks in host order)."""

    hosts: list[str]
    slots: list[int]
    node_rank: int

    @property
    def local_size(self) -> int:
        return self.slots[self.node_rank]

    @property
    def rank_offset(self) -> int:
        """Global rank of this host's first worker: the workers on the hosts before it."""
        return sum(self.slots[: self.node_rank])

    @property
    def size(self) -> int:
        return sum(self.slots)


def _topology(args: argparse.Namespace) -> Topology:
    """Hosts and slots from ``--hosts``/``--node-rank``/``--num-workers``; raises UsageError when they disagree."""
    if args.hosts is None:
        if args.node_rank not in (None, 0):
            raise UsageError("--node-rank needs --hosts")
        return Topology([LOCAL_HOST], [args.num_workers], 0)
    hosts = [name for name, _ in args.hosts]
    if args.node_rank is None or not 0 <= args.node_rank < len(hosts):
        raise UsageError(f"--hosts names {len(hosts)} hosts; give this host's --node-rank in 0..{len(hosts) - 1}")
    slots = [n for _, n in args.hosts]
    if slots[0] is None:
        if args.num_workers is None:
            raise UsageError("--hosts H0,H1,... needs --num-workers N (workers on each host), or give each host "
                             "its workers as --hosts H0:S0,H1:S1,...")
        slots = [args.num_workers] * len(hosts)
    elif args.num_workers not in (None, slots[args.node_rank]):
        raise UsageError(f"--num-workers {args.num_workers} disagrees with --hosts, which gives this host "
                         f"(--node-rank {args.node_rank}) {slots[args.node_rank]} workers; omit --num-workers")
    if sum(slots) > MAX_WORKERS:
        raise UsageError(f"--hosts gives {sum(slots)} workers in all; a job has at most {MAX_WORKERS}")
    return Topology(hosts, slots, args.node_rank)


def _interface_towards(host: str) -> str:
    """The name of this machine's network interface that carries traffic to ``host`` (IPv4).

    gloo binds its sockets to one interface; by default it resolves this machine's hostname,
    which is often 127.0.0.1 and unreachable from other hosts. Raises UsageError when ``host``
    does not resolve or no interface holds the source address the kernel picks for it.
    """
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect sends nothing; it only chooses the route
            source = probe.getsockname()[0]
    except OSError as error:
        raise UsageError(f"argument --hosts: cannot find a route to {host} ({error}); set GLOO_SOCKET_IFNAME to "
                         "the network interface that reaches it") from None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addresses):
            return name
    raise UsageError(f"argument --hosts: no network interface holds {source}, this machine's address towards "
                     f"{host}; set GLOO_SOCKET_IFNAME to the interface that reaches it")


def _check_tls(args: argparse.Namespace) -> None:
    """--tls-cert/--tls-key/--tls-ca: absolute paths of readable PEM files, the first two together,
    a key that matches the certificate and a CA that verifies it (else every report would fail)."""
    from dynamix_byteps.control.security import check_tls_files, read_pem

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: give the scheduler's certificate and its private key")
    if args.tls_cert is not None and args.tls_ca is None:
        raise UsageError("--tls-cert needs --tls-ca: the workers and agents verify the scheduler with that CA certificate")
    for flag, what in (("tls_cert", "TLS certificate"), ("tls_key", "TLS private key"), ("tls_ca", "TLS CA certificate")):
        path = getattr(args, flag)
        if path is not None:
            setattr(args, flag, path.expanduser().resolve())
            try:
                read_pem(path, what)
            except ConfigurationError as error:
                raise UsageError(f"argument --{flag.replace('_', '-')}: {error}") from None
    if args.tls_cert is not None:
        try:
            check_tls_files(args.tls_cert, args.tls_key, args.tls_ca)
        except ConfigurationError as error:
            raise UsageError(str(error)) from None


def _policy_name(text: str) -> str:
    """``--policy``: one of :data:`POLICIES` or ``ppo:NAME`` (checked against the library later)."""
    key, sep, name = text.strip().partition(":")
    if key in POLICIES and (not sep or (key == "ppo" and name)):
        return text.strip()
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(POLICIES)} or ppo:NAME)")


def _scheduler_specs(args: argparse.Namespace, env: Mapping[str, str], hosts: list[str], node_rank: int,
                     total: int) -> tuple[list[ChildSpec], str | None]:
    """The scheduler's ChildSpec (on node 0 only) and the ``host:port`` every worker reports to."""
    _check_tls(args)
    if args.policy is None:
        for flag in ("policy_path", "fine_tune", "scheduler_port", "bind", "tls_cert", "tls_key", "tls_ca"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} needs --policy")
        return [], None
    if args.policy.startswith("ppo:"):
        if args.policy_path is not None:
            raise UsageError(f"--policy {args.policy} is a library policy; drop --policy-path, or use --policy ppo "
                             "--policy-path DIR")
        from dynamix_byteps.policy.ppo.library import policy_dir

        try:
            policy_dir(args.policy[len("ppo:"):])
        except ConfigurationError as error:
            raise UsageError(f"--policy: {error}") from None
    elif args.policy == "ppo":
        if args.policy_path is None:
            raise UsageError("--policy ppo needs --policy-path DIR (a policy directory written by "
                             "`dynamix policy train --out DIR` or `dynamix policy export`)")
        from dynamix_byteps.policy.ppo.serve import read_metadata

        try:
            read_metadata(args.policy_path)
        except ConfigurationError as error:
            raise UsageError(f"--policy-path: {error}") from None
    elif args.policy_path is not None:
        raise UsageError(f"--policy-path is for --policy ppo, not --policy {args.policy}")
    multi_host = len(hosts) > 1
    if multi_host and args.scheduler_port is None:
        raise UsageError("--hosts with --policy needs --scheduler-port: the workers on every host must find it")
    if multi_host and not env.get("DYNAMIX_TOKEN"):
        raise UsageError("a multi-host job's scheduler listens beyond loopback: set DYNAMIX_TOKEN to a shared "
                         "secret on every host")
    bind = args.bind or (hosts[0] if multi_host else LOCAL_HOST)
    if args.scheduler_port is not None and node_rank == 0:
        _check_port_free(args.scheduler_port, bind, "--scheduler-port")
    port = args.scheduler_port if args.scheduler_port is not None else _free_port()
    address = f"{hosts[0] if multi_host else LOCAL_HOST}:{port}"
    if node_rank != 0:
        return [], address
    if args.tls_ca is not None and args.tls_cert is None:
        raise UsageError("--tls-ca on node 0 needs --tls-cert and --tls-key: its scheduler must serve TLS")
    run_dir = _run_dir(args)
    ready = run_dir / f".scheduler-{os.getpid()}.port"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "dynamix_byteps.cli", "scheduler", "--port", str(port), "--port-file", str(ready),
            "--bind", bind, "--policy", args.policy, "--num-workers", str(total),
            "--decision-interval", str(args.decision_interval), "--run-dir", str(run_dir)]
    trainer = []
    if args.fine_tune is not None:
        trainer.append(_fine_tune_spec(args, env, argv, run_dir))
    elif args.policy_path is not None:
        argv += ["--policy-option", f"path={args.policy_path}"]
    if args.tls_cert is not None:
        argv += ["--tls-cert", str(args.tls_cert), "--tls-key", str(args.tls_key)]
    log_path = None if args.log_dir is None else args.log_dir / "scheduler.log"
    spec = ChildSpec(label="scheduler", argv=argv, env=dict(env, PYTHONUNBUFFERED="1"), log_path=log_path,
                     service=True, ready_file=ready)
    return [spec, *trainer], address


def _fine_tune_spec(args: argparse.Namespace, env: Mapping[str, str], scheduler_argv: list[str],
                    run_dir: Path) -> ChildSpec:
    """--fine-tune: the trainer service (:mod:`dynamix_byteps.policy.ppo.finetune_cli`); points the
    scheduler at the copy of the policy it publishes into, with exploration on."""
    if args.policy != "ppo":
        raise UsageError(f"--fine-tune needs --policy ppo --policy-path DIR (a directory from `dynamix policy train` "
                         f"with its RLlib checkpoint), not --policy {args.policy}")
    if args.log_dir is None:
        raise UsageError("--fine-tune needs --log-dir DIR: the policy generations it trains are published there "
                         "(without it they would be deleted with the job's temporary folder)")
    from dynamix_byteps.policy.ppo.finetune_cli import trainer_argv

    try:
        argv, served = trainer_argv(args.policy_path, run_dir, every=args.fine_tune)
    except ConfigurationError as error:
        raise UsageError(f"--fine-tune: {error}") from None
    scheduler_argv += ["--policy-option", f"path={served}", "--policy-option", "explore=true"]
    return ChildSpec(label="finetune", argv=argv, env=dict(env, PYTHONUNBUFFERED="1"), log_path=args.log_dir / "finetune.log",
                     service=True)


def env_mode(args: argparse.Namespace, env: Mapping[str, str], notes: list[str]) -> list[ChildSpec]:
    """No ``--num-workers``: the role and cluster come from the BytePS ``DMLC_*`` variables.

    Returns an empty list when this role needs no process (server/scheduler with gloo).
    Raises :class:`UsageError` naming the first missing or invalid variable.
    """
    if args.policy is not None:
        raise UsageError("--policy needs --num-workers or --hosts; BytePS environment mode runs workers only")
    role = env.get("DMLC_ROLE", "").strip()
    if not role:
        raise UsageError(f"environment variable DMLC_ROLE is not set; {_ENV_MODE_HINT}")
    if role not in ("worker", "server", "scheduler"):
        raise UsageError(f"environment variable DMLC_ROLE={role!r} is not a role; set it to worker, server or scheduler")
    if role != "worker":
        return _server_specs(args, env, role, _engine(args, env, 1), notes)
    _require_command(args)
    num_nodes = _env_int(env, "DMLC_NUM_WORKER", "the number of worker nodes", 1)
    node_rank = _env_int(env, "DMLC_WORKER_ID", f"this node's index (0..{num_nodes - 1})", 0, num_nodes - 1)
    root_addr = env.get("DMLC_PS_ROOT_URI", "").strip()
    if not root_addr:
        raise UsageError(f"environment variable DMLC_PS_ROOT_URI is not set; set it to the host of global rank 0, or {_ENV_MODE_HINT}")
    root_port = args.port if args.port is not None else _env_int(env, "DMLC_PS_ROOT_PORT", "the rendezvous TCP port", 1, 65535)
    if env.get("BYTEPS_LOCAL_SIZE", "").strip():
        local_size = _env_int(env, "BYTEPS_LOCAL_SIZE", "the number of worker processes on this node", 1, MAX_WORKERS)
    else:
        local_size = _visible_gpu_count(env)
    engine = _engine(args, env, local_size)
    if engine == "byteps" and num_nodes > 1:
        _env_int(env, "DMLC_NUM_SERVER", "the number of BytePS server processes", 1)
    return worker_specs(
        args, env, engine=engine, num_nodes=num_nodes, node_rank=node_rank, local_size=local_size,
        root_addr=root_addr, root_port=root_port, notes=notes,
    )


def _server_specs(args: argparse.Namespace, env: Mapping[str, str], role: str, engine: str, notes: list[str]) -> list[ChildSpec]:
    if engine != "byteps":
        notes.append(f"DMLC_ROLE={role}: the {engine} engine needs no {role} process; nothing to start")
        return []
    _env_int(env, "DMLC_NUM_WORKER", "the number of worker nodes", 1)
    _env_int(env, "DMLC_NUM_SERVER", "the number of BytePS server processes", 1)
    if not env.get("DMLC_PS_ROOT_URI", "").strip():
        raise UsageError("environment variable DMLC_PS_ROOT_URI is not set; set it to the scheduler's host")
    child_env = dict(env, PYTHONUNBUFFERED="1")
    if args.port is not None:
        child_env["DMLC_PS_ROOT_PORT"] = str(args.port)
    else:
        _env_int(env, "DMLC_PS_ROOT_PORT", "the scheduler's TCP port", 1, 65535)
    _require_byteps(role)
    log_path = None if args.log_dir is None else args.log_dir / f"{role}.log"
    # As BytePS does: importing byteps.server starts the server (or scheduler) and blocks.
    return [ChildSpec(label=role, argv=[sys.executable, "-c", "import byteps.server"], env=child_env, log_path=log_path)]


def _prepare_log_files(log_dir: Path, specs: Sequence[ChildSpec]) -> None:
    """Create ``log_dir`` and check that every child's log file can be written, before any starts."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"argument --log-dir: cannot create {log_dir}: {error.strerror}") from None
    for spec in specs:
        if spec.log_path is None:
            continue
        try:
            with open(spec.log_path, "ab"):
                pass
        except OSError as error:
            raise UsageError(f"argument --log-dir: cannot write the log file {spec.log_path}: {error.strerror}") from None


# ---- entry point ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run ``bpslaunch``; returns the exit code (see the module docstring)."""
    parser = build_parser()
    env = dict(os.environ if environ is None else environ)
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv, parser)
    except SystemExit as stop:  # argparse: --help (0) or bad usage (2)
        return stop.code if isinstance(stop.code, int) else 2
    if args.log_dir is not None:
        args.log_dir = args.log_dir.expanduser().resolve()
    try:
        return _launch(args, env, parser)
    finally:
        if getattr(args, "temp_run_dir", None) is not None:
            shutil.rmtree(args.temp_run_dir, ignore_errors=True)


def _check_elastic(args: argparse.Namespace, env: dict) -> None:
    """--restart-on-failure/--checkpoint/--restart-port: local mode or --hosts; sets the variables every child reads."""
    if args.restart_on_failure:
        if args.num_workers is None and args.hosts is None:
            raise UsageError("--restart-on-failure needs --num-workers N or --hosts: BytePS environment mode jobs "
                             "are not restarted")
        if args.checkpoint is None:
            raise UsageError("--restart-on-failure needs --checkpoint PATH: the file the command saves with "
                             "bps.save_checkpoint and resumes from")
        if args.hosts is not None and len(args.hosts) > 1:
            if args.restart_port is None:
                raise UsageError("--hosts with --restart-on-failure needs --restart-port P (the same on every host): "
                                 "node 0's bpslaunch coordinates the restarts there")
            if args.restart_port in (args.port, args.scheduler_port):
                raise UsageError(f"--restart-port {args.restart_port} is also --port or --scheduler-port; give it a "
                                 "port of its own")
            if not env.get("DYNAMIX_TOKEN"):
                raise UsageError("--hosts with --restart-on-failure: set DYNAMIX_TOKEN to a shared secret on every "
                                 "host (node 0 listens for the other hosts' reports beyond loopback)")
    elif args.restart_port is not None:
        raise UsageError("--restart-port needs --restart-on-failure N")
    if args.checkpoint is not None:
        args.checkpoint = args.checkpoint.expanduser().resolve()
        if args.checkpoint.is_dir():
            raise UsageError(f"--checkpoint {args.checkpoint} is a directory; give the path of a file in it")
        try:  # like --log-dir, its folder is created (a run's checkpoint usually lives in its log dir)
            args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--checkpoint {args.checkpoint}: cannot create {args.checkpoint.parent}: "
                             f"{error.strerror}") from None
        if not os.access(args.checkpoint.parent, os.W_OK | os.X_OK):
            raise UsageError(f"--checkpoint {args.checkpoint}: the directory {args.checkpoint.parent} is not "
                             "writable (the command saves the checkpoint there)")
        env[CHECKPOINT_ENV] = str(args.checkpoint)
    env[RESTART_ENV] = "0"


def _build_specs(args: argparse.Namespace, env: dict, parser: argparse.ArgumentParser) -> list[ChildSpec] | int:
    """The job's children, or the exit code (2 bad usage, 1 configuration error) after printing why."""
    notes: list[str] = []
    try:
        local = args.num_workers is not None or args.hosts is not None
        specs = local_mode(args, env, notes) if local else env_mode(args, env, notes)
        if specs and args.log_dir is not None:
            _prepare_log_files(args.log_dir, specs)
    except UsageError as error:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except ConfigurationError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    return specs


def _launch(args: argparse.Namespace, env: dict, parser: argparse.ArgumentParser) -> int:
    try:
        _check_elastic(args, env)
    except UsageError as error:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    specs = _build_specs(args, env, parser)
    if isinstance(specs, int):
        return specs
    if not specs:
        return 0
    coordinator = None
    if _multi_host_elastic(args) and args.node_rank == 0:
        try:
            coordinator = Coordinator(args.hosts[0][0], args.restart_port, env["DYNAMIX_TOKEN"])
        except OSError as error:
            parser.print_usage(sys.stderr)
            print(f"{PROG}: error: argument --restart-port: cannot listen on {args.hosts[0][0]}:{args.restart_port} "
                  f"({error.strerror or error}); choose another port", file=sys.stderr)
            return 2
    try:
        return _run(args, env, parser, specs, coordinator)
    finally:
        if coordinator is not None:
            coordinator.close()


def _multi_host_elastic(args: argparse.Namespace) -> bool:
    return bool(args.restart_on_failure) and args.hosts is not None and len(args.hosts) > 1


def _run(args: argparse.Namespace, env: dict, parser: argparse.ArgumentParser, specs: list[ChildSpec],
         coordinator: Coordinator | None) -> int:
    """Run the job, restarting it as --restart-on-failure allows; returns the exit code."""
    restarts = 0
    while True:
        started = time.monotonic()
        code, supervisor, started_workers = _supervise(args, specs)
        if _multi_host_elastic(args):
            decision = _coordinate(args, env, supervisor, code, restarts, coordinator, started_workers)
            if "exit" in decision:
                if decision["exit"] != 0:
                    print(f"{PROG}: {decision['reason']}", file=sys.stderr, flush=True)
                return decision["exit"]
            restarts += 1
            if not _apply_decision(args, decision, restarts, started, code):
                return 0
        else:
            failed, self_failed = supervisor.failed_worker, supervisor.self_failed
            if code == 0 or failed is None or restarts >= args.restart_on_failure:
                return code
            workers = [s.label for s in specs if not s.service]
            if not started_workers:
                print(f"{PROG}: the job failed before it started (no worker got through bps.init; exit codes "
                      f"{_exit_codes(self_failed, workers)}): an error in the command or its environment, not a lost "
                      "worker; not restarting", file=sys.stderr, flush=True)
                return code
            if set(self_failed) == set(workers):
                print(f"{PROG}: every worker failed on its own at once (exit codes "
                      f"{', '.join(f'[{w}] {self_failed[w]}' for w in workers)}): an error in the command, not a lost "
                      "worker; not restarting", file=sys.stderr, flush=True)
                return code
            if args.num_workers <= 1:
                print(f"{PROG}: worker {failed} failed and none survives; not restarting", file=sys.stderr, flush=True)
                return code
            restarts += 1
            args.num_workers -= 1
            args.slowdown = [(rank, spec) for rank, spec in args.slowdown if rank < args.num_workers]
            print(f"{PROG}: worker {failed} failed with code {code} after {time.monotonic() - started:.1f} s; restart "
                  f"{restarts} of {args.restart_on_failure} with {args.num_workers} workers from {args.checkpoint}",
                  file=sys.stderr, flush=True)
        env[RESTART_ENV] = str(restarts)
        specs = _build_specs(args, env, parser)
        if isinstance(specs, int):
            return code
        specs = [dataclasses.replace(s, append_log=True) for s in specs]


def _exit_codes(self_failed: Mapping[str, int], workers: Sequence[str]) -> str:
    """``[0] 3, [1] 3, [2] signalled`` for a message: each worker's own exit code, when it had one."""
    return ", ".join(f"[{w}] {self_failed[w]}" if w in self_failed else f"[{w}] stopped" for w in workers)


def _coordinate(args: argparse.Namespace, env: Mapping[str, str], supervisor: Supervisor, code: int, run: int,
                coordinator: Coordinator | None, started_workers: bool) -> dict:
    """Report how run ``run`` ended on this host and get the job's next step (see :mod:`.restart`):
    node 0 collects every host's report, decides and answers; the others ask node 0."""
    topology = _topology(args)
    report = RunReport(node=topology.node_rank, run=run, code=code,
                       failed=None if supervisor.failed_worker is None else int(supervisor.failed_worker),
                       failed_at=supervisor.failed_at, killed=[int(label) for label in supervisor.killed],
                       self_failed=[int(label) for label in supervisor.self_failed],
                       workers=[int(s.label) for s in supervisor.specs if not s.service], token=env["DYNAMIX_TOKEN"],
                       started=started_workers)
    stopped = code != 0 and report.failed is None  # the launcher was signalled (or could not start the job)
    if coordinator is None:
        if stopped:
            tell((topology.hosts[0], args.restart_port), report)
            return {"exit": code, "reason": "stopped; not restarting"}
        return report_and_wait((topology.hosts[0], args.restart_port), report)
    if stopped:
        return {"exit": code, "reason": "stopped; not restarting"}
    peers = coordinator.collect(run, len(topology.hosts) - 1)
    missing = [i for i in range(1, len(topology.hosts)) if i not in peers]
    reports = [report] + [peers[i][0] for i in sorted(peers)]
    if missing:
        first = next((r.code for r in reports if r.code != 0), 1)
        decision = {"exit": first, "reason": f"host(s) {', '.join(map(str, missing))} sent no report of run {run} "
                    f"within {REPORT_TIMEOUT_S:g} s; not restarting"}
    else:
        decision = decide(topology.slots, reports, args.restart_on_failure - run)
    if "slots" in decision:
        address = topology.hosts[0] if sum(1 for n in decision["slots"] if n) > 1 else LOCAL_HOST
        decision["port"] = _free_port(address)
        if args.policy is not None:
            decision["scheduler_port"] = _free_port(address)
    Coordinator.answer([conn for _, conn in peers.values()], decision)
    return decision


def _apply_decision(args: argparse.Namespace, decision: dict, restarts: int, started: float, code: int) -> bool:
    """Set ``args`` for the next run of ``decision``; False when this host has no worker left in it."""
    topology = _topology(args)
    slots, mine = decision["slots"], decision["slots"][topology.node_rank]
    total = sum(slots)
    print(f"{PROG}: worker(s) {', '.join(map(str, decision['lost']))} lost (code {code} here) after "
          f"{time.monotonic() - started:.1f} s; restart {restarts} of {args.restart_on_failure} with {total} workers "
          f"({', '.join(f'{h}:{n}' for h, n in zip(topology.hosts, slots))}) from {args.checkpoint}",
          file=sys.stderr, flush=True)
    if mine == 0:
        print(f"{PROG}: no worker of this host is left in the job; leaving it", file=sys.stderr, flush=True)
        return False
    kept = [(host, n) for host, n in zip(topology.hosts, slots) if n]
    args.node_rank = sum(1 for n in slots[: topology.node_rank] if n)
    args.hosts, args.num_workers = kept, None
    if len(kept) == 1:  # the job shrank onto this host: a local job from now on
        args.hosts, args.node_rank, args.num_workers = None, None, mine
    args.port = decision["port"]
    args.scheduler_port = decision.get("scheduler_port", args.scheduler_port)
    args.slowdown = [(rank, spec) for rank, spec in args.slowdown if rank < total]
    return True


def _supervise(args: argparse.Namespace, specs: list[ChildSpec]) -> tuple[int, Supervisor, bool]:
    """Run the job once; returns its exit code, the Supervisor (which worker's failure ended it,
    when, and which failed on their own) and whether any worker got through ``bps.init``.

    Whatever ends the run (success, a worker's death, SIGTERM/SIGINT/SIGHUP to the launcher), the
    job's mailboxes left in /dev/shm are removed afterwards: a worker killed by a signal cannot."""
    started = Path(tempfile.mkdtemp(prefix="dynamix-started-"))
    specs = [spec if spec.service else dataclasses.replace(spec, env={**spec.env, STARTED_DIR_ENV: str(started)})
             for spec in specs]
    try:
        code, supervisor = _supervise_once(args, specs)
        return code, supervisor, any(started.iterdir())
    finally:
        shutil.rmtree(started, ignore_errors=True)
        if getattr(args, "job_id", None) is not None:
            remove_job_mailboxes(args.job_id)


def _supervise_once(args: argparse.Namespace, specs: list[ChildSpec]) -> tuple[int, Supervisor]:
    if not (sys.stderr.isatty() and any(spec.label == "0" for spec in specs)):
        supervisor = Supervisor(specs, grace_s=args.grace_period)
        return supervisor.run(), supervisor
    # A terminal shows a progress bar fed by rank 0 (dynamix_byteps.progress).
    with ConsoleProgress(_run_dir(args) / PROGRESS_FILE) as bar:
        specs = [dataclasses.replace(s, env={**s.env, PROGRESS_ENV: str(bar.path)}) if s.label == "0" else s
                 for s in specs]
        supervisor = Supervisor(specs, grace_s=args.grace_period, write_guard=bar.write_guard)
        return supervisor.run(), supervisor


if __name__ == "__main__":
    sys.exit(main())
