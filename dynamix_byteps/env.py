"""The environment contract between a launcher and a worker process.

The variables of BytePS, torchrun, MPI launchers and Slurm are read; a process started with none
of them is a single worker (rank 0 of 1), which is what ``python train.py`` without a launcher gives.

**BytePS** (``bpslaunch``, or BytePS's own variables set by hand) names the cluster with
``DMLC_*`` variables: ``DMLC_NUM_WORKER`` worker *nodes* (machines), this node's index
``DMLC_WORKER_ID``, and the root's address ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``; inside a
node, ``BYTEPS_LOCAL_SIZE`` worker processes with ``BYTEPS_LOCAL_RANK`` 0..local_size-1. As in
BytePS, the global rank is ``worker_id * local_size + local_rank`` and the size is
``num_worker * local_size``. Hosts with different numbers of workers (``bpslaunch --hosts
H0:3,H1:1``) cannot use that formula, so ``bpslaunch`` also sets ``DYNAMIX_RANK_OFFSET`` (the
global rank of this node's local rank 0) and ``DYNAMIX_SIZE`` (workers in the job); when both
are set, the global rank is ``rank_offset + local_rank`` and the size is ``DYNAMIX_SIZE``.

**torchrun** (also Slurm or Kubeflow PyTorchJob scripts that follow it) sets ``RANK`` of
``WORLD_SIZE``, ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE`` on this node, and the rendezvous
``MASTER_ADDR:MASTER_PORT``. ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` may both be absent (one
process per node or pod, as a PyTorchJob without torchrun starts): local rank 0 of 1.

**MPI launchers** (what Horovod users start jobs with) and **Slurm** name the same four numbers
in their own variables: Open MPI's ``mpirun`` ``OMPI_COMM_WORLD_RANK`` of ``OMPI_COMM_WORLD_SIZE`` and
``OMPI_COMM_WORLD_LOCAL_RANK`` of ``OMPI_COMM_WORLD_LOCAL_SIZE``; MPICH's and Intel MPI's
``mpiexec`` (Hydra) ``PMI_RANK`` of ``PMI_SIZE`` and ``MPI_LOCALRANKID`` of ``MPI_LOCALNRANKS``;
``horovodrun`` (Gloo mode) ``HOROVOD_RANK`` of ``HOROVOD_SIZE`` and ``HOROVOD_LOCAL_RANK`` of
``HOROVOD_LOCAL_SIZE``.
Slurm's ``srun`` gives ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` and ``SLURM_LOCALID`` of this
node's entry in ``SLURM_STEP_TASKS_PER_NODE`` (read only in an srun task: a batch script has
``SLURM_PROCID`` too, but no ``SLURM_STEP_*``). These launchers set no rendezvous, so the job gives
every rank ``MASTER_PORT``, and ``MASTER_ADDR`` (the host of rank 0) when its ranks span hosts
(``mpirun -x MASTER_PORT=29500 ...``, ``MASTER_PORT=29500 srun ...``).

A partial contract is an error, never a silent single worker: once any of a contract's rank
variables is set, the job's size (``DMLC_NUM_WORKER``, ``WORLD_SIZE``) is required, the
process's index whenever the size is above 1, a local index whenever the local size is
above 1 (and the local size whenever a local index is given), and the root's address and
port whenever the job has more than one worker. The root's address is a host name or an IP
address (an IPv6 one with or without brackets), spaces around it allowed; its port goes in its own
variable. When both BytePS's and torchrun's variables are set (a ``bpslaunch`` started inside a
torchrun job) they must describe the same rank and size; BytePS's wins. An MPI launcher's or srun's variables are read only when neither is set
(``mpirun`` or ``srun`` may start one torchrun per host, whose workers then inherit its rank).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping

from dynamix_byteps.argtypes import MAX_PORT, dial_address, host_problem, ip_version, is_host_name
from dynamix_byteps.errors import ConfigurationError

ENGINES = ("gloo", "nccl", "byteps", "ps", "auto")
DEFAULT_ENGINE = "gloo"
DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_WORKERS = 4096  # worker processes in one job (launcher, scheduler and protocol limit)
MAX_BATCH = 2**31 - 1  # samples: the largest local batch size anything accepts or assigns (int32 range)
DEFAULT_DECISION_INTERVAL = 20
JOB_ID_ENV = "DYNAMIX_JOB_ID"  # names the workers' monitoring mailboxes on this host (bpslaunch --policy)
STARTED_DIR_ENV = "DYNAMIX_STARTED_DIR"  # each worker leaves a file named by its rank there once it joined
COLLECTIVE_FAILED_SUFFIX = ".collective-failed"  # and <rank> + this once a collective of it failed
CHECKPOINT_ENV = "DYNAMIX_CHECKPOINT"  # bpslaunch --checkpoint: the file a job saves to and resumes from
RESTART_ENV = "DYNAMIX_RESTART"  # bpslaunch --restart-on-failure: 0 on the first run, then 1, 2, ...

BYTEPS_RANK_VARIABLES = ("DMLC_NUM_WORKER", "DMLC_WORKER_ID", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK",
                         "DYNAMIX_RANK_OFFSET", "DYNAMIX_SIZE")


@dataclass(frozen=True)
class RankContract:
    """A launcher that gives each process four variables, its rank of the job's size and its local
    rank of its node's size, and leaves the rendezvous to ``MASTER_ADDR:MASTER_PORT``.

    Attributes:
        name: the launcher's short name (:attr:`WorkerEnv.contract`).
        launcher: how messages name it, e.g. ``"mpirun (Open MPI)"``.
        size, rank, local_size, local_rank: the names of its four variables.
        rendezvous_hint: how a job started by it sets ``MASTER_ADDR``/``MASTER_PORT``; empty when
            the launcher sets them itself.
        node_id: when set, ``local_size`` names a list of every node's local size (srun's
            ``SLURM_STEP_TASKS_PER_NODE``), and this variable this node's index in it.
    """

    name: str
    launcher: str
    size: str
    rank: str
    local_size: str
    local_rank: str
    rendezvous_hint: str = ""
    node_id: str = ""

    @property
    def variables(self) -> tuple[str, str, str, str]:
        return self.size, self.rank, self.local_size, self.local_rank


TORCHRUN = RankContract("torchrun", "torchrun", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
OPEN_MPI = RankContract("openmpi", "mpirun (Open MPI)", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                        rendezvous_hint="mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ...")
# horovodrun's Gloo mode (in MPI mode it runs mpirun); it passes its own environment on to the ranks.
HOROVODRUN = RankContract("horovodrun", "horovodrun (Gloo)", "HOROVOD_SIZE", "HOROVOD_RANK", "HOROVOD_LOCAL_SIZE",
                          "HOROVOD_LOCAL_RANK", rendezvous_hint="MASTER_ADDR=<host of rank 0> MASTER_PORT=29500 "
                          "horovodrun ...")
MPICH = RankContract("mpich", "mpiexec (MPICH, Intel MPI)", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID",
                     rendezvous_hint="mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500 ...")
# SLURM_STEP_TASKS_PER_NODE ("2(x3),1": tasks on each node of the step) is read at SLURM_NODEID.
SLURM = RankContract("slurm", "srun (Slurm)", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE",
                     "SLURM_LOCALID", rendezvous_hint='MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | '
                     "head -1) MASTER_PORT=29500 srun ...", node_id="SLURM_NODEID")


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


def _is_set(env: Mapping[str, str], name: str) -> bool:
    return bool(env.get(name))


# ASCII digits only, spaces around allowed: int() also takes '+5', '1_6' and other scripts' digits, which
# another reader of the same variable (atoi in a C++ process, a shell's test) reads otherwise or refuses.
_INTEGER_TEXT = re.compile(r" *-?[0-9]+ *")
_QUOTED_LIMIT = 60  # characters of a text a message repeats
# Digits (leading zeros aside) beyond which an integer is out of every range here, and not given to int(): no
# PYTHONINTMAXSTRDIGITS makes int() refuse fewer (sys.int_info.str_digits_check_threshold).
_MAX_DIGITS = 640


def optional_int(env: Mapping[str, str], name: str, minimum: int, maximum: int | None = None) -> int | None:
    """The integer value of environment variable ``name`` in ``env`` (e.g. ``os.environ``), None when unset.

    Raises:
        ConfigurationError: naming the variable, when it is not an integer in [minimum, maximum]
            written in the ASCII digits 0-9 (an optional '-' and spaces around it allowed); an
            integer of over 640 digits is out of range, whatever ``maximum`` is.
    """
    if not _is_set(env, name):
        return None
    raw = env[name]
    if not _INTEGER_TEXT.fullmatch(raw):
        raise ConfigurationError(f"environment variable {name}={quoted(raw)} is not an integer written in the "
                                 "digits 0-9")
    text = raw.strip()
    negative, digits = text.startswith("-"), text.lstrip("-").lstrip("0")
    shown = _shown(text)
    if len(digits) > _MAX_DIGITS:
        if negative:
            raise ConfigurationError(f"environment variable {name}={shown} must be >= {minimum}")
        if maximum is not None:
            raise ConfigurationError(f"environment variable {name}={shown} must be <= {maximum}")
        raise ConfigurationError(f"environment variable {name}={shown} is out of range: it has over {_MAX_DIGITS} "
                                 "digits")
    value = int(digits or "0") * (-1 if negative else 1)
    if value < minimum:
        raise ConfigurationError(f"environment variable {name}={shown} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigurationError(f"environment variable {name}={shown} must be <= {maximum}")
    return value


def _shown(text: str) -> str:
    """An environment variable's value for a message: as it is (spaces around cut), or :func:`quoted` when long."""
    text = text.strip()
    return text if len(text) <= _QUOTED_LIMIT else quoted(text)


