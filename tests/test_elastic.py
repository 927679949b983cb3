"""Elastic restart: ``bpslaunch --restart-on-failure`` continues the epoch on the surviving workers
from the last atomic checkpoint, with no sample lost or repeated, and a scheduler for the new size."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import clean_env, kill_tree, run_bpslaunch
from multiworker import free_port

from dynamix_byteps.control.scheduler import DECISION_LOG
from dynamix_byteps.launcher.config import LaunchConfig
from dynamix_byteps.launcher.elastic import RunReport, _apply_decision, decide
from dynamix_byteps.testing import netns
from dynamix_byteps.testing.faults import FAULT_TAG_ENV, job_processes

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "scripts" / "elastic_worker.py"
SAMPLES = 480  # 20 steps of the global batch 24 (4 x 6, then 3 x 8): no epoch tail to pad
NETNS_REASON = netns.available()


def rank0_fails_once_every_worker_started(prelude: str = "") -> str:
    """A ``python -c`` script (its argument: a folder) in which rank 0 exits with code 3 once every
    worker has got through ``bps.init`` and ``prelude``, and the others sleep until stopped. Without
    the wait, rank 0 could leave while another was still in ``bps.init``; that one then failed too,
    and two failures at once read as an error in the command, which is not restarted."""
    return ("import os,sys,time,pathlib; import dynamix_byteps.torch as bps; bps.init(); " + prelude +
            "here = pathlib.Path(sys.argv[1]); (here / f'up-{bps.rank()}').touch()\n"
            "while bps.rank() == 0 and len(list(here.glob('up-*'))) < bps.size(): time.sleep(0.05)\n"
            "bps.rank() == 0 and os._exit(3); time.sleep(60)")


def bpslaunch(*args, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", *map(str, args)], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env)


def read_runs(out: Path) -> dict[int, dict[int, list[dict]]]:
    """``{run: {rank: [records]}}`` from the worker's ``rank<r>.run<k>.jsonl`` files."""
    runs: dict[int, dict[int, list[dict]]] = {}
    for path in out.glob("rank*.run*.jsonl"):
        rank, run = (int(part) for part in path.name[len("rank"):-len(".jsonl")].split(".run"))
        runs.setdefault(run, {})[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return runs


def trained_indices(runs: dict[int, dict[int, list[dict]]]) -> list[int]:
    """Indices of every checkpointed step: a run's steps at or after the next run's resume point are undone."""
    indices = []
    for run in sorted(runs):
        limit = None
        if run + 1 in runs:
            limit = runs[run + 1][0][0]["resumed_at"]
        for records in runs[run].values():
            for record in records:
                if "step" in record and (limit is None or record["step"] < limit):
                    indices += record["indices"]
    return indices


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_lost_mid_epoch_restarts_the_job_on_three_without_losing_or_repeating_a_sample(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = bpslaunch("-n", 4, "--batch-size", 6, "--restart-on-failure", 1, "--checkpoint", tmp_path / "ckpt.pt",
                     "--policy", "proportional", "--decision-interval", 2, "--monitor", "off", "--grace-period", 2,
                     "--log-dir", run_dir, "--", sys.executable, WORKER, out, SAMPLES, 2, 7, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "worker 2 failed" in proc.stderr and f"restart 1 of 1 with 3 workers from {tmp_path / 'ckpt.pt'}" in proc.stderr
    runs = read_runs(out)
    assert sorted(runs) == [0, 1] and sorted(runs[1]) == [0, 1, 2]
    resumed = {records[0]["resumed_at"] for records in runs[1].values()}
    assert resumed == {7}  # the checkpoint after step 6: rank 2 died before training step 7
    indices = trained_indices(runs)
    assert sorted(indices) == list(range(SAMPLES))  # every sample exactly once
    # the restarted scheduler decides for 3 workers
    decisions = [json.loads(line) for line in (run_dir / DECISION_LOG).read_text().splitlines()]
    sizes = [len(d["batch_sizes"]) for d in decisions if "batch_sizes" in d]
    assert 4 in sizes and sizes[-1] == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["-n", "2", "--restart-on-failure", "1"], "--checkpoint"),
    (["--hosts", "127.0.0.1:1,127.0.0.2:1", "--node-rank", "0", "--port", "29999", "--restart-on-failure", "1",
      "--checkpoint", "c.pt"], "needs --restart-port"),
    (["--hosts", "127.0.0.1:1,127.0.0.2:1", "--node-rank", "0", "--port", "29999", "--restart-on-failure", "1",
      "--checkpoint", "c.pt", "--restart-port", "29998"], "DYNAMIX_TOKEN"),
    (["--hosts", "127.0.0.1:1,127.0.0.2:1", "--node-rank", "0", "--port", "29999", "--restart-on-failure", "1",
      "--checkpoint", "c.pt", "--restart-port", "29999"], "a port of its own"),
    (["-n", "2", "--restart-port", "29998"], "needs --restart-on-failure"),
])
def test_restart_on_failure_needs_a_checkpoint_and_across_hosts_a_coordinator_port_and_token(flags, message):
    proc = bpslaunch(*flags, "--", "true", timeout=50)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def report(node, code=0, failed=None, killed=False, at=None, self_failed=(), workers=(), started=True):
    return RunReport(node=node, run=0, code=code, failed=failed, killed=[failed] if killed else [], failed_at=at,
                     self_failed=list(self_failed), workers=list(workers), started=started)


