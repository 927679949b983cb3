"""What one ``bpslaunch`` run was asked to do: :class:`LaunchConfig`, built by :mod:`.cli` and read
by every other part of the launcher (topology, child specs, the elastic loop), never changed in
place: a restart is a new config made with :func:`dataclasses.replace`."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from dynamix_byteps.env import DEFAULT_DECISION_INTERVAL

PROG = "bpslaunch"
DEFAULT_GRACE_S = 5.0
# The flags of one size for every worker or one per rank, and the variable each sets in the workers' environment.
PER_RANK_SIZES = {"batch_size": "DYNAMIX_BATCH_SIZE", "min_batch": "DYNAMIX_MIN_BATCH", "max_batch": "DYNAMIX_MAX_BATCH"}


def _new_job_id() -> str:
    return f"job{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class LaunchConfig:
    """The flags of ``bpslaunch`` (see ``bpslaunch --help``), validated, paths absolute.

    Attributes (one per flag unless said otherwise; None = not given):
        command: the program every worker runs, with its arguments.
        num_workers: ``--num-workers``; None = BytePS environment mode (or ``--hosts H:S``).
        engine: ``--engine``; None = ``$DYNAMIX_ENGINE``, else gloo.
        num_servers, server_hosts: ``--num-servers K`` and where they run (``--engine ps``).
        hosts: ``--hosts`` as ``((host, slots or None), ...)``; node_rank: ``--node-rank``.
        batch_size, min_batch, max_batch: ``--batch-size``/``--min-batch``/``--max-batch`` as given,
            ``"64"`` (every worker) or ``"32,96"`` (one per rank).
        slowdown: ``--slowdown`` as ``((rank, "FACTOR[@START-END]"), ...)``.
        policy_option: ``--policy-option`` as ``((key, value), ...)``, values parsed (bool, int, float, text).
        timeout, grace_period: seconds.
        restart_on_failure, restart_port, checkpoint: the elastic restart flags.
        run: this run's index (0, then 1 after the first restart, ...; ``DYNAMIX_RESTART``).
        run_dir: where the scheduler, the agent and the progress bar write (``--log-dir``, else a
            temporary folder the entry point owns); None until the entry point sets it.
        job_id: names the workers' monitoring mailboxes on this host (``DYNAMIX_JOB_ID``), the
            same for the whole life of this launcher and different for any other launcher.
    """

    command: tuple[str, ...] = ()
    num_workers: int | None = None
    engine: str | None = None
    num_servers: int | None = None
    server_hosts: tuple[str, ...] | None = None
    batch_size: str | None = None
    log_dir: Path | None = None
    port: int | None = None
    timeout: float | None = None
    grace_period: float = DEFAULT_GRACE_S
    policy: str | None = None
    policy_path: Path | None = None
    policy_option: tuple[tuple[str, object], ...] = ()
    fine_tune: int | None = None
    min_batch: str | None = None
    max_batch: str | None = None
    decision_interval: int = DEFAULT_DECISION_INTERVAL
    max_change: float | None = None
    hysteresis: float | None = None
    lr_scaling: str | None = None
    scheduler_port: int | None = None
    bind: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    monitor: str = "auto"
    slowdown: tuple[tuple[int, str], ...] = ()
    hosts: tuple[tuple[str, int | None], ...] | None = None
    node_rank: int | None = None
    restart_on_failure: int = 0
    restart_port: int | None = None
    checkpoint: Path | None = None
    run: int = 0
    run_dir: Path | None = None
    job_id: str = field(default_factory=_new_job_id)

    @property
    def local(self) -> bool:
        """Whether the flags name the workers (``--num-workers``/``--hosts``), not the DMLC_* environment."""
        return self.num_workers is not None or self.hosts is not None

    @property
    def temporary_run_dir(self) -> Path | None:
        """``run_dir`` when it is the entry point's temporary folder (no ``--log-dir``), else None."""
        return self.run_dir if self.log_dir is None else None

    @property
    def multi_host_elastic(self) -> bool:
        """Restarts agreed by the launchers of several hosts (:mod:`.elastic`)."""
        return bool(self.restart_on_failure) and self.hosts is not None and len(self.hosts) > 1
