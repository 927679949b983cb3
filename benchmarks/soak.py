"""Soak test: a 4-worker job with ``--policy goodput`` under a schedule of faults.

    python benchmarks/soak.py                 # 20 minutes
    python benchmarks/soak.py --minutes 60
    python benchmarks/soak.py --quick         # about 1 minute, the same faults compressed

The job trains a small MLP through ``DynamicBatchSampler`` under ``bpslaunch --policy goodput
--monitor proc``. While it runs:

* every minute (``--quick``: every 15 s) a burst of junk: 100 ``ReportMetrics`` and 20 ``Register``
  calls with out-of-range and non-finite fields, from a client that is not a worker;
* at 25 % of the time the scheduler is paused (SIGSTOP) for 5 s (``--quick``: 2 s), then resumed;
* at 50 % the node agent is SIGKILLed (the launcher does not restart it; training goes on);
* at 90 % the scheduler is SIGKILLed (training goes on with the last assignment).

Printed and written to ``benchmarks/results/soak.json``: decisions made, whether a decision came
within 30 s after each fault cleared (the scheduler kill excepted), refused reports in the
workers' logs, the junk calls' status codes, the RSS of every process of the job near the start
and before the scheduler kill, the job's exit code, and what is left afterwards: processes that
carry the job's tag and ``/dev/shm`` entries that were not there before. Targets: every fault
followed by a decision, 0 leftovers, RSS growth < 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import write_report

from dynamix_byteps.launcher.topology import free_port

REPO = Path(__file__).resolve().parents[1]

TAG_ENV = "DYNAMIX_SOAK_TAG"
DECIDED_WITHIN_S = 30.0


# ---- the worker ------------------------------------------------------------------------------


def worker(seconds: float) -> int:
    """One worker of the soak job: trains until rank 0 says ``seconds`` have passed."""
    import torch

    import dynamix_byteps.torch as bps

    torch.set_num_threads(1)
    bps.init()
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8192, 32, generator=generator),
                                          torch.randint(0, 10, (8192,), generator=generator))
    sampler = bps.DynamicBatchSampler(data, 32, seed=1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    start, steps, epoch, stop = time.monotonic(), 0, 0, False
    while not stop:
        sampler.set_epoch(epoch)
        for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            bps.report_loss(loss)
            steps += 1
            if steps % 10 == 0:  # every worker stops at the same step
                stop = bps.broadcast_object(time.monotonic() - start >= seconds, root_rank=0, name="soak.stop")
                if stop:
                    break
        epoch += 1
    print(f"steps {steps}", flush=True)
    bps.shutdown()
    return 0


# ---- faults ----------------------------------------------------------------------------------


def junk_burst(address: str) -> dict[str, int]:
    """100 junk reports and 20 junk registrations at the scheduler; returns the status codes' counts."""
    import grpc

    from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc

    codes: dict[str, int] = {}
    reports = [dynamix_pb2.Report(rank=2**32 - 1 if i % 3 == 0 else i % 4, step=2**64 - 1 if i % 2 else i,
                                  local_batch_size=i * 1000003 % 2**32, compute_s=[float("nan"), 1e308, -1.0][i % 3],
                                  push_pull_s=float("inf"), samples_per_s=-5.0, loss=float("nan"))
               for i in range(100)]
    registers = [dynamix_pb2.WorkerInfo(rank=i % 8, world_size=[0, 4, 2**32 - 1][i % 3], host="junk" * 50,
                                        min_batch=2**32 - 1, max_batch=1, batch_size=0, step=2**64 - 1)
                 for i in range(20)]
    with grpc.insecure_channel(address) as channel:
        stub = dynamix_pb2_grpc.SchedulerStub(channel)
        for call, messages in ((stub.ReportMetrics, reports), (stub.Register, registers)):
            for message in messages:
                try:
                    call(message, timeout=2.0)
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                codes[code] = codes.get(code, 0) + 1
    return codes


def tagged_processes(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG_ENV) == tag:
                found.append(process)
        except psutil.Error:
            continue
    return found