@pytest.mark.parametrize("reports, left, expected", [
    # rank 3 on host 1 SIGKILLed; host 0's ranks then fail their collectives on their own (code 1)
    ([report(0, 1, 0, False, 2.0, [0, 1], [0, 1]), report(1, 137, 3, True, 1.9, [], [2, 3])], 1,
     {"slots": [2, 1], "lost": [3]}),
    # the kill is what counts, even when a collective failure was seen first
    ([report(0, 1, 0, False, 1.0, [0, 1], [0, 1]), report(1, 137, 3, True, 1.9, [], [2, 3])], 1,
     {"slots": [2, 1], "lost": [3]}),
    # no kill: the earliest failure is the lost worker
    ([report(0, 1, 1, False, 2.0, [1], [0, 1]), report(1, 3, 2, False, 1.5, [2], [2, 3])], 1,
     {"slots": [2, 1], "lost": [2]}),
    ([report(0, workers=[0, 1]), report(1, workers=[2, 3])], 1, {"exit": 0}),
    ([report(0, 1, 0, False, 2.0, [0, 1], [0, 1]), report(1, 137, 3, True, 1.9, [], [2, 3])], 0, {"exit": 137}),
    ([report(0, 3, 0, False, 1.0, [0, 1], [0, 1]), report(1, 3, 2, False, 1.1, [2, 3], [2, 3])], 1, {"exit": 3}),
    ([report(0, 143, None, workers=[0, 1]), report(1, 137, 3, True, 1.9, [], [2, 3])], 1, {"exit": 137}),
    ([report(0, 137, 0, True, 1.0, [], [0]), report(1, 1, 1, False, 1.1, [1], [1])], 1, {"exit": 137}),
    # no host's workers got through bps.init: a start-up failure, whichever worker failed first
    ([report(0, 1, 0, False, 1.0, [0], [0, 1], False), report(1, 143, 2, False, 1.1, [], [2, 3], False)], 1,
     {"exit": 1}),
])
def test_decide_shrinks_the_hosts_of_lost_workers_or_ends_the_job(reports, left, expected):
    decision = decide([len(r.workers) for r in reports], reports, left)
    assert {k: v for k, v in decision.items() if k != "reason"} == expected, decision


