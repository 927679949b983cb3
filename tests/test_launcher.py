"""Tests of bpslaunch (dynamix_byteps.launcher) with real processes.

Every test runs the launcher as a subprocess (``python -m dynamix_byteps.launcher``) with
tests/scripts/launcher_worker.py as the worker program, and kills whatever it started in a
``finally``. Liveness is checked with psutil; a zombie counts as dead (this container's PID 1
does not reap orphans).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import clean_env, kill_tree, wait_until
from multiworker import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "scripts" / "launcher_worker.py")
LAUNCH = [sys.executable, "-m", "dynamix_byteps.launcher"]
LINE = re.compile(rb"^\[(\d+)\] (.*)$")


def launcher_env(**extra: str) -> dict[str, str]:
    """:func:`clean_env` without the settings the launcher makes per worker when the user has not."""
    return clean_env(unset=("OMP_NUM_THREADS", "NVIDIA_VISIBLE_DEVICES"), **extra)


def run_launcher(args: list[str], env: dict[str, str] | None = None, timeout: float = 50) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + args, env=env or launcher_env(), capture_output=True, timeout=timeout)


def start_launcher(args: list[str], tmp_path: Path, env: dict[str, str] | None = None,
                   new_session: bool = False) -> subprocess.Popen:
    # Files, not pipes: a test that stops reading must never block the launcher.
    return subprocess.Popen(
        LAUNCH + args,
        env=env or launcher_env(),
        stdout=open(tmp_path / "launcher.out", "wb"),
        stderr=open(tmp_path / "launcher.err", "wb"),
        start_new_session=new_session,
    )


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_pids(directory: Path, count: int, timeout: float = 30.0) -> list[int]:
    """Wait until ``count`` workers wrote ``<rank>.pids``; returns all worker and grandchild pids."""
    assert wait_until(lambda: len(list(directory.glob("*.pids"))) >= count, timeout), (
        f"only {len(list(directory.glob('*.pids')))} of {count} workers started"
    )
    pids: list[int] = []
    for path in sorted(directory.glob("*.pids")):
        pids.extend(int(p) for p in path.read_text().split())
    return pids


def assert_all_gone(pids: list[int]) -> None:
    wait_until(lambda: not any(alive(p) for p in pids), timeout=20)
    survivors = [p for p in pids if alive(p)]
    assert not survivors, f"processes of the job survived: {survivors}"


def kill_all(proc: subprocess.Popen | None, pids: list[int]) -> None:
    """:func:`kill_tree` and the workers' own children listed in ``pids`` (orphans no tree reaches)."""
    kill_tree(proc)
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def prefixed(stream: bytes) -> list[tuple[int, bytes]]:
    lines = []
    for raw in stream.splitlines():
        if raw.startswith(b"bpslaunch: "):
            continue
        match = LINE.match(raw)
        assert match, f"line without a rank prefix: {raw[:120]!r}"
        lines.append((int(match.group(1)), match.group(2)))
    return lines


def env_lines(stdout: bytes) -> dict[int, dict]:
    return {rank: json.loads(body) for rank, body in prefixed(stdout) if body.startswith(b"{")}


# ---- usage errors -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--bogus", "--", "true"], b"unrecognized arguments"),
        (["--num-workers", "0", "--", "true"], b"--num-workers"),
        (["--num-workers", "two", "--", "true"], b"--num-workers"),
        (["--num-workers", "2", "--port", "0", "--", "true"], b"--port"),
        (["--num-workers", "2", "--port", "70000", "--", "true"], b"--port"),
        (["--num-workers", "2", "--timeout", "-1", "--", "true"], b"--timeout"),
        (["--num-workers", "2", "--timeout", "1e10", "--", "true"], b"--timeout"),
        (["--num-workers", "2", "--grace-period", "1e300", "--", "true"], b"--grace-period"),
        (["--num-workers", "4097", "--", "dynamix-no-such-command-xyz"], b"--num-workers"),
        (["--num-workers", "2", "--engine", "mpi", "--", "true"], b"--engine"),
        (["--num-workers", "2", "--slowdown", "1=3@9-3", "--", "true"], b"--slowdown"),
        (["--num-workers", "2", "--slowdown", "1=0.5", "--", "true"], b"--slowdown"),
        (["--num-workers", "2", "--slowdown", "1=2@0-5", "--slowdown", "1=3@3-8", "--", "true"], b"given twice"),
        (["--num-workers", "2", "--"], b"no command"),
        (["--num-workers", "2"], b"no command"),
    ],
)
def test_bad_usage_exits_2_with_message(args, needle):
    result = run_launcher(args)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert b"usage: bpslaunch" in result.stderr


@pytest.mark.timeout(60)
def test_longest_timeout_and_grace_period_are_accepted():
    result = run_launcher(["-n", "1", "--timeout", "604800", "--grace-period", "604800", "--", sys.executable, WORKER, "env"])
    assert result.returncode == 0, result.stderr
    assert float(env_lines(result.stdout)[0]["DYNAMIX_TIMEOUT"]) == 604800.0


@pytest.mark.timeout(60)
def test_unusable_log_file_exits_2_before_any_worker_starts(tmp_path):
    log_dir = tmp_path / "logs"
    (log_dir / "worker-1.log").mkdir(parents=True)
    result = run_launcher(["--num-workers", "2", "--log-dir", str(log_dir), "--", sys.executable, WORKER, "env"])
    assert result.returncode == 2, result.stderr
    assert str(log_dir / "worker-1.log").encode() in result.stderr
    assert b"Traceback" not in result.stderr
    assert result.stdout == b""  # no worker ran


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("byteps") is not None, reason="BytePS is installed")
@pytest.mark.parametrize("env_mode", [False, True], ids=["local", "env"])
def test_byteps_engine_without_byteps_exits_1_before_any_worker_starts(env_mode):
    args = ["--engine", "byteps", "--", sys.executable, WORKER, "env"]
    env = launcher_env(**ENV_WORKER, DMLC_NUM_SERVER="1") if env_mode else launcher_env()
    result = run_launcher(args if env_mode else ["-n", "2"] + args, env=env)
    assert result.returncode == 1, result.stderr
    assert b"CUDA" in result.stderr and b"--engine gloo" in result.stderr
    assert b"Traceback" not in result.stderr
    assert result.stdout == b""  # no worker ran


