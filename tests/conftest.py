"""Shared fixtures."""

import collections
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

# Like dynamix_byteps.policy.ppo.module: RLlib must not import TensorFlow. When a test imports
# ray.rllib first, RLlib loads TensorFlow and calls disable_v2_behavior(), and every later
# TensorFlow test in the process runs in graph mode (SymbolicTensor has no .numpy()).
os.environ.setdefault("RLLIB_TEST_NO_TF_IMPORT", "1")

REPO = Path(__file__).resolve().parent.parent

# `make test` runs two pytest processes (pytest-xdist, --dist loadgroup): each file is one group, so
# a module's fixtures are built once, and files that would step on each other share a group and
# run one after the other: the network test beds (namespaces, tc qdiscs, eBPF programs, a fixed
# test subnet) and the users of the session-wide recorded run.
SERIAL_GROUPS = {
    "network": {"test_netns.py", "test_link_emulation.py", "test_faults.py", "test_slow_host.py", "test_elastic.py",
                "test_delivery_rate.py", "test_ebpf_collector.py", "test_proc_collector.py"},
    "recorded_run": {"test_progress.py", "test_report.py", "test_tensorboard.py"},
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    groups = {}
    for item in items:
        file = item.path.name
        group = groups[item] = next((name for name, files in SERIAL_GROUPS.items() if file in files), file)
        item.add_marker(pytest.mark.xdist_group(group))
    # Longest groups first, so that no long group starts last while the other process idles (xdist
    # would order them by their number of tests: three 80-s TensorFlow example runs came 72nd of 85).
    # A group's expected length is the sum of its tests' timeouts: every test that spawns has one.
    expected_s = collections.Counter()
    for item in items:
        own = [mark.args for mark in item.own_markers if mark.name == "timeout"]
        if len(own) > 1:  # the function's mark comes first and silently wins over a param's
            raise pytest.UsageError(f"{item.nodeid} has {len(own)} timeout marks {own}: give each case "
                                    "its own (pytest.param(..., marks=pytest.mark.timeout(N))) and none on the function")
        timeout = item.get_closest_marker("timeout")
        expected_s[groups[item]] += timeout.args[0] if timeout else 1
    items.sort(key=lambda item: -expected_s[groups[item]])


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order above
        config.option.loadscopereorder = False


@pytest.fixture(autouse=True)
def _no_default_batch_plan_across_tests():
    """Each test starts without a default batch plan: a sampler a test built and drew from in this
    process would otherwise feed its pending draws (and its rank) to the next test's frontend."""
    import dynamix_byteps.batch_plan as batch_plan

    batch_plan._default = None
    yield
    batch_plan._default = None


class TestTimedOut(BaseException):
    """A test ran past its pytest-timeout limit. A BaseException, unlike pytest-timeout's own
    ``Failed``: Hypothesis takes a ``Failed`` for a failing example and replays and shrinks it, so
    an example that never ends ran on past the limit until CI's own limit killed the run."""


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer

    def on_alarm(signum, frame):
        faulthandler.dump_traceback(all_threads=True)  # into the test's captured stderr
        raise TestTimedOut(f"{item.nodeid} ran past its {settings.timeout:g} s limit (pytest-timeout)")

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


OBSERVED_WORKER = REPO / "tests" / "scripts" / "observed_worker.py"
RECORDED_INTERVAL = 4  # --decision-interval of the recorded run


JOB_VARIABLES = ("DMLC_", "BYTEPS_", "DYNAMIX_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_",
                 "GROUP_RANK", "GROUP_WORLD_SIZE", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_",
                 "HOROVOD_")


def clean_env(*, unset: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment without any launcher's job variables (BytePS's, torchrun's, MPI's,
    Slurm's, horovodrun's, dynamix's) or the variables named in ``unset``, the repository on PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARIABLES) and k not in unset}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


@pytest.fixture
def no_job_variables(monkeypatch):
    """This test's process environment without any launcher's job variables (as :func:`clean_env`)."""
    for name in [name for name in os.environ if name.startswith(JOB_VARIABLES)]:
        monkeypatch.delenv(name)


@pytest.fixture
def single_process_job(no_job_variables):
    """``dynamix_byteps.torch`` initialised as a script run without a launcher (one worker), shut down after."""
    import dynamix_byteps.torch as bps

    bps.init()
    try:
        yield bps
    finally:
        bps.shutdown()


def wait_until(predicate, timeout: float = 30.0, step: float = 0.05):
    """Call ``predicate`` every ``step`` seconds until it returns a true value or ``timeout`` seconds
    passed; returns its last value (false when the time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(step)
    return predicate()


def kill_tree(proc: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """SIGKILL ``proc`` if it still runs (its whole process group when it leads one), give what it
    started ``grace_s`` seconds to end (a killed bpslaunch's guardian tears its job down and
    removes its scratch folders then), SIGKILL every descendant left, also those in sessions of
    their own (torchrun's workers); then reap it."""
    if proc is None:
        return
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    if proc.poll() is None:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    _, alive = psutil.wait_procs(descendants, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    proc.wait()


RANK_WORKER = REPO / "tests" / "scripts" / "torchrun_worker.py"  # joins the job its launcher describes


def has_ipv6_loopback() -> bool:
    """Whether this host can listen on ::1."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def worker_ranks(out: Path) -> list[dict]:
    """What each rank of :data:`RANK_WORKER` wrote to ``out`` (``rank<r>.json``), in rank order."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def run_in_session(command, timeout: float, **popen) -> tuple[int, str]:
    """``command`` in a session of its own; returns (exit code, stdout+stderr). Whatever it started
    is killed afterwards (:func:`kill_tree`); past ``timeout`` the test fails with the end of what it
    printed."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    job = subprocess.Popen([str(a) for a in command], text=True, start_new_session=True, **popen)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(job)
        output, _ = job.communicate()
        pytest.fail(f"{' '.join(map(str, command))[:300]} ran past {timeout:g} s; its output:\n{(output or '')[-12000:]}")
    finally:
        kill_tree(job)
    return job.returncode, output or ""


def run_bpslaunch(args, timeout: float, **popen) -> tuple[int, str]:
    """``bpslaunch ARGS`` through :func:`run_in_session`."""
    return run_in_session([sys.executable, "-m", "dynamix_byteps.launcher", *args], timeout, **popen)


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    """A real 2-worker job, recorded once per session: ``bpslaunch --policy proportional --log-dir``
    with rank 1 slowed 3x, 3 epochs of tests/scripts/observed_worker.py (64 steps each).

    Attributes: ``dir`` (the --log-dir), ``out`` (the workers' rank<r>.json), ``output``.
    """
    out = tmp_path_factory.mktemp("observed")
    run_dir = out / "run"
    code, output = run_bpslaunch(
        ["-n", 2, "--policy", "proportional", "--slowdown", "1=3.0", "--decision-interval", RECORDED_INTERVAL,
         "--monitor", "off", "--log-dir", run_dir, "--", sys.executable, OBSERVED_WORKER, out, 3],
        timeout=240)
    assert code == 0, output
    return SimpleNamespace(dir=run_dir, out=out, output=output)
