"""The processes of a ``bpslaunch`` job, as :class:`ChildSpec`-s, from a :class:`LaunchConfig` and the
launcher's environment: the workers with their environment contract (:mod:`dynamix_byteps.env`),
in local mode (``--num-workers``/``--hosts``) or BytePS environment mode (``DMLC_*``), and the
services of :mod:`.services` they need. Nothing is started here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from dynamix_byteps.argtypes import run_dir_entry_problem
from dynamix_byteps.assignment import BatchBounds, parse_batch_sizes
from dynamix_byteps.control.cluster import DECISION_LOG
from dynamix_byteps.engine.ps_rendezvous import MAX_SERVERS
from dynamix_byteps.env import (
    CHECKPOINT_ENV,
    DEFAULT_ENGINE,
    ENGINES,
    JOB_ID_ENV,
    MAX_WORKERS,
    RESTART_ENV,
    WorkerEnv,
    optional_int,
    resolve_engine,
    too_many_workers,
)
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.config import PER_RANK_SIZES, LaunchConfig
from dynamix_byteps.launcher.services import (
    agent_spec,
    byteps_role_spec,
    ps_server_spec,
    require_byteps,
    scheduler_specs,
)
from dynamix_byteps.launcher.supervisor import ChildSpec
from dynamix_byteps.launcher.topology import (
    Topology,
    check_port_free,
    free_port,
    interface_towards,
    visible_gpu_count,
)
from dynamix_byteps.tensorboard_scalars import TENSORBOARD_DIR

__all__ = ["build_specs", "env_mode", "local_mode", "worker_specs"]

#: What the run writes in --log-dir besides the children's logs (a directory's name ends in /).
RUN_DIR_ENTRIES = (DECISION_LOG, f"{TENSORBOARD_DIR}/")

_ENV_MODE_HINT = (
    "pass --num-workers N to run N local workers, or set the BytePS variables DMLC_ROLE, "
    "DMLC_NUM_WORKER, DMLC_WORKER_ID, DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT"
)


def build_specs(config: LaunchConfig, env: Mapping[str, str], notes: list[str]) -> list[ChildSpec]:
    """Every process this launcher starts for run ``config.run`` (empty when its role needs none),
    services first; each gets ``env`` with ``DYNAMIX_RESTART`` (and ``DYNAMIX_CHECKPOINT``) added.
    Notes for the user are appended to ``notes``; the log files are created.

    Raises:
        UsageError: flags or ``DMLC_*`` variables that do not describe a job (exit 2).
        ConfigurationError: this machine cannot run it (e.g. no byteps package; exit 1).
    """
    env = dict(env, **{RESTART_ENV: str(config.run)})
    if config.checkpoint is not None:
        env[CHECKPOINT_ENV] = str(config.checkpoint)
    specs = local_mode(config, env, notes) if config.local else env_mode(config, env, notes)
    if specs and config.log_dir is not None:
        _prepare_log_files(config.log_dir, specs)
    return specs


def _engine(config: LaunchConfig, env: Mapping[str, str], local_size: int) -> str:
    """--engine, else $DYNAMIX_ENGINE, else gloo, with ``auto`` resolved for ``local_size`` workers on this host."""
    engine = config.engine
    if engine is None:
        engine = env.get("DYNAMIX_ENGINE", "").strip() or DEFAULT_ENGINE
        if engine not in ENGINES:
            raise UsageError(f"environment variable DYNAMIX_ENGINE={engine!r} is not an engine; set it to one of "
                             f"{', '.join(ENGINES)} or pass --engine")
    return resolve_engine(engine, local_size)


def _required_int(env: Mapping[str, str], name: str, what: str, minimum: int, maximum: int | None = None) -> int:
    """Environment mode's integer variable ``name`` (``what`` it means, for the message)."""
    try:
        value = optional_int(env, name, minimum, maximum)
    except ConfigurationError as error:
        raise UsageError(f"{error}; set it to {what}") from None
    if value is None:
        raise UsageError(f"environment variable {name} is not set; set it to {what}, or {_ENV_MODE_HINT}")
    return value