@pytest.mark.timeout(60)
def test_help_exits_0():
    result = run_launcher(["--help"])
    assert result.returncode == 0
    assert b"--num-workers" in result.stdout and b"DMLC_ROLE" in result.stdout


@pytest.mark.timeout(60)
def test_command_not_found_exits_127():
    result = run_launcher(["--num-workers", "2", "--", "dynamix-no-such-command-xyz"])
    assert result.returncode == 127
    assert b"dynamix-no-such-command-xyz" in result.stderr and b"not found" in result.stderr


# ---- local mode -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_three_workers_get_the_contract_and_prefixed_lines():
    result = run_launcher(
        ["--num-workers", "3", "--batch-size", "32", "--timeout", "45", "--", sys.executable, WORKER, "env", "50"]
    )
    assert result.returncode == 0, result.stderr
    envs = env_lines(result.stdout)
    assert sorted(envs) == [0, 1, 2]
    for rank, env in envs.items():
        assert env["DMLC_ROLE"] == "worker"
        assert env["DMLC_NUM_WORKER"] == "1" and env["DMLC_WORKER_ID"] == "0"
        assert env["BYTEPS_LOCAL_SIZE"] == "3"
        assert env["BYTEPS_LOCAL_RANK"] == str(rank)
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert env["DYNAMIX_ENGINE"] == "gloo"
        assert env["DYNAMIX_BATCH_SIZE"] == "32"
        assert float(env["DYNAMIX_TIMEOUT"]) == 45.0
        assert env["DYNAMIX_LOG_DIR"] is None
        assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    ports = {env["DMLC_PS_ROOT_PORT"] for env in envs.values()}
    assert len(ports) == 1 and 1 <= int(ports.pop()) <= 65535
    # Every line, on both streams, is whole and carries the rank of the worker that wrote it.
    for stream, tag in ((result.stdout, b"out"), (result.stderr, b"err")):
        lines = [(rank, body) for rank, body in prefixed(stream) if not body.startswith(b"{")]
        assert len(lines) == 3 * 50
        for rank, body in lines:
            word, who, _, filler = body.split(b" ")
            assert word == tag and int(who) == rank and len(filler) == 300
    assert b"OMP_NUM_THREADS" in result.stderr  # the one note


@pytest.mark.timeout(60)
def test_user_omp_num_threads_and_port_are_kept(tmp_path):
    port = free_port()
    env = launcher_env(OMP_NUM_THREADS="2")
    result = run_launcher(["--num-workers", "2", "--port", str(port), "--", sys.executable, WORKER, "env"], env=env)
    assert result.returncode == 0, result.stderr
    envs = env_lines(result.stdout)
    assert {e["OMP_NUM_THREADS"] for e in envs.values()} == {"2"}
    assert {e["DMLC_PS_ROOT_PORT"] for e in envs.values()} == {str(port)}
    assert b"OMP_NUM_THREADS" not in result.stderr


@pytest.mark.timeout(60)
def test_log_dir_gets_one_raw_log_per_worker(tmp_path):
    log_dir = tmp_path / "logs" / "run1"
    result = run_launcher(["--num-workers", "2", "--log-dir", str(log_dir), "--", sys.executable, WORKER, "env", "3"])
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in log_dir.iterdir()) == ["worker-0.log", "worker-1.log"]
    for rank in (0, 1):
        lines = (log_dir / f"worker-{rank}.log").read_bytes().splitlines()
        assert not any(line.startswith(b"[") for line in lines)  # raw, no prefix
        # stdout and stderr are read by separate threads: lines keep their order per stream only
        (env_line,) = [line for line in lines if line.startswith(b"{")]
        assert json.loads(env_line)["DYNAMIX_LOG_DIR"] == str(log_dir)
        assert sum(line.startswith(b"out %d " % rank) for line in lines) == 3
        assert sum(line.startswith(b"err %d " % rank) for line in lines) == 3


