"""The ps engine: partition plan, summation server, and real jobs of workers and servers on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from unittest import mock

import ps_cases
import psutil
import pytest
import torch
from conftest import REPO, kill_tree, run_bpslaunch, wait_until
from multiworker import free_port, ok, ps_env, run_workers, start_servers, worker_command, worker_env

from dynamix_byteps.engine import ps_server
from dynamix_byteps.engine.ps_keys import KeyPlan, partition_bytes_from_env
from dynamix_byteps.engine.ps_rendezvous import STOPPED_BY_A_WORKER, PSRendezvous, channels_from_env
from dynamix_byteps.engine.ps_server import SummationServer
from dynamix_byteps.errors import ConfigurationError

PS_TIMEOUT_S = 10


def test_partitions_cover_the_tensor_and_balance_bytes_over_servers():
    plan = KeyPlan(num_servers=2, partition_bytes=4000)
    big = plan.partitions("big", 2500, 4, "torch.float32")  # 10,000 bytes: 1000 + 1000 + 500 elements
    assert [(p.start, p.stop) for p in big] == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert [p.key for p in big] == [0, 1, 2] and [p.server for p in big] == [0, 1, 0]
    small = plan.partitions("small", 100, 8, "torch.float64")
    assert small[0].server == 1 and plan.server_bytes == [6000, 4800]
    assert plan.partitions("big", 2500, 4, "torch.float32") is big  # declared once
    assert plan.partitions("big", 10, 4, "torch.float32")[0].key == 4  # a new size is a new tensor
    assert plan.partitions("empty", 0, 4, "torch.float32") == ()
    again = KeyPlan(num_servers=2, partition_bytes=4000)  # another worker, same order: the same plan
    assert again.partitions("big", 2500, 4, "torch.float32") == big


def test_rendezvous_and_partition_size_come_from_the_byteps_variables():
    group = PSRendezvous.from_environ(4, "10.0.0.1", 1234, 30.0, {"DMLC_NUM_SERVER": "2"})
    assert (group.num_servers, group.port, group.world_size, group.worker_rpc_rank(3)) == (2, 1235, 6, 5)
    assert PSRendezvous.from_environ(4, "h", 1234, 30.0, {"DMLC_NUM_SERVER": "1", "DYNAMIX_PS_PORT": "99"}).port == 99
    with pytest.raises(ConfigurationError, match="DMLC_NUM_SERVER"):
        PSRendezvous.from_environ(4, "h", 1234, 30.0, {})
    with pytest.raises(ConfigurationError, match="DYNAMIX_PS_PORT"):
        PSRendezvous.from_environ(1, "h", None, 30.0, {"DMLC_NUM_SERVER": "1"})
    assert partition_bytes_from_env({}) == 4096000
    assert group.channels is None  # TensorPipe's choice
    assert PSRendezvous.from_environ(4, "h", 1234, 30.0, {"DMLC_NUM_SERVER": "1", "DYNAMIX_PS_CHANNELS": "basic, cma"}
                                     ).channels == ("basic", "cma")
    with pytest.raises(ConfigurationError, match="DYNAMIX_PS_CHANNELS='shm' names unknown"):
        channels_from_env({"DYNAMIX_PS_CHANNELS": "shm"})
    with pytest.raises(ConfigurationError, match="BYTEPS_PARTITION_BYTES"):
        partition_bytes_from_env({"BYTEPS_PARTITION_BYTES": "0"})


def test_server_keeps_rounds_apart_and_answers_pulls_once_the_last_push_arrived():
    server = SummationServer(num_workers=2)
    early = server.pull(7, 0, 0)  # a pull before any push waits for the round
    server.push(7, 0, torch.tensor([1.0, 2.0]), 0)
    server.push(7, 1, torch.tensor([10.0, 20.0]), 0)  # the next round already starts
    assert not early.done()
    server.push(7, 0, torch.tensor([3.0, 4.0]), 1)
    assert early.wait()[0].tolist() == [4.0, 6.0]
    assert server.pull(7, 0, 1).wait()[0].tolist() == [4.0, 6.0]
    server.push(7, 1, torch.tensor([30.0, 40.0]), 1)
    assert [server.pull(7, 1, r).wait()[0].tolist() for r in range(2)] == [[40.0, 60.0]] * 2
    assert server.open_rounds == 0  # every round forgotten once both workers pulled it
    server.push(8, 0, torch.tensor([1], dtype=torch.int64), 0)
    server.push(8, 0, torch.tensor([1.0]), 1)  # the round fails; its pulls say why
    for worker in (0, 1):
        with pytest.raises(ValueError, match="different tensors"):
            server.pull(8, 0, worker).wait()


def test_a_worker_that_leaves_fails_every_round_still_short_of_its_push_and_every_later_one():
    server = SummationServer(num_workers=3)
    for worker in (0, 1):
        server.push(5, 0, torch.tensor([1.0]), worker)
    waiting = server.pull(5, 0, 0)
    server.push(6, 0, torch.tensor([1.0]), 2)  # worker 2's rounds are safe from its own departure
    server.push(6, 0, torch.tensor([1.0]), 0)
    assert server.leave(2) == 1
    with pytest.raises(ValueError, match="worker 2 left the job without pushing key 5 round 0"):
        waiting.wait()
    with pytest.raises(ValueError, match="worker 2 left the job"):
        server.pull(5, 0, 1).wait()
    server.push(6, 0, torch.tensor([2.0]), 1)
    assert server.pull(6, 0, 1).wait()[0].tolist() == [4.0]
    server.push(6, 1, torch.tensor([1.0]), 0)
    with pytest.raises(ValueError, match="worker 2 left the job without pushing key 6 round 1"):
        server.pull(6, 1, 0).wait()
    assert server.leave(0) == 0  # nothing left short of worker 0's push


def test_a_server_stopped_by_every_worker_of_a_failed_job_says_why_once(monkeypatch, capsys):
    """Before: one line per worker, and two RPC threads' prints ran into one line
    ('... worker 1 saw a collective failps server: stopping, ...')."""
    timers = []
    monkeypatch.setattr(ps_server, "_stopping", threading.Lock(), raising=False)
    monkeypatch.setattr(ps_server.threading, "Timer", lambda *args, **kwargs: timers.append(args) or mock.Mock())
    for rank in range(3):
        ps_server.abort(f"worker {rank} saw a collective fail")
    assert capsys.readouterr().err == "ps server: stopping, a worker reported: worker 0 saw a collective fail\n"
    assert len(timers) == 1


def test_a_pull_says_how_long_the_server_held_the_sum_after_that_workers_push():
    server = SummationServer(num_workers=2)
    early = server.pull(3, 0, 0)
    server.push(3, 0, torch.tensor([1.0]), 0)
    time.sleep(0.2)  # worker 1 is late: worker 0's sum is held back meanwhile
    server.push(3, 0, torch.tensor([2.0]), 1)
    total, held_ns = early.wait()
    assert total.tolist() == [3.0] and 0.2e9 <= held_ns < 5e9
    total, held_ns = server.pull(3, 0, 1).wait()  # the last pusher waited for nobody
    assert total.tolist() == [3.0] and 0 <= held_ns < 0.1e9


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_10000_back_to_back_rounds_give_exact_sums_and_averages():
    """3 workers, 2 servers, float32/float64/float16/int64 tensors of 1-3 partitions, no gap between
    rounds: 9,000 rounds of one tensor, then 1,000 rounds of five in flight, then averages through
    bps.push_pull. 10,000 rounds: the count BytePS 0.2.5's CPU server could not get through
    without partial sums."""
    results = ok(run_workers(3, "ps_cases:all_checks", 9000, 1000, 20, servers=2, timeout=1480,
                              env={"BYTEPS_PARTITION_BYTES": "4096", "DYNAMIX_TIMEOUT": "60"}))
    for result in results:
        for check in ("one_in_flight", "five_in_flight"):
            assert result[check]["wrong"] == 0, result[check]["examples"]
            assert result[check]["timed"]
        assert result["averages"]["worst_over_tolerance"] <= 1.0
    assert len({r["averages"]["digest"] for r in results}) == 1  # every worker pulled the same sums
    assert {r["default_group_size"] for r in results} == {3}  # the servers are not in the workers' group


@pytest.mark.timeout(180)
def test_a_workers_pull_time_leaves_out_the_wait_for_a_slower_worker():
    """Rank 0 pushes 1 s late every round: the others wait that long for their sums, yet their
    pull spans in the timing ring are the transfer only (without the server's hold they would be >= 1 s),
    and so is their exposed communication; rank 0, which waits for nobody, is exposed for its round trip.
    (With 0.5 s, a 125 ms stall of a pull or a 250 ms skew leaving the barrier on a loaded 2-core
    machine was enough to fail the bounds below.)"""
    delay = 1.0
    results = ok(run_workers(3, "ps_cases:pull_without_wait", 5, delay, servers=1, timeout=160))
    for rank, result in enumerate(results):
        assert all(p > 0 for p in result["push_s"]) and all(p >= 0 for p in result["pull_s"]), result
        assert all(0 <= e <= w for e, w in zip(result["exposed_s"], result["wait_s"])), result
        if rank > 0:
            assert min(result["wait_s"]) > delay / 2, result  # they did wait for rank 0
            assert max(result["pull_s"]) < delay / 4, result
            assert max(result["exposed_s"]) < delay / 4, result
        else:
            assert min(result["exposed_s"]) > 0, result


@pytest.mark.timeout(180)
def test_torch_frontend_under_ps_weights_by_batch_broadcasts_and_catches_mismatches():
    """DistributedOptimizer steps equal a single process on the concatenated batch (float64);
    broadcasts make every rank equal to the root, bit for bit in every dtype (complex128 raised
    KeyError before); mismatches raise on every rank."""
    results = ok(run_workers(3, "ps_cases:frontend", [8, 24, 40], 4, servers=2, timeout=160))
    root = results[1]["broadcasts"]
    for rank, result in enumerate(results):
        assert result["training"]["grad_error"] < 1e-6
        assert result["training"]["param_error"] < 1e-6
        assert result["broadcasts"]["params"] == root["before"] and result["broadcasts"]["opt"] == root["opt"]
        assert result["broadcasts"]["obj"] == root["obj"] == [1, [0, 1, 2], "é"]
        for case in ("name", "shape", "dtype", "root"):
            assert result["mismatches"][case] is not None, f"rank {rank}: {case} mismatch was not detected"
        assert result["mismatches"]["after"] == [3.0, 3.0]
        assert result["dtypes"] == {str(dtype): True for dtype in ps_cases.BROADCAST_DTYPES}, rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["ps", "gloo"])
def test_a_worker_alone_fails_within_the_timeout_naming_it(engine):
    """ps: no server was started; gloo: rank 1 of 2, and no rank 0."""
    port = free_port()
    env = (worker_env(0, 1, port, **ps_env(1, free_port()), DYNAMIX_TIMEOUT="5") if engine == "ps" else
           worker_env(1, 2, port, DYNAMIX_TIMEOUT="5"))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "import dynamix_byteps.torch as bps; bps.init()"], env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    assert f"CommunicationError: {engine} rendezvous at 127.0.0.1:" in done.stderr, done.stderr
    assert "failed within 5 s (DYNAMIX_TIMEOUT)" in done.stderr, done.stderr
    assert ("Check that the servers were started" if engine == "ps" else "the timeout leaves the others time") in done.stderr
    assert time.monotonic() - start < 60  # 5 s of waiting, the rest is starting the interpreter


@pytest.mark.timeout(150)
@pytest.mark.parametrize("servers, server_workers, timeout, message", [
    (1, 2, 60, "the servers and the workers count different numbers of members: this process counts 2"),
    (2, 1, 5, "only 2 of the 3 members of the ps group (servers and workers) joined it in time"),
], ids=["server counts more workers", "a server never came"])
def test_a_ps_group_short_of_a_member_fails_worker_and_server_within_the_timeout_saying_why(
        servers, server_workers, timeout, message):
    """A 1-worker job meets server 0 alone: a server for 2 workers (torchrun started fewer workers
    than DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE), or the first of 2 servers, the second never started.
    Before, worker and server waited in init_rpc for good (its gloo group's timeout is 24 days)."""
    env = worker_env(0, 1, free_port(), **ps_env(servers, free_port()), DYNAMIX_TIMEOUT=str(timeout))
    server = start_servers(1, server_workers, env)[0]
    try:
        done = subprocess.run([sys.executable, "-c", "import dynamix_byteps.torch as bps; bps.init()"], env=env,
                              capture_output=True, text=True, timeout=90)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert server.wait(timeout=timeout + 20) == 1
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


@contextlib.contextmanager
def summing_until_failure(tmp_path, size: int, timeout_s: float, limit_s: float):
    """Two servers and ``size`` workers running ``ps_cases:until_failure`` (20,000-byte pushes in two
    partitions: every round reaches both servers) as ``(servers, workers)``; every process left is
    killed at the end."""
    port = free_port()
    extra = {**ps_env(2, free_port()), "DYNAMIX_TIMEOUT": str(timeout_s), "BYTEPS_PARTITION_BYTES": "10000"}
    servers, workers = start_servers(2, size, worker_env(0, size, port, **extra)), []
    try:
        workers.extend(subprocess.Popen(worker_command("ps_cases:until_failure", [str(tmp_path), limit_s],
                                                       str(tmp_path / f"{r}.json")),
                                        env=worker_env(r, size, port, **extra), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL) for r in range(size))
        yield servers, workers
    finally:
        for p in workers + servers:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.timeout(240)
def test_killing_a_server_fails_every_worker_within_the_timeout_and_leaves_nothing_running(tmp_path):
    with summing_until_failure(tmp_path, 3, PS_TIMEOUT_S, 180) as (servers, workers):
        deadline = time.monotonic() + 150
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "the job never got through 5 rounds"
            assert all(p.poll() is None for p in workers + servers), "a process exited before the kill"
            time.sleep(0.1)
        servers[1].kill()
        for worker in workers:  # each leaves by itself: error, timing, engine shutdown
            worker.wait(timeout=PS_TIMEOUT_S + 30)
        servers[0].wait(timeout=15)  # the surviving server is told to stop
    results = ok([json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)])
    for result in results:
        assert result["error"] == "CommunicationError", result
        assert result["after_s"] < PS_TIMEOUT_S + 2, result
    assert servers[0].returncode == STOPPED_BY_A_WORKER


@pytest.mark.timeout(150)
@pytest.mark.parametrize("killed", [[1], [0, 1]], ids=["one worker", "every worker"])
def test_a_sigkilled_worker_stops_the_servers_and_the_others_long_before_the_timeout(tmp_path, killed):
    """No launcher (as under torchrun, whose servers start apart): a worker SIGKILLed mid-job
    cannot say it leaves. The servers exit 3 within seconds and a survivor raises naming it;
    before, the servers waited for it forever (every worker killed) and a survivor for DYNAMIX_TIMEOUT."""
    with summing_until_failure(tmp_path, 2, 120, 120) as (servers, workers):
        assert wait_until(lambda: (tmp_path / "ready").exists() or any(p.poll() is not None for p in workers + servers),
                          timeout=100), "the job never got through 5 rounds"
        assert all(p.poll() is None for p in workers + servers), "a process exited before the kill"
        for rank in killed:
            workers[rank].kill()
        for server in servers:
            assert server.wait(timeout=20) == STOPPED_BY_A_WORKER
        for worker in workers:
            worker.wait(timeout=20)
    for rank in set(range(2)) - set(killed):
        result = ok([json.loads((tmp_path / f"{rank}.json").read_text())])[0]
        assert result["error"] == "CommunicationError" and result["after_s"] < 20, result


EARLY_EXIT = """
import sys, time, torch
import dynamix_byteps.torch as bps
bps.init()
for step in range(1000):
    if bps.rank() == 1 and step == 3:
        sys.exit(3)
    bps.push_pull(torch.ones(1000), average=False, name="g")
    time.sleep(0.01)
"""


@pytest.mark.timeout(150)
def test_a_worker_that_exits_early_stops_a_ps_job_at_once_with_its_code_and_names_itself():
    """Rank 1 leaves after three rounds: the others fail at their next round, not after --timeout."""
    marker = f"ps-early-{os.getpid()}-{time.time_ns()}"
    start = time.monotonic()
    code, output = run_bpslaunch(["-n", 2, "--engine", "ps", "--num-servers", 1, "--timeout", 300, "--",
                                  sys.executable, "-c", EARLY_EXIT], timeout=120,
                                 env={**os.environ, "DYNAMIX_TEST_MARKER": marker, "OMP_NUM_THREADS": "1"})
    assert time.monotonic() - start < 100, output
    assert code in (1, 3), output  # the first worker to end: rank 1, or one that saw it leave
    assert "worker 1 left the job without pushing" in output, output
    assert "the workers cannot go on without it" not in output, output  # no server blamed, however slow the workers
    assert [p.pid for p in psutil.process_iter() if _environ(p).get("DYNAMIX_TEST_MARKER") == marker] == []


# Rank 1 is slow: interrupted, it leaves while rank 0 waits for its push (a round stranded).
TRAINS_UNTIL_INTERRUPTED = """
import time, torch
import dynamix_byteps.torch as bps
bps.init()
print("training", flush=True)
while True:
    time.sleep(0.05 * bps.rank())
    bps.push_pull(torch.ones(1000), average=False, name="g")
"""


@pytest.mark.timeout(60)
def test_ctrl_c_stops_a_ps_job_quietly_and_leaves_nothing_running(tmp_path):
    """SIGINT to bpslaunch's process group, as a terminal's Ctrl-C: exit 130, the launcher's line and
    one line per worker, no traceback, no TensorPipe warning (before: ~150 lines, a KeyboardInterrupt
    traceback from every worker and server, the RPC agents' warnings of the connections they lost)."""
    marker = f"ps-interrupted-{os.getpid()}-{time.time_ns()}"
    scratch = tmp_path / "tmp"  # the launcher's TMPDIR: its temporary folders must go with it
    scratch.mkdir()
    out, script = tmp_path / "out", tmp_path / "train.py"
    script.write_text(TRAINS_UNTIL_INTERRUPTED)
    launcher = None
    try:
        with out.open("wb") as sink:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--engine", "ps", "--num-servers", "2",
                 "--", sys.executable, script], stdout=sink, stderr=subprocess.STDOUT,
                env={**os.environ, "DYNAMIX_TEST_MARKER": marker, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)},
                start_new_session=True)
        assert wait_until(lambda: out.read_text().count("training") == 2, timeout=40), out.read_text()
        os.killpg(launcher.pid, signal.SIGINT)
        assert launcher.wait(timeout=15) == 130, out.read_text()
        output = out.read_text()
        assert "Traceback" not in output and "RPC agent" not in output, output
        where = sorted(re.sub(r":\d+ in", ":N in", line) for line in output.splitlines() if "interrupted" in line)
        assert where == [f"[{rank}] interrupted at {script}:N in <module>" for rank in range(2)], output
        assert len(output.splitlines()) == 5, output  # "training" twice, "received SIGINT; stopping 4 process(es)"
        assert wait_until(lambda: not _running_with(marker), timeout=10), _running_with(marker)
        assert list(scratch.iterdir()) == []
    finally:
        kill_tree(launcher)