@pytest.mark.slow
@pytest.mark.skipif(NETNS_REASON is not None, reason=f"network test bed unavailable: {NETNS_REASON}")
@pytest.mark.timeout(300)
def test_a_host_that_loses_its_only_worker_leaves_and_the_job_goes_on_with_three_on_two_hosts(tmp_path):
    out, run_dir, tag = tmp_path / "out", tmp_path / "run", secrets.token_hex(6)
    out.mkdir()
    args = ["--batch-size", 6, "--restart-on-failure", 1, "--checkpoint", tmp_path / "ckpt.pt", "--policy",
            "proportional", "--decision-interval", 2, "--monitor", "off", "--grace-period", 2, "--timeout", 60,
            "--log-dir", run_dir]
    with netns.Testbed(3) as bed:  # ranks 0, 1 on host 0, 2 on host 1 (dies before step 7), 3 on host 2
        result = netns.run_job(bed, [2, 1, 1], [sys.executable, str(WORKER), str(out), str(SAMPLES), "2", "7"],
                               [str(a) for a in args], env=dict(os.environ, **{FAULT_TAG_ENV: tag}), timeout_s=240,
                               grace_s=5)
        left = job_processes(tag)
    assert result.ok, "\n".join(o[-2500:] for o in result.outputs)
    assert left == []
    assert all("restart 1 of 1 with 3 workers" in o and "worker(s) 2 lost" in o for o in result.outputs), result.outputs
    # node 0 forks its workers while serving the rendezvous: gRPC's fork handlers stay off
    assert not any("fork()" in o for o in result.outputs), result.outputs
    assert "no worker of this host is left in the job" in result.outputs[1]
    # host 2 is node 1 of the new run: its worker is rank 2 now, beside ranks 0 and 1 on host 0
    assert "[2]" in result.outputs[2].split("restart 1 of 1", 1)[1]
    runs = read_runs(out)
    assert sorted(runs) == [0, 1] and sorted(runs[1]) == [0, 1, 2]
    assert {records[0]["resumed_at"] for records in runs[1].values()} == {7}
    assert sorted(trained_indices(runs)) == list(range(SAMPLES))  # every sample exactly once
    decisions = [json.loads(line) for line in (run_dir / DECISION_LOG).read_text().splitlines()]
    sizes = [len(d["batch_sizes"]) for d in decisions if "batch_sizes" in d]
    assert 4 in sizes and sizes[-1] == 3  # node 0's new scheduler decides for the 3 survivors


@pytest.mark.timeout(120)
def test_without_restarts_left_the_failed_code_is_returned(tmp_path):
    # Rank 0 fails after the job started; rank 1 would run on until the launcher stops it (a lost
    # worker, not a bug in the command).
    proc = bpslaunch("-n", 2, "--restart-on-failure", 1, "--checkpoint", tmp_path / "c.pt", "--grace-period", 2, "--",
                     sys.executable, "-c", rank0_fails_once_every_worker_started(), tmp_path, timeout=110)
    assert proc.returncode == 3
    assert proc.stderr.count("restart 1 of 1 with 1 workers from scratch: ") == 1 and "restart 2" not in proc.stderr


@pytest.mark.timeout(90)
def test_a_worker_whose_rendezvous_fails_after_a_peer_started_and_died_is_not_failing_on_its_own(tmp_path):
    """Rank 0 gets through (its started mark) and exits with 3; rank 1, still in its rendezvous, fails
    there with a CommunicationError. Before, both read as failing on their own at once: an error in
    the command, not restarted."""
    joining = tmp_path / "rank 1 joins"
    script = (f'if [ "$BYTEPS_LOCAL_RANK" = 0 ]; then while [ ! -e "{joining}" ]; '
              'do sleep 0.05; done; touch "$DYNAMIX_STARTED_DIR/0"; exit 3; fi; '
              f'exec {sys.executable} -c "import dynamix_byteps as bps, pathlib; pathlib.Path(\'{joining}\').touch(); bps.init()"')
    # The launcher gives the others 5 s after a failure to fail by themselves; rank 1's rendezvous
    # fails ~2.5 s after it joins (DYNAMIX_TIMEOUT=1, one retry).
    proc = bpslaunch("-n", 2, "--timeout", 1, "--restart-on-failure", 1, "--checkpoint", tmp_path / "c.pt",
                     "--grace-period", 20, "--", "sh", "-c", script, timeout=80)
    assert "failed on its own" not in proc.stderr, proc.stderr  # rank 1's traceback may be cut: it is stopped at once
    assert "restart 1 of 1 with 1 workers" in proc.stderr and proc.returncode == 3, proc.stderr