@pytest.mark.timeout(60)
def test_failing_worker_sets_exit_code_and_nothing_survives(tmp_path):
    proc, pids = None, []
    try:
        proc = start_launcher(
            ["--num-workers", "3", "--grace-period", "2", "--", sys.executable, WORKER, "job", str(tmp_path), "1", "3"],
            tmp_path,
        )
        pids = read_pids(tmp_path, 3)
        assert proc.wait(timeout=40) == 3
        assert_all_gone(pids)
        assert b"exited with code 3" in (tmp_path / "launcher.err").read_bytes()
    finally:
        kill_all(proc, pids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_stops_the_whole_job(tmp_path, sig, code):
    proc, pids = None, []
    try:
        proc = start_launcher(
            ["--num-workers", "2", "--grace-period", "3", "--", sys.executable, WORKER, "job", str(tmp_path)], tmp_path
        )
        pids = read_pids(tmp_path, 2)
        proc.send_signal(sig)
        assert proc.wait(timeout=40) == code
        assert_all_gone(pids)
    finally:
        kill_all(proc, pids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", [[], ["--policy", "static", "--monitor", "off"]], ids=["no-policy", "scheduler"])
@pytest.mark.parametrize("kill", ["launcher", "its-process-group"])
def test_sigkilled_launcher_leaves_no_orphans_and_no_temporary_directory(tmp_path, policy, kill):
    proc, pids = None, []
    scratch = tmp_path / "tmp"  # the launcher's TMPDIR, so only its own directories are seen here
    scratch.mkdir()
    try:
        proc = start_launcher(["--num-workers", "2", "--grace-period", "2", *policy, "--", sys.executable, WORKER, "job",
                               str(tmp_path)], tmp_path, env=launcher_env(TMPDIR=str(scratch)), new_session=True)
        pids = read_pids(tmp_path, 2)
        expected = {"dynamix-started-", "dynamix-run-"} if policy else {"dynamix-started-"}
        assert {p.name[:p.name.index("-", len("dynamix-")) + 1] for p in scratch.iterdir()} == expected
        if kill == "launcher":
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=20)
        else:  # as the tests' own clean-up does with a job past its limit
            kill_tree(proc)
        # Workers die by PR_SET_PDEATHSIG; their `sleep` grandchildren, and the launcher's
        # temporary directories, by the guardian.
        assert_all_gone(pids)
        assert wait_until(lambda: not any(scratch.iterdir()), timeout=20), list(scratch.iterdir())
    finally:
        kill_all(proc, pids)


@pytest.mark.timeout(60)
def test_daemon_holding_the_pipes_delays_exit_by_one_grace_period_only(tmp_path):
    pids = []
    try:
        start = time.monotonic()
        # Before: each of the 8 output threads was joined with its own timeout, 8 × 4 s = 32 s
        # here; one shared deadline is 4 s. The bound sits between the two with room for a
        # loaded machine's start-up, so it tells the behaviours apart without timing anything tight.
        result = run_launcher(["--num-workers", "4", "--grace-period", "4", "--", sys.executable, WORKER, "daemon", str(tmp_path)])
        elapsed = time.monotonic() - start
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pids")]
        assert result.returncode == 0, result.stderr
        assert len(pids) == 4
        assert elapsed < 20, f"bpslaunch took {elapsed:.1f} s to exit: one grace period per pipe?"
    finally:
        kill_all(None, pids)


# ---- processes a worker starts in a session of their own ---------------------------------------

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher adopts orphans on Linux only")
PIDS_LINE = re.compile(rb"^\[\d+\] pids ([\d ]+)\n", re.MULTILINE)


def marked(marker: str) -> list[psutil.Process]:
    """The processes with ``marker`` in their arguments (a zombie has no arguments left)."""
    return [p for p in psutil.process_iter(["cmdline"]) if any(marker in arg for arg in p.info["cmdline"] or ())]


def kill_marked(marker: str) -> None:
    for process in marked(marker):
        with contextlib.suppress(psutil.Error):
            process.kill()


@pytest.fixture
def marker() -> Iterator[str]:
    """Digits no other process has in its arguments: this test's sleeps run ``sleep 3xx.<marker>``.
    What still carries them after the test (its own ``finally`` has killed the launcher) is killed."""
    value = f"{os.getpid()}{secrets.randbelow(10**9):09d}"
    yield value
    kill_marked(value)


def left_behind(pids: list[int], marker: str) -> list[int]:
    """The processes still running with ``marker``, and those of ``pids`` left unreaped (zombies:
    this container's PID 1 does not reap what the launcher leaves it)."""
    left = {p.pid for p in marked(marker)}
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                left.add(pid)
    return sorted(left)


def run_script(script: str, *args: str, timeout: float, cwd: Path | None = None) -> tuple[int, bytes, bytes]:
    """Run Python ``script`` with ``args`` in the launcher's environment; its exit code, stdout and
    stderr. Whatever happens, what it started is killed and it is reaped (:func:`kill_tree`)."""
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], env=launcher_env(), cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        kill_tree(proc)


def printed_pids(stdout: bytes) -> list[int]:
    """The pids of every complete ``[rank] pids A B C`` line."""
    return [int(pid) for line in PIDS_LINE.findall(stdout) for pid in line.split()]


def once_sleeping(pid: str) -> str:
    """Shell that waits until process ``pid`` runs `sleep`: a ``trap "" TERM`` it set before its
    ``exec sleep`` is then in force (a SIGTERM that came earlier would end it, and the test)."""
    return f'until [ "$(cat /proc/{pid}/comm 2>/dev/null)" = sleep ]; do sleep 0.01; done; '


def sigterm_proof_orphan(sleep: str) -> str:
    """Shell that starts ``sleep SLEEP`` in a session of its own, ignoring SIGTERM, waits until it runs and
    prints ``pids PID``."""
    return (f"setsid bash -c 'trap \"\" TERM; exec sleep {sleep}' & p=$!; "
            f"{once_sleeping('$p')}echo pids $p; ")


def orphaning_worker(marker: str, then: str) -> list[str]:
    """A worker that starts `sleep`s with ``marker`` (in its group, in a session of its own, in its
    group ignoring SIGTERM, in a session of its own ignoring SIGTERM), prints their pids, then runs
    the shell command ``then``."""
    return ["bash", "-c", f'sleep 311.{marker} & a=$!; setsid sleep 312.{marker} & b=$!; '
                          f'(trap "" TERM; exec sleep 313.{marker}) & c=$!; '
                          f'setsid bash -c \'trap "" TERM; exec sleep 314.{marker}\' & d=$!; '
                          f'echo "pids $a $b $c $d"; {then}']


@linux_only
@pytest.mark.timeout(90)
@pytest.mark.parametrize("end", ["workers-exit-0", "sigterm-to-bpslaunch"])
def test_what_a_worker_starts_in_a_session_of_its_own_ends_with_the_job(tmp_path, end, marker):
    proc = None
    out = tmp_path / "launcher.out"
    try:
        proc = start_launcher(["-n", "2", "--grace-period", "2", "--",
                               *orphaning_worker(marker, "exit 0" if end == "workers-exit-0" else "wait")], tmp_path)
        assert wait_until(lambda: len(printed_pids(out.read_bytes())) == 8), out.read_bytes()
        if end == "sigterm-to-bpslaunch":
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == (0 if end == "workers-exit-0" else 143), (tmp_path / "launcher.err").read_bytes()
        assert left_behind(printed_pids(out.read_bytes()), marker) == []
    finally:
        kill_tree(proc)