def _running_with(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter() if _environ(p).get("DYNAMIX_TEST_MARKER") == marker]


def _environ(process) -> dict:
    try:
        return process.environ()
    except (psutil.Error, OSError):
        return {}


@pytest.mark.timeout(240)
def test_bpslaunch_engine_ps_starts_the_servers_and_leaves_nothing_running():
    marker = f"ps-launch-{os.getpid()}-{time.time_ns()}"
    code, output = run_bpslaunch(
        ["--num-workers", 3, "--engine", "ps", "--num-servers", 2, "--timeout", 60, "--",
         sys.executable, REPO / "tests" / "scripts" / "ps_worker.py"],
        timeout=200, env={**os.environ, "DYNAMIX_TEST_MARKER": marker, "OMP_NUM_THREADS": "1"})
    assert code == 0, output
    lines = sorted(line for line in output.splitlines() if "engine=" in line)
    assert lines == [f"[{rank}] engine=ps servers=2 workers=3 wrong=0" for rank in range(3)], output
    assert "go on without it" not in output  # servers leaving after the workers is the normal end
    leftovers = [p.pid for p in psutil.process_iter() if _environ(p).get("DYNAMIX_TEST_MARKER") == marker]
    assert leftovers == []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_a_server_exits_by_itself_when_its_launcher_is_killed():
    ps_port = free_port()
    env = worker_env(0, 1, free_port(), **ps_env(1, ps_port))
    launcher = subprocess.Popen(["bash", "-c", f"{sys.executable} -m dynamix_byteps.engine.ps_server --server-id 0 "
                                 "--num-workers 1 & echo $!; wait"], env=env, stdout=subprocess.PIPE, text=True)
    server = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while True:  # serving: its rendezvous store listens, and it watches its parent
            try:
                socket.create_connection(("127.0.0.1", ps_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server never listened"
                time.sleep(0.2)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server)
    finally:
        if _alive(server):
            os.kill(server, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.parametrize("variable, value, message", [
    ("DYNAMIX_SERVER_ID", "x", "DYNAMIX_SERVER_ID='x' is not an integer"),
    ("DYNAMIX_PS_CHANNELS", "basic,shm", "DYNAMIX_PS_CHANNELS='basic,shm' names unknown TensorPipe channel(s) ['shm']"),
])
def test_a_server_with_a_bad_variable_exits_2_naming_it(variable, value, message):
    args = [] if variable == "DYNAMIX_SERVER_ID" else ["--server-id", "0", "--num-servers", "1", "--num-workers", "1",
                                                      "--port", str(free_port())]
    done = subprocess.run([sys.executable, "-m", "dynamix_byteps.engine.ps_server", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, variable: value})
    assert done.returncode == 2 and message in done.stderr, done.stderr
