"""A real single-node Slurm cluster for tests that start workers through srun, sbatch or salloc.

:func:`slurm_cluster` runs munged, slurmctld and slurmd as child processes; their key, configuration,
sockets, state, spool, logs and pid files all lie in the folder it is given, and their ports are
free ones, so it touches neither /etc/slurm, /etc/munge nor a system munged, and two clusters (two
pytest-xdist workers) do not clash. Needs the Debian packages slurm-wlm and munge, and root (slurmd
starts the job steps as their user).
"""

import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from dynamix_byteps.launcher.topology import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "salloc", "sinfo", "scancel")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0
LOG_TAIL_CHARS = 3000


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster: ``env`` is the environment to give srun/sbatch/salloc (this process's,
    without any SLURM_* or PMI* variable of an allocation it may run in, plus SLURM_CONF; the
    configuration names the munge socket, so clients need no other variable); ``node`` is the one
    node's name; ``folder`` holds everything the cluster wrote."""

    env: dict[str, str]
    node: str
    folder: Path


def slurm_available() -> bool:
    """Whether the Slurm and munge programs this module starts are installed."""
    return all(shutil.which(program, path=SEARCH_PATH) for program in DAEMONS + CLIENTS)


@contextlib.contextmanager
def slurm_cluster(tmp_dir: Path | str):
    """Start munged, slurmctld (forgetting the jobs a previous cluster in ``tmp_dir`` left in its
    state) and slurmd with everything in ``tmp_dir``; yield a :class:`SlurmCluster` once the node
    is idle. On exit every daemon, job step (slurmstepd) and task the cluster started
    is stopped: SIGTERM, SIGKILL after ``STOP_GRACE_S`` s.

    Raises RuntimeError with the daemons' logs when a daemon exits or the node is not idle within
    ``START_TIMEOUT_S`` s."""
    folder = Path(tmp_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    conf = _write_files(folder)
    env = _client_env(conf)
    daemons: list[subprocess.Popen] = []
    try:
        daemons.append(_start(folder, "munged", _munged_command(folder), env))
        daemons.append(_start(folder, "slurmctld", [_program("slurmctld"), "-D", "-c", "-f", str(conf)], env))
        daemons.append(_start(folder, "slurmd", [_program("slurmd"), "-D", "-f", str(conf)], env))
        _wait_until_idle(folder, daemons, env)
        yield SlurmCluster(env=env, node=_node_name(), folder=folder)
    finally:
        _stop(daemons, folder, env)


def _program(name: str) -> str:
    path = shutil.which(name, path=SEARCH_PATH)
    if path is None:
        raise RuntimeError(f"{name} is not installed (Debian packages slurm-wlm and munge)")
    return path


def _node_name() -> str:
    return socket.gethostname().split(".")[0]


def _write_files(folder: Path) -> Path:
    """The munge key, an empty plugstack.conf (so /etc/slurm's is not read) and slurm.conf; returns
    slurm.conf's path."""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(mode=0o700, exist_ok=True)
    (folder / "munge").mkdir(exist_ok=True)
    (folder / "munge").chmod(0o755)  # munged wants its socket's folder searchable by all
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (folder / "plugstack.conf").write_text("")
    conf = folder / "slurm.conf"
    conf.write_text(_slurm_conf(folder))
    return conf


def _slurm_conf(folder: Path) -> str:
    user = getpass.getuser()
    controller_port = free_port()
    node_port = next(port for port in iter(free_port, None) if port != controller_port)
    memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.9)
    node = _node_name()
    settings = {
        "ClusterName": "pytest",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmUser": user,
        "SlurmdUser": user,
        "SlurmctldPort": controller_port,
        "SlurmdPort": node_port,
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={folder / 'munge' / 'munge.socket'}",
        "StateSaveLocation": folder / "state",
        "SlurmdSpoolDir": folder / "spool",
        "SlurmctldPidFile": folder / "slurmctld.pid",
        "SlurmdPidFile": folder / "slurmd.pid",
        "SlurmctldLogFile": folder / "slurmctld.log",
        "SlurmdLogFile": folder / "slurmd.log",
        "PlugStackConfig": folder / "plugstack.conf",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "MpiDefault": "none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "MailProg": shutil.which("true"),
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "ReturnToService": 2,
        "NodeName": f"{node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN",
        "PartitionName": f"debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
    }
    return "".join(f"{name}={value}\n" for name, value in settings.items())