@linux_only
@pytest.mark.timeout(60)
def test_a_failing_worker_s_start_new_session_child_ends_with_the_job(tmp_path, marker):
    proc = None
    try:
        proc = start_launcher(["-n", "2", "--grace-period", "2", "--", sys.executable, WORKER, "daemon", str(tmp_path),
                               f"300.{marker}", "3"], tmp_path)
        assert proc.wait(timeout=40) == 3, (tmp_path / "launcher.err").read_bytes()
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pids")]
        assert len(pids) == 2
        assert left_behind(pids, marker) == []
    finally:
        kill_tree(proc)


def restarting_worker(marker: str, folder: Path) -> list[str]:
    """On the first run, each worker starts a `sleep` in a session of its own and records its pid in
    ``folder``; rank 1 then fails, rank 0 waits to be stopped. On the restart, the worker prints
    which of those sleeps still run, then ``checked``."""
    return ["bash", "-c", f"""
rank=$((DYNAMIX_RANK_OFFSET + BYTEPS_LOCAL_RANK))
if [ "$DYNAMIX_RESTART" = 0 ]; then
    setsid sleep 312.{marker} & echo "pids $!"; echo $! > {folder}/orphan-$rank.pid
    touch "$DYNAMIX_STARTED_DIR/$rank"
    if [ $rank = 1 ]; then exit 1; fi
    wait
else
    for pid in $(cat {folder}/orphan-*.pid); do kill -0 $pid 2>/dev/null && echo "run 0's $pid still runs"; done
    echo checked
fi"""]


@linux_only
@pytest.mark.timeout(90)
def test_a_run_s_orphans_are_gone_before_the_restart(tmp_path, marker):
    proc = None
    try:
        proc = start_launcher(["-n", "2", "--grace-period", "2", "--restart-on-failure", "1", "--checkpoint",
                               str(tmp_path / "ckpt.pt"), "--", *restarting_worker(marker, tmp_path)], tmp_path)
        assert proc.wait(timeout=60) == 0, (tmp_path / "launcher.err").read_bytes()
        out = (tmp_path / "launcher.out").read_bytes()
        assert b"[0] checked" in out and b"still runs" not in out, out
        assert left_behind(printed_pids(out), marker) == []
    finally:
        kill_tree(proc)


EMBEDDED = """
import ctypes, os, subprocess, sys
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
marker = sys.argv[1]
own = subprocess.Popen(["sleep", f"301.{marker}"])  # the embedding program's own child
worker = ChildSpec("0", ["bash", "-c", f"setsid sleep 302.{marker} & echo pids $!"], dict(os.environ))
code = Supervisor([worker], grace_s=2).run()
subreaper = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(37, ctypes.byref(subreaper), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
print(f"code {code}, own child running {own.poll() is None}, subreaper {subreaper.value}", flush=True)
own.kill()
own.wait()
"""


@linux_only
@pytest.mark.timeout(60)
def test_an_embedded_supervisor_stops_the_job_s_orphans_only_and_clears_the_subreaper_flag(marker):
    code, out, err = run_script(EMBEDDED, marker, timeout=40)
    assert code == 0, err
    assert b"code 0, own child running True, subreaper 0" in out, out + err
    assert left_behind(printed_pids(out), marker) == []


def zombie_making_worker(code: int) -> list[str]:
    """A worker that orphans 50 short `sleep`s (the ``( cmd & )`` idiom), waits up to 15 s for its
    launcher ($PPID) to have no zombie child left, prints ``zombies N``, then exits ``code``."""
    return ["bash", "-c", "for i in $(seq 50); do ( sleep 0.01 & ); done; "
                          "for i in $(seq 300); do z=$(ps -o stat= --ppid $PPID | grep -c Z); "
                          '[ "$z" = 0 ] && break; sleep 0.05; done; '
                          f'echo "zombies $z"; exit {code}']


@linux_only
@pytest.mark.timeout(60)
def test_orphans_that_exit_while_the_job_runs_are_reaped_at_once(tmp_path):
    # Before: they stayed the launcher's zombies until the job ended (50 of them here).
    proc = None
    try:
        proc = start_launcher(["-n", "1", "--grace-period", "2", "--", *zombie_making_worker(5)], tmp_path)
        assert proc.wait(timeout=40) == 5, (tmp_path / "launcher.err").read_bytes()  # the worker's own code
        assert b"[0] zombies 0\n" in (tmp_path / "launcher.out").read_bytes(), (tmp_path / "launcher.out").read_bytes()
    finally:
        kill_tree(proc)


EMBEDDED_WITH_A_DAEMON = """
import os, subprocess, sys
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
marker, folder = sys.argv[1], sys.argv[2]
# The program's own helper, started before run(): once the job runs, it detaches a daemon and exits.
helper = subprocess.Popen(["bash", "-c", f"until [ -e {folder}/go ]; do sleep 0.05; done; "
                           f"setsid sleep 303.{marker} & echo $! > {folder}/d.tmp; mv {folder}/d.tmp {folder}/daemon"])
# The worker orphans a sleep of its own, then waits until the program has adopted the helper's daemon.
worker = ChildSpec("0", ["bash", "-c", f"setsid sleep 302.{marker} & echo pids $!; touch {folder}/go; "
                         f"until [ -e {folder}/daemon ]; do sleep 0.05; done; d=$(cat {folder}/daemon); "
                         'until [ "$(cut -d" " -f4 /proc/$d/stat)" = "$PPID" ]; do sleep 0.05; done'], dict(os.environ))
code = Supervisor([worker], grace_s=2).run()
daemon = int(open(f"{folder}/daemon").read())
state = open(f"/proc/{daemon}/stat").read().rsplit(") ", 1)[1].split()[0] if os.path.exists(f"/proc/{daemon}") else "gone"
print(f"code {code}, helper {helper.wait()}, daemon running {state in ('R', 'S')}", flush=True)
if state != "gone":
    os.kill(daemon, 9)
    os.waitpid(daemon, 0)
"""


