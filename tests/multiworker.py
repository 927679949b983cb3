"""Run a function in N real worker processes on loopback, BytePS environment and all.

``run_workers(n, "module:function", *args)`` starts ``n`` interpreters, each with the
``DMLC_*``/``BYTEPS_*`` variables bpslaunch would set, calls ``bps.init()`` and then
``function(*args)``, and returns each rank's JSON result. A hard timeout kills every child;
children are always reaped, also when the test fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_ENTRY = r"""
import importlib, json, sys, traceback, torch
torch.set_num_threads(1)
import dynamix_byteps.torch as bps
target, args_json, out = sys.argv[1], sys.argv[2], sys.argv[3]
module, func = target.split(":")
bps.init()
try:
    result = {"ok": getattr(importlib.import_module(module), func)(*json.loads(args_json))}
except Exception as exc:
    result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
with open(out, "w") as f:
    json.dump(result, f)
bps.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, size: int, port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DMLC_ROLE="worker", DMLC_NUM_WORKER="1", DMLC_WORKER_ID="0",
        BYTEPS_LOCAL_SIZE=str(size), BYTEPS_LOCAL_RANK=str(rank),
        DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
        OMP_NUM_THREADS="1", DYNAMIX_TIMEOUT="60",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def run_workers(n: int, target: str, *args, timeout: float = 120, env: dict | None = None) -> list[dict]:
    """Results of ``target(*args)`` on ranks 0..n-1: ``{"ok": value}`` or ``{"error": ..., "message": ...}``."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for rank in range(n):
                out = os.path.join(tmp, f"rank{rank}.json")
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", _ENTRY, target, json.dumps(args), out],
                    env=worker_env(rank, n, port, **(env or {})),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                ))
            deadline = time.monotonic() + timeout
            outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        results = []
        for rank, (proc, output) in enumerate(zip(procs, outputs)):
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} exited {proc.returncode} without a result:\n{output}")
            with open(path) as f:
                results.append(json.load(f))
        return results
