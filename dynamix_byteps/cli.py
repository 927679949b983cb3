"""``dynamix``: the command-line tool of dynamix_byteps.

Subcommands (one function ``_add_<name>(subparsers)`` each, which sets ``func``)::

    dynamix scheduler --num-workers 4 --policy proportional --run-dir runs/a --port-file runs/a/port
    dynamix policy train --scenario straggler,two-speed --out policies/p   (also: policy eval, policy export)
    dynamix sim fit runs/a                                                (simulator parameters of a run)
    dynamix report runs/a

Exit status: 0 on success (and on SIGTERM/SIGINT after a graceful stop), 1 on failure
(a port that cannot be bound, a policy that cannot be loaded), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from dynamix_byteps import __version__
from dynamix_byteps.agent.base import MONITORS
from dynamix_byteps.argtypes import float_in, int_in
from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.env import DEFAULT_DECISION_INTERVAL, MAX_WORKERS
from dynamix_byteps.errors import ConfigurationError, DynamixError, UsageError
from dynamix_byteps.policy.ppo.commands import add_policy_parser
from dynamix_byteps.policy.sim.commands import add_sim_parser

PROG = "dynamix"


def _option(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for convert in (int, float):
        try:
            return key, convert(raw)
        except ValueError:
            pass
    return key, raw


# ---- dynamix scheduler -----------------------------------------------------------------------


def _add_scheduler(sub) -> None:
    p = sub.add_parser(
        "scheduler",
        help="run the gRPC scheduler on the parameter-server host",
        description=(
            "Serve Register/ReportMetrics to the workers, call the batch-size policy every decision\n"
            "interval and answer with versioned assignments. Decisions go to RUN_DIR/decisions.jsonl."
        ),
        epilog=(
            "security: the scheduler binds 127.0.0.1 unless --bind; any other address requires a\n"
            "shared token (--token or $DYNAMIX_TOKEN, preferred: it stays out of `ps`), which every\n"
            "call must carry as x-dynamix-token metadata. The token authenticates, it does not encrypt:\n"
            "--tls-cert/--tls-key (or $DYNAMIX_TLS_CERT/$DYNAMIX_TLS_KEY) serve TLS only; clients then\n"
            "verify the certificate against --tls-ca / $DYNAMIX_TLS_CA, and plaintext clients are refused.\n\n"
            "exit status: 0 after SIGTERM/SIGINT, 1 on failure, 2 on bad usage."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--port", type=int_in(0, 65535, "port"), default=0, metavar="P", help="gRPC port (default 0: pick a free one)")
    p.add_argument("--port-file", type=Path, metavar="FILE", help="write the bound port to FILE (atomically) once listening")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="listen address (default 127.0.0.1; others require a token)")
    p.add_argument("--token", metavar="T", help="shared secret the workers send (default: $DYNAMIX_TOKEN)")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this certificate (default: $DYNAMIX_TLS_CERT)")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert (default: $DYNAMIX_TLS_KEY)")
    p.add_argument("--policy", default="static", metavar="NAME", help="static | proportional | goodput | ppo (default static)")
    p.add_argument("--policy-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="option passed to the policy (repeatable), e.g. path=policy.onnx")
    p.add_argument("--num-workers", type=int_in(1, MAX_WORKERS, "--num-workers"), metavar="N", help="job size (default: from the first registration)")
    p.add_argument("--decision-interval", type=int_in(1, what="--decision-interval"), default=DEFAULT_DECISION_INTERVAL, metavar="K", help=f"steps between decisions (default {DEFAULT_DECISION_INTERVAL}, as the workers')")
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="where decisions.jsonl is appended (default: no decision log)")
    p.add_argument("--metrics-port", type=int_in(0, 65535, "--metrics-port"), default=0, metavar="M", help="Prometheus /metrics port (default 0: off)")
    p.add_argument("--max-change", type=float_in(1.0), default=2.0, metavar="X", help="largest factor a batch size may change by per decision (default 2.0)")
    p.add_argument("--hysteresis", type=float_in(0.0), default=0.05, metavar="H", help="change only if the predicted gain exceeds H (default 0.05)")
    p.set_defaults(func=_run_scheduler)


def build_policy(name: str, options: dict, *, max_change: float, hysteresis: float):
    """``make_policy(name, **options)`` wrapped in the guardrails; UsageError for a bad name/option."""
    try:
        from dynamix_byteps.policy import make_policy
        from dynamix_byteps.policy.guardrails import Guarded
    except ImportError as error:
        raise ConfigurationError(f"the policies cannot be imported: {error}") from error
    try:
        policy = make_policy(name, **options)
    except (KeyError, ValueError, TypeError) as error:
        raise UsageError(f"argument --policy: {error}") from None
    return Guarded(policy, max_change=max_change, hysteresis=hysteresis)


def _run_scheduler(args: argparse.Namespace) -> int:
    from dynamix_byteps.control.scheduler import SchedulerServer
    from dynamix_byteps.control.security import (
        TLS_CERT_ENV,
        TLS_KEY_ENV,
        TOKEN_ENV,
        check_token,
        is_loopback,
    )

    tls_cert = args.tls_cert or os.environ.get(TLS_CERT_ENV) or None
    tls_key = args.tls_key or os.environ.get(TLS_KEY_ENV) or None
    if (tls_cert is None) != (tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: give the certificate and its private key")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None:
        try:
            check_token(token)
        except ValueError as error:
            raise UsageError(f"argument --token: {error}") from None
    if token is None and not is_loopback(args.bind):
        raise UsageError(
            f"argument --bind: {args.bind} is reachable from other hosts, so a shared token is required; "
            "set DYNAMIX_TOKEN (or pass --token), or bind 127.0.0.1"
        )
    policy = build_policy(args.policy, dict(args.policy_option), max_change=args.max_change, hysteresis=args.hysteresis)
    try:
        server = SchedulerServer(
            policy, num_workers=args.num_workers, decision_interval=args.decision_interval, bind=args.bind,
            port=args.port, token=token, tls_cert=tls_cert, tls_key=tls_key, run_dir=args.run_dir,
            metrics_port=args.metrics_port or None,
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        if args.port_file is not None:
            write_atomic(args.port_file, f"{server.port}\n", durable=False)  # read by a live process only
        log = logging.getLogger("dynamix_byteps.scheduler")
        log.info(
            "scheduler listening on %s policy=%s workers=%s interval=%d token=%s tls=%s metrics=%s run_dir=%s",
            server.address, args.policy, args.num_workers or "from-registration", args.decision_interval,
            "on" if token else "off", "on" if server.tls else "off", server.metrics_port or "off", args.run_dir or "-",
        )
        while not stop.wait(1.0):
            pass
        log.info("scheduler stopping (signal)")
    finally:
        server.stop(grace=1.0)
        if args.port_file is not None and server.port is not None:
            try:
                if args.port_file.read_text().strip() == str(server.port):
                    args.port_file.unlink()
            except OSError:
                pass
    return 0


# ---- dynamix agent ---------------------------------------------------------------------------


def _add_agent(sub) -> None:
    p = sub.add_parser(
        "agent",
        help="run the node agent of this host (network, CPU, GPU metrics of its workers)",
        description=(
            "Find the workers of JOB on this host through their shared-memory mailboxes, measure\n"
            "their TCP traffic (eBPF, or TCP_INFO and /proc), CPU and GPU, and report to the scheduler."
        ),
        epilog=(
            "--monitor: auto (eBPF if it loads, else proc; the reason is logged once), ebpf (exit 2\n"
            "with the reason if it cannot load), proc, off.\n\n"
            "capabilities (instead of root): CAP_BPF+CAP_PERFMON to load eBPF; CAP_SYS_PTRACE for the\n"
            "proc collector's pidfd_getfd on other users' workers (same-user workers need none when\n"
            "kernel.yama.ptrace_scope is 0); CAP_DAC_READ_SEARCH to list other users' /proc/PID/fd;\n"
            "nothing else (it opens /dev/shm mailboxes and talks gRPC). E.g. setpriv --inh-caps\n"
            "+bpf,+perfmon,+sys_ptrace --ambient-caps +bpf,+perfmon,+sys_ptrace dynamix agent ...\n\n"
            "TLS: --tls-ca (or $DYNAMIX_TLS_CA) verifies a TLS scheduler; the token is $DYNAMIX_TOKEN.\n\n"
            "exit status: 0 after SIGTERM/SIGINT, 1 on failure, 2 on bad usage."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--job", required=True, metavar="JOB", help="job id the workers got in DYNAMIX_JOB_ID")
    p.add_argument("--scheduler", required=True, metavar="HOST:PORT", help="the scheduler's address")
    p.add_argument("--monitor", choices=MONITORS, default="auto")
    p.add_argument("--interval", type=float_in(0.05), default=1.0, metavar="SECONDS",
                   help="seconds between samples (default 1)")
    p.add_argument("--ready-file", type=Path, metavar="FILE", help="create FILE once monitoring runs (for bpslaunch)")
    p.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA certificate of a TLS scheduler (default: $DYNAMIX_TLS_CA)")
    p.set_defaults(func=_run_agent)


def _run_agent(args: argparse.Namespace) -> int:
    from dynamix_byteps.agent.base import CollectorUnavailable
    from dynamix_byteps.agent.node_agent import NodeAgent
    from dynamix_byteps.control.security import TLS_CA_ENV, TOKEN_ENV

    tls_ca = args.tls_ca or os.environ.get(TLS_CA_ENV) or None
    try:
        agent = NodeAgent(args.job, args.scheduler, os.environ.get(TOKEN_ENV) or None, args.monitor, args.interval,
                          tls_ca=tls_ca)
    except CollectorUnavailable as why:
        raise UsageError(f"argument --monitor {args.monitor}: {why}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("dynamix_byteps.agent").info(
        "node agent for job %s monitoring with %s, reporting to %s", args.job,
        agent.collector.name if agent.collector else "nothing", args.scheduler)
    if args.ready_file is not None:
        write_atomic(args.ready_file, f"{os.getpid()}\n", durable=False)
    try:
        agent.run(stop)
    finally:
        agent.close()
    return 0


# ---- dynamix report --------------------------------------------------------------------------


def _add_report(sub) -> None:
    p = sub.add_parser(
        "report",
        help="draw PNG plots and print a summary table of a recorded run",
        description=(
            "Read the TensorBoard scalars of a run recorded with `bpslaunch --log-dir RUN_DIR` and write\n"
            "batch_size.png (batch size per worker over wall time), loss_accuracy.png (loss and logged\n"
            "accuracy against wall time) and step_time.png (step time per worker); print per-worker means\n"
            "and the job's wall time, steps and final accuracy/loss."
        ),
        epilog="exit status: 0 on success, 1 when the plots cannot be written, 2 when RUN_DIR holds no run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's --log-dir (or its tensorboard/ folder)")
    p.add_argument("--out", type=Path, metavar="DIR", help="where the PNGs go (default: RUN_DIR)")
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from dynamix_byteps.report import RunDirError, write_report

    try:
        paths, table = write_report(args.run_dir, args.out)
    except RunDirError as error:
        raise UsageError(f"argument RUN_DIR: {error}") from None
    print(table)
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0


# ---- entry point ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="dynamix_byteps: per-worker dynamic batch sizes for data-parallel training.")
    parser.add_argument("--version", action="version", version=f"dynamix_byteps {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_scheduler(sub)
    _add_agent(sub)
    add_policy_parser(sub, UsageError)
    add_sim_parser(sub, UsageError)
    _add_report(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dynamix``; returns the exit code (0 ok, 1 failure, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # --help (0) or bad usage (2)
        return stop.code if isinstance(stop.code, int) else 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as error:
        parser.print_usage(sys.stderr)
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (DynamixError, OSError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