def _munged_command(folder: Path) -> list[str]:
    munge = folder / "munge"
    return [_program("munged"), "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
            f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"]


def _client_env(conf: Path) -> dict[str, str]:
    """This process's environment without an enclosing allocation's variables (srun would take
    them for its own allocation), plus SLURM_CONF."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI"))}
    env["SLURM_CONF"] = str(conf)
    return env


def _start(folder: Path, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
    with open(folder / f"{name}.out", "wb") as output:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_until_idle(folder: Path, daemons: list[subprocess.Popen], env: dict[str, str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        exited = [d for d in daemons if d.poll() is not None]
        if exited:
            raise RuntimeError(f"{Path(exited[0].args[0]).name} exited with {exited[0].returncode}"
                               f" while the cluster started\n{_logs(folder)}")
        state = _node_state(env)
        if state == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Slurm node was not idle after {START_TIMEOUT_S:g} s (state {state!r})\n{_logs(folder)}")


def _node_state(env: dict[str, str]) -> str:
    try:
        result = subprocess.run([_program("sinfo"), "--noheader", "--Node", "--format=%T"], env=env,
                                capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    return result.stdout.strip() or result.stderr.strip()


def _logs(folder: Path) -> str:
    """The end of each daemon's log and captured output."""
    paths = sorted(folder.glob("*.out")) + sorted(folder.glob("*.log")) + [folder / "munge" / "munged.log"]
    return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-LOG_TAIL_CHARS:]}"
                     for path in paths if path.exists())


def _stop(daemons: list[subprocess.Popen], folder: Path, env: dict[str, str]) -> None:
    """Cancel the jobs while slurmctld still runs (slurmstepd ignores SIGTERM, and it outlives
    slurmd: it is no child of it), stop slurmd, slurmctld and munged, then whatever else still uses
    the folder: a step's slurmstepd and tasks, a client a test left running."""
    if len(daemons) == len(DAEMONS) and all(d.poll() is None for d in daemons):
        _cancel_jobs(daemons, folder, env)
    for daemon in reversed(daemons):
        _stop_daemon(daemon)
    _terminate(processes_using(folder))


def _stop_daemon(daemon: subprocess.Popen) -> None:
    daemon.terminate()
    try:
        daemon.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def _cancel_jobs(daemons: list[subprocess.Popen], folder: Path, env: dict[str, str]) -> None:
    """scancel every job, then give their steps ``STOP_GRACE_S`` s to end."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([_program("scancel"), f"--user={getpass.getuser()}"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=STOP_GRACE_S)
    daemon_tree = set()
    for daemon in daemons:
        with contextlib.suppress(psutil.Error):
            daemon_tree |= {daemon.pid} | {p.pid for p in psutil.Process(daemon.pid).children(recursive=True)}
    _wait_ended([p for p in processes_using(folder) if p.pid not in daemon_tree], STOP_GRACE_S)


def _terminate(processes: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL to those still running after ``STOP_GRACE_S`` s."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    alive = _wait_ended(processes, STOP_GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_ended(alive, STOP_GRACE_S)


def _wait_ended(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process is gone or a zombie (an orphan's reaper is init, which may reap late
    or never in a container), at most ``timeout_s`` s; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [process for process in processes if is_running(process)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def is_running(process: psutil.Process) -> bool:
    """Whether ``process`` runs: it exists, is not a zombie, and its pid was not reused."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def processes_using(folder: Path) -> list[psutil.Process]:
    """Running processes, other than this one and its ancestors, whose command line, environment
    or open files name a path in ``folder``: the daemons, slurmstepd (it holds slurmd's log open;
    its environment is empty), tasks and clients (SLURM_CONF)."""
    prefix = str(Path(folder).resolve()) + os.sep
    spared = {os.getpid()} | {p.pid for p in psutil.Process().parents()}
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid in spared or not is_running(process):
                continue
            names = [*process.cmdline(), *process.environ().values(), *(f.path for f in process.open_files())]
            if any(prefix in name for name in names):
                found.append(process)
    return found
