"""Worker program for tests/test_launcher.py; started by bpslaunch, one process per rank.

Usage:
    launcher_worker.py env [LINES]          print the contract variables as one JSON line, then
                                            LINES long filler lines on stdout and stderr
    launcher_worker.py job DIR [FAIL_RANK CODE]
                                            start a grandchild (`sleep`), write
                                            DIR/<rank>.pids = "<own pid> <grandchild pid>", then
                                            sleep; rank FAIL_RANK instead exits CODE once every
                                            rank has written its file
    launcher_worker.py daemon DIR [SECONDS CODE]
                                            start a `sleep SECONDS` (default 60) in its own session
                                            that keeps the output pipes open, write DIR/<rank>.pids,
                                            exit CODE (default 0)
    launcher_worker.py output DIR           write progress pieces ending in \r, wait for
                                            DIR/go, then a 1 MiB line and a last unterminated one
    launcher_worker.py traced DIR CODE      rank 0 lets any process trace it (Yama's
                                            PR_SET_PTRACER), writes DIR/0.pid, then sleeps; the
                                            other ranks exit CODE once DIR/traced exists
"""

import ctypes
import json
import os
import subprocess
import sys
import time

KEYS = (
    "DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_WORKER_ID", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK",
    "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DYNAMIX_ENGINE", "DYNAMIX_BATCH_SIZE",
    "DYNAMIX_LOG_DIR", "DYNAMIX_TIMEOUT", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
)


def rank() -> int:
    return int(os.environ["DMLC_WORKER_ID"]) * int(os.environ["BYTEPS_LOCAL_SIZE"]) + int(os.environ["BYTEPS_LOCAL_RANK"])


def env_mode(lines: int) -> int:
    print(json.dumps({key: os.environ.get(key) for key in KEYS}), flush=True)
    for i in range(lines):
        print(f"out {rank()} {i} " + "x" * 300)
        print(f"err {rank()} {i} " + "y" * 300, file=sys.stderr)
    return 0


def job_mode(directory: str, fail_rank: int, code: int) -> int:
    grandchild = subprocess.Popen(["sleep", "300"])
    me = rank()
    tmp = os.path.join(directory, f".{me}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    os.replace(tmp, os.path.join(directory, f"{me}.pids"))
    print(f"ready {me}", flush=True)
    if me == fail_rank:
        size = int(os.environ["DMLC_NUM_WORKER"]) * int(os.environ["BYTEPS_LOCAL_SIZE"])
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            if len([n for n in os.listdir(directory) if n.endswith(".pids")]) >= size:
                break
            time.sleep(0.05)
        return code
    time.sleep(300)
    return 0


def daemon_mode(directory: str, seconds: str, code: int) -> int:
    daemon = subprocess.Popen(["sleep", seconds], start_new_session=True)  # inherits stdout/stderr
    with open(os.path.join(directory, f"{rank()}.pids"), "w") as f:
        f.write(f"{daemon.pid}")
    print(f"done {rank()}", flush=True)
    return code


def output_mode(directory: str) -> int:
    out = sys.stdout.buffer
    out.write(b"step 1\rstep 2\r")
    out.flush()
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(directory, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    out.write(b"step 3\r\n" + b"z" * (1 << 20) + b"\nlast")
    out.flush()
    return 0


def traced_mode(directory: str, code: int) -> int:
    if rank() != 0:
        deadline = time.monotonic() + 40
        while not os.path.exists(os.path.join(directory, "traced")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return code
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, ANY; fails without Yama
    with open(os.path.join(directory, ".0.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(directory, ".0.tmp"), os.path.join(directory, "0.pid"))
    time.sleep(300)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "env":
        sys.exit(env_mode(int(sys.argv[2]) if len(sys.argv) > 2 else 0))
    if sys.argv[1] == "daemon":
        seconds, code = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 4 else ("60", 0)
        sys.exit(daemon_mode(sys.argv[2], seconds, code))
    if sys.argv[1] == "output":
        sys.exit(output_mode(sys.argv[2]))
    if sys.argv[1] == "traced":
        sys.exit(traced_mode(sys.argv[2], int(sys.argv[3])))
    fail_rank, code = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, 0)
    sys.exit(job_mode(sys.argv[2], fail_rank, code))
