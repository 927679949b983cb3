"""Jobs started by an MPI launcher, as Horovod users start them: Open MPI's ``mpirun`` and MPICH's
``mpiexec`` (Hydra). Each rank reads its place from the launcher's variables and rendezvouses at the
``MASTER_PORT`` the job passes; a job without one fails naming it instead of training as several
independent single workers.
"""

import shutil
import sys
from pathlib import Path

import pytest
from conftest import RANK_WORKER, clean_env, run_in_session, worker_ranks
from multiworker import free_port

WORKERS = 3


def launcher(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: scripts/install-system-packages.sh installs openmpi-bin and mpich")
    return path


def open_mpi(port: str | None) -> list:
    """``mpirun`` of Open MPI; as root it needs --allow-run-as-root, and 3 ranks on 2 cores --oversubscribe."""
    rendezvous = ["-x", f"MASTER_PORT={port}"] if port else []
    return [launcher("mpirun.openmpi"), "--allow-run-as-root", "--oversubscribe", "-np", WORKERS, *rendezvous]


def mpich(port: str | None) -> list:
    rendezvous = ["-genv", "MASTER_PORT", port] if port else []
    return [launcher("mpiexec.mpich"), "-n", WORKERS, *rendezvous]


LAUNCHERS = {"openmpi": open_mpi, "mpich": mpich}


def run(argv: list, tmp_path: Path) -> tuple[int, str]:
    env = clean_env(OMP_NUM_THREADS="1", DYNAMIX_TIMEOUT="60", TMPDIR=str(tmp_path))
    return run_in_session(argv, 80, env=env)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_mpi_ranks_join_one_job_and_sum_exactly(tmp_path, name):
    code, output = run([*LAUNCHERS[name](free_port()), sys.executable, RANK_WORKER, tmp_path], tmp_path)
    assert code == 0, output
    ranks = worker_ranks(tmp_path)
    assert sorted(r["rank"] for r in ranks) == list(range(WORKERS)), output
    for r in ranks:
        assert (r["size"], r["local_size"], r["local_rank"]) == (WORKERS, WORKERS, r["rank"])
        assert r["sum"] == 6.0  # 1 + 2 + 3, exactly


@pytest.mark.timeout(100)
@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_an_mpi_job_without_a_rendezvous_port_fails_saying_how_to_pass_one(tmp_path, name):
    code, output = run([*LAUNCHERS[name](None), sys.executable, RANK_WORKER, tmp_path], tmp_path)
    assert code != 0
    assert "sets no rendezvous: give every rank MASTER_PORT" in output, output
    assert not list(tmp_path.glob("rank*.json"))

