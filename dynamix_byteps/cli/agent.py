"""``dynamix agent``: the node agent of this host (its collectors are imported when it runs)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from dynamix_byteps.agent.base import MAX_INTERVAL_S, MONITORS, NODE_METRICS_MAX_AGE_S
from dynamix_byteps.argtypes import argument_type, float_in, host_port, output_path
from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.errors import UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Add ``agent`` to the ``dynamix`` subcommands ``sub``."""
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
    p.add_argument("--job", type=argument_type(_job_name), required=True, metavar="JOB",
                   help="job id the workers got in DYNAMIX_JOB_ID ([A-Za-z0-9_-])")
    p.add_argument("--scheduler", type=host_port, required=True, metavar="HOST:PORT",
                   help="the scheduler's address ([V6]:PORT for an IPv6 address; gRPC targets dns:///HOST:PORT, "
                   "ipv4:IP:PORT and ipv6:[IP]:PORT too)")
    p.add_argument("--monitor", choices=MONITORS, default="auto")
    p.add_argument("--interval", type=float_in(0.05, MAX_INTERVAL_S), default=1.0, metavar="SECONDS",
                   help=f"seconds between samples (default 1, at most {MAX_INTERVAL_S:g}: the scheduler ignores "
                   f"node metrics older than {NODE_METRICS_MAX_AGE_S:g} s)")
    p.add_argument("--ready-file", type=output_path("file"), metavar="FILE", help="create FILE once monitoring runs (for bpslaunch)")
    p.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA certificate of a TLS scheduler (default: $DYNAMIX_TLS_CA)")
    p.set_defaults(run=run)


def _job_name(text: str) -> str:
    """``--job``: a name the workers accept for their mailboxes (ValueError otherwise)."""
    from dynamix_byteps.control.mailbox import mailbox_name

    mailbox_name(text, 0)
    return text


def run(args: argparse.Namespace) -> int:
    """Monitor and report until SIGTERM/SIGINT; 0 then. UsageError when ``--monitor`` cannot run here."""
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
