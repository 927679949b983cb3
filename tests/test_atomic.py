"""dynamix_byteps.atomic: whole replacement, nothing left behind on failure, umask permissions."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from dynamix_byteps.atomic import atomic_write, write_atomic


def test_content_is_replaced_whole(tmp_path):
    path = tmp_path / "sub" / "f.bin"  # the parent is created
    write_atomic(path, b"old content that is longer")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(path.parent) == ["f.bin"]


def test_exception_in_block_keeps_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_write(path, "w", durable=False) as f:
        f.write("half of the new")
        f.flush()
        raise KeyboardInterrupt  # BaseException too
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_result_has_umask_permissions(tmp_path):
    path = tmp_path / "shared.txt"
    old = os.umask(0o022)
    try:
        write_atomic(path, "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # mkstemp would give 0o600


def test_text_mode(tmp_path):
    path = tmp_path / "t.txt"
    with atomic_write(path, "w") as f:
        f.write("θ = 1\n")
    assert path.read_text(encoding="utf-8") == "θ = 1\n"
    with pytest.raises(ValueError, match="mode"), atomic_write(path, "a"):
        pass


def test_a_path_that_is_not_a_regular_file_is_refused_and_left_as_it_was(tmp_path):
    """``sim fit --out /dev/full`` replaced the device node with a JSON file (as root)."""
    import errno

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as error:
        write_atomic(fifo, "{}")
    assert error.value.errno == errno.EINVAL and error.value.filename == str(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]


def test_a_symlink_loop_is_refused_and_left_as_it_was(tmp_path):
    import errno

    loop = tmp_path / "a"
    loop.symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(loop)
    with pytest.raises(OSError) as error:
        write_atomic(loop, "{}")
    assert error.value.errno == errno.ELOOP and error.value.filename == str(loop)
    assert loop.is_symlink() and sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_a_dangling_symlink_gets_its_target_created(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target.json")
    write_atomic(link, "{}")
    assert link.is_symlink() and (tmp_path / "target.json").read_text() == "{}"


def test_a_directory_that_refuses_new_files_is_reported_under_the_callers_name(tmp_path):
    """``sim fit --out /proc/x.json`` named the hidden temporary file in its error."""
    with pytest.raises(OSError) as error:
        write_atomic("/proc/x.json", "{}")
    assert error.value.filename == "/proc/x.json" and "cannot create a file in /proc" in str(error.value)



def _temporary(directory, name: str, pid: int, age_s: float) -> str:
    """An atomic_write temporary of ``name`` as ``pid`` would name it, last written ``age_s`` ago."""
    path = directory / f".{name}.{pid}.{os.urandom(4).hex()}.tmp"
    path.write_bytes(b"half a file")
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path.name


def test_a_write_removes_what_writers_killed_mid_write_long_ago_left_and_nothing_else(tmp_path):
    """A worker killed while saving (bpslaunch stopped by SIGTERM, the OOM killer, SIGKILL after
    the grace period) left a hidden temporary as large as the checkpoint at every interruption,
    which nothing removed."""
    path = tmp_path / "ckpt.pt"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, signal\n"
        "from dynamix_byteps.atomic import atomic_write\n"
        f"with atomic_write({str(path)!r}) as f:\n"
        "    f.write(b'half of a checkpoint'); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n")])
    assert writer.wait(timeout=60) == -signal.SIGKILL
    (left,) = os.listdir(tmp_path)
    os.utime(tmp_path / left, (time.time() - 3600, time.time() - 3600))
    kept = {
        _temporary(tmp_path, "ckpt.pt", writer.pid, age_s=60),  # a writer in another pid namespace may be at it
        _temporary(tmp_path, "ckpt.pt", os.getpid(), age_s=3600),  # its writer lives
        _temporary(tmp_path, "other.pt", writer.pid, age_s=3600),  # another file's
    }
    write_atomic(path, b"whole")
    assert path.read_bytes() == b"whole"
    assert set(os.listdir(tmp_path)) == kept | {"ckpt.pt"}
