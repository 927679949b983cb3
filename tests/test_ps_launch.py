"""bpslaunch and the ps engine's servers: where ``--server-hosts`` puts them, BytePS environment mode's
``DMLC_ROLE=server``, and real jobs on loopback whose servers run apart from rank 0's host."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO, kill_tree
from multiworker import free_port

from dynamix_byteps.engine.ps_rendezvous import PSRendezvous
from dynamix_byteps.errors import UsageError
from dynamix_byteps.launcher.cli import parse_args
from dynamix_byteps.launcher.elastic import RunReport, decide
from dynamix_byteps.launcher.specs import env_mode, local_mode

PS_WORKER = str(REPO / "tests" / "scripts" / "ps_worker.py")
HOSTS = ["--hosts", "h0:1,h1:1,h2:1", "--port", "29500", "--engine", "ps", "--num-servers", "3"]
NO_IFNAME_PROBE = {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}  # hX do not resolve: interfaces given


def servers_of(specs) -> dict[str, list[str]]:
    return {s.label: list(s.argv) for s in specs if s.label.startswith("server")}


def test_server_hosts_place_server_i_on_the_i_mod_n_th_host_and_workers_find_server_0():
    placed = {}
    for node in (1, 2):
        specs = local_mode(parse_args([*HOSTS, "--server-hosts", "h2,h1", "--node-rank", str(node), "--", "true"]),
                           NO_IFNAME_PROBE, [])
        placed[node] = sorted(servers_of(specs))
        worker = next(s for s in specs if not s.service)
        assert (worker.env["DYNAMIX_PS_ADDR"], worker.env["DYNAMIX_PS_PORT"], worker.env["DMLC_NUM_SERVER"]) == \
            ("h2", "29501", "3")
        for argv in servers_of(specs).values():
            assert argv[argv.index("--addr") + 1] == "h2" and argv[argv.index("--num-workers") + 1] == "3"
    assert placed == {1: ["server1"], 2: ["server0", "server2"]}


def test_servers_default_to_node_0_beside_the_scheduler():
    specs = local_mode(parse_args([*HOSTS, "--node-rank", "1", "--", "true"]), NO_IFNAME_PROBE, [])
    assert servers_of(specs) == {} and next(iter(specs)).env["DYNAMIX_PS_ADDR"] == "h0"


@pytest.mark.parametrize("argv, needle", [
    ([*HOSTS, "--node-rank", "1", "--server-hosts", "h1,h9"], "--server-hosts: h9 is not one of --hosts (h0, h1, h2)"),
    (["-n", "2", "--engine", "ps", "--server-hosts", "127.0.0.1"], "--server-hosts needs --hosts"),
    (["-n", "2", "--engine", "gloo", "--server-hosts", "127.0.0.1"], "--server-hosts is for --engine ps"),
])
def test_bad_server_hosts_are_usage_errors(argv, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        local_mode(parse_args([*argv, "--", "true"]), NO_IFNAME_PROBE, [])


SERVER_ENV = {"DMLC_ROLE": "server", "DMLC_NUM_SERVER": "2", "DYNAMIX_SERVER_ID": "1", "DMLC_NUM_WORKER": "2",
              "BYTEPS_LOCAL_SIZE": "2", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "1234"}


def test_env_mode_server_role_runs_a_summation_server_with_the_ps_engine():
    (spec,) = env_mode(parse_args(["--engine", "ps"]), SERVER_ENV, [])
    argv = list(spec.argv)
    assert spec.label == "server1" and not spec.service  # the launcher's only child: its exit is the launcher's
    assert [argv[argv.index(flag) + 1] for flag in ("--server-id", "--num-servers", "--num-workers", "--addr", "--port")] \
        == ["1", "2", "4", "10.0.0.1", "1235"]
    (spec,) = env_mode(parse_args(["--", "true"]), {**SERVER_ENV, "DYNAMIX_ENGINE": "ps", "DYNAMIX_PS_PORT": "777",
                                                    "DYNAMIX_PS_ADDR": "10.0.0.2"}, [])
    assert spec.argv[-4:] == ["--addr", "10.0.0.2", "--port", "777"]
    with pytest.raises(UsageError, match="DYNAMIX_SERVER_ID is not set"):
        env_mode(parse_args(["--engine", "ps"]), {k: v for k, v in SERVER_ENV.items() if k != "DYNAMIX_SERVER_ID"}, [])
    with pytest.raises(UsageError, match="DYNAMIX_SERVER_ID=2 must be <= 1"):
        env_mode(parse_args(["--engine", "ps"]), {**SERVER_ENV, "DYNAMIX_SERVER_ID": "2"}, [])


def test_workers_meet_the_servers_at_dynamix_ps_addr_when_it_is_set():
    group = PSRendezvous.from_environ(2, "10.0.0.1", 1234, 30.0, {"DMLC_NUM_SERVER": "1", "DYNAMIX_PS_ADDR": "10.0.0.2"})
    assert (group.addr, group.port) == ("10.0.0.2", 1235)
    assert PSRendezvous.from_environ(2, "10.0.0.1", 1234, 30.0, {"DMLC_NUM_SERVER": "1"}).addr == "10.0.0.1"


def test_a_lost_server_restarts_every_host_with_all_its_workers():
    reports = [RunReport(node=0, run=0, code=1, failed=0, failed_at=2.0, self_failed=[0, 1], workers=[0, 1]),
               RunReport(node=1, run=0, code=137, failed=None, failed_at=1.0, workers=[2, 3], server_failed=True)]
    assert decide([2, 2], reports, 1) == {"slots": [2, 2], "lost": []}
    stopped = [reports[0], RunReport(node=1, run=0, code=143, failed=None, failed_at=1.0, workers=[2, 3])]
    assert decide([2, 2], stopped, 1)["exit"] == 143  # a signalled launcher still ends the job (first code)


def _environ(process) -> dict:
    try:
        return process.environ()
    except (psutil.Error, OSError):
        return {}


def _left_running(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter() if _environ(p).get("DYNAMIX_TEST_MARKER") == marker]


def _run_launchers(envs: list[dict], argvs: list[list[str]], out_dir, timeout: float) -> list[tuple[int, str]]:
    """Run one bpslaunch per (env, argv) at once; returns each one's (exit code, output)."""
    outs = [out_dir / f"launcher{i}.out" for i in range(len(argvs))]
    procs = [subprocess.Popen([sys.executable, "-m", "dynamix_byteps.launcher", *argv], env=env,
                              start_new_session=True, stdout=open(out, "wb"), stderr=subprocess.STDOUT)
             for env, argv, out in zip(envs, argvs, outs)]
    try:
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    return [(code, out.read_text(errors="replace")) for code, out in zip(codes, outs)]