def quoted(text: str) -> str:
    """``repr(text)`` for a message; a text longer than 60 characters is cut there, with its length said."""
    if len(text) <= _QUOTED_LIMIT:
        return repr(text)
    return f"{text[:_QUOTED_LIMIT]!r}... ({len(text)} characters)"


def parse_batch_sizes(text: str, size: int) -> tuple[int, ...]:
    """``"64"`` (all workers) or ``"32,48,64,96"`` (one per rank) as a tuple of ``size`` ints; each
    value is written in the ASCII digits 0-9, spaces around it allowed.

    Raises:
        ConfigurationError: a value written otherwise (a sign '+', '_', other scripts' digits), a
            size below 1 or above :data:`MAX_BATCH`, or a count other than 1 or ``size``.
    """
    shown = quoted(text)
    fields = text.split(",")
    malformed = next((field for field in fields if not _INTEGER_TEXT.fullmatch(field)), None)
    if malformed is not None:
        raise ConfigurationError(f"batch sizes {shown} are not comma-separated integers: {quoted(malformed)} is not "
                                 "written in the digits 0-9; write each size as plain digits, e.g. 32,96")
    try:
        values = tuple(int(field) for field in fields)
    except ValueError:  # more digits than int() reads (4300)
        raise ConfigurationError(f"batch sizes {shown}: a value of over 4300 digits is no batch size; each must be "
                                 f"1 to {MAX_BATCH} samples") from None
    if min(values) < 1:
        raise ConfigurationError(f"batch sizes {shown}: {min(values)} is no batch size; each must be at least 1 sample")
    if max(values) > MAX_BATCH:
        raise ConfigurationError(f"batch sizes {shown}: {max(values)} is above the largest batch size, {MAX_BATCH} samples")
    if len(values) == 1:
        return values * size
    if len(values) != size:
        workers, wanted = ("1 worker", "1") if size == 1 else (f"{size} workers", f"1 or {size}, one per worker")
        raise ConfigurationError(f"batch sizes {shown} give {len(values)} values for {workers}; give {wanted}")
    return values


