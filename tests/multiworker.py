"""Run a function in N real worker processes on loopback, BytePS environment and all.

``run_workers(n, "module:function", *args)`` starts ``n`` interpreters, each with the
``DMLC_*``/``BYTEPS_*`` variables bpslaunch would set, calls ``bps.init()`` and then
``function(*args)``, and returns each rank's JSON result. A hard timeout kills every child;
children are always reaped, also when the test fails. With ``servers=K`` the job runs the ``ps``
engine: K summation servers (``python -m dynamix_byteps.engine.ps_server``) start first and are
killed after the workers have exited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynamix_byteps.launcher.topology import free_port

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


def worker_command(target: str, args: list, out: str) -> list[str]:
    """The command of one worker that runs ``target(*args)`` and writes its JSON result to ``out``."""
    return [sys.executable, "-c", _ENTRY, target, json.dumps(args), out]


def ps_env(servers: int, ps_port: int) -> dict[str, str]:
    """The variables that make a worker or server part of a ``ps`` job of ``servers`` servers."""
    return {"DYNAMIX_ENGINE": "ps", "DMLC_NUM_SERVER": str(servers), "DYNAMIX_PS_PORT": str(ps_port)}


def start_servers(servers: int, workers: int, env: dict[str, str]) -> list[subprocess.Popen]:
    """Start ``servers`` summation servers for ``workers`` workers; ``env`` is a worker's environment."""
    return [subprocess.Popen([sys.executable, "-m", "dynamix_byteps.engine.ps_server", "--server-id", str(i),
                              "--num-workers", str(workers)], env={**env, "DMLC_ROLE": "server"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i in range(servers)]


def run_workers(n: int, target: str, *args, timeout: float = 120, env: dict | None = None,
                servers: int = 0) -> list[dict]:
    """Results of ``target(*args)`` on ranks 0..n-1: ``{"ok": value}`` or ``{"error": ..., "message": ...}``."""
    port = free_port()
    if servers:
        env = {**ps_env(servers, free_port()), **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        procs, server_procs = [], []
        try:
            if servers:
                server_procs = start_servers(servers, n, worker_env(0, n, port, **env))
            for rank in range(n):
                out = os.path.join(tmp, f"rank{rank}.json")
                procs.append(subprocess.Popen(
                    worker_command(target, list(args), out),
                    env=worker_env(rank, n, port, **(env or {})),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                ))
            deadline = time.monotonic() + timeout
            outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for p in procs]
        finally:
            for p in procs + server_procs:
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


def ok(results: list[dict]) -> list:
    """Every rank's value from :func:`run_workers`' results; fails the test naming the first rank that raised."""
    for rank, result in enumerate(results):
        assert "ok" in result, f"rank {rank} raised {result.get('error')}: {result.get('traceback')}"
    return [result["ok"] for result in results]