@pytest.mark.timeout(120)
def test_per_worker_batch_bounds_follow_the_job_down_to_fewer_workers(tmp_path):
    # Each run's sampler reads its bounds (DYNAMIX_MIN_BATCH/DYNAMIX_MAX_BATCH) and bps.init its starting
    # sizes (DYNAMIX_BATCH_SIZE), one per worker, whether given as flags or inherited by bpslaunch.
    script = rank0_fails_once_every_worker_started(
        "bps.DynamicBatchSampler(100, 8); print('sampler built with', "
        "*(os.environ[f'DYNAMIX_{v}'] for v in ('BATCH_SIZE', 'MIN_BATCH', 'MAX_BATCH')), flush=True); ")
    proc = bpslaunch("-n", 2, "--max-batch", "40,50", "--restart-on-failure", 1, "--checkpoint", tmp_path / "c.pt",
                     "--grace-period", 2, "--", sys.executable, "-c", script, tmp_path, timeout=110,
                     env=clean_env(DYNAMIX_BATCH_SIZE="8,9", DYNAMIX_MIN_BATCH="2,3"))
    assert "restart 1 of 1 with 1 workers" in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    assert "[0] sampler built with 8,9 2,3 40,50" in proc.stdout, proc.stdout
    assert "[0] sampler built with 8 2 40" in proc.stdout, proc.stdout  # the restarted rank 0 ran too, on its own sizes
    assert proc.returncode == 3, proc.stderr