def worker_specs(config: LaunchConfig, env: Mapping[str, str], *, engine: str, num_nodes: int, node_rank: int,
                 local_size: int, root_addr: str, root_port: int, notes: list[str], scheduler: str | None = None,
                 rank_offset: int | None = None, world_size: int | None = None) -> list[ChildSpec]:
    """One :class:`ChildSpec` per local worker, with the environment contract filled in.

    ``rank_offset``/``world_size`` (local mode) number the workers ``rank_offset + local_rank``
    of ``world_size`` (``DYNAMIX_RANK_OFFSET``, ``DYNAMIX_SIZE``); None keeps BytePS's formula.
    """
    if engine == "byteps":
        require_byteps("worker")
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
    if config.timeout is not None:
        base["DYNAMIX_TIMEOUT"] = repr(config.timeout)
    if config.log_dir is not None:
        base["DYNAMIX_LOG_DIR"] = str(config.log_dir)
    for flag, variable in (*PER_RANK_SIZES.items(), ("lr_scaling", "DYNAMIX_LR_SCALING")):
        if getattr(config, flag) is not None:
            base[variable] = getattr(config, flag)
    if scheduler is not None:
        base.update(DYNAMIX_SCHEDULER=scheduler, DYNAMIX_DECISION_INTERVAL=str(config.decision_interval))
        if config.tls_ca is not None:
            base["DYNAMIX_TLS_CA"] = str(config.tls_ca)
        if config.monitor != "off":
            base[JOB_ID_ENV] = config.job_id
    slowdowns = dict(config.slowdown)
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
        log_path = None if config.log_dir is None else config.log_dir / f"worker-{rank}.log"
        specs.append(ChildSpec(label=str(rank), argv=list(config.command), env=child_env, log_path=log_path))
    return specs


def _require_command(config: LaunchConfig) -> None:
    if not config.command:
        raise UsageError("no command to run; put it after '--', e.g. bpslaunch --num-workers 2 -- python train.py")


def local_mode(config: LaunchConfig, env: Mapping[str, str], notes: list[str]) -> list[ChildSpec]:
    """``--num-workers N``: N workers on this machine (and, with ``--hosts``, on each host, or
    the host's slots of ``--hosts H:S,...``); with ``--policy``, the scheduler first, on node 0."""
    _require_command(config)
    topology = Topology.of(config.hosts, config.node_rank, config.num_workers)
    engine = _engine(config, env, topology.local_size)
    hosts, node_rank, total = topology.hosts, topology.node_rank, topology.size
    if len(hosts) > 1 and config.port is None:
        raise UsageError("--hosts needs --port: every host must use the same rendezvous port")
    if engine == "byteps" and len(set(topology.slots)) > 1:
        raise UsageError("--hosts with different slots per host needs --engine gloo: BytePS numbers ranks as "
                         "node_rank * local_size + local_rank, which needs the same number of workers on every host")
    if node_rank == 0 and config.port is not None:
        check_port_free(config.port, topology.root)
    port = config.port if config.port is not None else free_port()
    if len(hosts) > 1 and engine in ("gloo", "ps") and not env.get("GLOO_SOCKET_IFNAME"):
        env = dict(env, GLOO_SOCKET_IFNAME=interface_towards(hosts[0]))
        notes.append(f"gloo binds to {env['GLOO_SOCKET_IFNAME']}, the interface that reaches {hosts[0]}; "
                     "set GLOO_SOCKET_IFNAME to choose another")
    if len(hosts) > 1 and engine == "ps" and not env.get("TP_SOCKET_IFNAME"):  # the ps engine's RPC (TensorPipe)
        env = dict(env, TP_SOCKET_IFNAME=interface_towards(hosts[0]))
    _check_bounds(config, env, total)
    seen = set()
    for rank, _ in config.slowdown:
        if rank >= total:
            raise UsageError(f"argument --slowdown: rank {rank} is not in this job of {total} workers")
        if rank in seen:
            raise UsageError(f"argument --slowdown: rank {rank} is given twice; one slowdown (and window) per rank")
        seen.add(rank)
    services, scheduler = scheduler_specs(config, env, hosts, node_rank, total)
    if engine == "ps":
        placement = _ps_placement(config, topology)
        # Every host must name the same rendezvous port for the servers: --port's next one across hosts.
        ps_port = free_port() if len(hosts) == 1 else port + 1
        ps_addr = topology.root if placement[0] == 0 else hosts[placement[0]]  # server 0 hosts the rendezvous
        env = dict(env, DMLC_NUM_SERVER=str(len(placement)), DYNAMIX_PS_PORT=str(ps_port), DYNAMIX_PS_ADDR=ps_addr)
        services += [ps_server_spec(config, env, index, servers=len(placement), workers=total, addr=ps_addr,
                                    port=ps_port) for index, node in enumerate(placement) if node == node_rank]
    elif config.num_servers is not None or config.server_hosts is not None:
        raise UsageError(f"--{'num-servers' if config.num_servers is not None else 'server-hosts'} is for --engine ps")
    if scheduler is not None and config.monitor != "off":
        services.append(agent_spec(config, env, scheduler, node_rank))
    return services + worker_specs(
        config, env, engine=engine, num_nodes=len(hosts), node_rank=node_rank, local_size=topology.local_size,
        root_addr=topology.root, root_port=port, notes=notes, scheduler=scheduler,
        rank_offset=topology.rank_offset, world_size=total,
    )


