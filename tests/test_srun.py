"""Jobs started by Slurm's srun on a real single-node cluster (tests/slurm_cluster.py): each task
reads its place from srun's variables and rendezvouses at the MASTER_PORT the job passes; a batch
script that runs the program itself stays one worker.

Needs the Debian packages slurm-wlm and munge (scripts/install-system-packages.sh) and root.
"""

import os
import sys

import pytest
from conftest import RANK_WORKER, clean_env, run_in_session, worker_ranks
from multiworker import free_port
from slurm_cluster import slurm_available, slurm_cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="slurmd starts job steps as their user: needs root")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not slurm_available():
        pytest.fail("Slurm or munge is not installed: scripts/install-system-packages.sh installs slurm-wlm and munge")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def job_env(cluster, **extra: str) -> dict[str, str]:
    return clean_env(OMP_NUM_THREADS="1", DYNAMIX_TIMEOUT="60", SLURM_CONF=cluster.env["SLURM_CONF"], **extra)



@pytest.mark.timeout(90)
@pytest.mark.parametrize("mpi", ["none", "pmi2"])
def test_srun_tasks_join_one_job_and_sum_exactly(cluster, tmp_path, mpi):
    """With --mpi=pmi2 srun also sets PMI_RANK/PMI_SIZE: srun's own variables still give the local ranks."""
    code, output = run_in_session(["srun", "--ntasks=2", f"--mpi={mpi}", sys.executable, RANK_WORKER, tmp_path], 60,
                                  env=job_env(cluster, MASTER_PORT=str(free_port())))
    assert code == 0, output
    ranks = worker_ranks(tmp_path)
    assert sorted(r["rank"] for r in ranks) == [0, 1], output
    for r in ranks:
        assert (r["size"], r["local_size"], r["local_rank"]) == (2, 2, r["rank"])
        assert r["sum"] == 3.0  # 1 + 2


@pytest.mark.timeout(90)
def test_an_srun_job_without_a_rendezvous_port_fails_saying_how_to_pass_one(cluster, tmp_path):
    code, output = run_in_session(["srun", "--ntasks=2", sys.executable, RANK_WORKER, tmp_path], 60, env=job_env(cluster))
    assert code != 0
    assert "SLURM_PROCID=0 of SLURM_STEP_NUM_TASKS=2, started by srun (Slurm), which sets no rendezvous: give every " \
           "rank MASTER_PORT" in output, output
    assert not worker_ranks(tmp_path)


@pytest.mark.timeout(90)
def test_a_batch_script_running_the_program_itself_is_one_worker(cluster, tmp_path):
    """sbatch's script sees SLURM_PROCID=0 and SLURM_NTASKS=2, but is one process: it must not wait for a rank 1."""
    log = tmp_path / "batch.log"
    code, output = run_in_session(["sbatch", "--wait", "--ntasks=2", f"--output={log}",
                                   f"--wrap={sys.executable} {RANK_WORKER} {tmp_path}"], 60, env=job_env(cluster))
    assert code == 0, output + (log.read_text() if log.exists() else "")
    assert [(r["rank"], r["size"], r["sum"]) for r in worker_ranks(tmp_path)] == [(0, 1, 1.0)]
