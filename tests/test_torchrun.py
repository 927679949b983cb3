"""Jobs started by torchrun (``python -m torch.distributed.run``) instead of bpslaunch.

torchrun's agent serves a TCPStore on MASTER_PORT and tells its workers so
(TORCHELASTIC_USE_AGENT_STORE=True); these tests check that the workers then rendezvous through
it, with the ranks and size torchrun gave them, and that a hand-made partial environment fails.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from multiworker import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "scripts" / "torchrun_worker.py"
EXAMPLE = REPO / "examples" / "torch_fashion_mnist.py"
LAUNCH_VARIABLES = ("DMLC_", "BYTEPS_", "DYNAMIX_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "GROUP_RANK", "GROUP_WORLD_SIZE")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables; one torch thread per worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env.update(OMP_NUM_THREADS="1", DYNAMIX_TIMEOUT="60", PYTHONPATH=str(REPO), **extra)
    return env


def run(argv: list, timeout: float, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` in its own session with TMPDIR in ``tmp_path`` (torchrun leaves its
    ``torchelastic_*`` log folders there); returns (exit code, stdout+stderr). Whatever it started is
    SIGKILLed afterwards: torchrun starts each worker in a session of its own, so the workers are
    collected as descendants before the kill, not reached through torchrun's process group."""
    env = {**(env or clean_env()), "TMPDIR": str(tmp_path)}
    job = subprocess.Popen([str(a) for a in argv], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout)
    finally:
        try:
            descendants = psutil.Process(job.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        for child in descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        job.wait()
    return job.returncode, output or ""


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", *args]


def results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rendezvous", ["master-port", "standalone"])
def test_torchrun_workers_get_their_ranks_and_sum_exactly(tmp_path, rendezvous):
    flags = ["--standalone"] if rendezvous == "standalone" else ["--master-port", free_port()]
    code, output = run(torchrun(*flags, WORKER, tmp_path), timeout=50, tmp_path=tmp_path)
    assert code == 0, output
    ranks = results(tmp_path)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2], output
    for r in ranks:
        assert (r["size"], r["local_size"], r["local_rank"]) == (3, 3, r["rank"])
        assert (r["engine"], r["device"]) == ("gloo", "cpu")
        assert r["sum"] == 6.0  # 1 + 2 + 3, exactly


@pytest.mark.timeout(90)
def test_the_example_trains_under_torchrun(tmp_path):
    metrics_file = tmp_path / "metrics.json"
    code, output = run(torchrun("--master-port", free_port(), EXAMPLE, "--epochs", "1", "--limit-train", "384",
                                "--batch-size", "32", "--output", metrics_file), timeout=80, tmp_path=tmp_path)
    assert code == 0, output
    metrics = json.loads(metrics_file.read_text())
    assert metrics["workers"] == 3
    # 384 samples cut in global batches of 3 x 32: every rank ran the same 4 steps on its own samples.
    assert [(w["rank"], w["steps"], w["samples"]) for w in metrics["worker_statistics"]] == [(r, 4, 128) for r in range(3)]


@pytest.mark.timeout(40)
def test_a_hand_made_partial_torchrun_environment_fails_naming_what_is_missing(tmp_path):
    env = clean_env(WORLD_SIZE="3", RANK="0", MASTER_ADDR="127.0.0.1")
    code, output = run([sys.executable, WORKER, tmp_path], timeout=30, tmp_path=tmp_path, env=env)
    assert code != 0
    assert "ConfigurationError: environment variable MASTER_PORT is not set" in output, output
    assert not list(tmp_path.glob("rank*.json"))
