"""Crashes, leaks and exits (issue 18, items 13-16): what a job leaves behind and how it ends.

Every test that starts processes gives them a hard timeout and, in a ``finally``, kills what is
left of them and removes every /dev/shm segment of its job.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import clean_env, kill_tree, wait_until

from dynamix_byteps.control.mailbox import Mailbox, job_mailboxes, mailbox_name, remove_job_mailboxes
from dynamix_byteps.launcher.config import LaunchConfig

REPO = Path(__file__).resolve().parents[1]
MAILBOX_WORKER = str(REPO / "tests" / "scripts" / "mailbox_worker.py")
LAUNCH = [sys.executable, "-m", "dynamix_byteps.launcher"]

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux POSIX shared memory in /dev/shm")


# ---- item 13: mailboxes ---------------------------------------------------------------------------


def test_two_launchers_on_the_same_port_name_their_mailboxes_differently():
    first, second = LaunchConfig(port=29500), LaunchConfig(port=29500)
    assert first.job_id != second.job_id
    assert dataclasses.replace(first, port=29501).job_id == first.job_id  # one name for the launcher's whole life
    mailbox_name(first.job_id, 0)  # a valid mailbox name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["sigterm", "sigint", "worker_sigkilled", "normal_exit"])
def test_the_launcher_removes_its_jobs_mailboxes_however_the_job_ends(tmp_path, ending):
    how = {"worker_sigkilled": "sigkill", "normal_exit": "exit"}.get(ending, "sleep")
    args = ["-n", "2", "--policy", "static", "--monitor", "proc", "--grace-period", "2", "--",
            sys.executable, MAILBOX_WORKER, str(tmp_path), how]
    job, proc = None, None
    try:
        proc = subprocess.Popen(LAUNCH + args, env=clean_env(), stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "launcher.err", "wb"))
        assert wait_until(lambda: len(list(tmp_path.glob("*.job"))) == 2 or proc.poll() is not None, 90), "no worker started"
        job = (tmp_path / "0.job").read_text()
        assert job_mailboxes(job) or ending == "normal_exit"
        if ending in ("sigterm", "sigint"):
            proc.send_signal(signal.SIGTERM if ending == "sigterm" else signal.SIGINT)
        proc.wait(timeout=60)
        err = (tmp_path / "launcher.err").read_text()
        assert job_mailboxes(job) == [], f"left in /dev/shm after {ending}: {job_mailboxes(job)}\n{err}"
        assert "go on without it" not in err, err  # the scheduler stopped with the job: no such note
    finally:
        kill_tree(proc)
        if job is not None:
            remove_job_mailboxes(job)


@pytest.mark.timeout(120)
def test_a_sigkilled_launchers_guardian_removes_the_jobs_mailboxes(tmp_path):
    args = ["-n", "2", "--policy", "static", "--monitor", "proc", "--grace-period", "2", "--",
            sys.executable, MAILBOX_WORKER, str(tmp_path), "sleep"]
    job, proc = None, None
    try:
        proc = subprocess.Popen(LAUNCH + args, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: len(list(tmp_path.glob("*.job"))) == 2 or proc.poll() is not None, 90), "no worker started"
        job = (tmp_path / "0.job").read_text()
        assert len(job_mailboxes(job)) == 2
        proc.kill()
        proc.wait(timeout=20)
        assert wait_until(lambda: not job_mailboxes(job), 30), f"left in /dev/shm: {job_mailboxes(job)}"
    finally:
        kill_tree(proc)
        if job is not None:
            remove_job_mailboxes(job)


SQUATTED_WORKER = """
import torch
import dynamix_byteps.torch as bps

