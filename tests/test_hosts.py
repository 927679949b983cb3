"""``bpslaunch --hosts H:S,...``: parsing, rank assignment in host order, the DYNAMIX_RANK_OFFSET /
DYNAMIX_SIZE contract read by WorkerEnv, and one real two-launcher gloo job on loopback."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, kill_tree
from multiworker import free_port

from dynamix_byteps.env import MAX_WORKERS, WorkerEnv
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.cli import parse_args, parse_hosts
from dynamix_byteps.launcher.specs import env_mode, local_mode

REPO = Path(__file__).resolve().parents[1]
RANK_WORKER = str(REPO / "tests" / "scripts" / "rank_worker.py")
BATCH_SIZE_WORKER = str(REPO / "tests" / "scripts" / "batch_size_worker.py")


def specs_for(argv: list[str], env: dict[str, str] | None = None) -> tuple[list, list[str]]:
    """The ChildSpecs bpslaunch would start for ``argv`` (nothing is started), and its notes."""
    args = parse_args(argv)
    notes: list[str] = []
    return local_mode(args, dict(env or {}), notes), notes


def worker_envs(specs) -> dict[int, WorkerEnv]:
    return {int(s.label): WorkerEnv.from_environ(s.env) for s in specs if not s.service}


@pytest.mark.parametrize("text, hosts", [
    ("a,b", [("a", None), ("b", None)]),
    ("a:3,b:1", [("a", 3), ("b", 1)]),
    (" 10.0.0.1:2 , h-2.example:7 ", [("10.0.0.1", 2), ("h-2.example", 7)]),
    ("fe80::1,fe80::2", [("fe80::1", None), ("fe80::2", None)]),
])
def test_hosts_parse(text, hosts):
    assert parse_hosts(text) == hosts


@pytest.mark.parametrize("text, needle", [
    ("a:0,b:1", "slots after ':'"),
    ("a:x,b:1", "slots after ':'"),
    ("a:-1", "slots after ':'"),
    ("a:3,b", "slots for some hosts only"),
    ("a,,b", "comma-separated"),
    (":3", "comma-separated"),
])
def test_bad_hosts_are_refused(text, needle):
    with pytest.raises(Exception, match=needle):
        parse_hosts(text)


@pytest.mark.parametrize("slots, node_rank, ranks", [
    ((3, 1), 0, [0, 1, 2]),
    ((3, 1), 1, [3]),
    ((1, 2, 3), 1, [1, 2]),
    ((1, 2, 3), 2, [3, 4, 5]),
])
def test_ranks_follow_host_order(slots, node_rank, ranks):
    hosts = ",".join(f"127.0.0.1:{s}" for s in slots)
    specs, _ = specs_for(["--hosts", hosts, "--node-rank", str(node_rank), "--port", str(free_port()), "--", "true"])
    envs = worker_envs(specs)
    assert sorted(envs) == ranks
    for rank, env in envs.items():
        assert (env.rank, env.size) == (rank, sum(slots))
        assert (env.local_size, env.local_rank) == (slots[node_rank], rank - ranks[0])
        assert (env.num_nodes, env.node_rank, env.root_addr) == (len(slots), node_rank, "127.0.0.1")


def test_plain_hosts_keep_num_workers_per_host():
    specs, notes = specs_for(["--hosts", "127.0.0.1,127.0.0.1", "--node-rank", "1", "-n", "2",
                              "--port", str(free_port()), "--", "true"])
    envs = worker_envs(specs)
    assert {r: (e.rank, e.size) for r, e in envs.items()} == {2: (2, 4), 3: (3, 4)}
    assert all(s.env["GLOO_SOCKET_IFNAME"] == "lo" for s in specs)
    assert any("GLOO_SOCKET_IFNAME" in n for n in notes)


def test_agreeing_num_workers_and_user_interface_are_kept():
    specs, notes = specs_for(["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "-n", "1",
                              "--port", str(free_port()), "--", "true"], {"GLOO_SOCKET_IFNAME": "eth7"})
    assert [s.label for s in specs] == ["3"]
    assert specs[0].env["GLOO_SOCKET_IFNAME"] == "eth7" and not any("GLOO" in n for n in notes)


def test_single_host_sets_the_same_contract():
    specs, _ = specs_for(["-n", "2", "--", "true"])
    assert [(s.env["DYNAMIX_RANK_OFFSET"], s.env["DYNAMIX_SIZE"]) for s in specs] == [("0", "2")] * 2
    assert "GLOO_SOCKET_IFNAME" not in specs[0].env


def test_slowdown_and_bounds_use_the_uneven_total():
    specs, _ = specs_for(["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "--port", str(free_port()),
                          "--slowdown", "3=2", "--max-batch", "8,8,8,4", "--", "true"])
    assert specs[0].env["DYNAMIX_SLOWDOWN"].startswith("2")


@pytest.mark.parametrize("argv, env, needle", [
    (["--min-batch", "abc"], {}, "argument --min-batch: batch sizes 'abc' are not comma-separated integers"),
    ([], {"DYNAMIX_MIN_BATCH": "abc"}, "environment variable DYNAMIX_MIN_BATCH: batch sizes 'abc'"),
    ([], {"DYNAMIX_MAX_BATCH": "0"}, "environment variable DYNAMIX_MAX_BATCH: batch sizes '0'"),
    (["--batch-size", "4"], {"DYNAMIX_MIN_BATCH": "8"}, "argument --batch-size: 4 is outside rank 0's bounds [8,"),
    (["--max-batch", "4"], {"DYNAMIX_MIN_BATCH": "9"}, "max_batch for rank 0 must be an integer >= min_batch=9"),
    ([], {"DYNAMIX_BATCH_SIZE": "100", "DYNAMIX_MAX_BATCH": "8"},
     "environment variable DYNAMIX_BATCH_SIZE: 100 is outside rank 0's bounds [1, 8]"),
    (["--max-batch", "8"], {"DYNAMIX_BATCH_SIZE": "100"}, "DYNAMIX_BATCH_SIZE: 100 is outside rank 0's bounds"),
    ([], {"DYNAMIX_BATCH_SIZE": str(2**31)},
     "environment variable DYNAMIX_BATCH_SIZE: batch sizes '2147483648': 2147483648 is above the largest batch size"),
    (["--batch-size", "32,96", "--max-batch", "128,64"], {}, "argument --batch-size: 96 is outside rank 1's bounds [1, 64]"),
    (["--batch-size", "8,4", "--min-batch", "2,6"], {}, "argument --batch-size: 4 is outside rank 1's bounds [6, unbounded]"),
    ([], {"DYNAMIX_BATCH_SIZE": "4,100", "DYNAMIX_MAX_BATCH": "8"},
     "environment variable DYNAMIX_BATCH_SIZE: 100 is outside rank 1's bounds [1, 8]"),
    (["--min-batch", str(2**31)], {}, "argument --min-batch: batch sizes '2147483648': 2147483648 is above"),
])
def test_bounds_from_flags_or_the_inherited_environment_are_checked_before_any_worker_starts(argv, env, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        specs_for(["-n", "2", *argv, "--", "true"], env)
    assert specs_for(["-n", "2", "--min-batch", "2", "--", "true"], {"DYNAMIX_MIN_BATCH": "abc"})  # the flag wins


@pytest.mark.parametrize("text, needle", [
    (str(10**20), "batch sizes '100000000000000000000': 100000000000000000000 is above the largest batch size"),
    ("32,x", "batch sizes '32,x' are not comma-separated integers"),
    ("32,0", "batch sizes '32,0': 0 is no batch size"),
])
def test_a_malformed_batch_size_is_a_usage_error_naming_the_flag(capsys, text, needle):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["-n", "2", "--batch-size", text, "--", "true"])
    assert exit_.value.code == 2
    assert f"argument --batch-size: {needle}" in capsys.readouterr().err


def test_a_batch_size_per_worker_reaches_every_worker_as_the_same_text():
    specs, _ = specs_for(["-n", "2", "--batch-size", "32,96", "--max-batch", "32,96", "--", "true"])
    assert [s.env["DYNAMIX_BATCH_SIZE"] for s in specs] == ["32,96", "32,96"]
    specs, _ = specs_for(["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "--port", str(free_port()),
                          "--batch-size", "8,8,8,4", "--", "true"])
    assert [s.env["DYNAMIX_BATCH_SIZE"] for s in specs] == ["8,8,8,4"]
    assert worker_envs(specs)[3].size == 4  # bps.init's check of the text passes on rank 3


@pytest.mark.parametrize("argv, needle", [
    (["-n", "2", "--batch-size", "32,64,96"], "batch sizes '32,64,96' give 3 values for 2 workers; give 1 or 2, one per worker"),
    (["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "--port", "1", "--batch-size", "8,4"],
     "batch sizes '8,4' give 2 values for 4 workers; give 1 or 4, one per worker"),
])
def test_a_batch_size_list_that_does_not_match_the_job_is_a_usage_error_naming_the_flag(argv, needle):
    with pytest.raises(UsageError, match=re.escape(f"argument --batch-size: {needle}")):
        specs_for([*argv, "--", "true"])


def test_environment_mode_checks_the_batch_size_list_against_the_job_size():
    env = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "2",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1234"}
    specs = env_mode(parse_args(["--batch-size", "1,2,3,4", "--", "true"]), env, [])
    assert [s.env["DYNAMIX_BATCH_SIZE"] for s in specs] == ["1,2,3,4"] * 2
    with pytest.raises(UsageError, match=re.escape("argument --batch-size: batch sizes '1,2' give 2 values for 4 workers")):
        env_mode(parse_args(["--batch-size", "1,2", "--", "true"]), env, [])


@pytest.mark.parametrize("argv, env, needle", [
    (["--min-batch", "64", "--batch-size", "32,96"], {}, "argument --batch-size: 32 is outside rank 0's bounds [64, unbounded]"),
    ([], {"DYNAMIX_BATCH_SIZE": "32,96", "DYNAMIX_MAX_BATCH": "64"},
     "environment variable DYNAMIX_BATCH_SIZE: 96 is outside rank 1's bounds [1, 64]"),
    (["--max-batch", "8,8,8"], {}, "argument --max-batch: batch sizes '8,8,8' give 3 values for 2 workers"),
])
def test_environment_mode_checks_each_rank_s_batch_size_against_its_bounds(argv, env, needle):
    cluster = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_SIZE": "2",
               "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1234"}
    with pytest.raises(UsageError, match=re.escape(needle)):
        env_mode(parse_args([*argv, "--", "true"]), {**cluster, **env}, [])


@pytest.mark.timeout(120)
def test_two_workers_each_start_at_their_own_batch_size():
    proc = subprocess.Popen([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--batch-size", "32,96",
                             "--timeout", "60", "--", sys.executable, BATCH_SIZE_WORKER], env=clean_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output = proc.communicate(timeout=100)[0].decode(errors="replace")
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output
    assert "[0] rank 0 starts at 32" in output and "[1] rank 1 starts at 96" in output, output


@pytest.mark.parametrize("extra, needle", [
    (["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "-n", "2"], b"--num-workers 2 disagrees"),
    (["--hosts", "127.0.0.1,127.0.0.1", "--node-rank", "1"], b"needs --num-workers"),
    (["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "2"], b"--node-rank in 0..1"),
    (["--hosts", "127.0.0.1:3,127.0.0.1:1"], b"--node-rank in 0..1"),
    (["--hosts", f"127.0.0.1:{MAX_WORKERS},127.0.0.1:1", "--node-rank", "1"], b"at most 4096"),
    (["--hosts", "127.0.0.1:3,127.0.0.1:0", "--node-rank", "1"], b"slots after ':'"),
    (["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "--slowdown", "4=2"], b"rank 4 is not in this job of 4"),
    (["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "--engine", "byteps"], b"needs --engine gloo"),
    (["--hosts", "no-such-host.invalid:3,127.0.0.1:1", "--node-rank", "1"], b"GLOO_SOCKET_IFNAME"),
])
def test_bad_slots_exit_2_naming_the_problem(extra, needle):
    proc = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", *extra, "--port", str(free_port()),
                           "--", "true"], check=False, capture_output=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "DYNAMIX_", "GLOO_"))})
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and b"usage: bpslaunch" in proc.stderr


NODE_1 = {"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "1", "BYTEPS_LOCAL_RANK": "0",
          "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1234"}


@pytest.mark.parametrize("variables, named", [
    ({"DYNAMIX_RANK_OFFSET": "1"}, "^environment variable DYNAMIX_SIZE is not set"),
    ({"DYNAMIX_SIZE": "4"}, "^environment variable DYNAMIX_RANK_OFFSET is not set"),
    ({"DYNAMIX_RANK_OFFSET": "-1", "DYNAMIX_SIZE": "4"}, "DYNAMIX_RANK_OFFSET=-1 must be >= 0"),
    ({"DYNAMIX_RANK_OFFSET": "3", "DYNAMIX_SIZE": "4", "BYTEPS_LOCAL_SIZE": "2"},
     "^DYNAMIX_RANK_OFFSET=3 \\+ BYTEPS_LOCAL_SIZE=2 must be <= DYNAMIX_SIZE=4"),
    ({"DYNAMIX_RANK_OFFSET": "0", "DYNAMIX_SIZE": str(MAX_WORKERS + 1)}, f"DYNAMIX_SIZE={MAX_WORKERS + 1} must be <="),
])
def test_bad_rank_layout_is_named(variables, named):
    with pytest.raises(ConfigurationError, match=named):
        WorkerEnv.from_environ({**NODE_1, **variables})


def test_rank_offset_overrides_the_byteps_formula():
    env = WorkerEnv.from_environ({**NODE_1, "DYNAMIX_RANK_OFFSET": "3", "DYNAMIX_SIZE": "4"})
    assert (env.rank, env.size) == (3, 4)


def test_env_mode_drops_a_stale_rank_offset():
    """BytePS's environment mode keeps BytePS's formula even if the caller's environment has our variables."""
    args = parse_args(["--", "true"])
    env = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "1234", "BYTEPS_LOCAL_SIZE": "2", "DYNAMIX_RANK_OFFSET": "0", "DYNAMIX_SIZE": "9"}
    envs = worker_envs(env_mode(args, env, []))
    assert {r: (e.rank, e.size) for r, e in envs.items()} == {2: (2, 4), 3: (3, 4)}


