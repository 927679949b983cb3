"""Jobs started by torchrun (``python -m torch.distributed.run``) instead of bpslaunch.

torchrun's agent serves a TCPStore on MASTER_PORT and tells its workers so
(TORCHELASTIC_USE_AGENT_STORE=True); these tests check that the workers then rendezvous through
it, with the ranks and size torchrun gave them, and that a hand-made partial environment fails.
"""

import json
import sys
from pathlib import Path

import pytest
from conftest import RANK_WORKER, clean_env, has_ipv6_loopback, run_in_session, worker_ranks
from multiworker import free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "torch_fashion_mnist.py"


def torchrun_env(**extra: str) -> dict[str, str]:
    """:func:`clean_env` with one torch thread per worker and a 60-s collective timeout."""
    return clean_env(OMP_NUM_THREADS="1", DYNAMIX_TIMEOUT="60", **extra)


def run(argv: list, timeout: float, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """:func:`run_in_session` with TMPDIR in ``tmp_path`` (torchrun leaves its ``torchelastic_*``
    log folders there)."""
    return run_in_session(argv, timeout, env={**(env or torchrun_env()), "TMPDIR": str(tmp_path)})


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", *args]



@pytest.mark.timeout(60)
@pytest.mark.parametrize("rendezvous", ["master-port", "standalone"])
def test_torchrun_workers_get_their_ranks_and_sum_exactly(tmp_path, rendezvous):
    flags = ["--standalone"] if rendezvous == "standalone" else ["--master-port", free_port()]
    code, output = run(torchrun(*flags, RANK_WORKER, tmp_path), timeout=50, tmp_path=tmp_path)
    assert code == 0, output
    ranks = worker_ranks(tmp_path)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2], output
    for r in ranks:
        assert (r["size"], r["local_size"], r["local_rank"]) == (3, 3, r["rank"])
        assert (r["engine"], r["device"]) == ("gloo", "cpu")
        assert r["sum"] == 6.0  # 1 + 2 + 3, exactly


@pytest.mark.timeout(60)
@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 here")
def test_torchrun_workers_rendezvous_at_an_ipv6_master_addr(tmp_path):
    """torchrun --master-addr ::1 gives its workers MASTER_ADDR=::1, which torch's env:// takes; the workers
    failed: "Port could not be cast to integer value as ':1:<port>'" (the address was not bracketed in tcp://)."""
    code, output = run(torchrun("--master-addr", "::1", "--master-port", free_port(),
                                RANK_WORKER, tmp_path), timeout=50, tmp_path=tmp_path)
    assert code == 0, output
    assert [(r["rank"], r["size"], r["sum"]) for r in worker_ranks(tmp_path)] == [(r, 3, 6.0) for r in range(3)], output


@pytest.mark.timeout(90)
def test_the_example_trains_under_torchrun(tmp_path):
    metrics_file = tmp_path / "metrics.json"
    code, output = run(torchrun("--master-port", free_port(), EXAMPLE, "--epochs", "1", "--limit-train", "384",
                                "--batch-size", "32", "--eval-subset", "500", "--output", metrics_file),
                       timeout=80, tmp_path=tmp_path)
    assert code == 0, output
    metrics = json.loads(metrics_file.read_text())
    assert metrics["workers"] == 3
    # 384 samples cut in global batches of 3 x 32: every rank ran the same 4 steps on its own samples.
    assert [(w["rank"], w["steps"], w["samples"]) for w in metrics["worker_statistics"]] == [(r, 4, 128) for r in range(3)]


@pytest.mark.timeout(40)
def test_a_hand_made_partial_torchrun_environment_fails_naming_what_is_missing(tmp_path):
    env = torchrun_env(WORLD_SIZE="3", RANK="0", MASTER_ADDR="127.0.0.1")
    code, output = run([sys.executable, RANK_WORKER, tmp_path], timeout=30, tmp_path=tmp_path, env=env)
    assert code != 0
    assert "ConfigurationError: environment variable MASTER_PORT is not set" in output, output
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.timeout(40)
def test_a_blank_master_addr_fails_at_once_naming_it(tmp_path):
    """MASTER_ADDR=" " was dialled as it is: every rank waited DYNAMIX_TIMEOUT for the host ' ', then failed with
    torch's 'The client socket has timed out ... connect to ( , PORT)'."""
    env = torchrun_env(WORLD_SIZE="2", RANK="0", MASTER_ADDR=" ", MASTER_PORT=str(free_port()))
    code, output = run([sys.executable, RANK_WORKER, tmp_path], timeout=30, tmp_path=tmp_path, env=env)
    assert code != 0
    assert "ConfigurationError: environment variable MASTER_ADDR=' ' is blank, but torchrun reads the host of rank 0 " \
           "from it: set it to that host's name or IP address" in output, output
