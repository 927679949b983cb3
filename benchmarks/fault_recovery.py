"""Elastic restart: time from a killed worker to training resumed on the survivors, and steps lost.

Runs ``bpslaunch -n N --restart-on-failure 1 --checkpoint ...`` with ``tests/scripts/elastic_worker.py``
(a small MLP, one epoch of synthetic data, a checkpoint every --every steps); rank N-1 SIGKILLs
itself before step --kill-step, the launcher restarts the job on N-1 workers, which resume from the
checkpoint. From the workers' per-step records (wall-clock times, one machine):

* ``to_restart_s``: from the killed worker's last trained step to the launcher's restart note
  (noticing the failure, stopping the others within ``--grace-period 2``);
* ``to_resumed_s``: from the killed worker's last trained step to the first step trained on the
  survivors (includes the launcher noticing, stopping the others, and restarting everything:
  interpreter and torch import, rendezvous, checkpoint load, first step);
* ``to_loaded_s``: the same, to the moment the checkpoint was loaded (before the first step);
* ``steps_lost``: steps trained before the failure but after the last checkpoint (trained again).

Each figure is the median over --repeats runs. Prints a table, writes JSON.

    python benchmarks/fault_recovery.py [--workers 4] [--repeats 3] [--every 1] [--hosts 1] [--out PATH]

With ``--hosts H > 1`` (root) the job runs across H network-namespace hosts (``testing.netns``),
the killed rank alone on the last one, which leaves the job; ``to_restart_s`` is not measured then.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_report

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "scripts" / "elastic_worker.py"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fault_recovery.json"


def _records(out: Path, run: int) -> dict[int, list[dict]]:
    return {int(p.name.split(".")[0][len("rank"):]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in out.glob(f"rank*.run{run}.jsonl")}


def one_run(workers: int, batch: int, kill_step: int, every: int, step_sleep: float, timeout_s: float,
            hosts: int = 1) -> dict:
    with tempfile.TemporaryDirectory(prefix="fault-recovery-") as tmp:
        out = Path(tmp, "out")
        out.mkdir()
        samples = batch * workers * (workers - 1) * (kill_step // (workers - 1) + 4)  # a multiple of both global batches
        launcher = ["--batch-size", str(batch), "--restart-on-failure", "1", "--checkpoint", str(Path(tmp, "ckpt.pt")),
                    "--grace-period", "2"]
        command = [sys.executable, str(WORKER), str(out), str(samples), str(workers - 1), str(kill_step),
                   str(step_sleep), str(every)]
        restarted = _run_hosts(hosts, workers, launcher, command, timeout_s) if hosts > 1 else \
            _run_local(workers, launcher, command, timeout_s)
        before, after = _records(out, 0), _records(out, 1)
        killed_last = max(r["time"] for r in before[workers - 1] if "step" in r)
        resumed_at = after[0][0]["resumed_at"]
        last_trained = max(r["step"] for records in before.values() for r in records if "step" in r)
        return {
            "to_restart_s": None if restarted is None else restarted - killed_last,
            "to_loaded_s": min(records[0]["time"] for records in after.values()) - killed_last,
            "to_resumed_s": min(r["time"] for records in after.values() for r in records if "step" in r) - killed_last,
            "steps_lost": last_trained + 1 - resumed_at,
            "resumed_at": resumed_at,
        }


def _run_local(workers: int, launcher: list[str], command: list[str], timeout_s: float) -> float:
    """One bpslaunch -n; returns the wall-clock time of its restart note."""
    proc = subprocess.Popen([sys.executable, "-m", "dynamix_byteps.launcher", "-n", str(workers), *launcher, "--",
                             *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    restarted, lines = None, []
    try:
        for line in proc.stderr:  # the launcher's own notes, timestamped as they come
            lines.append(line)
            if restarted is None and "restart 1 of 1" in line:
                restarted = time.time()
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or restarted is None:
        raise RuntimeError(f"the job failed with code {proc.returncode}:\n{''.join(lines)[-3000:]}")
    return restarted


def _run_hosts(hosts: int, workers: int, launcher: list[str], command: list[str], timeout_s: float) -> None:
    """One job across ``hosts`` network-namespace hosts (root): the last rank alone on the last host,
    which leaves the job at the restart; the launchers' notes are not timed (None)."""
    from dynamix_byteps.testing import netns

    slots = [workers - hosts + 1] + [1] * (hosts - 1)
    if slots[0] < 1:
        raise SystemExit(f"--hosts {hosts} needs --workers >= {hosts}")
    with netns.Testbed(hosts) as bed:
        result = netns.run_job(bed, slots, command, launcher, timeout_s=timeout_s, grace_s=5)
    if not result.ok:
        raise RuntimeError(f"the job failed with codes {result.returncodes}:\n{result.outputs[0][-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="workers before the failure (default 4)")
    parser.add_argument("--batch", type=int, default=6, help="local batch size (default 6)")
    parser.add_argument("--kill-step", type=int, default=7, help="step before which the last rank dies (default 7)")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5], help="checkpoint intervals in steps (default 1 5)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (default 0)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; medians are reported (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    parser.add_argument("--hosts", type=int, default=1, help="emulated hosts (network namespaces, needs root); the "
                        "killed last rank is alone on the last host (default 1: one bpslaunch -n)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.workers < 2 or args.kill_step < 1 or args.repeats < 1 or min(args.every) < 1:
        parser.error("need --workers >= 2, --kill-step >= 1, --repeats >= 1 and --every >= 1")
    results = []
    print(f"{'every':>5}  {'to_restart_s':>12}  {'to_loaded_s':>11}  {'to_resumed_s':>12}  {'steps_lost':>10}  runs")
    for every in args.every:
        runs = [one_run(args.workers, args.batch, args.kill_step, every, args.step_sleep, args.timeout, args.hosts)
                for _ in range(args.repeats)]
        row = {"checkpoint_every": every, "runs": runs}
        for key in ("to_restart_s", "to_loaded_s", "to_resumed_s", "steps_lost"):
            values = [r[key] for r in runs if r[key] is not None]
            row[f"{key}_median"] = statistics.median(values) if values else float("nan")
        results.append(row)
        print(f"{every:>5}  {row['to_restart_s_median']:>12.2f}  {row['to_loaded_s_median']:>11.2f}  {row['to_resumed_s_median']:>12.2f}  "
              f"{row['steps_lost_median']:>10g}  {len(runs)}")
    write_report(args.out, {"benchmark": "fault_recovery", "hosts": args.hosts, "workers": args.workers,
                            "survivors": args.workers - 1,
                            "batch": args.batch, "kill_step": args.kill_step, "step_sleep_s": args.step_sleep,
                            "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