@pytest.mark.parametrize("nodes, engine, address", [("1", "gloo", "127.0.0.1"), ("2", "gloo", "10.0.0.1"),
                                                     ("1", "ps", "10.0.0.1")])
def test_a_single_node_job_rendezvous_on_this_machine_whatever_the_root_uri(nodes, engine, address):
    """BytePS's single-machine recipe sets DMLC_PS_ROOT_URI=10.0.0.1 ("it does not matter");
    only a job spread over nodes, or one whose servers may be elsewhere, uses it."""
    args = parse_args(["--engine", engine, "--", "true"])
    env = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": nodes, "DMLC_WORKER_ID": "0", "DMLC_PS_ROOT_URI": "10.0.0.1",
           "DMLC_PS_ROOT_PORT": "1234", "BYTEPS_LOCAL_SIZE": "2", "DMLC_NUM_SERVER": "1"}
    notes: list[str] = []
    specs = env_mode(args, env, notes)
    assert {s.env["DMLC_PS_ROOT_URI"] for s in specs if not s.service} == {address}
    assert any("DMLC_PS_ROOT_URI=10.0.0.1 is not used" in note for note in notes) == (address == "127.0.0.1")


@pytest.mark.timeout(240)
def test_two_launchers_with_uneven_slots_run_one_gloo_job(tmp_path):
    """3 + 1 workers from two bpslaunch invocations on loopback: every rank 0..3 once, one all-reduce."""
    common = ["--hosts", "127.0.0.1:3,127.0.0.1:1", "--port", str(free_port()), "--timeout", "120"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "DYNAMIX_", "GLOO_"))}
    procs = [subprocess.Popen([sys.executable, "-m", "dynamix_byteps.launcher", *common, "--node-rank", str(i), "--",
                               sys.executable, RANK_WORKER, str(tmp_path)], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in (0, 1)]
    try:
        outputs = [p.communicate(timeout=220)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [r["local_rank"] for r in results] == [0, 1, 2, 0]
    assert all(r["rank_sum"] == 0 + 1 + 2 + 3 for r in results)


def test_network_scenario_maps_to_hosts():
    """The linked ranks come last, one emulated host each; the rest share host 0."""
    from dynamix_byteps.scenarios import Link, Scenario, scenario

    slots, rates = scenario("network").host_layout()
    assert slots == [3, 1] and set(rates) == {1} and rates[1] > 0
    assert Scenario("s", 5, links=(Link(3, 10.0), Link(4, 5.0))).host_layout() == ([3, 1, 1], {1: 10.0, 2: 5.0})
    assert Scenario("s", 2).host_layout() == ([2], {})
    for links in ((Link(0, 10.0),), (Link(2, 10.0),)):
        with pytest.raises(ConfigurationError, match="highest"):
            Scenario("s", 4, links=links).host_layout()


def test_each_host_s_node_agent_logs_to_its_own_file_in_a_shared_log_dir(tmp_path):
    """With --policy every host runs a node agent; one --log-dir on a shared file system must not
    give two hosts' agents the same log file (the later one truncated the other's)."""
    port, scheduler_port = free_port(), free_port()
    agent_logs = []
    for node_rank in (0, 1):
        args = parse_args(["--hosts", "127.0.0.1,127.0.0.1", "--node-rank", str(node_rank), "-n", "1",
                           "--port", str(port), "--policy", "static", "--scheduler-port", str(scheduler_port),
                           "--log-dir", str(tmp_path), "--", "true"])
        specs = local_mode(dataclasses.replace(args, run_dir=tmp_path), {"DYNAMIX_TOKEN": "t" * 32}, [])
        agent_logs += [s.log_path for s in specs if s.label == "agent"]
    assert agent_logs == [tmp_path / "agent.log", tmp_path / "agent-1.log"]