def _ps_placement(config: LaunchConfig, topology: Topology) -> list[int]:
    """The index in ``--hosts`` of each summation server's host: server i on the (i mod n)-th of
    ``--server-hosts`` (a name given twice in ``--hosts`` is its first), else all on node 0."""
    servers = config.num_servers or 1
    if config.server_hosts is None:
        return [0] * servers
    if len(topology.hosts) == 1:
        raise UsageError("--server-hosts needs --hosts: on one machine every server runs on it")
    unknown = [host for host in config.server_hosts if host not in topology.hosts]
    if unknown:
        raise UsageError(f"argument --server-hosts: {', '.join(unknown)} is not one of --hosts "
                         f"({', '.join(topology.hosts)}); a server runs beside a host's workers, started by its bpslaunch")
    nodes = [topology.hosts.index(host) for host in config.server_hosts]
    return [nodes[index % len(nodes)] for index in range(servers)]


def _check_bounds(config: LaunchConfig, env: Mapping[str, str], total: int) -> None:
    """--min-batch/--max-batch (else the DYNAMIX_MIN_BATCH/DYNAMIX_MAX_BATCH the workers inherit) and
    --batch-size (else DYNAMIX_BATCH_SIZE) agree, rank by rank, so a bad combination is a usage error
    here, not a traceback in every worker."""
    lows, _ = _per_rank_sizes(config, env, "min_batch", "DYNAMIX_MIN_BATCH", total)
    highs, _ = _per_rank_sizes(config, env, "max_batch", "DYNAMIX_MAX_BATCH", total)
    try:
        bounds = BatchBounds.build(total, lows or 1, highs)
    except ConfigurationError as error:
        raise UsageError(f"--min-batch/--max-batch (or DYNAMIX_MIN_BATCH/DYNAMIX_MAX_BATCH): {error}") from None
    batches, source = _per_rank_sizes(config, env, "batch_size", "DYNAMIX_BATCH_SIZE", total)
    for rank, (batch, low, high) in enumerate(zip(batches or (), bounds.min_batch, bounds.max_batch)):
        if not low <= batch <= (high or batch):
            raise UsageError(f"{source}: {batch} is outside rank {rank}'s bounds [{low}, {high or 'unbounded'}]")


