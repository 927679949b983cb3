"""The environment contract between ``bpslaunch`` and a worker process.

BytePS names the cluster with ``DMLC_*`` variables: ``DMLC_NUM_WORKER`` worker *nodes*
(machines), this node's index ``DMLC_WORKER_ID``, and the root's address
``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``; inside a node, ``BYTEPS_LOCAL_SIZE`` worker
processes with ``BYTEPS_LOCAL_RANK`` 0..local_size-1. As in BytePS, the global rank is
``worker_id * local_size + local_rank`` and the size is ``num_worker * local_size``.

Hosts with different numbers of workers (``bpslaunch --hosts H0:3,H1:1``) cannot use that
formula, so ``bpslaunch`` also sets ``DYNAMIX_RANK_OFFSET`` (the global rank of this node's
local rank 0) and ``DYNAMIX_SIZE`` (workers in the job); when both are set, the global rank is
``rank_offset + local_rank`` and the size is ``DYNAMIX_SIZE``. BytePS's environment mode sets
neither and keeps BytePS's formula.

A process started with none of these variables is a single worker (rank 0 of 1), which is
what ``python train.py`` without a launcher gives.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping

from dynamix_byteps.errors import ConfigurationError

ENGINES = ("gloo", "nccl", "byteps", "auto")
DEFAULT_ENGINE = "gloo"
DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_WORKERS = 4096  # worker processes in one job (launcher, scheduler and protocol limit)
DEFAULT_DECISION_INTERVAL = 20


def resolve_engine(name: str, local_size: int) -> str:
    """The engine that ``name`` (one of :data:`ENGINES`) stands for on a node of ``local_size`` workers.

    ``auto`` is ``nccl`` when this torch has CUDA and NCCL and every local worker gets a GPU of
    its own (``torch.cuda.device_count() >= local_size``), else ``gloo``; any other name is itself.
    """
    if name != "auto":
        return name
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= local_size:
        return "nccl"
    return "gloo"


def _int_var(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigurationError(f"environment variable {name} is not set; set it or start the job with bpslaunch")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigurationError(f"environment variable {name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class WorkerEnv:
    """Where this worker process sits in the job, read from the environment.

    Attributes:
        num_nodes: worker nodes in the job (``DMLC_NUM_WORKER``).
        node_rank: this node's index (``DMLC_WORKER_ID``), ``0 <= node_rank < num_nodes``.
        local_size: worker processes on this node (``BYTEPS_LOCAL_SIZE``).
        local_rank: this process's index on its node (``BYTEPS_LOCAL_RANK``).
        root_addr: host of the rendezvous (``DMLC_PS_ROOT_URI``), rank 0 listens there.
        root_port: TCP port of the rendezvous (``DMLC_PS_ROOT_PORT``).
        engine: communication engine (``DYNAMIX_ENGINE``), one of :data:`ENGINES` but ``auto``,
            which :func:`resolve_engine` has replaced.
        timeout_s: seconds a collective may wait for its peers (``DYNAMIX_TIMEOUT``).
        scheduler: ``host:port`` of the scheduler (``DYNAMIX_SCHEDULER``); None = no control plane.
        token: shared secret sent to the scheduler (``DYNAMIX_TOKEN``).
        tls_ca: PEM CA file that verifies a TLS scheduler (``DYNAMIX_TLS_CA``); None = plaintext.
        decision_interval: steps between reports and assignment boundaries (``DYNAMIX_DECISION_INTERVAL``).
        slowdown: straggler emulation, this worker's compute is stretched by this factor
            (``DYNAMIX_SLOWDOWN``, ``FACTOR`` or ``FACTOR@START-END``, >= 1; for benchmarks and tests).
        slowdown_window: ``(start_s, end_s)``, seconds of training (since the worker's first step,
            untimed sections excluded) during which ``slowdown`` applies; ``(0, inf)`` = always.
        rank_offset: global rank of this node's local rank 0 (``DYNAMIX_RANK_OFFSET``), for
            nodes with different numbers of workers; None = BytePS's ``node_rank * local_size``.
        world_size: workers in the job (``DYNAMIX_SIZE``), set together with ``rank_offset``;
            None = BytePS's ``num_nodes * local_size``.
    """

    num_nodes: int = 1
    node_rank: int = 0
    local_size: int = 1
    local_rank: int = 0
    root_addr: str = "127.0.0.1"
    root_port: int | None = None
    engine: str = DEFAULT_ENGINE
    timeout_s: float = DEFAULT_TIMEOUT_S
    scheduler: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    decision_interval: int = DEFAULT_DECISION_INTERVAL
    slowdown: float = 1.0
    slowdown_window: tuple[float, float] = (0.0, math.inf)
    rank_offset: int | None = None
    world_size: int | None = None

    @property
    def rank(self) -> int:
        if self.rank_offset is not None:
            return self.rank_offset + self.local_rank
        return self.node_rank * self.local_size + self.local_rank

    @property
    def size(self) -> int:
        return self.world_size if self.world_size is not None else self.num_nodes * self.local_size

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "WorkerEnv":
        """Read and validate the variables; raises :class:`ConfigurationError` naming the bad one."""
        env = os.environ if env is None else env
        num_nodes = _int_var(env, "DMLC_NUM_WORKER", 1, 1)
        node_rank = _int_var(env, "DMLC_WORKER_ID", 0, 0)
        local_size = _int_var(env, "BYTEPS_LOCAL_SIZE", 1, 1)
        local_rank = _int_var(env, "BYTEPS_LOCAL_RANK", 0, 0)
        if node_rank >= num_nodes:
            raise ConfigurationError(f"DMLC_WORKER_ID={node_rank} must be < DMLC_NUM_WORKER={num_nodes}")
        if local_rank >= local_size:
            raise ConfigurationError(f"BYTEPS_LOCAL_RANK={local_rank} must be < BYTEPS_LOCAL_SIZE={local_size}")
        rank_offset, world_size = _rank_layout(env, local_size)
        distributed = (world_size or num_nodes * local_size) > 1
        root_port = _int_var(env, "DMLC_PS_ROOT_PORT", None if distributed else 0, 0) or None
        if root_port is not None and root_port > 65535:
            raise ConfigurationError(f"DMLC_PS_ROOT_PORT={root_port} is not a TCP port (1-65535)")
        engine = env.get("DYNAMIX_ENGINE", DEFAULT_ENGINE) or DEFAULT_ENGINE
        if engine not in ENGINES:
            raise ConfigurationError(f"DYNAMIX_ENGINE={engine!r} is not an engine; choose one of {', '.join(ENGINES)}")
        try:
            timeout_s = float(env.get("DYNAMIX_TIMEOUT", DEFAULT_TIMEOUT_S))
        except ValueError:
            raise ConfigurationError(f"DYNAMIX_TIMEOUT={env['DYNAMIX_TIMEOUT']!r} is not a number of seconds") from None
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ConfigurationError(f"DYNAMIX_TIMEOUT={timeout_s} must be > 0 and <= {MAX_TIMEOUT_S:.0f} seconds (7 days)")
        scheduler = env.get("DYNAMIX_SCHEDULER") or None
        if scheduler is not None and not scheduler.rpartition(":")[2].isdigit():
            raise ConfigurationError(f"DYNAMIX_SCHEDULER={scheduler!r} is not HOST:PORT")
        try:
            slowdown, slowdown_window = parse_slowdown(env.get("DYNAMIX_SLOWDOWN") or "1")
        except ValueError as error:
            raise ConfigurationError(f"DYNAMIX_SLOWDOWN: {error}") from None
        return cls(
            num_nodes=num_nodes,
            node_rank=node_rank,
            local_size=local_size,
            local_rank=local_rank,
            root_addr=env.get("DMLC_PS_ROOT_URI") or "127.0.0.1",
            root_port=root_port,
            engine=resolve_engine(engine, local_size),
            timeout_s=timeout_s,
            scheduler=scheduler,
            token=env.get("DYNAMIX_TOKEN") or None,
            tls_ca=env.get("DYNAMIX_TLS_CA") or None,
            decision_interval=_int_var(env, "DYNAMIX_DECISION_INTERVAL", DEFAULT_DECISION_INTERVAL, 1),
            slowdown=slowdown,
            slowdown_window=slowdown_window,
            rank_offset=rank_offset,
            world_size=world_size,
        )


def _rank_layout(env: Mapping[str, str], local_size: int) -> tuple[int | None, int | None]:
    """``(DYNAMIX_RANK_OFFSET, DYNAMIX_SIZE)``, both or neither, with this node's ranks inside the job."""
    if not env.get("DYNAMIX_RANK_OFFSET") and not env.get("DYNAMIX_SIZE"):
        return None, None
    for name in ("DYNAMIX_RANK_OFFSET", "DYNAMIX_SIZE"):
        if not env.get(name):
            raise ConfigurationError(f"environment variable {name} is not set; DYNAMIX_RANK_OFFSET and DYNAMIX_SIZE "
                                     "go together (bpslaunch sets both): set both or neither")
    rank_offset = _int_var(env, "DYNAMIX_RANK_OFFSET", None, 0)
    world_size = _int_var(env, "DYNAMIX_SIZE", None, 1)
    if world_size > MAX_WORKERS:
        raise ConfigurationError(f"DYNAMIX_SIZE={world_size} must be <= {MAX_WORKERS}")
    if rank_offset + local_size > world_size:
        raise ConfigurationError(f"DYNAMIX_RANK_OFFSET={rank_offset} + BYTEPS_LOCAL_SIZE={local_size} must be "
                                 f"<= DYNAMIX_SIZE={world_size}: this node's ranks must lie inside the job")
    return rank_offset, world_size


def parse_slowdown(text: str) -> tuple[float, tuple[float, float]]:
    """Parse a straggler emulation ``FACTOR`` or ``FACTOR@START-END`` (seconds of training).

    Returns ``(factor, (start_s, end_s))``; without a window it is ``(0, inf)``.

    Raises:
        ValueError: not that form, ``FACTOR`` outside 1–1000, or not ``0 <= START < END``.
    """
    factor_text, at, window = text.strip().partition("@")
    try:
        factor = float(factor_text)
        start, end = (float(x) for x in window.split("-")) if at else (0.0, math.inf)
    except ValueError:
        factor = start = end = math.nan
    if not (1.0 <= factor <= 1000.0 and 0.0 <= start < end):
        raise ValueError(f"{text!r} is not FACTOR or FACTOR@START-END with 1 <= FACTOR <= 1000 "
                         "and 0 <= START < END seconds")
    return factor, (start, end)
