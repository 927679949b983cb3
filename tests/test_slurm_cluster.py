"""The single-node Slurm cluster of tests/slurm_cluster.py: srun starts tasks through it, and
nothing it started outlives it, not even a job step still running when it stops.

Needs the Debian packages slurm-wlm and munge (scripts/install-system-packages.sh) and root.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import kill_tree, wait_until
from slurm_cluster import is_running, processes_using, slurm_available, slurm_cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="slurmd starts job steps as their user: needs root")


@pytest.fixture(autouse=True)
def _slurm_installed():
    if not slurm_available():
        pytest.fail("Slurm or munge is not installed: scripts/install-system-packages.sh installs slurm-wlm and munge")


def names_using(folder) -> list[str]:
    return sorted(p.name() for p in processes_using(folder))


@pytest.mark.timeout(60)
def test_srun_starts_two_tasks_ranked_0_and_1(tmp_path):
    with slurm_cluster(tmp_path) as cluster:
        ranks = subprocess.run(["srun", "--ntasks=2", "printenv", "SLURM_PROCID"], env=cluster.env,
                               capture_output=True, text=True, timeout=20)
    assert sorted(ranks.stdout.split()) == ["0", "1"], ranks.stderr


@pytest.mark.timeout(60)
def test_nothing_the_cluster_started_outlives_it_not_even_a_running_step(tmp_path):
    left_running = None
    try:
        with slurm_cluster(tmp_path) as cluster:
            left_running = subprocess.Popen(["srun", "--ntasks=2", "sleep", "300"], env=cluster.env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            assert wait_until(lambda: names_using(tmp_path).count("sleep") == 2, 20, step=0.2), names_using(tmp_path)
            used = processes_using(tmp_path)
            assert {"munged", "slurmctld", "slurmd", "slurmstepd", "srun"} <= {p.name() for p in used}
        assert [p for p in used if is_running(p)] == []
        assert processes_using(tmp_path) == []
    finally:
        kill_tree(left_running)
