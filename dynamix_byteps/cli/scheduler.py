"""``dynamix scheduler``: the gRPC scheduler on the parameter-server host (``grpcio`` only when run).

:func:`build_policy` is the policy the scheduler serves, as ``--policy`` and ``--policy-option`` name it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from dynamix_byteps.argtypes import float_in, int_in, key_value, output_path
from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.control.cluster import DECISION_LOG
from dynamix_byteps.env import DEFAULT_DECISION_INTERVAL, MAX_WORKERS
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.tensorboard_scalars import SCHEDULER_RUN, TENSORBOARD_DIR

__all__ = ["add_parser", "build_policy", "run"]


def add_parser(sub) -> None:
    """Add ``scheduler`` to the ``dynamix`` subcommands ``sub``."""
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
    p.add_argument("--port-file", type=output_path("file"), metavar="FILE", help="write the bound port to FILE (atomically) once listening")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="listen address (default 127.0.0.1; others require a token)")
    p.add_argument("--token", metavar="T", help="shared secret the workers send (default: $DYNAMIX_TOKEN)")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this certificate (default: $DYNAMIX_TLS_CERT)")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert (default: $DYNAMIX_TLS_KEY)")
    p.add_argument("--policy", default="static", metavar="NAME", help="static | proportional | goodput | ppo | ppo:NAME (a library policy) (default static)")
    p.add_argument("--policy-option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="option passed to the policy (repeatable), e.g. path=policy.onnx")
    p.add_argument("--num-workers", type=int_in(1, MAX_WORKERS, "--num-workers"), metavar="N", help="job size (default: from the first registration)")
    p.add_argument("--decision-interval", type=int_in(1, what="--decision-interval"), default=DEFAULT_DECISION_INTERVAL, metavar="K", help=f"steps between decisions (default {DEFAULT_DECISION_INTERVAL}, as the workers')")
    run_dir = output_path("dir", appends=(DECISION_LOG, f"{TENSORBOARD_DIR}/{SCHEDULER_RUN}/"))
    p.add_argument("--run-dir", type=run_dir, metavar="DIR",
                   help="where decisions.jsonl is appended (default: no decision log): the run's folder, which "
                   "bpslaunch's --log-dir and the workers' DYNAMIX_LOG_DIR name; --log-dir DIR works too")
    p.add_argument("--log-dir", dest="run_dir", type=run_dir, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int_in(0, 65535, "--metrics-port"), default=0, metavar="M", help="Prometheus /metrics port (default 0: off)")
    p.add_argument("--max-change", type=float_in(1.0, low_open=True), default=2.0, metavar="X",
                   help="largest factor a batch size may change by per decision, > 1 (default 2.0); a size may "
                   "always move by one sample (X=1.01 moves a size of 64 by at most 1)")
    p.add_argument("--hysteresis", type=float_in(0.0), default=0.05, metavar="H", help="change only if the predicted gain exceeds H (default 0.05)")
    p.set_defaults(run=run)


def build_policy(name: str, options: dict, *, max_change: float, hysteresis: float, num_workers: int | None = None):
    """``make_policy(name, **options)`` wrapped in the guardrails (``max_change``, ``hysteresis``).
    With the job's ``num_workers``, a ``ppo`` policy trained on other worker counts warns at once
    (:meth:`~dynamix_byteps.policy.PPOPolicy.check_job_size`); without, at its first decision.

    Raises:
        UsageError: an unknown policy name or an option it does not take (``argument --policy: ...``).
        ConfigurationError: the policies cannot be imported.
    """
    try:
        from dynamix_byteps.policy import PPOPolicy, make_policy
        from dynamix_byteps.policy.guardrails import Guarded
    except ImportError as error:
        raise ConfigurationError(f"the policies cannot be imported: {error}") from error
    try:
        policy = make_policy(name, **options)
    except (KeyError, ValueError, TypeError) as error:
        raise UsageError(f"argument --policy: {error}") from None
    if num_workers is not None and isinstance(policy, PPOPolicy):
        policy.check_job_size(num_workers)
    return Guarded(policy, max_change=max_change, hysteresis=hysteresis)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 then. UsageError for inconsistent TLS/token/bind flags or a bad policy."""
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
    policy = build_policy(args.policy, dict(args.policy_option), max_change=args.max_change, hysteresis=args.hysteresis,
                          num_workers=args.num_workers)
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
