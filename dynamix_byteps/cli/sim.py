"""``dynamix sim fit``: the simulator's command-line front end (numpy only, no torch or Ray)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynamix_byteps.argtypes import output_path
from dynamix_byteps.errors import ConfigurationError, UsageError

__all__ = ["add_parser", "format_fit_table", "run_fit"]

FITTED_FILE = "sim_params.json"


def add_parser(sub) -> None:
    """Add ``sim`` with its ``fit`` subcommand to the ``dynamix`` subcommands ``sub``."""
    p = sub.add_parser("sim", help="fit the training simulator to a recorded run",
                       description="Tools for the training simulator the PPO agent learns in.")
    cmds = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)
    f = cmds.add_parser(
        "fit", help="fit simulator parameters (SimParams JSON) to a run's decision log",
        description="Read RUN_DIR/decisions.jsonl of a `bpslaunch --policy ... --log-dir RUN_DIR` run, fit per-worker\n"
                    "compute time a_i + b/θ_i, jitter, communication and the noise-scale/loss model, write\n"
                    "the SimParams JSON and print, per worker, the fit and the recorded vs replayed step time.\n"
                    "Runs of the same job at other global batches (MORE_RUN_DIRS) calibrate the noise scale.\n"
                    "Use the file with `dynamix policy train --scenario homogeneous --sim-params FILE`.",
        epilog="exit status: 0 on success, 1 when FILE cannot be written, 2 on bad usage or an unusable log.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    f.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's --log-dir (holding decisions.jsonl)")
    f.add_argument("calibration_dirs", type=Path, nargs="*", metavar="MORE_RUN_DIRS",
                   help="runs of the same model and data at other global batches (e.g. --policy static at 2x and "
                        "1/2x the batch): their losses calibrate how much larger batches cost in progress")
    f.add_argument("--timings-from", type=Path, action="append", default=[], metavar="DIR",
                   help="a run of the same job (workers, scenario) at other batches, repeatable: its intervals join "
                        "RUN_DIR's in each worker's compute fit (a wider span of batches separates a_i from θ_i)")
    f.add_argument("--out", type=output_path("file", FITTED_FILE), metavar="FILE", help=f"where the parameters go (default RUN_DIR/{FITTED_FILE})")
    f.set_defaults(run=run_fit)


def format_fit_table(rows: list[dict], methods: list[str]) -> str:
    """Rows of :func:`~dynamix_byteps.policy.sim.fit.replay` (with each worker's fit method) as a table."""
    head = (f"{'rank':>4} {'a_i s':>8} {'θ_i samples/s':>13} {'method':<16} {'compute rec s':>13} {'sim s':>7} "
            f"{'step rec s':>10} {'sim s':>7} {'step error':>10}")
    lines = [head, "-" * len(head)]
    for r, method in zip(rows, methods):
        lines.append(f"{r['rank']:>4} {r['fixed_s']:>8.4f} {r['samples_per_s']:>13.1f} {method:<16} "
                     f"{r['recorded_compute_s']:>13.4f} {r['simulated_compute_s']:>7.4f} {r['recorded_step_s']:>10.4f} "
                     f"{r['simulated_step_s']:>7.4f} {100 * r['step_error']:>+9.1f}%")
    return "\n".join(lines)


#: A fit that pools --timings-from runs and replays RUN_DIR's own steps worse than this is suspect: a
#: run of the same job replays the example within 1-6% per worker, one of a job 100x faster gave 61%.
TIMINGS_REPLAY_ERROR = 0.25


def run_fit(args: argparse.Namespace) -> int:
    """Fit, write and print; UsageError for an unusable log."""
    import numpy as np

    from dynamix_byteps.policy.sim.fit import (
        END_INTERVALS,
        LEARNED_DROP,
        MIN_GLOBAL_BATCH_SPREAD,
        SPIKE_FACTOR,
        check_same_job,
        fit_log,
        global_batch_spread,
        learned,
        load_log,
        replay,
        usable_losses,
    )

    try:
        log = load_log(args.run_dir)
    except ConfigurationError as error:
        raise UsageError(f"argument RUN_DIR: {error}") from None
    try:
        calibration = [load_log(d) for d in args.calibration_dirs]
    except ConfigurationError as error:
        raise UsageError(f"argument MORE_RUN_DIRS: {error}") from None
    try:
        timings = [load_log(d) for d in args.timings_from]
        check_same_job(log, timings)
    except ConfigurationError as error:
        raise UsageError(f"argument --timings-from: {error}") from None
    try:
        params, fits = fit_log(log, calibration, timings)
    except ConfigurationError as error:
        raise UsageError(f"argument RUN_DIR: {error}") from None
    out = args.out or (log.path.parent / FITTED_FILE)
    if any(out.resolve() == run.path.resolve() for run in (log, *calibration, *timings)):
        raise UsageError(f"argument --out: {out} is one of the decision logs being fitted; name another file")
    params.to_json(out)
    print(f"fitted {params.num_workers} workers from {len(log.steps)} decisions of {log.path}"
          + "".join(f" and {len(t.steps)} of {t.path}" for t in timings))
    replayed = replay(params, log)
    print(format_fit_table(replayed, [f.method for f in fits]))
    worst = max(abs(r["step_error"]) for r in replayed)
    if timings and worst > TIMINGS_REPLAY_ERROR:
        print(f"warning: the fit replays {log.path}'s steps with an error of up to {worst:.0%}; are the --timings-from "
              "runs of the same job (same model, data and slowdowns)?")
    c, s = params.comm, params.stats
    print(f"communication {c.latency_s + 2 * c.model_bytes / c.bandwidth_bytes_per_s:.4f} s/step; "
          f"B_noise {s.noise_scale:.1f} samples (growth {s.noise_growth:.2f}); τ {s.steps_scale:.1f} steps, loss tail "
          f"{'exponential' if s.loss_tail is None else f'α {s.loss_tail:g}'}; K {params.decision_interval}")
    print(f"episodes end at loss {s.target_loss:.3f}, where the runs ended (record runs as long as the jobs the "
          "policy will drive)")
    runs = [log, *calibration]
    for run in runs:
        spikes = int(np.sum(np.isnan(usable_losses(run)) & np.isfinite(run.loss) & (run.loss > 0)))
        if spikes:
            print(f"left out of the loss model: {spikes} interval loss(es) of {run.path}, each over {SPIKE_FACTOR:g}x "
                  f"the median of the {END_INTERVALS} around it (a diverging step or a corrupted record?)")
    flags = learned(runs)
    for run, ok in zip(runs, flags):
        if not ok:
            print(f"left out of the loss model: {run.path} (its loss, averaged over {END_INTERVALS} intervals, did not end "
                  f"{LEARNED_DROP:.0%} below where it started, or it logged fewer than {END_INTERVALS} losses: did it "
                  "diverge?)")
    if not any(flags):
        print("no run learned: the noise scale and the loss curve keep their reference values; record runs that learn")
    elif calibration:
        spread = global_batch_spread([run for run, ok in zip(runs, flags) if ok])
        print(f"noise scale calibrated with {sum(flags[1:])} more run(s): progress uses B_noise {s.noise_scale:.1f} "
              f"(growth {s.noise_growth:.2f}), the workers measure {s.measured_noise_scale:.1f} (growth "
              f"{s.measured_noise_growth:.2f})" if s.measured_noise_scale is not None else
              f"noise scale not calibrated: the runs' median global batches differ by x{spread:.2f}, less than "
              f"x{MIN_GLOBAL_BATCH_SPREAD}; record one at half or twice the global batch")
    print(f"parameters: {out}")
    return 0
