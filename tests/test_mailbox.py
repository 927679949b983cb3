"""Shared-memory seqlock mailbox (csrc/mailbox.hpp, dynamix_byteps.control.mailbox).

Cross-process tests spawn real interpreters with subprocess; every test removes the segments
it made in a finally block, whatever happens.
"""

from __future__ import annotations

import gc
import json
import math
import os
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings

import numpy as np
import pytest

from dynamix_byteps import _core
from dynamix_byteps.control import mailbox as mbox
from dynamix_byteps.control.mailbox import (
    Mailbox,
    MailboxLayoutError,
    MailboxRoleError,
    StaleMailboxWarning,
    mailbox_name,
)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux POSIX shared memory in /dev/shm")

METRICS_SEQ_OFFSET = 64  # MetricsSlot.seq


def shm_file(name: str) -> str:
    return "/dev/shm" + name


def unique_name() -> str:
    return f"/dynamix.test{os.getpid()}.{uuid.uuid4().hex[:10]}"


def remove(name: str) -> None:
    try:
        os.unlink(shm_file(name))
    except FileNotFoundError:
        pass


@pytest.fixture
def name():
    n = unique_name()
    try:
        yield n
    finally:
        remove(n)


def run_python(code: str, *args: str, timeout: float = 50) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def poke_u64(name: str, offset: int, value: int) -> None:
    """Write one little-endian uint64 into the segment's file, as a crashed or foreign writer would."""
    with open(shm_file(name), "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<Q", value))


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_round_trip_in_one_process(name):
    worker = agent = None
    try:
        worker = Mailbox.create(name)
        agent = Mailbox.open(name)
        assert worker.is_creator and not agent.is_creator
        assert worker.owner_pid == agent.owner_pid == os.getpid()
        assert agent.read_metrics() is None

        values = [0.5, -1.25, 1e300, 5e-324, 0.0, -0.0, 3.0]
        assert worker.publish_metrics(7, values) == 1
        version, step, got = agent.read_metrics()
        assert (version, step) == (1, 7)
        assert got.dtype == np.float64 and got.tolist() == values
        assert math.copysign(1.0, got[5]) == -1.0  # -0.0 survives bit for bit

        assert worker.publish_metrics(8, np.arange(32, dtype=np.float64)) == 2
        version, step, got = agent.read_metrics()
        assert (version, step, got.tolist()) == (2, 8, list(range(32)))
        assert worker.publish_metrics(2**64 - 1, []) == 3  # step is a uint64; zero values allowed
        version, step, got = agent.read_metrics()
        assert (version, step, got.shape) == (3, 2**64 - 1, (0,))
        assert worker.busy_reads == agent.busy_reads == 0
    finally:
        for mb in (agent, worker):
            if mb is not None:
                mb.close()


@pytest.mark.timeout(60)
def test_non_finite_metrics_pass_through(name):
    with Mailbox.create(name) as worker, Mailbox.open(name) as agent:
        worker.publish_metrics(1, [math.nan, math.inf, -math.inf, 1.0])
        _, _, got = agent.read_metrics()
        assert math.isnan(got[0]) and got[1] == math.inf and got[2] == -math.inf and got[3] == 1.0


AGENT_ROUND_TRIP = """
import json, sys
from dynamix_byteps.control.mailbox import Mailbox
with Mailbox.open(sys.argv[1], timeout=20) as agent:
    got = None
    for _ in range(2000):
        got = agent.read_metrics()
        if got is not None:
            break
        import time; time.sleep(0.01)
    version, step, values = got
    print(json.dumps({"version": version, "step": step, "values": values.tolist()}))
"""


@pytest.mark.timeout(60)
def test_round_trip_across_two_processes(name):
    worker = None
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_ROUND_TRIP, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        worker = Mailbox.create(name)
        worker.publish_metrics(41, [3.0, 4.0, 5.0])
        out, err = agent.communicate(timeout=40)
        assert agent.returncode == 0, err
        assert json.loads(out) == {"version": 1, "step": 41, "values": [3.0, 4.0, 5.0]}
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if worker is not None:
            worker.close()


# ---- never a torn value ---------------------------------------------------------------------

