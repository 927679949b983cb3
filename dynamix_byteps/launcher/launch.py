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
with the default gloo engine; with ``--engine byteps`` they run BytePS's server; with ``--engine
ps`` a ``server`` runs summation server ``DYNAMIX_SERVER_ID`` of ``DMLC_NUM_SERVER``.

Elastic restart: with ``--restart-on-failure N --checkpoint PATH``, when a worker fails the others
are stopped and the job starts again with one worker fewer (ranks 0..size-2, a fresh scheduler
for the new size; logs are appended to), up to N times; when a summation server of ``--engine ps``
fails, the job stops the same way and starts again with the same workers and fresh servers. With
``--hosts``, every host's bpslaunch reports how its run ended to node 0's on ``--restart-port``
(needs ``DYNAMIX_TOKEN``), which decides for all (:mod:`.elastic`): the host of each lost worker
runs one fewer, a host left with none leaves the job (exit 0), and the next run rendezvouses on a
fresh port; PATH must be on a file system every host sees. Every child sees ``DYNAMIX_CHECKPOINT`` (PATH) and ``DYNAMIX_RESTART`` (0 on the first run, then 1, 2,
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
``/dev/shm/dynamix.job<pid>-<random>.<rank>`` (``DYNAMIX_JOB_ID``); whatever ends a run (success,
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
import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.cli import PROG, LaunchConfig, build_parser, parse_args
from dynamix_byteps.launcher.elastic import run
from dynamix_byteps.launcher.rendezvous import RendezvousServer
from dynamix_byteps.launcher.specs import build_specs
from dynamix_byteps.launcher.stop_signals import StopSignals
from dynamix_byteps.launcher.supervisor import ChildSpec

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run ``bpslaunch``; returns the exit code (see the module docstring)."""
    parser = build_parser()
    env = dict(os.environ if environ is None else environ)
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv, parser, env)
    except SystemExit as stop:  # argparse: --help (0) or bad usage (2)
        return stop.code if isinstance(stop.code, int) else 2
    except UsageError as error:
        return _usage_error(parser, str(error))
    # Caught from here to the end, the run folder's removal included: a signal between runs or while the
    # hosts agree on the next one stops the job, never with a traceback or a folder left behind.
    with StopSignals().caught() as signals, _run_dir(config) as run_dir:
        return _launch(dataclasses.replace(config, run_dir=run_dir), env, parser, signals)


@contextlib.contextmanager
def _run_dir(config: LaunchConfig) -> Iterator[Path | None]:
    """Where the scheduler, the agent and the progress bar write: ``--log-dir``, else a temporary
    folder removed at the end (only when one of them runs), else None."""
    if config.log_dir is not None or (config.policy is None and not sys.stderr.isatty()):
        yield config.log_dir
        return
    with tempfile.TemporaryDirectory(prefix="dynamix-run-") as folder:
        yield Path(folder)


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _build(config: LaunchConfig, env: Mapping[str, str], parser: argparse.ArgumentParser) -> list[ChildSpec] | int:
    """The run's children, or the exit code (2 bad usage, 1 configuration error) after printing why."""
    notes: list[str] = []
    try:
        specs = build_specs(config, env, notes)
    except UsageError as error:
        return _usage_error(parser, str(error))
    except ConfigurationError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    return specs


def _launch(config: LaunchConfig, env: Mapping[str, str], parser: argparse.ArgumentParser,
            signals: StopSignals) -> int:
    build = functools.partial(_build, env=env, parser=parser)
    specs = build(config)
    if isinstance(specs, int):
        return specs
    if not specs:
        return 0
    coordinator = None
    if config.multi_host_elastic and config.node_rank == 0:  # serves the restart rendezvous (scheduler's token, TLS)
        try:
            coordinator = RendezvousServer(config.hosts[0][0], config.restart_port, env["DYNAMIX_TOKEN"],
                                           config.tls_cert, config.tls_key, hosts=len(config.hosts))
        except (OSError, ValueError) as error:  # the port is taken; the token is no gRPC metadata
            return _usage_error(parser, f"{'argument --restart-port' if isinstance(error, OSError) else 'DYNAMIX_TOKEN'}"
                                f": {error}")
    try:
        return run(config, env, build, specs, coordinator, signals)
    finally:
        if coordinator is not None:
            coordinator.close()


if __name__ == "__main__":
    sys.exit(main())