@pytest.mark.timeout(240)
def test_two_hosts_with_both_servers_on_the_second_sum_exactly_and_leave_nothing_running(tmp_path):
    """Two launchers on loopback (127.0.0.1 and 127.0.0.2): the servers and their rendezvous run beside node 1."""
    marker = f"ps-hosts-{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "DYNAMIX_TEST_MARKER": marker, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    common = ["--hosts", "127.0.0.1:2,127.0.0.2:1", "--port", str(free_port()), "--engine", "ps", "--num-servers", "2",
              "--server-hosts", "127.0.0.2", "--timeout", "60"]
    results = _run_launchers([env, env], [[*common, "--node-rank", str(i), "--", sys.executable, PS_WORKER]
                                          for i in (0, 1)], tmp_path, timeout=200)
    assert [code for code, _ in results] == [0, 0], results
    lines = sorted(line for _, out in results for line in out.splitlines() if "engine=" in line)
    assert lines == [f"[{rank}] engine=ps servers=2 workers=3 wrong=0" for rank in range(3)], results
    assert "[server0]" not in results[0][1] and "[server1]" not in results[0][1]  # none on node 0
    assert _left_running(marker) == []


@pytest.mark.timeout(240)
def test_env_mode_server_and_worker_launchers_run_one_ps_job(tmp_path):
    """BytePS style: one ``DMLC_ROLE=server`` bpslaunch and one ``DMLC_ROLE=worker`` bpslaunch of 2 processes."""
    marker = f"ps-env-{os.getpid()}-{time.time_ns()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "DYNAMIX_", "BYTEPS_"))}
    base.update(DYNAMIX_TEST_MARKER=marker, OMP_NUM_THREADS="1", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1",
                DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()), DYNAMIX_PS_PORT=str(free_port()),
                BYTEPS_LOCAL_SIZE="2", DYNAMIX_ENGINE="ps", DYNAMIX_TIMEOUT="60")
    results = _run_launchers([{**base, "DMLC_ROLE": "server"}, {**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"}],
                             [[], ["--", sys.executable, PS_WORKER]], tmp_path, timeout=200)
    assert [code for code, _ in results] == [0, 0], results
    lines = sorted(line for line in results[1][1].splitlines() if "engine=" in line)
    assert lines == [f"[{rank}] engine=ps servers=1 workers=2 wrong=0" for rank in range(2)], results
    assert _left_running(marker) == []
