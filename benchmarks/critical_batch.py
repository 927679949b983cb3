"""Samples to a target accuracy against the global batch: real static-batch runs beside the simulator.

McCandlish et al. (*An Empirical Model of Large-Batch Training*, arXiv 1812.06162, eq. 2.11–2.12)
predict the samples a run at global batch ``M`` needs to reach a target as ``E(M) = E_min + S_min·M``
(``S_min`` optimiser steps at an infinite batch, ``E_min`` samples in the small-batch limit), so the
critical batch ``B_crit = E_min / S_min`` is where doubling the batch stops halving the steps. The
training simulator charges a larger batch through the same law with its ``B_noise(L)`` and learning
curve; a ``B_noise`` that is too large late in training makes large batches look free.

Reads ``benchmarks/time_to_accuracy.py`` reports and keeps their ``static<b>`` runs (global batch
``M = b × workers``; a fixed batch follows the same trajectory however fast its workers are, so
runs of different scenarios pool). Per target accuracy:

* each run's samples at its first crossing (linear in time between the two evaluations around it);
* per global batch: the median of those samples and the runs that reached the target;
* a least-squares fit of ``E = E_min + S_min·M`` over all the runs that reached it, and
  ``B_crit = E_min / S_min`` with a 90% bootstrap interval over the runs (resampled within each
  global batch); ``inf`` where ``S_min <= 0`` (no measurable cost of a larger batch);
* ``E(M) / E(reference)``: the median samples relative to the reference global batch (``--reference``,
  default 256), beside the simulator's ratio for a :class:`~dynamix_byteps.policy.sim.params.SimParams`
  file (``--sim``, default the library policy ``small-cnn-sgd``'s): its samples to its target loss at
  the same constant global batches, split evenly over its workers (its statistics are noise-free, so
  one episode per batch).

    python benchmarks/time_to_accuracy.py --scenario homogeneous --configs static64,static128,static256 \\
        --repeats 2 --budget 150 --out benchmarks/results/time_to_accuracy_homogeneous_large_static.json
    python benchmarks/critical_batch.py benchmarks/results/time_to_accuracy_homogeneous_large_static.json \\
        benchmarks/results/time_to_accuracy_straggler.json

Prints the table and writes JSON (``--out``, default ``benchmarks/results/critical_batch.json``).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from common import REPO, RESULTS, interval90, markdown_table, shown_path, summarise_reports
from time_to_accuracy import time_to_target

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.sim.dynamics import Simulator
from dynamix_byteps.policy.sim.params import SimParams

LIBRARY_SIM = REPO / "dynamix_byteps" / "policy" / "library" / "small-cnn-sgd" / "sim_params.json"
ROUNDS = 2000


def samples_at(curve: list[dict], seconds: float) -> float:
    """Samples trained at ``seconds`` of training, linear between the curve's points (0 at 0 s)."""
    times = [0.0, *(point["train_s"] for point in curve)]
    return float(np.interp(seconds, times, [0.0, *(point["samples"] for point in curve)]))


def static_runs(reports: list[dict]) -> list[tuple[int, dict]]:
    """``(global batch, run)`` for every ``static<b>`` run of ``reports``."""
    out = []
    for report in reports:
        for run in report["runs"]:
            if run["config"].startswith("static"):
                out.append((int(run["config"].removeprefix("static")) * report["workers"], run))
    return out


def fit_critical_batch(batches, samples) -> tuple[float, float, float]:
    """Least squares of ``samples = E_min + S_min · batches`` (1-D, equal length, >= 2 distinct batches):
    ``(E_min, S_min, B_crit)``, ``B_crit = E_min / S_min`` or ``inf`` when ``S_min <= 0``."""
    slope, intercept = np.polyfit(np.asarray(batches, float), np.asarray(samples, float), 1)
    return float(intercept), float(slope), float(intercept / slope) if slope > 0 else math.inf


def _bootstrap_critical_batch(by_batch: dict[int, list[float]], seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(ROUNDS):
        batches, samples = [], []
        for batch, runs in by_batch.items():
            drawn = rng.choice(runs, size=len(runs))
            batches += [batch] * len(runs)
            samples += list(drawn)
        values.append(fit_critical_batch(batches, samples)[2])
    return interval90(np.asarray(values), method="inverted_cdf")


def simulated_samples(params: SimParams, global_batch: int) -> float:
    """Samples the simulator trains to its target loss at a constant ``global_batch`` split evenly
    over its workers (the bounds widened to allow it); ``inf`` if it does not reach the target.

    Raises:
        ValueError: ``global_batch`` does not split evenly over the workers.
    """
    n = params.num_workers
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} does not split evenly over {n} simulated workers")
    local = global_batch // n
    sim = Simulator(replace(params, initial_batch=(local,) * n, min_batch=min(params.min_batch, local),
                            max_batch=max(params.max_batch, local), max_decisions=100_000),
                    rng=np.random.default_rng(0))
    sim.reset()
    while not sim.done and sim.time_to_target is None:
        sim.step([local] * n)
    return float(sim.steps * global_batch) if sim.time_to_target is not None else math.inf


