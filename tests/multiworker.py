"""Run a function in N real worker processes on loopback, BytePS environment and all.

``run_workers(n, "module:function", *args)`` starts ``n`` worker processes, each with the
``DMLC_*``/``BYTEPS_*`` variables bpslaunch would set as its environment, calls ``bps.init()`` and
then ``function(*args)``, and returns each rank's JSON result. The workers are forked from a fork
server (one per pytest process, started on first use, ending with it) that has imported torch,
``torch._dynamo`` and ``dynamix_byteps.torch`` already, which spares each worker the seconds those
imports take (every torch optimizer imports ``torch._dynamo`` when it is first built); for a
TensorFlow case (a ``tf_*`` module or a ``tensorflow*`` function) it has imported TensorFlow, Keras and
``dynamix_byteps.tensorflow`` too (another ~7 s of CPU per worker), and torch cases never run in a
process that imported them. A hard
timeout kills every child; children are always reaped, also when the test fails. With
``servers=K`` the job runs the ``ps`` engine: K summation servers (``python -m
dynamix_byteps.engine.ps_server``) start first and are killed after the workers have exited.
"""

from __future__ import annotations

import atexit
import importlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

from dynamix_byteps.launcher.topology import free_port

REPO = Path(__file__).resolve().parent.parent
_ENTRY = "import sys, multiworker; multiworker.run_target(*sys.argv[1:])"
# What the fork server imports once. torch._dynamo: the first torch.optim optimizer a process builds
# imports it (~800 modules, ~2 s of CPU), so each worker that trains would pay it after the fork.
_PRELOADED = ["torch", "torch._dynamo", "dynamix_byteps.torch", "multiworker"]
# What it imports besides for a TensorFlow case: in each worker these took ~7 s of CPU (TensorFlow 2.21).
_TENSORFLOW = ["tensorflow", "keras", "dynamix_byteps.tensorflow", "dynamix_byteps.tensorflow.keras"]
_preloaded: list[str] | None = None  # what the running fork server imported


def run_target(target: str, args_json: str, out: str) -> None:
    """A worker's body: join the job, write ``{"ok": target(*args)}`` (or the exception it raised)
    as JSON to the file ``out``, leave the job."""
    import torch

    torch.set_num_threads(1)
    import dynamix_byteps.torch as bps

    module, func = target.split(":")
    bps.init()
    try:
        result = {"ok": getattr(importlib.import_module(module), func)(*json.loads(args_json))}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    bps.shutdown()


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
    """The command of one worker (a fresh interpreter) that runs ``target(*args)`` and writes its
    JSON result to ``out``; run it with :func:`worker_env`'s environment."""
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


def _fork_server(target: str) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's fork server (one per process) with :data:`_PRELOADED` imported, and
    :data:`_TENSORFLOW` when ``target`` is a TensorFlow case; a server that imported
    otherwise is stopped first (its workers run on). It exits when this process's end of its pipe
    closes (this process exits); a worker's environment replaces the server's."""
    global _preloaded
    module, function = target.split(":")
    tensorflow_case = module.startswith("tf_") or function.startswith("tensorflow")
    preload = _PRELOADED + (_TENSORFLOW if tensorflow_case else [])
    context = multiprocessing.get_context("forkserver")
    if preload != _preloaded:
        multiprocessing.forkserver._forkserver._stop()
        context.set_forkserver_preload(preload)
        with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):  # OpenBLAS and OpenMP size their pools at import
            multiprocessing.forkserver.ensure_running()
        _preloaded = preload
    return context


def _forked_worker(target: str, args_json: str, out: str, output: str, env: dict[str, str]) -> None:
    """:func:`run_target` in a child of the fork server, as a fresh worker would run it: ``env`` as
    its whole environment, stdout and stderr into the file ``output``, exit handlers run at the end."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    import numpy

    numpy.random.seed()  # a fresh interpreter draws a seed of its own; forked ones share the server's
    try:
        run_target(target, args_json, out)
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child ends with os._exit, which skips them


def _start_worker(target: str, args: list, files: str, env: dict[str, str]) -> multiprocessing.Process:
    process = _fork_server(target).Process(target=_forked_worker,
                                     args=(target, json.dumps(args), f"{files}.json", f"{files}.out", env))
    process.start()
    return process


def _exit_codes(workers: list[multiprocessing.Process], timeout: float) -> list[int | None]:
    """Each worker's exit code once all have exited, None for those still running after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    for process in workers:
        process.join(max(deadline - time.monotonic(), 0))
    return [process.exitcode for process in workers]


def _end(workers: list[multiprocessing.Process], servers: list[subprocess.Popen]) -> None:
    """Kill whatever still runs and reap it all."""
    for process in workers:
        if process.exitcode is None:
            process.kill()
        process.join()
        process.close()
    for proc in servers:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _output(files: str) -> str:
    """What a worker wrote to stdout and stderr."""
    path = Path(f"{files}.out")
    return path.read_text(errors="replace") if path.exists() else "(none: it died before it could redirect them)"


def run_workers(n: int, target: str, *args, timeout: float = 120, env: dict | None = None,
                servers: int = 0) -> list[dict]:
    """Results of ``target(*args)`` on ranks 0..n-1: ``{"ok": value}`` or ``{"error": ..., "message": ...}``.

    Raises:
        TimeoutError: ranks still ran after ``timeout`` seconds (all are killed); shows their output.
        AssertionError: a rank exited without a result; shows its exit code and output.
    """
    port = free_port()
    if servers:
        env = {**ps_env(servers, free_port()), **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"rank{rank}") for rank in range(n)]
        workers, server_procs = [], []
        try:
            if servers:
                server_procs = start_servers(servers, n, worker_env(0, n, port, **env))
            for rank in range(n):
                workers.append(_start_worker(target, list(args), files[rank], worker_env(rank, n, port, **(env or {}))))
            exit_codes = _exit_codes(workers, timeout)
        finally:
            _end(workers, server_procs)
        late = [rank for rank, code in enumerate(exit_codes) if code is None]
        if late:
            raise TimeoutError(f"{target}: ranks {late} still ran after {timeout:g} s and were killed; their output:\n"
                               + "\n".join(f"rank {rank}:\n{_output(files[rank])}" for rank in late))
        results = []
        for rank, code in enumerate(exit_codes):
            if not os.path.exists(f"{files[rank]}.json"):
                raise AssertionError(f"rank {rank} exited {code} without a result:\n{_output(files[rank])}")
            with open(f"{files[rank]}.json") as f:
                results.append(json.load(f))
        return results


def ok(results: list[dict]) -> list:
    """Every rank's value from :func:`run_workers`' results; fails the test naming the first rank that raised."""
    for rank, result in enumerate(results):
        assert "ok" in result, f"rank {rank} raised {result.get('error')}: {result.get('traceback')}"
    return [result["ok"] for result in results]