# Both processes at once, from Python, for --seconds: the worker publishes metrics whose 31 first
# values are c + i/2 and whose last is their sum (checksum), step = c; the agent reads them with
# newer_than = last version seen and checks every record.
HAMMER = """
import json, sys, time
import numpy as np
from dynamix_byteps.control.mailbox import Mailbox

role, name, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
mb = Mailbox.create(name) if role == "worker" else Mailbox.open(name, timeout=20)
print("ready", flush=True)
sys.stdin.readline()  # start together
stats = {"writes": 0, "reads": 0, "torn": 0, "backwards": 0, "empty_or_old": 0, "busy": 0}
last = 0
deadline = time.monotonic() + seconds
base = np.arange(31) / 2.0
c = 0
while time.monotonic() < deadline:
    c += 1
    if role == "worker":
        vals = c + base
        mb.publish_metrics(c, np.append(vals, vals.sum()))
        stats["writes"] += 1
        continue
    got = mb.read_metrics(last)
    if got is None:
        stats["empty_or_old"] += 1
        continue
    stats["reads"] += 1
    version, step, payload = got
    ok = (len(payload) == 32 and step == version and payload[-1] == payload[:-1].sum()
          and np.array_equal(payload[:-1], step + base))
    stats["torn"] += not ok
    stats["backwards"] += version <= last
    last = version
stats["busy"] = mb.busy_reads
stats["last"] = last
print(json.dumps(stats), flush=True)
sys.stdin.readline()  # the worker keeps the segment until the agent is done
mb.close()
"""


@pytest.mark.timeout(60)
def test_python_writer_and_reader_processes_never_tear(name):
    procs = []
    try:
        for role in ("worker", "agent"):
            p = subprocess.Popen(
                [sys.executable, "-c", HAMMER, role, name, "2.0"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            procs.append(p)
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        stats = {}
        for role, p in zip(("worker", "agent"), procs):
            line = p.stdout.readline()
            assert line, p.stderr.read()
            stats[role] = json.loads(line)
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=30) == 0, p.stderr.read()
        worker, agent = stats["worker"], stats["agent"]
        assert worker["writes"] > 1000, worker
        assert agent["torn"] == 0 and agent["backwards"] == 0, agent
        assert agent["reads"] > 100, agent
        assert agent["last"] <= worker["writes"]  # the agent cannot read past what the worker wrote
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(60)
def test_native_threads_hammering_never_tear(name):
    """A native writer thread and a native reader thread (no GIL) race on the slot for 1.5 s."""
    with Mailbox.create(name) as worker, Mailbox.open(name) as agent:
        results = {}

        def write():
            results["writes"] = _core._mailbox_hammer_write(worker._mb, 1.5)

        t = threading.Thread(target=write)
        t.start()
        try:
            stats = _core._mailbox_hammer_read(agent._mb, 1.5)
        finally:
            t.join()
        assert stats["torn"] == 0, stats
        assert stats["backwards"] == 0, stats
        # The race must really have happened. On a loaded machine the two threads may mostly
        # time-share one core, so few distinct records are seen (6 once in CI); "busy" counts the
        # reads that met a write in progress, which is the race itself.
        assert stats["ok"] >= 2 and stats["ok"] + stats["busy"] >= 20, stats
        assert stats["last_version"] <= results["writes"]
        if (os.cpu_count() or 1) >= 2:  # the reader really met writes in progress, and retried
            assert stats["retries"] > 0, stats


NATIVE_WRITER = """
import sys
from dynamix_byteps import _core
from dynamix_byteps.control.mailbox import Mailbox
name = sys.argv[1]
mb = Mailbox.create(name)
print("ready", flush=True)
sys.stdin.readline()
print(_core._mailbox_hammer_write(mb._mb, float(sys.argv[2])), flush=True)
sys.stdin.readline()  # keeps the segment until the reader is done
mb.close()
"""


@pytest.mark.timeout(60)
def test_native_writer_process_and_reader_process_never_tear(name):
    """Native-speed writer in another process (the worker side) against a native reader here."""
    p = None
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", NATIVE_WRITER, name, "2.0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        agent = Mailbox.open(name, timeout=20)
        p.stdin.write("\n")
        p.stdin.flush()
        stats = _core._mailbox_hammer_read(agent._mb, 2.0)
        writes = int(p.stdout.readline())
        agent.close()
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=30) == 0, p.stderr.read()
        assert stats["torn"] == 0 and stats["backwards"] == 0, stats
        assert stats["ok"] >= 20, stats
        assert stats["last_version"] <= writes
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


# ---- versions and bounded reads -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_newer_than_semantics(name):
    with Mailbox.create(name) as worker, Mailbox.open(name) as agent:
        assert agent.read_metrics(0) is None  # nothing published yet
        assert worker.publish_metrics(10, [1.0]) == 1
        assert worker.publish_metrics(11, [2.0]) == 2
        assert agent.read_metrics(0)[:2] == (2, 11)  # only the newest record is kept
        assert agent.read_metrics(1)[:2] == (2, 11)
        assert agent.read_metrics(2) is None
        assert agent.read_metrics(2**64 - 1) is None
        assert worker.read_metrics(1)[:2] == (2, 11)  # the creator may read its own slot too
        assert worker.busy_reads == agent.busy_reads == 0