def analyse(reports: list[dict], params: SimParams, reference: int) -> dict:
    """Per target of the reports: samples per global batch, the fitted critical batch, and the
    ratios to ``reference`` beside the simulator's.

    Raises:
        ValueError: the reports have no static runs, or ``reference`` is not among their global batches.
    """
    runs = static_runs(reports)
    batches = sorted({batch for batch, _ in runs})
    if reference not in batches:
        raise ValueError(f"the reports' static runs have global batches {batches}; --reference {reference} must be one")
    simulated = {batch: simulated_samples(params, batch) for batch in batches}
    rows = []
    for target in sorted({t for report in reports for t in report["targets"]}):
        reached: dict[int, list[float]] = {batch: [] for batch in batches}
        for batch, run in runs:
            seconds = time_to_target(run["curve"], target)
            if seconds is not None:
                reached[batch].append(samples_at(run["curve"], seconds))
        medians = {batch: float(np.median(v)) if v else None for batch, v in reached.items()}
        cells = [{"global_batch": batch, "runs": sum(1 for b, _ in runs if b == batch), "samples": reached[batch],
                  "median_samples": medians[batch],
                  "ratio": None if medians[batch] is None or medians[reference] is None
                  else medians[batch] / medians[reference]} for batch in batches]
        row = {"target": target, "batches": cells, "critical_batch": None, "critical_batch_interval": None}
        fitted = {batch: v for batch, v in reached.items() if v}
        if len(fitted) >= 2:
            flat = [(batch, s) for batch, values in fitted.items() for s in values]
            e_min, s_min, b_crit = fit_critical_batch(*zip(*flat))
            row |= {"e_min": e_min, "s_min": s_min, "critical_batch": b_crit,
                    "critical_batch_interval": _bootstrap_critical_batch(fitted)}
        rows.append(row)
    return {"benchmark": "critical_batch", "reference": reference, "global_batches": batches, "rows": rows,
            "simulated": [{"global_batch": batch, "samples": simulated[batch],
                           "ratio": simulated[batch] / simulated[reference]} for batch in batches],
            "sim_target_loss": params.stats.target_loss}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one per target, then the simulator's ratios."""
    batches, reference = report["global_batches"], report["reference"]
    header = ["target", *(f"M={b}: k samples (reached/runs)" for b in batches),
              f"E(M)/E({reference}), M={','.join(map(str, batches))}", "B_crit [90%]"]
    lines = []
    for row in report["rows"]:
        cells = [f"{row['target']:.0%}"]
        for cell in row["batches"]:
            median = "-" if cell["median_samples"] is None else f"{cell['median_samples'] / 1000:.0f}"
            cells.append(f"{median} ({len(cell['samples'])}/{cell['runs']})")
        cells.append(", ".join(_ratio(cell["ratio"]) for cell in row["batches"]))
        if row["critical_batch"] is None:
            cells.append("-")
        else:
            low, high = row["critical_batch_interval"]
            cells.append(f"{row['critical_batch']:.0f} [{low:.0f}, {high:.0f}]")
        lines.append(cells)
    lines.append([f"simulator (to loss {report['sim_target_loss']:g})", *("" for _ in batches),
                  ", ".join(_ratio(cell["ratio"]) for cell in report["simulated"]), ""])
    return header, lines


def markdown(report: dict) -> str:
    """The table as GitHub markdown."""
    return markdown_table(*table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="time_to_accuracy.py JSON reports")
    parser.add_argument("--sim", type=Path, default=LIBRARY_SIM, help="SimParams JSON (default: small-cnn-sgd's)")
    parser.add_argument("--reference", type=int, default=256, help="global batch the ratios divide by (default 256)")
    parser.add_argument("--out", type=Path, default=RESULTS / "critical_batch.json")
    args = parser.parse_args(argv)
    try:
        params = SimParams.from_json(args.sim)
    except ConfigurationError as error:
        print(f"critical_batch: --sim: {error}", file=sys.stderr)
        return 2
    return summarise_reports("critical_batch", args.reports, lambda reports: analyse(reports, params, args.reference),
                             table, args.out, {"sim": shown_path(args.sim)})


if __name__ == "__main__":
    sys.exit(main())