@linux_only
@pytest.mark.timeout(60)
def test_an_embedded_supervisor_leaves_the_daemons_of_the_program_s_own_children_running(tmp_path, marker):
    # Before: the program adopted its helper's daemon during the job and stopped it as the job's orphan.
    code, out, err = run_script(EMBEDDED_WITH_A_DAEMON, marker, str(tmp_path), timeout=40)
    assert code == 0, err
    assert b"code 0, helper 0, daemon running True" in out, out + err
    assert left_behind(printed_pids(out), marker) == []


@linux_only
@pytest.mark.timeout(90)
def test_waiting_for_an_orphan_that_ignores_sigterm_is_announced_and_a_signal_ends_it(tmp_path, marker):
    # Before: bpslaunch waited out the whole grace period silently, and signals changed nothing.
    proc = None
    err = tmp_path / "launcher.err"
    try:
        proc = start_launcher(["-n", "1", "--grace-period", "120", "--", "bash", "-c",
                               f"{sigterm_proof_orphan(f'315.{marker}')}exit 0"],
                              tmp_path)
        assert wait_until(lambda: b"waiting up to" in err.read_bytes(), timeout=30), err.read_bytes()
        pid = printed_pids((tmp_path / "launcher.out").read_bytes())[0]
        note = next(line for line in err.read_bytes().splitlines() if b"waiting up to" in line)
        assert f"{pid} sleep 315.{marker}".encode() in note and b"SIGKILL" in note, note
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)  # well within the grace period of 120 s
        assert left_behind([pid], marker) == []
    finally:
        kill_tree(proc)


@pytest.mark.timeout(90)
def test_a_signal_ends_the_wait_for_a_worker_s_group_that_ignores_sigterm(tmp_path, marker):
    # Before: once the workers had exited, a child left in a worker's group that ignores SIGTERM got
    # the whole grace period, and signals to bpslaunch changed nothing.
    proc, pid = None, None
    try:
        proc = start_launcher(["-n", "1", "--grace-period", "120", "--", "bash", "-c",
                               f"(trap '' TERM; exec sleep 317.{marker}) & p=$!; {once_sleeping('$p')}"
                               "echo pids $p; echo worker $$; exit 0"],
                              tmp_path)
        out = tmp_path / "launcher.out"
        assert wait_until(lambda: b"[0] worker " in out.read_bytes()), "the worker never started"
        pid = printed_pids(out.read_bytes())[0]
        worker = int(re.search(rb"\[0\] worker (\d+)", out.read_bytes()).group(1))
        assert wait_until(lambda: not psutil.pid_exists(worker))  # reaped: the launcher now cleans up
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)  # well within the grace period of 120 s
        assert left_behind([pid], marker) == []
    finally:
        kill_tree(proc)


SIGNAL_AS_THE_JOB_ENDS = """
import os, signal, sys, time
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
marker = sys.argv[1]
count_live = Supervisor._count_live
def count_live_then_ctrl_c(self):
    live = count_live(self)
    if live == 0 and not getattr(self, "interrupted", False):  # the launcher has just seen the job end
        self.interrupted = True
        os.kill(os.getpid(), signal.SIGINT)
    return live
Supervisor._count_live = count_live_then_ctrl_c
worker = ChildSpec("0", ["bash", "-c", f"(trap '' TERM; exec sleep 318.{marker}) & p=$!; "
                         f"until [ $(cat /proc/$p/comm) = sleep ]; do sleep 0.01; done; echo pids $p; exit 0"],
                   dict(os.environ))
start = time.monotonic()
code = Supervisor([worker], grace_s=60).run()
print(f"code {code} after {time.monotonic() - start:.0f} s", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_signal_that_comes_as_the_launcher_sees_the_job_end_still_ends_the_clean_up_s_wait(marker):
    # Before: the clean-up counted signals from its own start, so Ctrl-C in the moment between the
    # last worker's exit and that start was lost and the group's SIGTERM-proof child got the whole
    # grace period (a CI run: the launcher ignored SIGINT for over 30 s).
    code, out, err = run_script(SIGNAL_AS_THE_JOB_ENDS, marker, timeout=50)
    assert code == 0, err
    assert re.search(rb"code 0 after ([0-9]|1[0-9]) s", out), out + err  # well within the 60 s grace period
    assert left_behind(printed_pids(out), marker) == []


SIGNAL_AS_A_WORKER_FAILS = """
import os, signal, sys, time
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
fail = Supervisor._fail
def fail_then_ctrl_c(self, *args, **kwargs):
    code = fail(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)  # one Ctrl-C, the moment the launcher sees the failure
    return code
Supervisor._fail = fail_then_ctrl_c
graceful = "trap 'sleep 1; echo clean exit; exit 0' TERM; touch ready; sleep 30 & wait"
specs = [ChildSpec("0", ["bash", "-c", graceful], dict(os.environ)),
         ChildSpec("1", ["bash", "-c", "until [ -e ready ]; do sleep 0.05; done; exit 3"], dict(os.environ))]
code = Supervisor(specs, grace_s=20).run()
print(f"code {code}", flush=True)
"""


@pytest.mark.timeout(90)
def test_one_signal_as_a_worker_fails_gives_the_others_the_grace_period(tmp_path):
    # Before (a breaker, on the first version of the signal count): the signal was answered as it came
    # (SIGTERM) and again on the next pass (SIGKILL): the worker that needs 1 s after SIGTERM was killed.
    _, out, err = run_script(SIGNAL_AS_A_WORKER_FAILS, timeout=60, cwd=tmp_path)
    assert b"[0] clean exit" in out and b"code 3" in out, out + err


@linux_only
@pytest.mark.timeout(90)
def test_a_second_signal_ends_the_wait_for_orphans_in_a_session_of_their_own_too(tmp_path, marker):
    # Before: the second Ctrl-C SIGKILLed the workers' groups, then their setsid orphans got SIGTERM and a
    # whole new grace period (60 s here): a third Ctrl-C was needed.
    proc = None
    err = tmp_path / "launcher.err"
    try:
        proc = start_launcher(["-n", "1", "--grace-period", "60", "--", "bash", "-c",
                               f"trap '' TERM INT; {sigterm_proof_orphan(f'319.{marker}')}sleep 300 & wait"],
                              tmp_path)
        assert wait_until(lambda: printed_pids((tmp_path / "launcher.out").read_bytes())), err.read_bytes()
        pid = printed_pids((tmp_path / "launcher.out").read_bytes())[0]
        proc.send_signal(signal.SIGINT)
        assert wait_until(lambda: b"received SIGINT" in err.read_bytes()), err.read_bytes()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130, err.read_bytes()  # well within the grace period of 60 s
        assert left_behind([pid], marker) == []
    finally:
        kill_tree(proc)


SIGNAL_WHILE_A_SERVICE_STOPS = """
import os, signal, sys, time
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
service = ChildSpec("scheduler", ["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"], dict(os.environ),
                    service=True)