@pytest.mark.timeout(60)
def test_read_gives_up_on_a_write_that_never_ends_and_the_next_writer_recovers(name):
    """A writer killed mid-write leaves seq odd: reads return None at once; the next write heals it."""
    with Mailbox.create(name) as worker, Mailbox.open(name) as agent:
        worker.publish_metrics(3, [1.0])
        poke_u64(name, METRICS_SEQ_OFFSET, 5)  # odd: "write in progress", forever
        t0 = time.perf_counter()
        for _ in range(100):
            assert agent.read_metrics() is None
        elapsed = time.perf_counter() - t0
        assert agent.busy_reads == 100
        assert elapsed < 0.5, f"100 bounded reads took {elapsed:.3f} s"

        assert worker.publish_metrics(4, [2.0]) == 2
        assert agent.read_metrics(1)[:2] == (2, 4)


# ---- layout ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_segment_layout_header_and_permissions(name):
    with Mailbox.create(name):
        st = os.stat(shm_file(name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == mbox.SEGMENT_BYTES == 384
        with open(shm_file(name), "rb") as f:
            head = f.read(32)
        magic, layout, seg_bytes, pid = struct.unpack_from("<8sIIq", head)
        assert magic == b"DYNXMBOX"
        assert struct.unpack_from("<Q", head)[0] == _core.MAILBOX_MAGIC
        assert (layout, seg_bytes, pid) == (2, 384, os.getpid())


@pytest.mark.timeout(60)
def test_wrong_magic_raises_layout_error(name):
    with Mailbox.create(name):
        poke_u64(name, 0, int.from_bytes(b"NOTAMBOX", "little"))
        with pytest.raises(MailboxLayoutError, match="magic 0x584f424d41544f4e.*not a dynamix mailbox"):
            Mailbox.open(name)
        poke_u64(name, 0, _core.MAILBOX_MAGIC)
        Mailbox.open(name).close()


@pytest.mark.timeout(60)
def test_wrong_layout_version_or_size_raises_layout_error(name):
    with Mailbox.create(name):
        with open(shm_file(name), "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 99))
        with pytest.raises(MailboxLayoutError, match="layout version 99, this build reads version 2"):
            Mailbox.open(name)
    other = unique_name()
    try:
        with open(shm_file(other), "wb") as f:  # a foreign, too small file with a mailbox's name
            f.write(b"x" * 10)
        with pytest.raises(MailboxLayoutError, match="10 bytes"):
            Mailbox.open(other)
        assert issubclass(MailboxLayoutError, ValueError)
    finally:
        remove(other)


@pytest.mark.timeout(60)
def test_open_waits_for_a_creator_that_comes_late(name):
    with pytest.raises(FileNotFoundError):
        Mailbox.open(name)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        Mailbox.open(name, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    # An empty segment (creator between shm_open and ftruncate) is "not ready", not foreign.
    open(shm_file(name), "wb").close()
    with pytest.raises(MailboxLayoutError, match="not initialised"):
        Mailbox.open(name, timeout=0.05)
    remove(name)

    late = threading.Timer(0.3, lambda: holder.append(Mailbox.create(name)))
    holder: list = []
    late.start()
    try:
        with Mailbox.open(name, timeout=20) as agent:
            assert agent.owner_pid == os.getpid()
    finally:
        late.join()
        for mb in holder:
            mb.close()


# ---- lifetime -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_segment_removed_on_close_context_exit_and_garbage_collection(name):
    mb = Mailbox.create(name)
    agent = Mailbox.open(name)
    assert os.path.exists(shm_file(name))
    agent.close()  # an opener never removes it
    assert os.path.exists(shm_file(name))
    mb.close()
    assert not os.path.exists(shm_file(name))
    mb.close()  # idempotent
    assert mb.closed
    for method, args in ((mb.publish_metrics, (1, [1.0])), (mb.read_metrics, ())):
        with pytest.raises(ValueError, match="closed"):
            method(*args)

    with Mailbox.create(name):
        assert os.path.exists(shm_file(name))
    assert not os.path.exists(shm_file(name))

    mb = Mailbox.create(name)
    assert os.path.exists(shm_file(name))
    del mb
    gc.collect()
    assert not os.path.exists(shm_file(name))


@pytest.mark.timeout(60)
def test_segment_removed_when_creating_process_exits_normally(name):
    code = """
    import sys
    from dynamix_byteps.control.mailbox import Mailbox
    keep = Mailbox.create(sys.argv[1])   # never closed: atexit must remove it
    keep.publish_metrics(1, [1.0])
    import os; assert os.path.exists("/dev/shm" + sys.argv[1])
    sys.exit(0)
    """
    r = run_python(code, name)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(shm_file(name))


@pytest.mark.timeout(60)
def test_forked_child_does_not_remove_its_parents_segment(name):
    with Mailbox.create(name) as mb:
        pid = os.fork()
        if pid == 0:  # child: closing (or exiting) must only unmap
            try:
                mb.close()
                mbox._close_created()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert os.path.exists(shm_file(name))
        assert mb.publish_metrics(1, [1.0]) == 1
    assert not os.path.exists(shm_file(name))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("death", ["os._exit", "SIGKILL"])
def test_stale_segment_of_a_dead_process_is_replaced_with_a_warning(name, death):
    code = f"""
    import os, signal, sys
    from dynamix_byteps.control.mailbox import Mailbox
    mb = Mailbox.create(sys.argv[1])
    mb.publish_metrics(99, [9.0])
    print(os.getpid(), flush=True)
    if {death!r} == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # no atexit, no destructor: the segment stays behind
    """
    r = run_python(code, name)  # run() reaps the child, so its pid is gone (not a zombie)
    dead_pid = int(r.stdout.split()[0])
    assert os.path.exists(shm_file(name))
    with Mailbox.open(name) as agent:
        assert agent.owner_pid == dead_pid
    with pytest.warns(StaleMailboxWarning, match=f"pid {dead_pid}"):
        mb = Mailbox.create(name)
    try:
        assert mb.owner_pid == os.getpid()
        assert mb.read_metrics() is None  # a fresh segment, not the old contents
    finally:
        mb.close()
    assert not os.path.exists(shm_file(name))


@pytest.mark.timeout(60)
def test_zombie_owner_counts_as_dead(name):
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys, os\nfrom dynamix_byteps.control.mailbox import Mailbox\n"
         "mb = Mailbox.create(sys.argv[1]); print('made', flush=True); os._exit(0)", name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "made"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until it is a zombie (not reaped)
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        with pytest.warns(StaleMailboxWarning):
            Mailbox.create(name).close()
    finally:
        p.wait()


@pytest.mark.timeout(60)
def test_live_owner_or_foreign_file_is_not_replaced(name):
    with Mailbox.create(name):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(FileExistsError, match=f"pid {os.getpid()}, is alive"):
                Mailbox.create(name)
        assert os.path.exists(shm_file(name))
    with open(shm_file(name), "wb") as f:
        f.write(b"not a mailbox" * 10)
    with pytest.raises(FileExistsError, match="not an initialised dynamix mailbox"):
        Mailbox.create(name)
    with open(shm_file(name), "rb") as f:
        assert f.read(13) == b"not a mailbox"


@pytest.mark.timeout(60)
def test_a_fifo_under_the_name_is_refused_not_waited_on(name):
    """A FIFO (anyone may make one in /dev/shm) blocked the stale check's read-only open: the worker
    hung in bps.init, where unavailable_reason asks, with no message."""
    os.mkfifo(shm_file(name), 0o600)
    try:
        probe = run_python(f"from dynamix_byteps.control.mailbox import unavailable_reason; "
                           f"print(unavailable_reason({name!r}))", timeout=30)
    finally:
        os.unlink(shm_file(name))
    assert "not an initialised dynamix mailbox" in probe.stdout, probe


# ---- bad inputs -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_bad_inputs_raise(name):
    with Mailbox.create(name) as worker, Mailbox.open(name) as agent:
        bad_value = [
            lambda: worker.publish_metrics(1, [1.0] * 33),
            lambda: worker.publish_metrics(1, np.ones((2, 2))),
            lambda: worker.publish_metrics(-1, [1.0]),
            lambda: worker.publish_metrics(2**64, [1.0]),
            lambda: agent.read_metrics(-1),
            lambda: agent.read_metrics(2**64),
        ]
        for i, call in enumerate(bad_value):
            with pytest.raises(ValueError):
                call()
                pytest.fail(f"case {i} did not raise")
        with pytest.raises(TypeError):
            worker.publish_metrics(1.5, [1.0])
        with pytest.raises(TypeError):
            worker.publish_metrics(1, ["a"])
        with pytest.raises(MailboxRoleError, match="metrics are written by the worker"):
            agent.publish_metrics(1, [1.0])
        # nothing of the above reached the slot
        assert agent.read_metrics() is None
    for bad_name in ["/", "/a/b", "/with space", "/" + "x" * 255, "/.."]:
        with pytest.raises(ValueError, match="mailbox name"):
            Mailbox.create(bad_name)
    with pytest.raises(TypeError):
        Mailbox.create(5)
    with pytest.raises(ValueError):
        Mailbox.open(name, timeout=-1)
    with pytest.raises(TypeError):
        Mailbox(object())


@pytest.mark.timeout(60)
def test_mailbox_name_and_leading_slash(name):
    assert mailbox_name("job-1_a", 3) == "/dynamix.job-1_a.3"
    for job, rank in [("", 0), ("a.b", 0), ("a/b", 0), ("ok", -1)]:
        with pytest.raises(ValueError):
            mailbox_name(job, rank)
    with Mailbox.create(name[1:]) as mb:  # the leading "/" is optional
        assert mb.name == name
        assert repr(mb) == f"Mailbox({name!r}, creator)"
        with Mailbox.open(name[1:]) as agent:
            assert repr(agent) == f"Mailbox({name!r}, opened)"


# ---- truncation, squatting, cleanup (issue 18, item 13) -----------------------------------------

# Opens the mailbox, polls the slot and owner_pid every 2 ms (the agent polls every second, a
# worker once a step) until told to stop on stdin; a truncation under it must not kill it (SIGBUS)
# but detach the handle. The size check leaves a window of about a microsecond per poll between
# check and access, which a poll loop without pause would hit.
TRUNCATED_READER = """
import json, sys, threading, time, warnings
from dynamix_byteps.control.mailbox import Mailbox

warnings.simplefilter("always")
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
mb = Mailbox.open(sys.argv[1], timeout=20)
print("ready", flush=True)
reads = 0
with warnings.catch_warnings(record=True) as caught:
    while True:
        stopping = stop.is_set()  # told after the truncation: poll once more, however late it came
        mb.read_metrics()
        mb.owner_pid
        reads += 1
        if stopping:
            break
        time.sleep(0.002)
print(json.dumps({"reads": reads, "detached": mb.detached, "owner_pid": mb.owner_pid,
                  "metrics": mb.read_metrics(), "warnings": [str(w.message) for w in caught]}))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [0, 100, mbox.SEGMENT_BYTES - 8])
def test_a_reader_survives_its_segment_being_truncated_under_it(name, size):
    worker = Mailbox.create(name)
    reader = subprocess.Popen([sys.executable, "-c", TRUNCATED_READER, name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker.publish_metrics(1, [1.0])
        assert reader.stdout.readline().strip() == "ready"
        os.truncate(shm_file(name), size)
        time.sleep(0.3)  # the reader goes on polling the shortened segment
        out, err = reader.communicate("stop\n", timeout=40)
        assert reader.returncode == 0, f"reader died with {reader.returncode}: {err}"
        result = json.loads(out)
        assert result["detached"] and result["owner_pid"] == 0 and result["metrics"] is None
        assert len(result["warnings"]) == 1 and "truncated" in result["warnings"][0], result
        with pytest.warns(mbox.MailboxDetachedWarning):
            assert worker.publish_metrics(2, [2.0]) == 0  # the creator survives it too
        assert worker.read_metrics() is None
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
        worker.close()


def test_unavailable_reason_names_the_live_holder_and_leaves_a_free_name_free(name):
    assert mbox.unavailable_reason(name) is None
    assert not os.path.exists(shm_file(name))
    with Mailbox.create(name):
        reason = mbox.unavailable_reason(name)
    assert reason is not None and str(os.getpid()) in reason


def test_remove_job_mailboxes_removes_every_rank_of_that_job_only():
    job, other = f"test{os.getpid()}-{uuid.uuid4().hex[:6]}", f"test{os.getpid()}-{uuid.uuid4().hex[:6]}"
    names = [mailbox_name(job, r) for r in (0, 1, 12)] + [mailbox_name(other, 0)]
    try:
        for n in names:
            with open(shm_file(n), "wb"):  # as a SIGKILLed worker leaves them
                pass
        removed = mbox.remove_job_mailboxes(job)
        assert sorted(p.name for p in removed) == sorted(n[1:] for n in names[:3])
        assert not any(os.path.exists(shm_file(n)) for n in names[:3]) and os.path.exists(shm_file(names[3]))
    finally:
        for n in names:
            remove(n)