def role(process: psutil.Process) -> str:
    """``launcher``, ``scheduler``, ``agent``, ``guardian`` or ``worker <local rank>``."""
    try:
        command = " ".join(process.cmdline())
        if "dynamix_byteps.launcher" in command:
            return "launcher"
        if "_guardian.py" in command:
            return "guardian"
        for name in ("scheduler", "agent"):
            if f"dynamix_byteps.cli {name}" in command:
                return name
        return f"worker {process.environ().get('BYTEPS_LOCAL_RANK', '?')}"
    except psutil.Error:
        return "gone"


def rss_by_role(launcher: psutil.Process) -> dict[str, float]:
    """MiB of resident memory of the launcher and each of its descendants, by role."""
    rss = {}
    for process in [launcher, *launcher.children(recursive=True)]:
        try:
            name = role(process)
            if name != "gone" and not process.cmdline()[0].endswith("timeout"):
                rss[name] = process.memory_info().rss / 2**20
        except (psutil.Error, IndexError):
            continue
    return rss


def find(launcher: psutil.Process, wanted: str) -> psutil.Process | None:
    for process in launcher.children(recursive=True):
        if role(process) == wanted:
            return process
    return None


def job_id(launcher: psutil.Process) -> str | None:
    """The job id the launcher gave its node agent (``--job``): its workers' mailboxes carry it."""
    agent = find(launcher, "agent")
    try:
        command = agent.cmdline() if agent is not None else []
    except psutil.Error:
        return None
    return command[command.index("--job") + 1] if "--job" in command[:-1] else None


def decision_times(run_dir: Path) -> list[float]:
    path = run_dir / "decisions.jsonl"
    if not path.exists():
        return []
    times = []
    for line in path.read_text().splitlines():
        try:
            times.append(float(json.loads(line)["time"]))
        except (ValueError, KeyError, TypeError):
            continue
    return times


# ---- the run ---------------------------------------------------------------------------------



def schedule(seconds: float, quick: bool) -> list[tuple[float, str]]:
    """(seconds after the start, fault) in time order."""
    every = 15.0 if quick else 60.0
    faults = [(t, "junk") for t in _arange(every / 2, seconds * 0.85, every)]
    faults += [(seconds * 0.25, "pause_scheduler"), (seconds * 0.5, "kill_agent"), (seconds * 0.9, "kill_scheduler")]
    return sorted(faults)


def _arange(start: float, stop: float, step: float) -> list[float]:
    values = []
    while start < stop:
        values.append(start)
        start += step
    return values