worker = ChildSpec("0", ["bash", "-c", "exit 0"], dict(os.environ))
supervisor = Supervisor([service, worker], grace_s=60)
signal_live = Supervisor._signal_live
def ctrl_c_once_the_service_got_sigterm(self, sig):
    signal_live(self, sig)
    if sig == signal.SIGTERM:
        os.kill(os.getpid(), signal.SIGINT)
Supervisor._signal_live = ctrl_c_once_the_service_got_sigterm
start = time.monotonic()
code = supervisor.run()
print(f"code {code} after {time.monotonic() - start:.0f} s", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_signal_while_the_services_stop_after_the_workers_succeeded_kills_them_now_and_keeps_code_0():
    # Before: it was taken for a first signal: forwarded, a new grace period (60 s here), exit 130.
    _, out, err = run_script(SIGNAL_WHILE_A_SERVICE_STOPS, timeout=80)
    assert re.search(rb"code 0 after ([0-9]|1[0-9]) s", out), out + err


ORPHAN_SEEN_MID_EXEC = """
import os, sys
from dynamix_byteps.launcher import _subreaper
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
marker = sys.argv[1]
carries_mark, asked = _subreaper.carries_mark, set()
def mid_exec_at_first(pid, mark):  # the kernel shows no environment while a process execs
    if pid not in asked:
        asked.add(pid)
        return None
    return carries_mark(pid, mark)
_subreaper.carries_mark = mid_exec_at_first
worker = ChildSpec("0", ["bash", "-c", f"setsid sleep 304.{marker} & echo pids $!"], dict(os.environ))
print(f"code {Supervisor([worker], grace_s=2).run()}", flush=True)
"""


@linux_only
@pytest.mark.timeout(60)
def test_an_orphan_whose_environment_reads_empty_at_first_is_still_the_job_s(marker):
    # Before: an orphan caught in the middle of an exec (setsid, then sleep), whose /proc/PID/environ reads
    # empty then, was taken for another program's process for good and outlived the job (a fresh-clone run).
    _, out, err = run_script(ORPHAN_SEEN_MID_EXEC, marker, timeout=40)
    assert b"code 0" in out, out + err
    assert left_behind(printed_pids(out), marker) == []


ORPHAN_SEEN_EXITING = """
import os, subprocess, sys, time
from dynamix_byteps.launcher import _subreaper
mark = _subreaper.new_mark()
reaped, waited = _subreaper._reaped, set()
def exiting_at_first(pid):  # SIGKILLed, not a zombie yet when waited for, memory gone when its environ is read
    if pid not in waited:
        waited.add(pid)
        return False
    return reaped(pid)
_subreaper._reaped = exiting_at_first
with _subreaper.adopting():
    orphan = subprocess.Popen(["sleep", f"320.{sys.argv[1]}"], env={**os.environ, _subreaper.MARK_ENV: mark})
    orphan.kill()
    while open(f"/proc/{orphan.pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.01)
    _subreaper.stop_adopted((), mark, 60, 0.05, print, lambda: True)
    try:
        print("zombie left" if os.waitpid(orphan.pid, os.WNOHANG)[0] == orphan.pid else "still runs", flush=True)
    except ChildProcessError:
        print("reaped", flush=True)
"""


@linux_only
@pytest.mark.timeout(60)
def test_an_orphan_seen_while_it_exits_is_reaped(marker):
    # Before (a CI run): an orphan SIGKILLed by the clean-up and seen between its exit and its becoming a
    # zombie, whose /proc/PID/environ then answers ESRCH (Linux 6.x), was taken for another program's
    # process: the clean-up ended without reaping it, and it stayed a zombie under PID 1.
    code, out, err = run_script(ORPHAN_SEEN_EXITING, marker, timeout=40)
    assert code == 0, err
    assert out.strip().endswith(b"reaped"), out + err


UNKILLABLE_ORPHAN = """
import os, subprocess, sys
from dynamix_byteps.launcher import _subreaper
_subreaper.AFTER_KILL_S = 0.5
_subreaper._signal = lambda pid, sig: None  # stands in for a process no signal ends (uninterruptible sleep)
mark = _subreaper.new_mark()
with _subreaper.adopting():
    stuck = subprocess.Popen(["sleep", f"316.{sys.argv[1]}"], env={**os.environ, _subreaper.MARK_ENV: mark})
    notes = []
    _subreaper.stop_adopted((), mark, 0.5, 0.05, notes.append, lambda: False)
print(f"stuck {stuck.pid}: {notes}", flush=True)
stuck.kill()
stuck.wait()
"""


@linux_only
@pytest.mark.timeout(60)
def test_an_orphan_that_survives_sigkill_is_named_and_given_up_on(tmp_path, marker):
    # Before: the clean-up loop waited for it forever.
    code, out, err = run_script(UNKILLABLE_ORPHAN, marker, timeout=30)
    assert code == 0, err
    pid = re.search(rb"stuck (\d+):", out).group(1)
    assert b"still run 0.5 s after SIGKILL" in out and pid + b" sleep 316." in out, out


TRACER = """
import ctypes, os, sys, time
# PTRACE_SEIZE: the worker runs on, traced; its exit is reported to this process alone, which never waits.
if ctypes.CDLL(None, use_errno=True).ptrace(0x4206, int(sys.argv[1]), None, None) != 0:
    print("refused:", os.strerror(ctypes.get_errno()), flush=True)
    sys.exit(1)
print("seized", flush=True)
time.sleep(120)
"""


@linux_only
@pytest.mark.timeout(60)
def test_a_worker_whose_exit_is_not_seen_after_sigkill_is_named_and_the_job_s_code_returned(tmp_path):
    # Before: bpslaunch waited for it forever. A worker in uninterruptible sleep (a dead NFS mount)
    # cannot be made here without root; a worker traced by a debugger that does not reap it is what
    # bpslaunch sees the same way, with real processes and nothing patched: SIGKILL ends it, but the
    # kernel reports a traced process's exit to its tracer only, so bpslaunch's waitpid never does.
    proc = tracer = None
    err = tmp_path / "launcher.err"
    try:
        proc = start_launcher(["-n", "2", "--grace-period", "1", "--", sys.executable, WORKER, "traced", str(tmp_path),
                               "3"], tmp_path)
        assert wait_until(lambda: (tmp_path / "0.pid").exists()), err.read_bytes()
        worker = int((tmp_path / "0.pid").read_text())
        tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(worker)], stdout=subprocess.PIPE, text=True)
        answer = tracer.stdout.readline()
        if answer != "seized\n":
            pytest.skip(f"this system does not let a test trace a process: {answer.strip()}")
        (tmp_path / "traced").touch()  # rank 1 now fails; rank 0 gets SIGTERM, then SIGKILL
        assert proc.wait(timeout=40) == 3, err.read_bytes()
        note = next((line for line in err.read_bytes().splitlines() if b"after SIGKILL" in line), err.read_bytes())
        assert f"[0] {worker} {sys.executable[:40]}".encode() in note, note
    finally:
        kill_tree(proc)
        kill_tree(tracer)