def _per_rank_sizes(config: LaunchConfig, env: Mapping[str, str], flag: str, variable: str,
                    total: int) -> tuple[tuple[int, ...] | None, str]:
    """The ``total`` per-rank sizes of flag ``flag`` (``"64"`` or ``"32,96"``), else of the inherited
    ``variable``, and where they came from; None when neither is given.

    Raises:
        UsageError: naming the flag or variable, when the text is malformed or has neither 1 nor
            ``total`` values.
    """
    given = getattr(config, flag)
    text, source = (given, f"argument --{flag.replace('_', '-')}") if given is not None else \
        (env.get(variable), f"environment variable {variable}")
    if not text:
        return None, source
    try:
        return parse_batch_sizes(text, total), source
    except ConfigurationError as error:
        raise UsageError(f"{source}: {error}") from None


def env_mode(config: LaunchConfig, env: Mapping[str, str], notes: list[str]) -> list[ChildSpec]:
    """No ``--num-workers``: the role and cluster come from the BytePS ``DMLC_*`` variables.

    Returns an empty list when this role needs no process (server/scheduler with gloo).
    Raises :class:`UsageError` naming the first missing or invalid variable.
    """
    if config.policy is not None:
        raise UsageError("--policy needs --num-workers or --hosts; BytePS environment mode runs workers only")
    role = env.get("DMLC_ROLE", "").strip()
    if not role:
        raise UsageError(f"environment variable DMLC_ROLE is not set; {_ENV_MODE_HINT}")
    if role not in ("worker", "server", "scheduler"):
        raise UsageError(f"environment variable DMLC_ROLE={role!r} is not a role; set it to worker, server or scheduler")
    if role != "worker":
        return _role_specs(config, env, role, _engine(config, env, 1), notes)
    _require_command(config)
    num_nodes = _required_int(env, "DMLC_NUM_WORKER", "the number of worker nodes", 1, MAX_WORKERS)
    node_rank = _required_int(env, "DMLC_WORKER_ID", f"this node's index (0..{num_nodes - 1})", 0, num_nodes - 1)
    root_addr = env.get("DMLC_PS_ROOT_URI", "").strip()
    if not root_addr:
        raise UsageError(f"environment variable DMLC_PS_ROOT_URI is not set; set it to the host of global rank 0, "
                         f"or {_ENV_MODE_HINT}")
    root_port = config.port if config.port is not None else _required_int(
        env, "DMLC_PS_ROOT_PORT", "the rendezvous TCP port", 1, 65535)
    if env.get("BYTEPS_LOCAL_SIZE", "").strip():
        local_size = _required_int(env, "BYTEPS_LOCAL_SIZE", "the number of worker processes on this node", 1,
                                   MAX_WORKERS)
    else:
        local_size = visible_gpu_count(env)
    if num_nodes * local_size > MAX_WORKERS:
        raise UsageError(too_many_workers(num_nodes, local_size, per_gpu=not env.get("BYTEPS_LOCAL_SIZE", "").strip()))
    engine = _engine(config, env, local_size)
    if engine == "byteps" and num_nodes > 1:
        _required_int(env, "DMLC_NUM_SERVER", "the number of BytePS server processes", 1, MAX_SERVERS)
    if num_nodes == 1 and engine in ("gloo", "nccl") and root_addr != "127.0.0.1":
        # Every process of the job is on this machine. BytePS's single-machine recipe sets any
        # DMLC_PS_ROOT_URI ("it does not matter"); rendezvousing there would wait for the timeout.
        notes.append(f"DMLC_NUM_WORKER=1: the workers rendezvous on this machine (127.0.0.1:{root_port}); "
                     f"DMLC_PS_ROOT_URI={root_addr} is not used")
        root_addr = "127.0.0.1"
    _check_bounds(config, env, num_nodes * local_size)
    return worker_specs(
        config, env, engine=engine, num_nodes=num_nodes, node_rank=node_rank, local_size=local_size,
        root_addr=root_addr, root_port=root_port, notes=notes,
    )


