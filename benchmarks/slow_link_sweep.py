"""How far splitting a fixed global batch can balance a slow link, at several link rates.

Reads ``benchmarks/time_to_accuracy.py`` reports of ``static64`` and ``proportional`` under
``--engine ps``, one per scenario (``network`` and ``network-<rate>``: rank 3 behind a tbf link;
``homogeneous``: no slow link), and compares the job's step time, not the time to a target: both
configurations keep the global batch at 256, so they need the same samples and their times to a
target differ by their steps and the learning noise. Per link rate:

* the step of each configuration (the job's training seconds / steps, ms): median over the
  report's seeds and its range;
* ``proportional / static64``: the ratio of the median steps with a 90% bootstrap interval over
  the seed pairs, and its verdict (``ahead``, ``tie``, ``behind``; ``n/a`` with one seed, whose
  interval is that seed's ratio alone);
* the slow-link worker under ``proportional``: its mean batch and its compute and push+pull ms per
  step (from its own timing: ``compute_s`` and ``push_pull_s`` over its steps);
* ``link floor``: that push+pull over ``static64``'s step. A split of the global batch cannot make
  the step shorter than the slow-link worker's own transfer, so no split reaches a ratio below it;
* ``CPU floor``: the ``homogeneous`` report's ``static64`` step (the same global batch, no slow
  link) over ``static64``'s step: the machine's cores must still compute all 256 samples.

A split helps only as far as both floors allow: ``proportional / static64`` stays above about
``max(link floor, CPU floor)``.

    for s in network network-200 network-300; do
        python benchmarks/time_to_accuracy.py --scenario $s --engine ps --num-servers 2 \\
            --configs static64,proportional --repeats 3 --budget 60 \\
            --out benchmarks/results/time_to_accuracy_${s}_ps_60s.json
    done
    python benchmarks/time_to_accuracy.py --scenario homogeneous --engine ps --num-servers 2 \\
        --configs static64 --repeats 3 --budget 60 --out benchmarks/results/time_to_accuracy_homogeneous_ps_60s.json
    python benchmarks/slow_link_sweep.py benchmarks/results/time_to_accuracy_*_ps_60s.json

Prints the table and writes JSON (``--out``, default ``benchmarks/results/slow_link_sweep.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from common import MIN_PAIRS, RESULTS, markdown_table, paired_ratio_interval, summarise_reports, verdict

from dynamix_byteps.scenarios import scenario

STATIC, SPLIT = "static64", "proportional"


def step_ms(run: dict) -> float:
    """The job's mean step of one run, ms."""
    return 1000.0 * run["train_s"] / run["steps"]


def _runs(report: dict, config: str) -> list[dict]:
    return sorted((run for run in report["runs"] if run["config"] == config), key=lambda run: run["seed"])


def _per_step_ms(worker: dict, key: str) -> float:
    return 1000.0 * worker[key] / worker["steps"]


def sweep_row(report: dict, cpu_floor_ms: float) -> dict:
    """One link rate's row from a report with ``static64`` and ``proportional`` runs at the same seeds.

    Raises:
        ValueError: the report is not under ``--engine ps``, its scenario has no link, or the two
            configurations were not run at the same seeds.
    """
    name = report["scenario"]
    if report.get("engine") != "ps":
        raise ValueError(f"{name}: engine {report.get('engine')!r}; the sweep compares runs under --engine ps")
    links = scenario(name).links
    if not links:
        raise ValueError(f"{name}: the scenario has no slow link")
    static, split = _runs(report, STATIC), _runs(report, SPLIT)
    if not static or [run["seed"] for run in static] != [run["seed"] for run in split]:
        raise ValueError(f"{name}: needs {STATIC} and {SPLIT} at the same seeds, got "
                         f"{[r['seed'] for r in static]} and {[r['seed'] for r in split]}")
    static_ms, split_ms = [step_ms(r) for r in static], [step_ms(r) for r in split]
    slow = [next(w for w in run["worker_statistics"] if w["rank"] == links[0].rank) for run in split]
    interval = paired_ratio_interval(split_ms, static_ms)
    static_median = float(np.median(static_ms))
    transfer_ms = float(np.median([_per_step_ms(w, "push_pull_s") for w in slow]))
    return {"scenario": name, "link_mbit": links[0].rate_mbit, "seeds": [run["seed"] for run in static],
            "static_step_ms": static_ms, "split_step_ms": split_ms,
            "ratio": float(np.median(split_ms)) / static_median, "ratio_interval": interval,
            "verdict": verdict(interval) if len(static) >= MIN_PAIRS else "n/a",
            "slow_batch": float(np.median([w["samples"] / w["steps"] for w in slow])),
            "slow_compute_ms": float(np.median([_per_step_ms(w, "compute_s") for w in slow])),
            "slow_transfer_ms": transfer_ms,
            "link_floor": transfer_ms / static_median, "cpu_floor": cpu_floor_ms / static_median}


def sweep(reports: list[dict]) -> dict:
    """The sweep of ``reports``: exactly one ``homogeneous`` report (its ``static64`` step is the CPU
    floor) and one per linked scenario, rows in order of link rate.

    Raises:
        ValueError: no or several ``homogeneous`` reports, or a row's report is unusable (:func:`sweep_row`).
    """
    homogeneous = [r for r in reports if r["scenario"] == "homogeneous"]
    if len(homogeneous) != 1 or not _runs(homogeneous[0], STATIC):
        raise ValueError(f"needs one homogeneous report with {STATIC} runs (the CPU floor), got {len(homogeneous)}")
    cpu_ms = [step_ms(run) for run in _runs(homogeneous[0], STATIC)]
    rows = sorted((sweep_row(r, float(np.median(cpu_ms))) for r in reports if r is not homogeneous[0]),
                  key=lambda row: row["link_mbit"])
    budgets = sorted({r["budget_s"] for r in reports})
    return {"benchmark": "slow_link_sweep", "budget_s": budgets, "cpu_floor_step_ms": cpu_ms, "rows": rows}


def _steps(values: list[float]) -> str:
    return f"{np.median(values):.0f} [{min(values):.0f}, {max(values):.0f}]"


def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the sweep's table."""
    header = ["link Mbit/s", "static64 step ms [range]", "proportional step ms [range]", "proportional / static64 [90%]",
              "slow-link worker: batch, compute ms, push+pull ms", "link floor", "CPU floor"]
    lines = [[f"{row['link_mbit']:g}", _steps(row["static_step_ms"]), _steps(row["split_step_ms"]),
              f"{row['ratio']:.2f}x [{row['ratio_interval'][0]:.2f}x, {row['ratio_interval'][1]:.2f}x] {row['verdict']}",
              f"{row['slow_batch']:.0f}, {row['slow_compute_ms']:.0f}, {row['slow_transfer_ms']:.0f}",
              f"{row['link_floor']:.2f}x", f"{row['cpu_floor']:.2f}x"] for row in report["rows"]]
    return header, lines


def markdown(report: dict) -> str:
    """The sweep's table as GitHub markdown."""
    return markdown_table(*table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="time_to_accuracy.py JSON reports")
    parser.add_argument("--out", type=Path, default=RESULTS / "slow_link_sweep.json")
    args = parser.parse_args(argv)
    return summarise_reports("slow_link_sweep", args.reports, sweep, table, args.out)


if __name__ == "__main__":
    sys.exit(main())