bps.init()
model = torch.nn.Linear(3, 1)
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
print("trained", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_worker_whose_mailbox_a_live_process_holds_warns_and_trains_without_it():
    job = f"squat{os.getpid()}-{uuid.uuid4().hex[:6]}"
    with Mailbox.create(mailbox_name(job, 0)):  # this test process is the live holder
        proc = subprocess.run([sys.executable, "-c", SQUATTED_WORKER], env=clean_env(DYNAMIX_JOB_ID=job),
                              capture_output=True, text=True, timeout=100)
    remove_job_mailboxes(job)
    assert proc.returncode == 0, proc.stderr
    assert "trained" in proc.stdout
    assert "monitoring mailbox is unavailable" in proc.stderr and str(os.getpid()) in proc.stderr, proc.stderr


# ---- item 14: the engine shuts down at interpreter exit -------------------------------------------

AT_EXIT = """
import atexit
import torch.distributed as dist
import dynamix_byteps.torch as bps

# Registered before init, so it runs after the engine's own exit handler (last in, first out).
atexit.register(lambda: print("group at exit:", dist.is_initialized(), flush=True))
bps.init()
print("initialised:", dist.is_initialized(), flush=True)
"""


@pytest.mark.timeout(120)
def test_without_shutdown_the_process_group_is_destroyed_at_interpreter_exit():
    proc = subprocess.run([sys.executable, "-c", AT_EXIT], env=clean_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "initialised: True" in proc.stdout and "group at exit: False" in proc.stdout, proc.stdout


# ---- item 16: usage errors exit 2 ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_busy_scheduler_port_is_a_usage_error_like_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flag in ("--port", "--scheduler-port"):
            proc = subprocess.run(LAUNCH + ["-n", "1", "--policy", "static", "--monitor", "off", flag, str(port),
                                            "--", "true"], env=clean_env(), capture_output=True, text=True, timeout=50)
            assert proc.returncode == 2, (flag, proc.stderr)
            assert f"argument {flag}: 127.0.0.1:{port} is not available" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_an_invalid_dynamix_batch_size_is_a_usage_error_like_batch_size_0(value):
    proc = subprocess.run(LAUNCH + ["-n", "1", "--", "true"], env=clean_env(DYNAMIX_BATCH_SIZE=value),
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert f"environment variable DYNAMIX_BATCH_SIZE: batch sizes {value!r}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_an_invalid_dynamix_batch_size_stops_a_worker_at_init_with_a_configuration_error():
    script = textwrap.dedent("""
        import dynamix_byteps.torch as bps
        try:
            bps.init()
        except bps.ConfigurationError as error:
            print("refused:", error)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(DYNAMIX_BATCH_SIZE="0"), capture_output=True,
                          text=True, timeout=100)
    assert "refused: DYNAMIX_BATCH_SIZE: batch sizes '0': 0 is no batch size" in proc.stdout, proc.stdout + proc.stderr


# ---- item 16: a dead peer's error names the user's operation ------------------------------------

DEAD_PEER = """
import os, time, torch
import dynamix_byteps.torch as bps

bps.init()
if bps.rank() == 1:
    os._exit(0)
time.sleep(1)
bps.push_pull(torch.ones(3), name="my_tensor")
"""


@pytest.mark.timeout(120)
def test_a_dead_peer_error_does_not_name_an_internal_tensor(tmp_path):
    proc = subprocess.run(LAUNCH + ["-n", "2", "--timeout", "30", "--", sys.executable, "-c", DEAD_PEER],
                          env=clean_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1, proc.stderr
    error = next(line for line in proc.stderr.splitlines() if "CommunicationError:" in line)
    assert "dynamix.exchange" not in error and "starts each push_pull" in error, error
    assert "A peer worker probably exited" in error


class _BrokenHandle:
    def wait(self):
        from dynamix_byteps.errors import CommunicationError

        raise CommunicationError("the exchange between the workers failed: Connection closed by peer")


def test_exchange_puts_the_callers_operation_first_in_its_error():
    from dynamix_byteps.engine.base import Engine
    from dynamix_byteps.env import WorkerEnv
    from dynamix_byteps.errors import CommunicationError

    class Broken(Engine):
        name = "broken"
        all_reduce_async = staticmethod(lambda tensor, name: _BrokenHandle())
        broadcast = barrier = shutdown = staticmethod(lambda *args: None)

    engine = Broken(WorkerEnv())
    with pytest.raises(CommunicationError, match=r"^push_pull of gradients at step 7: the exchange .* closed by peer"):
        engine.exchange([1, 2], what="push_pull of gradients at step 7")


IN_FLIGHT_AT_EXIT = """
import torch
import dynamix_byteps as bps
import dynamix_byteps.engine as engine

bps.init()
handles = [engine.current().all_reduce_async(torch.ones(1 << 20), f"left{i}") for i in range(16)]
print("leaving with collectives in flight", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_worker_leaving_with_collectives_in_flight_and_no_shutdown_exits_cleanly():
    # Before the engine shut down at exit, a gloo thread finishing one of these needed the GIL of a
    # finalising interpreter: "terminate called without an active exception", exit 134 (2 runs of 3).
    proc = subprocess.run(LAUNCH + ["-n", "3", "--grace-period", "5", "--", sys.executable, "-X", "faulthandler", "-c",
                                    IN_FLIGHT_AT_EXIT], env=clean_env(), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("leaving with collectives in flight") == 3
    assert "terminate called" not in proc.stdout + proc.stderr


GLOO_THREADS_AFTER_SHUTDOWN = """
import os
import torch
import dynamix_byteps.torch as bps
from dynamix_byteps import engine
torch.set_num_threads(1)
bps.init()
model = torch.nn.Linear(4, 2)
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
model(torch.randn(8, 4)).sum().backward()
opt.step()
import torch._dynamo  # imports torch.distributed.nn.functional, whose defaults bind group.WORLD
kept = engine.current().all_reduce_async(torch.ones(4), "kept.past.shutdown")
kept.wait()
bps.shutdown()
names = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
print("torch threads after shutdown:", [n for n in names if "gloo" in n or "tcpstore" in n])
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc/self/task")
def test_shutdown_stops_the_process_groups_threads_however_the_group_was_referenced():
    # A group kept alive past shutdown (torch._dynamo imported after init bound it as a default
    # argument; handles held torch's Work) ran its gloo threads into the interpreter's finalization,
    # where one that needed the GIL aborted the finished worker (exit 134; three CI runs failed so).
    proc = subprocess.run(LAUNCH + ["-n", "2", "--", sys.executable, "-c", GLOO_THREADS_AFTER_SHUTDOWN],
                          env=clean_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("torch threads after shutdown: []") == 2, proc.stdout


def test_a_gloo_collective_is_timed_when_the_worker_sees_it_complete():
    import torch

    from dynamix_byteps.engine.distributed import TorchDistributedEngine
    from dynamix_byteps.env import WorkerEnv

    engine = TorchDistributedEngine(WorkerEnv(), "gloo")
    try:
        handle = engine.all_reduce_async(torch.ones(8), "timed.tensor")
        handle.wait()
        assert handle.done()
        records = engine.timing.ring.drain()  # one array per field
        assert [engine.timing.names()[int(i)] for i in records["name_id"]] == ["timed.tensor"]  # once, not per call
        assert int(records["nbytes"][0]) == 32 and records["end_ns"][0] >= records["start_ns"][0]
    finally:
        engine.shutdown()


def test_shutdown_frees_an_unreachable_torch_ddp_before_it_destroys_the_group(monkeypatch):
    # Freed after the group was destroyed, a torch DDP's Reducer dropped the group's last reference
    # with the GIL held and joined gloo's work threads, one of which waited for the GIL: a worker of
    # benchmarks/ddp_comparison.py hung at exit (about 1 run in 20 on a loaded machine).
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from dynamix_byteps.engine.distributed import TorchDistributedEngine
    from dynamix_byteps.env import WorkerEnv

    engine = TorchDistributedEngine(WorkerEnv(), "gloo")
    gc.disable()  # so that only shutdown can free the cycle
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        ddp.cycle = [ddp]  # as a step closure that refers back to its model
        ddp_alive = weakref.ref(ddp)
        del ddp
        alive_at_destroy = []
        destroy = dist.destroy_process_group
        monkeypatch.setattr(dist, "destroy_process_group",
                            lambda *args: (alive_at_destroy.append(ddp_alive() is not None), destroy(*args)))
    finally:
        engine.shutdown()
        gc.enable()
    assert alive_at_destroy == [False]


def test_a_collective_after_the_user_destroyed_the_process_group_names_that():
    # The engine sends its all-reduces to the default group itself; it must not keep the group (a
    # kept group runs gloo's threads into the interpreter's exit) nor fail with torch's internals.
    import torch
    import torch.distributed as dist

    from dynamix_byteps.engine.distributed import TorchDistributedEngine
    from dynamix_byteps.env import WorkerEnv
    from dynamix_byteps.errors import CommunicationError

    engine = TorchDistributedEngine(WorkerEnv(), "gloo")
    try:
        dist.destroy_process_group()
        with pytest.raises(CommunicationError, match=r"'late\.tensor'.*process group was destroyed.*bps\.init\(\)"):
            engine.all_reduce_async(torch.ones(2), "late.tensor")
    finally:
        engine.shutdown()