def env_batch_sizes(variable: str, size: int, env: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """:func:`parse_batch_sizes` of environment variable ``variable`` in ``env`` (default ``os.environ``)
    for a job of ``size`` workers, None when unset.

    Raises:
        ConfigurationError: naming the variable, when its value is malformed or has neither 1 nor
            ``size`` values.
    """
    text = (os.environ if env is None else env).get(variable)
    if not text:
        return None
    try:
        return parse_batch_sizes(text, size)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{variable}: {exc}") from None


def _rendezvous_host(env: Mapping[str, str], name: str, port_name: str, launcher: str) -> str | None:
    """The host of the rendezvous that environment variable ``name`` gives (spaces around it cut, an
    IPv6 address without brackets), None when unset; ``port_name`` is the variable of its port.

    Raises:
        ConfigurationError: naming the variable, when its value is blank, has a port in it
            (``host:29500``) or is not a host name or IP address.
    """
    if not _is_set(env, name):
        return None
    raw = env[name]
    host = raw.strip()
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ip_version(bare) == 6 or is_host_name(host):
        return bare
    if not host:
        problem = f"is blank, but {launcher} reads the host of rank 0 from it: set it to that host's name or IP address"
    elif (split := _host_and_port(host)) is not None:
        problem = (f"has a port in it, but {launcher} reads the host alone from it, and the port from {port_name}: "
                   f"set {name}={split[0]} and {port_name}={split[1]}")
    else:
        problem = f"is not a host name or an IP address: set it to the host of rank 0, e.g. {name}=10.0.0.1"
    raise ConfigurationError(f"environment variable {name}={quoted(raw)} {problem}")


def _host_and_port(text: str) -> tuple[str, str] | None:
    """``(host, port)`` of ``HOST:PORT`` (``HOST`` a name, an IPv4 address or ``[IPv6]``, returned bare; ``PORT``
    digits); None when ``text`` is not of that form."""
    host, _, port = text.rpartition(":")
    if host_problem(host) is not None or not (port.isascii() and port.isdigit()):
        return None
    return host.strip("[]"), port


def _require(env: Mapping[str, str], launcher: str, rank_variables: tuple[str, ...],
             needed: dict[str, bool]) -> None:
    """Raise one ConfigurationError naming every variable ``needed`` maps to True that is unset."""
    missing = [name for name, condition in needed.items() if condition and not _is_set(env, name)]
    if not missing:
        return
    given = [name for name in rank_variables if _is_set(env, name)]
    names, plural = ", ".join(missing), len(missing) > 1
    raise ConfigurationError(
        f"environment variable{'s' if plural else ''} {names} {'are' if plural else 'is'} not set, but this process "
        f"has {', '.join(f'{name}={_shown(env[name])}' for name in given)}, which make{'' if len(given) > 1 else 's'} it "
        f"part of a job that {launcher} describes: set {names} as {launcher} does (or start the job with "
        f"{launcher}), or unset {', '.join(given)} to run a single worker"
    )


@dataclass(frozen=True)
class WorkerEnv:
    """Where this worker process sits in the job, read from the environment.

    Attributes:
        num_nodes: worker nodes in the job (``DMLC_NUM_WORKER``; torchrun: ``WORLD_SIZE / LOCAL_WORLD_SIZE``).
        node_rank: this node's index (``DMLC_WORKER_ID``), ``0 <= node_rank < num_nodes``.
        local_size: worker processes on this node (``BYTEPS_LOCAL_SIZE``, ``LOCAL_WORLD_SIZE``).
        local_rank: this process's index on its node (``BYTEPS_LOCAL_RANK``, ``LOCAL_RANK``).
        root_addr: host of the rendezvous (``DMLC_PS_ROOT_URI``, ``MASTER_ADDR``); an IPv6 address without brackets.
        root_port: TCP port of the rendezvous (``DMLC_PS_ROOT_PORT``, ``MASTER_PORT``); None in a
            job of one worker that was given none.
        engine: communication engine (``DYNAMIX_ENGINE``), one of :data:`ENGINES` but ``auto``,
            which :func:`resolve_engine` has replaced.
        timeout_s: seconds a collective may wait for its peers (``DYNAMIX_TIMEOUT``).
        scheduler: ``host:port`` of the scheduler (``DYNAMIX_SCHEDULER``; ``[v6]:port`` for an IPv6
            address, port 1..65535), or a gRPC target of one (``dns:///host:port``, ``ipv4:ip:port``,
            ``ipv6:[ip]:port``); None = no control plane.
        token: shared secret sent to the scheduler (``DYNAMIX_TOKEN``).
        tls_ca: PEM CA file that verifies a TLS scheduler (``DYNAMIX_TLS_CA``); None = plaintext.
        decision_interval: steps between reports and assignment boundaries (``DYNAMIX_DECISION_INTERVAL``).
        slowdown: straggler emulation, this worker's compute is stretched by this factor
            (``DYNAMIX_SLOWDOWN``, ``FACTOR`` or ``FACTOR@START-END``, >= 1; for benchmarks and tests).
        slowdown_window: ``(start_s, end_s)``, seconds of training (since the worker's first step,
            untimed sections excluded) during which ``slowdown`` applies; ``(0, inf)`` = always.
        rank_offset: global rank of this node's local rank 0 (``DYNAMIX_RANK_OFFSET``); under a
            :class:`RankContract`, ``rank - local_rank``; None = BytePS's ``node_rank * local_size``.
        world_size: workers in the job (``DYNAMIX_SIZE``, ``WORLD_SIZE``), set together with
            ``rank_offset``; None = BytePS's ``num_nodes * local_size``.
        contract: whose variables described the job: ``byteps`` (the ``DMLC_*`` variables, or
            none at all), or a :class:`RankContract`'s name: ``torchrun`` (``RANK``,
            ``WORLD_SIZE``, ...), ``openmpi``, ``horovodrun``, ``mpich`` or ``slurm``; error messages
            name them.
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
    contract: str = "byteps"

    @property
    def rank(self) -> int:
        if self.rank_offset is not None:
            return self.rank_offset + self.local_rank
        return self.node_rank * self.local_size + self.local_rank

    @property
    def size(self) -> int:
        return self.world_size if self.world_size is not None else self.num_nodes * self.local_size

    @property
    def root_variables(self) -> str:
        """The variables that name the rendezvous, for messages: ``MASTER_ADDR/MASTER_PORT`` but under BytePS's."""
        return "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT" if self.contract == "byteps" else "MASTER_ADDR/MASTER_PORT"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "WorkerEnv":
        """Read and validate the variables (see the module docstring for both launchers' contracts).

        Raises:
            ConfigurationError: a variable is invalid (a rendezvous host that is blank or has a port in it
                too), a contract is partial (the message names
                every missing variable), the BytePS and torchrun variables disagree, or an MPI
                launcher's or srun's job of several ranks has no ``MASTER_PORT``.
        """
        env = os.environ if env is None else env
        byteps = _byteps_layout(env)
        torchrun = _rank_layout(env, TORCHRUN)
        if byteps is not None and torchrun is not None:
            _check_agreement(env, byteps, torchrun)
        # An MPI launcher's or srun's variables last: it may have started one bpslaunch or torchrun per host.
        layout = byteps or torchrun or _mpi_layout(env) or cls()
        engine = env.get("DYNAMIX_ENGINE") or DEFAULT_ENGINE
        if engine not in ENGINES:
            raise ConfigurationError(f"DYNAMIX_ENGINE={engine!r} is not an engine; choose one of {', '.join(ENGINES)}")
        try:
            timeout_s = float(env.get("DYNAMIX_TIMEOUT", DEFAULT_TIMEOUT_S))
        except ValueError:
            raise ConfigurationError(f"DYNAMIX_TIMEOUT={env['DYNAMIX_TIMEOUT']!r} is not a number of seconds") from None
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ConfigurationError(f"DYNAMIX_TIMEOUT={timeout_s} must be > 0 and <= {MAX_TIMEOUT_S:.0f} seconds (7 days)")
        scheduler = env.get("DYNAMIX_SCHEDULER") or None
        if scheduler is not None:
            try:
                dial_address(scheduler)
            except ValueError as error:
                raise ConfigurationError(f"DYNAMIX_SCHEDULER: {error}") from None
        env_batch_sizes("DYNAMIX_BATCH_SIZE", layout.size, env)  # read by scripts; 0 or a wrong count would fail far from its cause
        try:
            slowdown, slowdown_window = parse_slowdown(env.get("DYNAMIX_SLOWDOWN") or "1")
        except ValueError as error:
            raise ConfigurationError(f"DYNAMIX_SLOWDOWN: {error}") from None
        return dataclasses.replace(
            layout,
            engine=resolve_engine(engine, layout.local_size),
            timeout_s=timeout_s,
            scheduler=scheduler,
            token=env.get("DYNAMIX_TOKEN") or None,
            tls_ca=env.get("DYNAMIX_TLS_CA") or None,
            decision_interval=optional_int(env, "DYNAMIX_DECISION_INTERVAL", 1) or DEFAULT_DECISION_INTERVAL,
            slowdown=slowdown,
            slowdown_window=slowdown_window,
        )


def too_many_workers(num_nodes: int, local_size: int, per_gpu: bool = False) -> str:
    """The message for a BytePS job of ``num_nodes`` x ``local_size`` workers, above :data:`MAX_WORKERS`;
    ``per_gpu``: ``BYTEPS_LOCAL_SIZE`` was unset, and ``local_size`` counts the visible GPUs."""
    local = (f"{local_size} workers a node (BYTEPS_LOCAL_SIZE is unset: one per GPU in NVIDIA_VISIBLE_DEVICES)"
             if per_gpu else f"BYTEPS_LOCAL_SIZE={local_size}")
    return (f"DMLC_NUM_WORKER={num_nodes} x {local} make a job of {num_nodes * local_size} workers, more than the "
            f"{MAX_WORKERS} a job may have; lower DMLC_NUM_WORKER or {'set ' if per_gpu else ''}BYTEPS_LOCAL_SIZE")


def _byteps_layout(env: Mapping[str, str]) -> WorkerEnv | None:
    """The job as the ``DMLC_*``/``BYTEPS_*``/``DYNAMIX_RANK_OFFSET``/``DYNAMIX_SIZE`` variables give it;
    None when none of their rank variables is set."""
    if not any(_is_set(env, name) for name in BYTEPS_RANK_VARIABLES):
        return None
    num_nodes = optional_int(env, "DMLC_NUM_WORKER", 1, MAX_WORKERS)
    node_rank = optional_int(env, "DMLC_WORKER_ID", 0, MAX_WORKERS - 1)
    local_size = optional_int(env, "BYTEPS_LOCAL_SIZE", 1, MAX_WORKERS)
    local_rank = optional_int(env, "BYTEPS_LOCAL_RANK", 0, MAX_WORKERS - 1)
    rank_offset = optional_int(env, "DYNAMIX_RANK_OFFSET", 0, MAX_WORKERS - 1)
    world_size = optional_int(env, "DYNAMIX_SIZE", 1, MAX_WORKERS)
    root_port = optional_int(env, "DMLC_PS_ROOT_PORT", 1, MAX_PORT)
    root_addr = _rendezvous_host(env, "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "bpslaunch")
    if world_size is not None:
        size = world_size
    else:
        size = None if num_nodes is None else num_nodes * (local_size or 1)
    _require(env, "bpslaunch", BYTEPS_RANK_VARIABLES, {
        "DMLC_NUM_WORKER": True, "DMLC_WORKER_ID": num_nodes != 1, "BYTEPS_LOCAL_SIZE": local_rank is not None,
        "BYTEPS_LOCAL_RANK": (local_size or 1) > 1, "DYNAMIX_RANK_OFFSET": world_size is not None,
        "DYNAMIX_SIZE": rank_offset is not None, "DMLC_PS_ROOT_URI": size != 1, "DMLC_PS_ROOT_PORT": size != 1})
    node_rank, local_size, local_rank = node_rank or 0, local_size or 1, local_rank or 0
    if world_size is None and num_nodes * local_size > MAX_WORKERS:
        raise ConfigurationError(too_many_workers(num_nodes, local_size))
    if node_rank >= num_nodes:
        raise ConfigurationError(f"DMLC_WORKER_ID={node_rank} must be < DMLC_NUM_WORKER={num_nodes}")
    if local_rank >= local_size:
        raise ConfigurationError(f"BYTEPS_LOCAL_RANK={local_rank} must be < BYTEPS_LOCAL_SIZE={local_size}")
    if rank_offset is not None and rank_offset + local_size > world_size:
        raise ConfigurationError(f"DYNAMIX_RANK_OFFSET={rank_offset} + BYTEPS_LOCAL_SIZE={local_size} must be "
                                 f"<= DYNAMIX_SIZE={world_size}: this node's ranks must lie inside the job")
    return WorkerEnv(num_nodes=num_nodes, node_rank=node_rank, local_size=local_size, local_rank=local_rank,
                     root_addr=root_addr or "127.0.0.1", root_port=root_port,
                     rank_offset=rank_offset, world_size=world_size)


def _rank_layout(env: Mapping[str, str], contract: RankContract) -> WorkerEnv | None:
    """The job as ``contract``'s four variables and ``MASTER_ADDR``/``MASTER_PORT`` give it; None when
    none of its four is set. A launcher that sets no rendezvous leaves checking it to :func:`_checked_rendezvous`."""
    if not any(_is_set(env, name) for name in contract.variables):
        return None
    c = contract
    world_size = optional_int(env, c.size, 1, MAX_WORKERS)
    rank = optional_int(env, c.rank, 0, MAX_WORKERS - 1)
    local_size, local_size_shown = _local_size(env, c)
    local_rank = optional_int(env, c.local_rank, 0, MAX_WORKERS - 1)
    root_port = optional_int(env, "MASTER_PORT", 1, MAX_PORT)
    root_addr = _rendezvous_host(env, "MASTER_ADDR", "MASTER_PORT", c.launcher)
    needed = {c.size: True, c.rank: world_size != 1, c.local_size: local_rank is not None,
              c.local_rank: (local_size or 1) > 1}
    if not c.rendezvous_hint:  # the launcher sets these too: name them with the rest
        needed.update(MASTER_ADDR=world_size != 1, MASTER_PORT=world_size != 1)
    _require(env, c.launcher, c.variables, needed)
    rank, local_size, local_rank = rank or 0, local_size or 1, local_rank or 0
    if rank >= world_size:
        raise _inconsistent(c, f"{c.rank}={rank} must be < {c.size}={world_size}")
    if local_rank >= local_size:
        raise _inconsistent(c, f"{c.local_rank}={local_rank} must be < {local_size_shown}")
    rank_offset = rank - local_rank
    if rank_offset < 0 or rank_offset + local_size > world_size:
        raise _inconsistent(c, f"{c.rank}={rank} - {c.local_rank}={local_rank} + {local_size_shown} must lie in "
                               f"0..{c.size}={world_size}: this node's ranks must lie inside the job")
    return WorkerEnv(num_nodes=-(-world_size // local_size), node_rank=rank_offset // local_size,
                     local_size=local_size, local_rank=local_rank,
                     root_addr=root_addr or "127.0.0.1", root_port=root_port,
                     rank_offset=rank_offset, world_size=world_size, contract=c.name)


def _inconsistent(contract: RankContract, problem: str) -> ConfigurationError:
    """The error for ``contract``'s variables that contradict each other: ``problem``, and what to do."""
    return ConfigurationError(f"{problem}; start the job with {contract.launcher}, or set its variables as it does")


def _local_size(env: Mapping[str, str], contract: RankContract) -> tuple[int | None, str]:
    """The local size ``contract`` gives this process (None when unset), and how messages name it:
    ``LOCAL_WORLD_SIZE=3``, or for a list of every node's (srun's) the list and the entry that was read:
    ``1 (the tasks of node SLURM_NODEID=1 in SLURM_STEP_TASKS_PER_NODE='3,1')``.

    Raises:
        ConfigurationError: the value or its node's entry is not a local size, or the list has
            several node sizes and no node index says which is this node's.
    """
    if not contract.node_id or not _is_set(env, contract.local_size):
        local_size = optional_int(env, contract.local_size, 1, MAX_WORKERS)
        return local_size, f"{contract.local_size}={local_size}"
    per_node = env[contract.local_size]
    counts = _tasks_per_node(per_node)
    # srun always sets SLURM_NODEID; by hand, node 0's count would be read on every node
    _require(env, contract.launcher, contract.variables, {contract.node_id: len(set(counts)) > 1})
    node = optional_int(env, contract.node_id, 0, MAX_WORKERS - 1) or 0
    listed = f"{contract.local_size}={quoted(per_node)}"
    if node >= len(counts):
        raise ConfigurationError(f"{contract.node_id}={node} has no entry in {listed}, which lists {len(counts)} "
                                 f"node{'s' if len(counts) > 1 else ''}; start the job with {contract.launcher}")
    shown = f"{counts[node]} (the tasks of node {contract.node_id}={node} in {listed})"
    if not 1 <= counts[node] <= MAX_WORKERS:
        raise ConfigurationError(f"the local size {shown} must be 1 to {MAX_WORKERS}; start the job with "
                                 f"{contract.launcher}")
    return counts[node], shown


def _mpi_layout(env: Mapping[str, str]) -> WorkerEnv | None:
    """The job as an MPI launcher, horovodrun or Slurm's srun describes it; None when none does.

    Open MPI's or horovodrun's variables first, then MPICH's ``PMI_*``, then srun's: an MPI launcher run inside a
    Slurm allocation starts its ranks through srun steps of its own, whose ``SLURM_*`` variables the
    ranks inherit. But srun gives ``PMI_RANK``/``PMI_SIZE`` itself (``srun --mpi=pmi2``, or a
    cluster's ``MpiDefault``); when they name the rank and size srun's do, srun's are read, since
    only they give the local ones.
    """
    for contract in (OPEN_MPI, HOROVODRUN):
        layout = _rank_layout(env, contract)
        if layout is not None:
            return _checked_rendezvous(env, contract, layout)
    pmi, slurm = _rank_layout(env, MPICH), _slurm_layout(env)
    if pmi is not None and (slurm is None or (pmi.rank, pmi.size) != (slurm.rank, slurm.size)):
        return _checked_rendezvous(env, MPICH, pmi)
    return slurm and _checked_rendezvous(env, SLURM, slurm)


def _slurm_layout(env: Mapping[str, str]) -> WorkerEnv | None:
    """The job as srun's variables give it, None outside an srun task: a batch script has
    ``SLURM_PROCID=0``, ``SLURM_LOCALID=0`` and ``SLURM_NTASKS`` too, but is one process, and only srun's
    tasks have ``SLURM_STEP_NUM_TASKS`` and ``SLURM_STEP_TASKS_PER_NODE`` (one of them set: a partial contract)."""
    if not (_is_set(env, SLURM.size) or _is_set(env, SLURM.local_size)):
        return None
    return _rank_layout(env, SLURM)


_TASKS_PER_NODE = re.compile(r"([0-9]{1,6})(?:\(x([0-9]{1,6})\))?")


def _tasks_per_node(per_node: str) -> list[int]:
    """The tasks on each node that Slurm's ``SLURM_STEP_TASKS_PER_NODE`` lists (``"2(x3),1"``: 2 on each of
    three nodes, then 1), at most :data:`MAX_WORKERS` nodes of each group.

    Raises:
        ConfigurationError: the value is not of that form.
    """
    counts = []
    for field in per_node.split(","):
        match = _TASKS_PER_NODE.fullmatch(field.strip())
        if match is None:
            raise ConfigurationError(f"{SLURM.local_size}={quoted(per_node)} is not Slurm's list of tasks per node "
                                     "(e.g. 2(x3),1)")
        counts += [int(match[1])] * min(int(match[2] or 1), MAX_WORKERS)
    return counts


def _checked_rendezvous(env: Mapping[str, str], contract: RankContract, layout: WorkerEnv) -> WorkerEnv:
    """``layout``, once sure of its rendezvous: a job of several workers started by a launcher that sets
    none needs ``MASTER_PORT``, and ``MASTER_ADDR`` when its ranks span hosts (on one host rank 0
    listens on 127.0.0.1)."""
    spans_hosts = layout.local_size < layout.size
    missing = [name for name, needed in (("MASTER_ADDR", spans_hosts), ("MASTER_PORT", layout.size != 1))
               if needed and not _is_set(env, name)]
    if missing:
        raise ConfigurationError(
            f"this process is {contract.rank}={layout.rank} of {contract.size}={layout.size}, started by "
            f"{contract.launcher}, which sets no rendezvous: give every rank {' and '.join(missing)} "
            f"({'the host of rank 0 and ' if spans_hosts else ''}a free TCP port there), e.g. {contract.rendezvous_hint}"
        )
    return layout


def _check_agreement(env: Mapping[str, str], byteps: WorkerEnv, torchrun: WorkerEnv) -> None:
    """Both launchers' variables are set: they must name the same worker (local ones only if torchrun gave them)."""
    same = (byteps.rank, byteps.size) == (torchrun.rank, torchrun.size)
    if _is_set(env, "LOCAL_RANK"):
        same = same and (byteps.local_rank, byteps.local_size) == (torchrun.local_rank, torchrun.local_size)
    if not same:
        raise ConfigurationError(
            f"the BytePS variables make this process rank {byteps.rank} of {byteps.size} (local "
            f"{byteps.local_rank} of {byteps.local_size}), torchrun's RANK={torchrun.rank} of "
            f"WORLD_SIZE={torchrun.size} (LOCAL_RANK={torchrun.local_rank} of LOCAL_WORLD_SIZE="
            f"{torchrun.local_size}); start the job with one launcher, or unset the other's variables"
        )


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