def run(minutes: float, quick: bool, workers: int) -> dict:
    seconds = minutes * 60.0
    tag = secrets.token_hex(6)
    run_dir = Path(tempfile.mkdtemp(prefix="dynamix-soak-"))
    scheduler_port = free_port()
    shm_before = set(os.listdir("/dev/shm"))
    command = [sys.executable, "-m", "dynamix_byteps.launcher", "-n", str(workers), "--policy", "goodput",
               "--monitor", "proc", "--scheduler-port", str(scheduler_port), "--decision-interval", "5",
               "--log-dir", str(run_dir), "--timeout", "120", "--",
               sys.executable, str(Path(__file__).resolve()), "--worker", "--seconds", str(seconds)]
    env = dict(os.environ, **{TAG_ENV: tag}, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = open(run_dir / "launcher.log", "wb")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    launcher = psutil.Process(proc.pid)
    events, junk_codes, rss_start, rss_end, job = [], {}, {}, {}, None
    try:
        started = time.monotonic()
        while not decision_times(run_dir) and proc.poll() is None and time.monotonic() - started < 300:
            time.sleep(0.5)  # the first decision: every worker is training
        t0 = time.monotonic()
        rss_start = rss_by_role(launcher)
        job = job_id(launcher)
        for at, fault in schedule(seconds, quick):
            while time.monotonic() - t0 < at and proc.poll() is None:
                time.sleep(0.2)
            if proc.poll() is not None:
                break
            if fault == "kill_scheduler":
                rss_end = rss_by_role(launcher)
            events.append(fire(fault, launcher, scheduler_port, quick, junk_codes))
        if not rss_end:
            rss_end = rss_by_role(launcher)
        code = proc.wait(timeout=seconds + 600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    decided = decision_times(run_dir)
    for event in events:
        if event["fault"] != "kill_scheduler":
            event["decided_after"] = any(event["cleared_at"] < t <= event["cleared_at"] + DECIDED_WITHIN_S for t in decided)
    time.sleep(2)  # the guardian's teardown, when there is one
    leftovers = [f"{p.pid} {role(p)}" for p in tagged_processes(tag)]
    for process in tagged_processes(tag):
        process.kill()
    refused = sum(len(re.findall("refused a report", path.read_text(errors="replace")))
                  for path in run_dir.glob("worker-*.log"))
    return {
        "minutes": minutes, "quick": quick, "workers": workers, "exit_code": code, "run_dir": str(run_dir),
        "decisions": len(decided), "refused_reports": refused, "junk_codes": junk_codes, "faults": events,
        "rss_mib_start": rss_start, "rss_mib_end": rss_end,
        "leftover_processes": leftovers,
        "leftover_shm": sorted(n for n in set(os.listdir("/dev/shm")) - shm_before
                               if job is None or n.startswith(f"dynamix.{job}.")),
    }


def fire(fault: str, launcher: psutil.Process, scheduler_port: int, quick: bool, junk_codes: dict) -> dict:
    """Run one fault; returns when and what, with ``cleared_at`` (wall time it was over)."""
    at = time.time()
    what = fault
    if fault == "junk":
        for code, count in junk_burst(f"127.0.0.1:{scheduler_port}").items():
            junk_codes[code] = junk_codes.get(code, 0) + count
    elif fault == "pause_scheduler":
        target = find(launcher, "scheduler")
        if target is not None:
            target.send_signal(signal.SIGSTOP)
            time.sleep(2.0 if quick else 5.0)
            target.send_signal(signal.SIGCONT)
        else:
            what += " (no scheduler)"
    else:
        target = find(launcher, "agent" if fault == "kill_agent" else "scheduler")
        if target is not None:
            target.kill()
        else:
            what += " (no target)"
    return {"fault": what, "at": at, "cleared_at": time.time()}


def print_table(report: dict) -> None:
    print(f"soak: {report['workers']} workers, {report['minutes']:g} min, exit code {report['exit_code']}, "
          f"{report['decisions']} decisions, {report['refused_reports']} refused reports")
    print(f"{'fault':<24}{'at (s)':>8}  decision within {DECIDED_WITHIN_S:g} s after")
    first = report["faults"][0]["at"] if report["faults"] else 0.0
    for event in report["faults"]:
        decided = event.get("decided_after")
        print(f"{event['fault']:<24}{event['at'] - first:>8.1f}  {'-' if decided is None else ('yes' if decided else 'NO')}")
    print(f"junk calls: {report['junk_codes']}")
    print(f"{'process':<14}{'RSS start MiB':>14}{'RSS end MiB':>13}{'growth':>9}")
    for name in sorted(set(report["rss_mib_start"]) | set(report["rss_mib_end"])):
        start, end = report["rss_mib_start"].get(name), report["rss_mib_end"].get(name)
        growth = f"{(end - start) / start * 100:+.1f}%" if start and end else "-"
        print(f"{name:<14}{_mib(start):>14}{_mib(end):>13}{growth:>9}")
    print(f"leftover processes: {report['leftover_processes'] or 0}; leftover /dev/shm entries: "
          f"{report['leftover_shm'] or 0}")


def _mib(value: float | None) -> str:
    return "gone" if value is None else f"{value:.1f}"  # a process the faults killed has no end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the run, minutes (default 20)")
    parser.add_argument("--quick", action="store_true", help="a 1-minute run with the faults compressed")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.seconds)
    report = run(1.0 if args.quick else args.minutes, args.quick, args.workers)
    print_table(report)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
