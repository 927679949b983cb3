"""Does the fitted simulator charge a larger batch what real runs pay? Samples to each training
loss, recorded runs beside simulators.

Input: decision logs of the same job at several global batches, recorded with a scheduler so that
every interval's loss is logged (the first gives the timings to ``dynamix sim fit``)::

    for seed in 43 44; do for b in 64 32 128 256; do
      bpslaunch -n 4 --policy static --decision-interval 5 --log-dir runs/static$b-$seed -- \\
          python examples/torch_fashion_mnist.py --batch-size $b --epochs 1000 --seed $seed --time-budget 150
    done; done
    python benchmarks/sim_calibration.py runs/static64-43 runs/static*-*

For each recorded run: its global batch ``M`` (median over intervals) and the samples at which its
training loss, averaged over :data:`~dynamix_byteps.policy.sim.fit.END_INTERVALS` consecutive
intervals, first falls to each ``--losses`` level (linear between the two averages around it).
Beside them, the samples each simulator needs to the same loss at the same constant ``M``
(:func:`critical_batch.simulated_samples`). Runs at the same global batch (repeats at other seeds)
pool: the median of those that reached the loss; every figure is also shown as a ratio to the
reference global batch's (``--reference``, default the first run's):

* ``fit``: ``dynamix sim fit`` of all the runs (noise scale calibrated across their batches);
* ``one run``: the fit of the first run alone (progress set by the measured noise scale);
* ``--sim``: a parameter file (default the library policy ``small-cnn-sgd``'s).

Prints the table and writes JSON (``--out``, default ``benchmarks/results/sim_calibration.json``).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from common import RESULTS, markdown_table, publish, run_main, text_table
from critical_batch import LIBRARY_SIM, simulated_samples

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.sim.fit import END_INTERVALS, RunLog, fit_log, load_log
from dynamix_byteps.policy.sim.params import SimParams

LOSSES = (0.5, 0.4, 0.3, 0.25)


def samples_to_loss(log: RunLog, loss: float) -> float | None:
    """Samples ``log``'s run had trained when its training loss, averaged over ``END_INTERVALS``
    consecutive logged intervals (placed at the mean of their middles), first fell to ``loss``;
    linear between the two averages around the crossing. None: never, already at the first, or
    fewer than ``END_INTERVALS`` losses logged."""
    per_interval = np.diff(log.steps, prepend=0) * log.batch.sum(axis=1)
    middle = np.cumsum(per_interval) - per_interval / 2.0
    known = np.isfinite(log.loss)
    if known.sum() < END_INTERVALS:
        return None
    window = np.ones(END_INTERVALS) / END_INTERVALS
    losses = np.convolve(log.loss[known], window, mode="valid")
    samples = np.convolve(middle[known], window, mode="valid")
    below = np.flatnonzero(losses <= loss)
    if not below.size or below[0] == 0:
        return None
    k = below[0]
    return float(np.interp(loss, [losses[k], losses[k - 1]], [samples[k], samples[k - 1]]))


def _simulated(params: SimParams, batch: int, loss: float) -> float | None:
    stats = params.stats
    if not stats.initial_loss > loss > stats.min_loss:
        return None
    samples = simulated_samples(replace(params, stats=replace(stats, target_loss=loss)), batch)
    return None if samples == np.inf else samples


def _ratios(samples: dict[int, float | None], reference: int) -> list[float | None]:
    base = samples[reference]
    return [None if v is None or base is None else v / base for v in samples.values()]


def analyse(logs: list[RunLog], sims: dict[str, SimParams], losses, reference: int | None = None) -> dict:
    """Per loss level: each run's samples, their median per global batch (over the runs that got
    there) and its ratio to the ``reference`` global batch's (default: the first run's), beside each
    simulator's at the same global batches (rounded to split evenly over its workers).

    Raises:
        ValueError: ``reference`` is not one of the runs' global batches.
    """
    of_run = [int(round(float(np.median(log.batch.sum(axis=1))))) for log in logs]
    batches = sorted(set(of_run))
    reference = of_run[0] if reference is None else reference
    if len(batches) < 2:
        raise ValueError(f"every run has global batch {batches[0]}; give runs at two or more global batches")
    if reference not in batches:
        raise ValueError(f"the runs have global batches {batches}; --reference {reference} must be one")
    rows = []
    for loss in losses:
        each = [samples_to_loss(log, loss) for log in logs]
        medians = {}
        for batch in batches:
            reached = [v for v, b in zip(each, of_run) if b == batch and v is not None]
            medians[batch] = float(np.median(reached)) if reached else None
        row = {"loss": loss, "runs": [{"global_batch": b, "samples": v} for b, v in zip(of_run, each)],
               "recorded": {"median_samples": list(medians.values()), "ratio": _ratios(medians, reference)}}
        for name, params in sims.items():
            n = params.num_workers
            simulated = {b: _simulated(params, max(n, round(b / n) * n), loss) for b in batches}
            row[name] = {"samples": list(simulated.values()), "ratio": _ratios(simulated, reference)}
        rows.append(row)
    return {"benchmark": "sim_calibration", "runs": [log.path.parent.name for log in logs], "global_batches": batches,
            "reference_batch": reference, "simulators": list(sims), "rows": rows}


def _cell(value: float | None, digits: str = ".2f") -> str:
    return "-" if value is None else format(value, digits)


def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per loss level, the recorded samples per global batch (each run's, / between
    runs), then the ratios of the recorded medians and of every simulator to the reference batch."""
    batches, reference = report["global_batches"], report["reference_batch"]
    header = ["training loss", f"recorded k samples, M={','.join(map(str, batches))}", f"recorded E(M)/E({reference})",
              *(f"{name}: E(M)/E({reference})" for name in report["simulators"])]
    lines = []
    for row in report["rows"]:
        per_batch = ["/".join(_cell(None if run["samples"] is None else run["samples"] / 1000, ".0f")
                              for run in row["runs"] if run["global_batch"] == batch) for batch in batches]
        lines.append([f"{row['loss']:g}", ", ".join(per_batch),
                      *(", ".join(_cell(r) for r in row[name]["ratio"]) for name in ("recorded", *report["simulators"]))])
    return header, lines


def markdown(report: dict) -> str:
    """The table as GitHub markdown."""
    return markdown_table(*table(report))


def _losses(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of losses, e.g. 0.4,0.3") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every loss must be a finite number > 0")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="--log-dir of bpslaunch runs of one job at several global batches")
    parser.add_argument("--losses", type=_losses, default=list(LOSSES), help="training losses to compare (default 0.5,0.4,0.3,0.25)")
    parser.add_argument("--sim", type=Path, default=LIBRARY_SIM, help="one more SimParams JSON (default: small-cnn-sgd's)")
    parser.add_argument("--reference", type=int, default=None,
                        help="global batch the ratios divide by (default: the first run's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sim_calibration.json")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs, at different global batches")
    try:
        logs = [load_log(run) for run in args.runs]
        named = args.sim.parent.name if args.sim.stem == "sim_params" else args.sim.stem  # a library policy's folder
        sims = {"fit": fit_log(logs[0], logs[1:])[0], "one run": fit_log(logs[0])[0], named: SimParams.from_json(args.sim)}
        report = analyse(logs, sims, args.losses, args.reference)
    except (ConfigurationError, ValueError) as error:
        print(f"sim_calibration: {error}", file=sys.stderr)
        return 2
    return publish("sim_calibration", args.out, report, text_table(*table(report)))


if __name__ == "__main__":
    run_main(main)