SPAWN_FAILS_BESIDE_A_TRACED_WORKER = """
import os, sys
from pathlib import Path
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
worker, folder = sys.argv[1], Path(sys.argv[2])
env = {**os.environ, "DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_SIZE": "1", "BYTEPS_LOCAL_RANK": "0"}
traced = ChildSpec("0", [sys.executable, worker, "traced", str(folder), "0"], env, ready_file=folder / "traced")
missing = ChildSpec("1", [str(folder / "no-such-command")], env)
print("code", Supervisor([traced, missing], grace_s=1).run(), flush=True)
"""


@linux_only
@pytest.mark.timeout(60)
def test_a_child_whose_exit_is_not_seen_when_the_start_fails_is_named_and_the_code_returned(tmp_path):
    # Before: the clean-up after a failed start waited for it forever (see the test above for why
    # a traced worker).
    proc = tracer = None
    try:
        proc = subprocess.Popen([sys.executable, "-c", SPAWN_FAILS_BESIDE_A_TRACED_WORKER, WORKER, str(tmp_path)],
                                env=launcher_env(), stdout=open(tmp_path / "out", "wb"), stderr=open(tmp_path / "err", "wb"))
        assert wait_until(lambda: (tmp_path / "0.pid").exists()), (tmp_path / "err").read_bytes()
        worker = int((tmp_path / "0.pid").read_text())
        tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(worker)], stdout=subprocess.PIPE, text=True)
        answer = tracer.stdout.readline()
        if answer != "seized\n":
            pytest.skip(f"this system does not let a test trace a process: {answer.strip()}")
        (tmp_path / "traced").touch()  # the ready file: the missing command is started next
        assert proc.wait(timeout=40) == 0, (tmp_path / "err").read_bytes()
        err = (tmp_path / "err").read_bytes()
        assert (tmp_path / "out").read_bytes() == b"code 127\n", err
        assert b"still run 5 s after SIGKILL" in err and f"[0] {worker} ".encode() in err, err
    finally:
        kill_tree(proc)
        kill_tree(tracer)


@pytest.mark.timeout(60)
def test_carriage_returns_and_long_lines_are_forwarded_in_bounded_pieces(tmp_path):
    proc = None
    try:
        log_dir = tmp_path / "logs"
        proc = start_launcher(["-n", "1", "--log-dir", str(log_dir), "--", sys.executable, WORKER, "output", str(tmp_path)], tmp_path)
        # A progress bar shows before any newline is written.
        assert wait_until(lambda: b"[0] step 1\r" in (tmp_path / "launcher.out").read_bytes(), timeout=15)
        (tmp_path / "go").touch()
        assert proc.wait(timeout=40) == 0
    finally:
        kill_all(proc, [])
    out = (tmp_path / "launcher.out").read_bytes()
    assert out.startswith(b"[0] step 1\r[0] step 2\r[0] step 3\r\n[0] zzz")
    assert out.endswith(b"\n[0] last\n")
    pieces = out.split(b"[0] ")
    assert max(map(len, pieces)) <= 64 * 1024 + 1  # a piece, plus the newline that ends a cut one
    assert b"".join(p.rstrip(b"\n") for p in pieces[4:-1]) == b"z" * (1 << 20)
    # The log is the raw output, byte for byte.
    assert (log_dir / "worker-0.log").read_bytes() == b"step 1\rstep 2\rstep 3\r\n" + b"z" * (1 << 20) + b"\nlast"


# ---- BytePS environment mode ---------------------------------------------------------------------