@pytest.mark.parametrize("hosts, slots, lost, kept_sizes, kept_low, kept_slowdown", [
    ("ab", [2, 1], [3], "1,2,3", "1,1,2", ((1, "2.0"), (2, "3.0"))),
    # Before: the first 3 ranks' settings, so host b's ranks got those of host a's lost rank and each other's.
    ("ab", [1, 2], [1], "1,3,4", "1,2,2", ((1, "3.0"),)),
    ("abc", [2, 0, 1], [3, 4], "1,2,5", "1,1,3", ((1, "2.0"),)),
])
def test_a_restart_across_hosts_keeps_each_host_s_first_ranks_settings_given_or_inherited(
        tmp_path, capsys, hosts, slots, lost, kept_sizes, kept_low, kept_slowdown):
    ranks = 2 * len(hosts)
    config = LaunchConfig(command=("true",), hosts=tuple((host, 2) for host in hosts), node_rank=0,
                          batch_size=",".join(str(rank + 1) for rank in range(ranks)), max_batch="9",
                          slowdown=((1, "2.0"), (2, "3.0")), restart_on_failure=1, checkpoint=tmp_path / "c.pt")
    inherited = {"DYNAMIX_MIN_BATCH": ",".join(str(rank // 2 + 1) for rank in range(ranks))}  # 1,1,2,2,...
    after = _apply_decision(config, inherited, {"slots": slots, "lost": lost, "port": 1}, time.monotonic(), 3)
    assert (after.batch_size, after.min_batch, after.max_batch) == (kept_sizes, kept_low, "9")
    assert after.slowdown == kept_slowdown
    assert f"restart 1 of 1 with {sum(slots)} workers" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_when_every_worker_fails_at_once_the_job_is_not_shrunk(tmp_path):
    # Under load the first failure stops the other workers before they fail by themselves; that a
    # failure came before any worker got through bps.init decides, whatever the order.
    proc = bpslaunch("-n", 3, "--restart-on-failure", 5, "--checkpoint", tmp_path / "c.pt", "--", "sh", "-c", "exit 3",
                     timeout=50)
    assert proc.returncode == 3, proc.stderr
    assert "the job failed before it started" in proc.stderr and "not restarting" in proc.stderr, proc.stderr
    assert "restart 1" not in proc.stderr and not (tmp_path / "c.pt").exists()


@pytest.mark.timeout(240)
def test_workers_that_each_fail_on_a_corrupt_checkpoint_a_moment_apart_end_the_job_without_a_restart(tmp_path):
    # Each worker raises the same ConfigurationError and unwinds it at its own pace; they were
    # SIGTERMed while still unwinding when the first had exited, so the job stepped down 3 -> 2 -> 1.
    out, checkpoint = tmp_path / "out", tmp_path / "c.pt"
    out.mkdir()
    checkpoint.write_bytes(bytes(range(256)) * 8)
    code, output = run_bpslaunch(["-n", 3, "--restart-on-failure", 2, "--checkpoint", checkpoint, "--grace-period", 10,
                                  "--", sys.executable, WORKER, out, SAMPLES], timeout=220, env=clean_env(OMP_NUM_THREADS="1"))
    assert code == 1, output[-3000:]
    assert output.count(f"ConfigurationError: {checkpoint} ") == 3, output[-3000:]
    assert "every worker failed on its own at once (exit codes [0] 1, [1] 1, [2] 1)" in output and "not restarting" in output, output[-3000:]
    assert "restart 1" not in output


@pytest.mark.timeout(240)
def test_a_worker_that_raises_mid_epoch_is_lost_and_the_job_restarts_on_the_others(tmp_path):
    # Rank 1's exception breaks the others' collectives: they raise CommunicationError, so they do
    # not fail on their own even when they exit by themselves.
    out = tmp_path / "out"
    out.mkdir()
    code, output = run_bpslaunch(["-n", 3, "--batch-size", 8, "--restart-on-failure", 1, "--checkpoint", tmp_path / "c.pt",
                                  "--grace-period", 10, "--", sys.executable, WORKER, out, 240, 1, 3],
                                 timeout=220, env=clean_env(OMP_NUM_THREADS="1", ELASTIC_WORKER_RAISE="1"))
    assert code == 0, output[-3000:]
    assert "RuntimeError: rank 1 fails at step 3" in output, output[-3000:]
    assert "restart 1 of 1 with 2 workers" in output and "failed on its own" not in output, output[-3000:]
    runs = read_runs(out)
    assert sorted(runs) == [0, 1] and sorted(runs[1]) == [0, 1]
    assert sorted(trained_indices(runs)) == list(range(240))  # every sample exactly once


@pytest.mark.timeout(90)
def test_a_job_whose_workers_cannot_import_their_module_is_not_restarted_and_names_no_checkpoint(tmp_path):
    proc = bpslaunch("-n", 3, "--restart-on-failure", 2, "--checkpoint", tmp_path / "c.pt", "--", sys.executable, "-c",
                     "import dynamix_byteps_no_such_module", timeout=80)
    assert proc.returncode == 1, proc.stderr
    assert "the job failed before it started" in proc.stderr, proc.stderr
    assert "restart 1" not in proc.stderr and str(tmp_path / "c.pt") not in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where, message", [("a-file/c.pt", "cannot create"), (".", "is a directory")])
def test_a_checkpoint_path_that_cannot_be_written_is_refused_before_start(tmp_path, where, message):
    (tmp_path / "a-file").write_text("")
    proc = bpslaunch("-n", 1, "--restart-on-failure", 1, "--checkpoint", tmp_path / where, "--", "touch",
                     tmp_path / "started", timeout=50)
    assert proc.returncode == 2 and message in proc.stderr and "--checkpoint" in proc.stderr, proc.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.timeout(60)
def test_the_checkpoint_folder_is_created_like_the_log_dir(tmp_path):
    proc = bpslaunch("-n", 1, "--restart-on-failure", 1, "--checkpoint", tmp_path / "run" / "c.pt", "--", "true",
                     timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run").is_dir()


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("DYNAMIX_TEST_MARKER") == marker:
                found.append(process)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.timeout(300)
def test_a_killed_ps_server_restarts_servers_and_workers_from_the_checkpoint_and_leaves_nothing(tmp_path):
    """--engine ps: SIGKILL server1 mid-epoch; the launcher stops the run, starts fresh servers and the same two
    workers, which resume from the checkpoint; every sample is trained once and no process is left."""
    out, marker = tmp_path / "out", f"ps-restart-{os.getpid()}-{time.time_ns()}"
    out.mkdir()
    samples = 240  # 20 steps of the global batch 12
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--engine", "ps", "--num-servers", "2",
         "--batch-size", "6", "--timeout", "30", "--grace-period", "2", "--restart-on-failure", "1",
         "--checkpoint", str(tmp_path / "ckpt.pt"), "--", sys.executable, str(WORKER), str(out), str(samples),
         "-1", "-1", "0.2"],
        env={**os.environ, "DYNAMIX_TEST_MARKER": marker, "OMP_NUM_THREADS": "1"}, start_new_session=True,
        stdout=open(tmp_path / "stdout", "wb"), stderr=open(tmp_path / "stderr", "wb"))
    try:
        deadline = time.monotonic() + 150
        first = out / "rank0.run0.jsonl"
        while not (first.exists() and first.read_text().count('"step"') >= 4):
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.1)
        (server,) = [p for p in _marked(marker) if "dynamix_byteps.engine.ps_server" in p.cmdline()
                     and p.cmdline()[p.cmdline().index("--server-id") + 1] == "1"]
        server.kill()
        code = launcher.wait(timeout=180)
    finally:
        kill_tree(launcher)
    stderr = (tmp_path / "stderr").read_text()
    assert code == 0, stderr[-3000:]
    assert "[server1] was killed by SIGKILL; the workers cannot go on without it" in stderr
    assert "server1 failed with code 137" in stderr and "restart 1 of 1 with 2 workers and fresh servers" in stderr
    runs = read_runs(out)
    assert sorted(runs) == [0, 1] and sorted(runs[1]) == [0, 1]
    resumed = {records[0]["resumed_at"] for records in runs[1].values()}
    assert len(resumed) == 1 and resumed.pop() >= 4  # both resumed from one checkpoint, past the kill's step
    assert sorted(trained_indices(runs)) == list(range(samples))  # every sample exactly once
    assert _marked(marker) == []


def launcher(args: list, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """bpslaunch with ``args`` in the background, its stdout and stderr together in ``log``."""
    with open(log, "wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "dynamix_byteps.launcher", *map(str, args)],
                                stdout=sink, stderr=subprocess.STDOUT, env=env)


def wait_for(text: bytes, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_bytes():
        assert time.monotonic() < deadline, log.read_bytes()
        time.sleep(0.05)


# Rank FAIL exits 3 in the first run (after bps.init, as far as the launcher can tell); the others run on.
FAILS_ONCE = ('r=$((DYNAMIX_RANK_OFFSET + BYTEPS_LOCAL_RANK)); touch "$DYNAMIX_STARTED_DIR/$r"; '
              'if [ $r = $FAIL ] && [ $DYNAMIX_RESTART = 0 ]; then exit 3; fi; exec sleep 20')


@pytest.mark.timeout(90)
def test_a_signal_after_a_worker_failed_stops_the_job_instead_of_restarting_it(tmp_path):
    # Before: the Ctrl-C was taken as the end of the settle; the job restarted on one worker fewer and exited 0.
    log, proc = tmp_path / "launcher.log", None
    try:
        proc = launcher(["-n", 3, "--grace-period", 10, "--restart-on-failure", 2, "--checkpoint", tmp_path / "c.pt",
                         "--", "bash", "-c", FAILS_ONCE], log, clean_env(FAIL="1"))
        wait_for(b"[1] exited with code 3", log)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=40) == 3, log.read_bytes()  # the worker's failure came first
        assert b"stopped by SIGINT; not restarting" in log.read_bytes() and b"restart 1" not in log.read_bytes()
        assert b"received SIGINT; stopping 2 process(es)" in log.read_bytes()  # said at once, not after the grace
    finally:
        kill_tree(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_signal_while_a_host_waits_for_node_0_s_decision_stops_it_cleanly(tmp_path, stop):
    # Before: the launchers' own handlers were gone between runs: node 1, waiting for node 0's decision,
    # died of a KeyboardInterrupt traceback (SIGINT) or without its clean-up (SIGTERM: its run folder stayed).
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = clean_env(FAIL="1", DYNAMIX_TOKEN=secrets.token_hex(8), TMPDIR=str(scratch))
    common = ["--hosts", "127.0.0.1:1,127.0.0.2:1", "--port", free_port(), "--restart-port", free_port(),
              "--restart-on-failure", 1, "--checkpoint", tmp_path / "c.pt", "--grace-period", 2,
              "--policy", "static", "--monitor", "off", "--scheduler-port", free_port()]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = []
    try:
        procs = [launcher([*common, "--node-rank", node, "--", "bash", "-c", FAILS_ONCE], logs[node], env)
                 for node in (0, 1)]
        wait_for(b"[1] exited with code 3", logs[1])
        time.sleep(1)  # node 1 now waits for node 0, whose worker runs on
        procs[1].send_signal(getattr(signal, stop))
        assert procs[1].wait(timeout=20) == 3, logs[1].read_bytes()
        assert b"Traceback" not in logs[1].read_bytes() and b"stopped; not restarting" in logs[1].read_bytes()
        assert procs[0].wait(timeout=60) == 3, logs[0].read_bytes()
        assert b"a launcher was stopped; not restarting" in logs[0].read_bytes()
        assert list(scratch.iterdir()) == []  # the run folders (the scheduler's) are removed
    finally:
        for proc in procs:
            kill_tree(proc)