def _role_specs(config: LaunchConfig, env: Mapping[str, str], role: str, engine: str,
                notes: list[str]) -> list[ChildSpec]:
    """``DMLC_ROLE=server`` or ``scheduler``: BytePS's process with ``--engine byteps``, a summation
    server with ``--engine ps`` (its scheduler role needs none), else none."""
    if engine == "ps" and role == "server":
        return [_ps_env_server(config, env)]
    if engine != "byteps":
        notes.append(f"DMLC_ROLE={role}: the {engine} engine needs no {role} process; nothing to start")
        return []
    _required_int(env, "DMLC_NUM_WORKER", "the number of worker nodes", 1, MAX_WORKERS)
    _required_int(env, "DMLC_NUM_SERVER", "the number of BytePS server processes", 1, MAX_SERVERS)
    if not env.get("DMLC_PS_ROOT_URI", "").strip():
        raise UsageError("environment variable DMLC_PS_ROOT_URI is not set; set it to the scheduler's host")
    if config.port is None:
        _required_int(env, "DMLC_PS_ROOT_PORT", "the scheduler's TCP port", 1, 65535)
    return [byteps_role_spec(config, env, role)]


def _ps_env_server(config: LaunchConfig, env: Mapping[str, str]) -> ChildSpec:
    """``DMLC_ROLE=server`` with the ps engine: summation server ``DYNAMIX_SERVER_ID`` (0..DMLC_NUM_SERVER-1,
    default 0 when there is one) for the ``DMLC_NUM_WORKER`` x ``BYTEPS_LOCAL_SIZE`` workers (or
    ``DYNAMIX_SIZE``), its rendezvous at ``DYNAMIX_PS_ADDR`` (default ``DMLC_PS_ROOT_URI``) on
    ``DYNAMIX_PS_PORT`` (default the root port + 1), as the workers read them."""
    servers = _required_int(env, "DMLC_NUM_SERVER", "the number of summation servers", 1, MAX_SERVERS)
    if servers == 1 and not env.get("DYNAMIX_SERVER_ID", "").strip():
        index = 0
    else:
        index = _required_int(env, "DYNAMIX_SERVER_ID", f"this server's index (0..{servers - 1})", 0, servers - 1)
    if env.get("DYNAMIX_SIZE", "").strip():
        workers = _required_int(env, "DYNAMIX_SIZE", "the number of worker processes", 1, MAX_WORKERS)
    else:
        try:
            local_size = optional_int(env, "BYTEPS_LOCAL_SIZE", 1, MAX_WORKERS) or 1
        except ConfigurationError as error:
            raise UsageError(f"{error}; set it to the number of worker processes on each node") from None
        nodes = _required_int(env, "DMLC_NUM_WORKER", "the number of worker nodes", 1, MAX_WORKERS)
        if nodes * local_size > MAX_WORKERS:
            raise UsageError(too_many_workers(nodes, local_size))
        workers = nodes * local_size
    addr = env.get("DYNAMIX_PS_ADDR", "").strip() or env.get("DMLC_PS_ROOT_URI", "").strip()
    if not addr:
        raise UsageError(f"environment variable DMLC_PS_ROOT_URI is not set; set it to the host of the workers' "
                         f"rendezvous, or {_ENV_MODE_HINT}")
    if env.get("DYNAMIX_PS_PORT", "").strip():
        port = _required_int(env, "DYNAMIX_PS_PORT", "the servers' rendezvous TCP port", 1, 65535)
    else:
        port = 1 + (config.port if config.port is not None else
                    _required_int(env, "DMLC_PS_ROOT_PORT", "the rendezvous TCP port", 1, 65534))
    return ps_server_spec(config, env, index, servers=servers, workers=workers, addr=addr, port=port, service=False)


def _prepare_log_files(log_dir: Path, specs: Sequence[ChildSpec]) -> None:
    """Create ``log_dir`` and check that every child's log file, the decision log and the TensorBoard
    folder can be written, before any starts."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"argument --log-dir: cannot create {log_dir}: {error.strerror}") from None
    for entry in RUN_DIR_ENTRIES:
        if problem := run_dir_entry_problem(log_dir, entry):
            raise UsageError(f"argument --log-dir: {problem}")
    for spec in specs:
        if spec.log_path is None:
            continue
        try:
            with open(spec.log_path, "ab"):
                pass
        except OSError as error:
            raise UsageError(f"argument --log-dir: cannot write the log file {spec.log_path}: {error.strerror}") from None