ENV_WORKER = dict(
    DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_WORKER_ID="1",
    DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="29517",
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("missing", ["DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_WORKER_ID", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"])
def test_env_mode_missing_variable_exits_2_naming_it(missing):
    env = launcher_env(**{k: v for k, v in ENV_WORKER.items() if k != missing})
    result = run_launcher(["--", sys.executable, WORKER, "env"], env=env)
    assert result.returncode == 2, result.stderr
    assert missing.encode() in result.stderr
    assert b"not set" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name, value", [("DMLC_ROLE", "boss"), ("DMLC_WORKER_ID", "2"), ("DMLC_PS_ROOT_PORT", "http"), ("BYTEPS_LOCAL_SIZE", "0")]
)
def test_env_mode_invalid_variable_exits_2_naming_it(name, value):
    result = run_launcher(["--", sys.executable, WORKER, "env"], env=launcher_env(**dict(ENV_WORKER, **{name: value})))
    assert result.returncode == 2, result.stderr
    assert f"{name}=".encode() in result.stderr


@pytest.mark.timeout(60)
def test_env_mode_local_size_is_capped():
    env = launcher_env(**ENV_WORKER, BYTEPS_LOCAL_SIZE="4097")
    result = run_launcher(["--", "dynamix-no-such-command-xyz"], env=env)
    assert result.returncode == 2, result.stderr
    assert b"BYTEPS_LOCAL_SIZE=4097" in result.stderr


@pytest.mark.timeout(60)
def test_env_mode_starts_byteps_local_size_workers():
    env = launcher_env(**ENV_WORKER, BYTEPS_LOCAL_SIZE="2")
    result = run_launcher([sys.executable, WORKER, "env"], env=env)  # BytePS style: no '--'
    assert result.returncode == 0, result.stderr
    envs = env_lines(result.stdout)
    assert sorted(envs) == [2, 3]  # global rank = worker_id * local_size + local_rank
    for rank, e in envs.items():
        assert (e["DMLC_NUM_WORKER"], e["DMLC_WORKER_ID"], e["BYTEPS_LOCAL_SIZE"]) == ("2", "1", "2")
        assert e["BYTEPS_LOCAL_RANK"] == str(rank - 2)
        assert (e["DMLC_PS_ROOT_URI"], e["DMLC_PS_ROOT_PORT"]) == ("127.0.0.1", "29517")


@pytest.mark.timeout(60)
def test_env_mode_local_size_defaults_to_visible_gpus():
    env = launcher_env(**ENV_WORKER, NVIDIA_VISIBLE_DEVICES="0,1,3")
    result = run_launcher(["--", sys.executable, WORKER, "env"], env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(env_lines(result.stdout)) == [3, 4, 5]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_env_mode_scheduler_and_server_with_gloo_exit_0(role):
    result = run_launcher([], env=launcher_env(DMLC_ROLE=role))
    assert result.returncode == 0, result.stderr
    assert b"gloo" in result.stderr and b"nothing to start" in result.stderr


@pytest.mark.parametrize("gpus, expected", [(0, "gloo"), (2, "gloo"), (3, "nccl")])
def test_engine_auto_is_resolved_once_and_passed_on(monkeypatch, gpus, expected):
    """``--engine auto`` (or DYNAMIX_ENGINE=auto) becomes nccl only when each of this host's 3 workers gets a GPU."""
    import torch
    import torch.distributed as dist

    from dynamix_byteps.launcher.cli import parse_args
    from dynamix_byteps.launcher.specs import env_mode, local_mode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    local = local_mode(parse_args(["-n", "3", "--engine", "auto", "--", "true"]), {}, [])
    environment = env_mode(parse_args(["--", "true"]),
                           dict(ENV_WORKER, BYTEPS_LOCAL_SIZE="3", DYNAMIX_ENGINE="auto"), [])
    for specs in (local, environment):
        assert [s.env["DYNAMIX_ENGINE"] for s in specs] == [expected] * 3


@pytest.mark.parametrize("flag", ["-n", "-np", "--num-workers"])
def test_worker_count_is_read_from_bpslaunch_s_and_horovodrun_s_spellings(flag):
    from dynamix_byteps.launcher.cli import parse_args

    assert parse_args([flag, "3", "--", "true"]).num_workers == 3


@pytest.mark.parametrize("engine", ["nccl", "auto"])
def test_env_mode_server_roles_need_no_process_with_nccl(engine):
    from dynamix_byteps.launcher.cli import parse_args
    from dynamix_byteps.launcher.specs import env_mode

    notes: list[str] = []
    assert env_mode(parse_args(["--engine", engine]), {"DMLC_ROLE": "server"}, notes) == []
    assert "needs no server process; nothing to start" in notes[0]


def test_free_ports_lie_below_the_range_outgoing_connections_draw_from():
    """A port from the ephemeral range can be taken by any connect() before the listener binds it."""
    import socket

    from dynamix_byteps.launcher.topology import LISTEN_PORTS, _ephemeral_start

    high = min(LISTEN_PORTS[1], _ephemeral_start())
    if high <= LISTEN_PORTS[0]:
        pytest.skip(f"the ephemeral range starts at {high}, below {LISTEN_PORTS[0]}")
    ports = {free_port() for _ in range(20)}
    assert all(LISTEN_PORTS[0] <= port < high for port in ports), ports
    assert len(ports) > 1  # drawn at random, so concurrent callers rarely meet
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # and free


AWAIT_READY = """
import os, sys
from pathlib import Path
from dynamix_byteps.launcher.supervisor import ChildSpec, Supervisor
marker, never = sys.argv[1], Path(sys.argv[2])
service = ChildSpec("service", [sys.executable, "-c", f"open({marker!r}, 'w').close(); import time; time.sleep(60)"],
                    dict(os.environ), service=True, ready_file=never)
worker = ChildSpec("0", [sys.executable, "-c", "pass"], dict(os.environ))
sys.exit(Supervisor([service, worker], grace_s=2).run())
"""


@pytest.mark.timeout(60)
def test_a_signal_while_a_service_gets_ready_stops_the_job_as_a_signal_does(tmp_path):
    marker = tmp_path / "service-started"
    proc = subprocess.Popen([sys.executable, "-c", AWAIT_READY, str(marker), str(tmp_path / "never")],
                            env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(marker.exists, timeout=30), "the service never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, err
    assert b"received SIGINT" in err and b"did not become ready" not in err, err
