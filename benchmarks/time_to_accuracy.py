"""Time to accuracy on real Fashion-MNIST: static batches against the batch-size policies.

For one scenario of ``dynamix_byteps/scenarios.toml`` (who is slow, when, behind which link), every
configuration trains the example's model (``examples/torch_fashion_mnist.py`` through ``bpslaunch``,
``--engine gloo`` or ``ps``; with ``--framework tensorflow``, ``examples/tf_fashion_mnist.py --fit``:
the Keras ``model.fit`` path, CNN only) for the same budget of training seconds. Configurations: static
uniform batches (32, 64, 128, 256 per worker), ``proportional`` (LB-BSP), ``goodput`` (Pollux) and,
with ``--ppo-policy``, ``ppo`` (``--ppo-policy LABEL=DIR`` once more adds ``ppo-LABEL``, to compare
a candidate policy with the shipped one in one run; a policy directory is copied beside the report,
into ``policies/<first 12 hex digits of its ONNX file's SHA-256>/``, before the first run, and each
run names that copy as ``policy.kept``); the dynamic policies start from the local batch
``--policy-start`` (default 64, the example's default), with ``--warmup-steps N`` of learning-rate
warm-up for every configuration or, under ``--warmup-scope large-start``, only for those that start
above 64 per worker. Every ``--eval-every`` seconds of training (default 4) the job
scores a fixed subset of the test set (``--eval-subset`` images, default 2000, the same images for
every run; the pause is not training time), so a target crossing is placed within a few seconds.

Repeats: ``--repeats N`` runs every configuration N times round-robin (A seed S, B seed S, ...,
A seed S+1, ...; a drift in the machine's load hits every configuration alike); run r uses the
example's ``--seed S + r`` (model initialisation and data order). ``--quick``: 30 s budget,
static32, static64, proportional and goodput, 2 seeds, targets 50/60/70%, evaluation every 3 s on
500 images.

Per run, from its accuracy curve (linear between evaluations, from 10% at 0 s):

* ``time to X%``: training seconds until accuracy first reaches each target (``--targets``);
* ``acc@budget``: accuracy at the end of the budget;
* ``AUC``: area under the accuracy-time curve over the budget ÷ the budget (the last
  evaluation's accuracy held to the end), in [0, 1];
* ``samples/s``, ``mean batch`` (global samples per step) and ``straggler eff.``: achieved global
  samples/s ÷ Σ θ_i, θ_i being worker i's compute-only samples/s in the same run (1.0 is the
  physical limit; a uniform batch with 1 of 4 workers 3x slower sits near 0.4).

Per configuration: the median over its runs and a 90% bootstrap interval of the median (2000
resamples of the runs, numpy PCG64 seeded with 0, 5th-95th percentile by inverted CDF). A run
that never reaches a target counts as slower than every run that does (time ``inf``); a median
that is ``inf`` prints as ``-``.

Verdicts, per configuration against two references: the best static batch and the best
heuristic (``proportional``/``goodput``); beside a labelled ``ppo-LABEL``, also against ``ppo``
(its only candidate). For each, the verdict target is the highest target that
the median run of some candidate (a static batch; a heuristic) reaches, and the reference is the
candidate with the lowest median time to it; a configuration that never reaches it counts as
slower. When no candidate's median reaches any target, the reference is the candidate with the
highest median AUC and the verdict compares AUC (higher is better). The rule: over the seeds
both configurations ran, resample the seeds (pairs kept together) 2000 times and take the ratio
median(configuration) ÷ median(reference); its 90% interval (5th-95th percentile) decides:
``ahead`` when the whole interval is on the better side of 1 (below 1 for a time, above 1 for
AUC), ``behind`` when it is wholly on the worse side, ``tie`` otherwise; ``ref`` marks the
reference itself and ``n/a`` a pair with fewer than 2 common seeds. With 2 or 3 seeds, a
resample's medians are one seed's pair whenever that seed is drawn at least twice (25% and 26% of
the resamples for each seed), so the interval spans every seed's own ratio: ``ahead`` needs every
seed ahead.

Load: during each run, ``os.getloadavg()`` is sampled every 2 s. The run's own expected share is
its worker count (plus the summation servers with ``--engine ps``) seen through the kernel's
1-minute filter, on top of what the previous run still holds in the average; a run whose mean
excess over that share is above ``--load-margin`` (default 0.75 runnable processes) was loaded by
other work. Without ``--allow-load`` a run starts only when the excess is within the margin
(waiting up to ``--load-wait`` s), and a run that turns out loaded is set aside (kept in the
JSON under ``refused_runs``) and made again, twice at most, before the benchmark stops with exit
status 1. With ``--allow-load`` loaded runs are kept and flagged in the table.

    python benchmarks/time_to_accuracy.py --scenario straggler --ppo-policy small-cnn-sgd
    python benchmarks/time_to_accuracy.py --scenario straggler --quick --allow-load     # CI
    python benchmarks/time_to_accuracy.py --scenario network --engine ps --num-servers 2
    python benchmarks/time_to_accuracy.py --scenario straggler --configs goodput,ppo,ppo-candidate \\
        --ppo-policy small-cnn-sgd --ppo-policy candidate=runs/policy --out /tmp/candidate.json
    python benchmarks/time_to_accuracy.py --scenario straggler --framework tensorflow --configs proportional,goodput \\
        --out benchmarks/results/time_to_accuracy_straggler_tensorflow.json
    python benchmarks/time_to_accuracy.py --scenario straggler --table-only --targets 0.85,0.87 --markdown

Writes ``benchmarks/results/time_to_accuracy_<scenario>[_quick].json`` (schema 2: every run with
its curve, seed, times to each target and load; rewritten after every run) and ``.png`` (accuracy
against training time, median and min-max of the runs; time to each target per run), and keeps
each run's log directory (TensorBoard files, decisions.jsonl) as ``--runs-dir/<report name>/<config>/seed<S>`` for
``dynamix report``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from common import (
    MIN_PAIRS,
    REPO,
    RESULTS,
    LoadSampler,
    bootstrap_medians,
    interval90,
    keep_policy,
    machine,
    markdown_table,
    paired_ratio_interval,
    policy_identity,
    shown_path,
    text_table,
    verdict,
    write_report,
)

from dynamix_byteps.argtypes import float_in, int_in
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo import library
from dynamix_byteps.scenarios import Scenario, load_scenarios

SCHEMA = 2
#: The example each framework runs, and its extra flags.
EXAMPLES = {"torch": (REPO / "examples" / "torch_fashion_mnist.py", []),
            "tensorflow": (REPO / "examples" / "tf_fashion_mnist.py", ["--fit"])}
STATIC_SIZES = (32, 64, 128, 256)
HEURISTICS = ("proportional", "goodput")
POLICY_START = 64  # the local batch every dynamic policy starts from: the example's default
WARMUP_SCOPES = ("all", "large-start")
MIN_BATCH, MAX_BATCH = 16, 512  # the dynamic policies' local batch bounds
BOUNDS = ["--min-batch", str(MIN_BATCH), "--max-batch", str(MAX_BATCH)]
#: Per model: the highest is reached late, if at all, by the best static batch in 150 s (measured, straggler).
TARGETS = {"cnn": (0.86, 0.88, 0.89, 0.90), "resnet8": (0.75, 0.80, 0.83, 0.86)}
QUICK_TARGETS = (0.5, 0.6, 0.7)
QUICK_CONFIGS = ("static32", "static64", "proportional", "goodput")
ROUNDS = 2000  # bootstrap resamples
LOAD_RETRIES = 2  # remakes of a loaded run without --allow-load
CHANCE = 0.1  # accuracy at 0 s: 10 classes
#: One colour and marker per configuration, for every figure of every scenario (Okabe-Ito colours).
STYLES = {"static32": ("#56b4e9", "v"), "static64": ("#0072b2", "<"), "static128": ("#6a3d9a", ">"),
          "static256": ("#7f7f7f", "^"), "proportional": ("#009e73", "s"), "goodput": ("#e69f00", "D"),
          "ppo": ("#d55e00", "o")}
LABELLED_STYLES = (("#cc79a7", "P"), ("#000000", "X"), ("#f0e442", "*"))  # ppo-LABEL configurations, in order


def configurations(ppo_policies: dict[str, str], decision_interval: int,
                   policy_start: int = POLICY_START) -> dict[str, dict]:
    """Every configuration by name: its local batch (``policy_start`` for the dynamic policies) and
    its extra bpslaunch flags. ``ppo_policies``: configuration name (``ppo`` or ``ppo-LABEL``) to a
    library policy's name or a policy directory."""
    configs = {f"static{b}": {"batch": b, "launch": []} for b in STATIC_SIZES}
    policy_flags = ["--decision-interval", str(decision_interval), *BOUNDS]
    for policy in HEURISTICS:
        configs[policy] = {"batch": policy_start, "launch": ["--policy", policy, *policy_flags]}
    for name, source in ppo_policies.items():
        chosen = ["--policy", "ppo", "--policy-path", str(source)] if Path(source).is_dir() \
            else ["--policy", f"ppo:{source}"]  # a policy of the library
        configs[name] = {"batch": policy_start, "launch": [*chosen, *policy_flags], "policy": policy_identity(source)}
    return configs


def ppo_policies(specs: list[str]) -> dict[str, str]:
    """``--ppo-policy`` values, ``[LABEL=]NAME|DIR``, as configuration names to sources: ``ppo``
    without a label, ``ppo-LABEL`` with one. Raises ValueError for a repeated name or a bad label."""
    policies: dict[str, str] = {}
    for spec in specs:
        label, source = "", spec
        if "=" in spec and not Path(spec).is_dir():  # a directory's own '=' stays in its path
            label, source = spec.split("=", 1)
        source = source.removeprefix("ppo:")  # bpslaunch's spelling of a library policy
        if label and not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", label):
            raise ValueError(f"--ppo-policy {spec}: the label {label!r} must be lower-case letters, digits, "
                             "'-', '_' or '.' (it names the configuration ppo-LABEL)")
        name = f"ppo-{label}" if label else "ppo"
        if name in policies:
            raise ValueError(f"--ppo-policy {spec}: a second policy named {name!r}; give each policy after the "
                             "first a label, e.g. --ppo-policy candidate=DIR (configuration ppo-candidate)")
        if not source or (not Path(source).is_dir() and source not in library.entries()):
            raise ValueError(f"--ppo-policy {spec}: {source!r} is neither a policy directory (dynamix policy train "
                             f"--out DIR writes one) nor a library policy ({', '.join(library.entries()) or 'none installed'})")
        try:
            library.resolve(source)
        except ConfigurationError as error:
            raise ValueError(f"--ppo-policy {spec}: {error}") from None
        policies[name] = source
    return policies


def style(name: str, names: list[str]) -> tuple[str, str]:
    """A configuration's colour and marker: fixed for the standard ones; a labelled PPO policy
    takes the next of ``LABELLED_STYLES`` in the order of ``names``."""
    if name in STYLES:
        return STYLES[name]
    labelled = [n for n in names if n not in STYLES]
    return LABELLED_STYLES[labelled.index(name) % len(LABELLED_STYLES)]


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Training seconds at which accuracy first reaches ``target``, linear between evaluations.

    ``curve``: points with ``train_s`` and ``test_accuracy``, in time order; the run starts at
    (0 s, 0.1), the accuracy of chance on 10 classes. None if the target is never reached.
    """
    previous = (0.0, CHANCE)
    for point in curve:
        t, acc = point["train_s"], point["test_accuracy"]
        if acc >= target:  # and the previous point was below it
            t0, a0 = previous
            return t0 + (t - t0) * (target - a0) / (acc - a0)
        previous = (t, acc)
    return None


def accuracy_area(curve: list[dict], budget_s: float) -> float:
    """∫ accuracy dt over [0, ``budget_s``] ÷ ``budget_s``, in [0, 1]: trapezoids from (0 s, 0.1)
    through the curve's points, the last accuracy held to the budget, points past it cut off."""
    t = np.array([0.0, *(p["train_s"] for p in curve)])
    grid = np.append(t[t < budget_s], budget_s)
    accuracy = np.interp(grid, t, [CHANCE, *(p["test_accuracy"] for p in curve)])  # holds the last value
    return float(np.trapezoid(accuracy, grid) / budget_s)


def straggler_efficiency(result: dict) -> float:
    """Achieved global samples/s ÷ Σ θ_i (θ_i: each worker's compute-only samples/s)."""
    total = sum(w["samples_per_s"] for w in result["worker_statistics"])
    return result["samples_per_s"] / total if total > 0 else math.nan


def target_key(target: float) -> str:
    """A target as a JSON key and a column title: 0.885 -> "0.885"."""
    return f"{target:g}"


def run_metrics(run: dict, targets: list[float], budget_s: float) -> dict:
    """One run's figures: time to each target (``inf``: never), accuracy at the budget, AUC, speed."""
    times = [time_to_target(run["curve"], t) for t in targets]
    return {"times": [math.inf if t is None else t for t in times],
            "accuracy_at_budget": run["test_accuracy"], "auc": accuracy_area(run["curve"], budget_s),
            "samples_per_s": run["samples_per_s"], "straggler_efficiency": straggler_efficiency(run),
            "mean_global_batch": run["samples"] / max(run["steps"], 1)}


def run_config(name: str, config: dict, scenario: Scenario, args: argparse.Namespace, repeat: int, tail: float) -> dict:
    """Train one configuration through bpslaunch, sampling the machine's load meanwhile.

    ``tail``: this benchmark's load still in the 1-minute average from the previous run.
    Returns the example's metrics plus the run's facts (seed, load, wall time, times to targets).
    """
    seed = args.seed + repeat
    run_dir = args.runs_dir / args.out.stem / name / f"seed{seed}"  # one folder per report: engines never share
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    output = run_dir / "result.json"
    launch = [*config["launch"], "--log-dir", str(run_dir), "--engine", args.engine]
    launch += ["--num-servers", str(args.num_servers)] if args.engine == "ps" else []
    launch += [flag for s in scenario.slowdowns for flag in ("--slowdown", s.launch_flag(args.budget))]
    command = example_command(args, config["batch"], seed, output)
    timeout = args.budget * 4 + 300
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    started = time.perf_counter()
    with open(run_dir / "launcher.log", "wb") as log, LoadSampler(share=own_share(args), tail=tail) as load:
        if scenario.links:
            returncode = run_behind_links(scenario, launch, command, timeout, log, args.host_cpus)
        else:
            argv = [sys.executable, "-m", "dynamix_byteps.launcher", "-n", str(scenario.workers), *launch, "--", *command]
            returncode = run_launcher(argv, timeout, log)
    if returncode != 0 or not output.exists():
        raise RuntimeError(f"{name} on {scenario.name} failed with exit code {returncode}; see {run_dir}/launcher.log")
    result = json.loads(output.read_text())
    other = load.other_load()
    times = run_metrics(result, args.targets, args.budget)["times"]
    return {"config": name, "seed": seed, "started_at": started_at, **result, "policy": config.get("policy"),
            "run_wall_s": time.perf_counter() - started, "run_dir": str(run_dir),
            "times_to_target_s": {target_key(t): None if s == math.inf else s for t, s in zip(args.targets, times)},
            "load": {"share": load.share, "tail": tail, "samples": load.samples, "other_load": other,
                     "loaded": other > args.load_margin}}


def example_command(args: argparse.Namespace, batch: int, seed: int, output: Path) -> list[str]:
    """The worker command of one run: ``args.framework``'s example, local batch ``batch``, trained
    for ``args.budget`` s (epochs unbounded), metrics to ``output``."""
    example, flags = EXAMPLES[args.framework]
    flags = [*flags, "--model", args.model] if args.framework == "torch" else flags
    flags = [*flags, "--fp16-pushpull"] if args.compression == "fp16" else flags
    warmup = warmup_steps_for(args, batch)
    flags = [*flags, "--warmup-steps", str(warmup)] if warmup else flags
    return [sys.executable, str(example), *flags, "--batch-size", str(batch), "--epochs", "1000", "--seed", str(seed),
            "--time-budget", str(args.budget), "--eval-every", str(args.eval_every),
            "--eval-subset", str(args.eval_subset), "--output", str(output)]


def warmup_steps_for(args: argparse.Namespace, batch: int) -> int:
    """The warm-up steps of a configuration whose first local batch is ``batch``: ``--warmup-steps``
    for all of them, or under ``--warmup-scope large-start`` only above the example's default batch."""
    return args.warmup_steps if args.warmup_scope == "all" or batch > POLICY_START else 0


def run_launcher(argv: list[str], timeout: float, log) -> int:
    """Run bpslaunch, its output to ``log``; its exit status. Past ``timeout`` seconds it is
    stopped with SIGTERM (which stops its workers too), SIGKILL 30 s later, and RuntimeError raised."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the job ran past {timeout:g} s and was stopped") from None
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def own_share(args: argparse.Namespace) -> float:
    """A run's expected share of the load: one busy process per worker, and per ps server."""
    return args.scenario.workers + (args.num_servers if args.engine == "ps" else 0)


def run_behind_links(scenario: Scenario, launch: list[str], command: list[str], timeout: float, log,
                     host_cpus: str = "shared") -> int:
    """Run the job with the linked workers in network namespaces behind their rate limits; with
    ``host_cpus="split"`` each emulated host may use only its workers' share of this machine's cores."""
    from dynamix_byteps.testing import netns

    reason = netns.available()
    if reason:
        raise RuntimeError(f"scenario {scenario.name!r} needs network namespaces: {reason}")
    slots, rates = scenario.host_layout()
    cpus = {host: os.cpu_count() * n / scenario.workers for host, n in enumerate(slots)} if host_cpus == "split" else None
    with netns.Testbed(len(slots), rates, cpus) as bed:
        job = netns.run_job(bed, slots, command, launch, timeout_s=timeout, cwd=REPO)
    for host, output in enumerate(job.outputs):
        log.write(f"---- host {host} ----\n{output}".encode())
    return 0 if job.ok else max(job.returncodes, key=abs) or 1


def _median_interval(values) -> dict:
    """Median of ``values`` and its 90% bootstrap interval; ``inf`` stays ``inf``."""
    return {"median": float(np.median(values)),
            "ci90": interval90(bootstrap_medians(values, ROUNDS), method="inverted_cdf")}


def summarise(runs: list[dict], targets: list[float], budget_s: float) -> dict:
    """Rows of the table from every kept run, and the references of the verdicts.

    Returns ``{"rows": [...], "verdict": {"best_static": REF, "best_heuristic": REF, "ppo": REF}}``,
    REF being ``{"reference", "target", "metric"}`` or None without candidates (``ppo`` is a reference
    only beside a labelled ``ppo-LABEL``, the candidate it is compared with); each row holds medians
    with 90% intervals (``inf`` where never reached) and ``vs_best_static`` / ``vs_best_heuristic`` /
    ``vs_ppo``: ``{"reference", "seeds", "ratio", "ci90", "verdict"}``.
    """
    by_config: dict[str, list[dict]] = {name: [] for name in STYLES}  # the table's order, labelled PPO last
    for run in runs:
        by_config.setdefault(run["config"], []).append(run)
    by_config = {name: done for name, done in by_config.items() if done}
    metrics = {name: [run_metrics(r, targets, budget_s) for r in done] for name, done in by_config.items()}
    rows = {}
    for name, done in by_config.items():
        m = metrics[name]
        rows[name] = {"config": name, "runs": len(done), "seeds": [r["seed"] for r in done],
                      "loaded_runs": sum(r["load"]["loaded"] for r in done),
                      "time_to_target_s": {target_key(t): {**_median_interval([x["times"][i] for x in m]),
                                                          "runs": [x["times"][i] for x in m]}
                                           for i, t in enumerate(targets)},
                      **{key: _median_interval([x[key] for x in m]) for key in ("accuracy_at_budget", "auc")},
                      **{key: float(np.median([x[key] for x in m]))
                         for key in ("samples_per_s", "straggler_efficiency", "mean_global_batch")}}
    references = {"best_static": [n for n in rows if n.startswith("static")],
                  "best_heuristic": [n for n in rows if n in HEURISTICS],
                  "ppo": ["ppo"] if "ppo" in rows and any(n.startswith("ppo-") for n in rows) else []}
    chosen = {}
    for kind, candidates in references.items():
        if not candidates:
            chosen[kind] = None
            continue
        reference, target, score = _reference(candidates, metrics, targets)
        chosen[kind] = {"reference": reference, "target": target,
                        "metric": "AUC" if target is None else f"time to {100 * target:g}%"}
        theirs = {r["seed"]: score(x) for r, x in zip(by_config[reference], metrics[reference])}
        for name, row in rows.items():
            mine = {r["seed"]: score(x) for r, x in zip(by_config[name], metrics[name])}
            seeds = sorted(set(mine) & set(theirs))
            row[f"vs_{kind}"] = {"reference": reference, "seeds": seeds,
                                 **_compare([mine[s] for s in seeds], [theirs[s] for s in seeds], name == reference,
                                            lower_is_better=target is not None)}
    return {"rows": list(rows.values()), "verdict": chosen}


def _reference(candidates: list[str], metrics: dict[str, list[dict]], targets: list[float]):
    """The best of ``candidates`` and what it is best at: ``(name, target or None, score)``.

    The target is the highest one that some candidate's median run reaches; the best candidate
    has the lowest median time to it (ties: the first in the table). Without such a target, the
    best has the highest median AUC (target None). ``score(run_metrics)``: a time, or an AUC.
    """
    reached = [i for i in range(len(targets))
               if any(np.median([x["times"][i] for x in metrics[c]]) < math.inf for c in candidates)]
    if reached:
        def score(run_metric: dict) -> float:
            return run_metric["times"][reached[-1]]
        sign, target = 1.0, targets[reached[-1]]
    else:
        def score(run_metric: dict) -> float:
            return run_metric["auc"]
        sign, target = -1.0, None
    best = min(candidates, key=lambda c: sign * float(np.median([score(x) for x in metrics[c]])))
    return best, target, score


def _compare(mine: list[float], theirs: list[float], itself: bool, lower_is_better: bool) -> dict:
    """Ratio of medians over paired seeds, its 90% interval and the verdict (see the module's rule)."""
    if itself:
        return {"ratio": 1.0, "ci90": [1.0, 1.0], "verdict": "ref"}
    if len(mine) < MIN_PAIRS:
        return {"ratio": None, "ci90": None, "verdict": "n/a"}
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(np.median(mine) / np.median(theirs))
    ci = paired_ratio_interval(mine, theirs, ROUNDS)
    return {"ratio": 1.0 if math.isnan(ratio) else ratio, "ci90": ci, "verdict": verdict(ci, lower_is_better)}


def finite(value):
    """``value`` with every infinite float replaced by None (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _seconds(value: float | None) -> str:
    return "-" if value is None or value == math.inf else f"{value:.1f}"


def _with_interval(cell: dict, fmt) -> str:
    low, high = cell["ci90"]
    return f"{fmt(cell['median'])} [{fmt(low)}, {fmt(high)}]"


def _comparison(row: dict, kind: str) -> str:
    c = row.get(f"vs_{kind}")
    if c is None:
        return ""
    if c["ci90"] is None or c["verdict"] == "ref":
        return c["verdict"]
    return f"{_ratio(c['ratio'])} [{_ratio(c['ci90'][0])}, {_ratio(c['ci90'][1])}] {c['verdict']}"


def _ratio(value: float | None) -> str:
    return "inf" if value is None or value == math.inf else f"{value:.2f}x"


def _three(value: float) -> str:
    return f"{value:.3f}"


def tables(summary: dict, targets: list[float]) -> tuple[list[str], list[list[str]]]:
    """The header and cells of the table (one row per configuration)."""
    decided = summary["verdict"]
    header = ["config", "runs", *(f"time to {100 * t:g}% s [90%]" for t in targets), "acc@budget [90%]", "AUC [90%]",
              "samples/s", "straggler eff.", "mean batch"]
    kinds = [k for k in ("best_static", "best_heuristic", "ppo") if decided.get(k) is not None]
    header += [("vs ppo" if k == "ppo" else f"vs {k.replace('_', ' ')} ({decided[k]['reference']})")
               + f" on {decided[k]['metric']}" for k in kinds]
    header += ["loaded runs"]
    lines = []
    for row in summary["rows"]:
        lines.append([row["config"], str(row["runs"]),
                      *(_with_interval(row["time_to_target_s"][target_key(t)], _seconds) for t in targets),
                      _with_interval(row["accuracy_at_budget"], _three), _with_interval(row["auc"], _three),
                      f"{row['samples_per_s']:.0f}", f"{row['straggler_efficiency']:.2f}", f"{row['mean_global_batch']:.0f}",
                      *(_comparison(row, k) for k in kinds),
                      f"{row['loaded_runs']}/{row['runs']}" + (" LOADED" if row["loaded_runs"] else "")])
    return header, lines


def print_report(summary: dict, runs: list[dict], targets: list[float], markdown: bool) -> None:
    """The table, then one line per run (seed, times to each target, load)."""
    header, lines = tables(summary, targets)
    print(text_table(header, lines))
    for run in runs:
        times = ", ".join(_seconds(time_to_target(run["curve"], t)) for t in targets)
        load = run["load"]
        flag = " LOADED" if load["loaded"] else ""
        print(f"  {run['config']} seed {run['seed']}: times to {', '.join(f'{100 * t:g}%' for t in targets)}: {times} s; "
              f"load beyond its own share {load['other_load']:.2f}{flag}")
    if markdown:
        print()
        print(markdown_table(header, lines))


def plot(runs: list[dict], summary: dict, report: dict, out: Path) -> None:
    """Accuracy against training time (median and min-max per configuration, target lines) and
    time to each target (every run, median marked), one colour and marker per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets, budget = report["targets"], report["budget_s"]
    fig, (curves, crossings) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    grid = np.linspace(0.0, budget, 301)
    names = [row["config"] for row in summary["rows"]]
    for k, name in enumerate(names):
        colour, marker = style(name, names)
        mine = [r for r in runs if r["config"] == name]
        accuracy = np.array([np.interp(grid, [0.0, *(p["train_s"] for p in r["curve"])],
                                       [CHANCE, *(p["test_accuracy"] for p in r["curve"])]) for r in mine])
        curves.fill_between(grid, accuracy.min(0), accuracy.max(0), color=colour, alpha=0.15, linewidth=0)
        curves.plot(grid, np.median(accuracy, 0), color=colour, marker=marker, markevery=30, markersize=5,
                    linewidth=1.6, label=f"{name} ({len(mine)})")
        for i, t in enumerate(targets):
            y = i + (k - (len(names) - 1) / 2) * 0.8 / max(len(names), 1)
            times = [time_to_target(r["curve"], t) for r in mine]
            reached = [x for x in times if x is not None]
            crossings.scatter(reached, [y] * len(reached), color=colour, marker=marker, s=14, alpha=0.5)
            missed = len(times) - len(reached)
            crossings.scatter([budget] * missed, [y] * missed, marker=marker, s=14, facecolors="none", edgecolors=colour)
            cell = summary["rows"][k]["time_to_target_s"][target_key(t)]
            if cell["median"] < math.inf:
                crossings.scatter([cell["median"]], [y], color=colour, marker=marker, s=60, edgecolors="black",
                                  linewidths=0.6)
    for t in targets:
        curves.axhline(t, color="grey", linestyle=":", linewidth=1)
        curves.annotate(f"{100 * t:g}%", (budget, t), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=8, color="grey", annotation_clip=False)
    highest = max([*targets, *(p["test_accuracy"] for r in runs for p in r["curve"])])
    curves.set(xlabel="training time (s)", ylabel=f"accuracy on {report['eval_subset']} test images",
               ylim=(max(0.0, min(targets) - 0.2), min(1.0, highest + 0.02)), xlim=(0, budget))
    curves.grid(alpha=0.3)
    curves.legend(loc="lower right", fontsize=8, title="median, min-max (runs)", title_fontsize=8)
    crossings.set(xlabel="training s to target (runs; large: median; hollow: not reached)",
                  yticks=range(len(targets)), yticklabels=[f"{100 * t:g}%" for t in targets], xlim=(0, budget * 1.03))
    crossings.grid(alpha=0.3, axis="x")
    fig.suptitle(f"Fashion-MNIST {report['model']} ({report['framework']}), {report['workers']} workers, {report['engine']}"
                 f"{' fp16' if report.get('compression') == 'fp16' else ''}"
                 f"{', a CPU quota per host' if report.get('host_cpus') == 'split' else ''}: scenario "
                 f"{report['scenario']} ({report['description']}), {report['measured_at'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def _accuracies(text: str) -> list[float]:
    """``--targets``: comma-separated accuracies in (0.1, 1], sorted, duplicates dropped."""
    try:
        values = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or any(not 0.1 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated accuracies in (0.1, 1]")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    scenarios = load_scenarios()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(scenarios), default="straggler")
    p.add_argument("--quick", action="store_true", help="a check that every column fills (CI), not a comparison: 30-s budget, "
                   f"targets {'/'.join(f'{t * 100:.0f}' for t in QUICK_TARGETS)}%% reached in the first seconds, while the "
                   "policies make their first decisions, four configurations, two repeats")
    p.add_argument("--configs", default=None, help="comma-separated subset of the configurations (default: all; "
                   f"--quick: {','.join(QUICK_CONFIGS)})")
    p.add_argument("--budget", type=float_in(0, 86400, low_open=True, unit="s"), default=None,
                   help="training seconds per run (default 150; --quick 30)")
    p.add_argument("--eval-every", type=float_in(0, 86400, low_open=True, unit="s"), default=None,
                   help="seconds of training between evaluations (default 4; --quick 3)")
    p.add_argument("--eval-subset", type=int_in(1, 10000), default=None, metavar="N",
                   help="test images scored at each evaluation, a fixed subset (default 2000; --quick 500)")
    defaults = "; ".join(f"{model} {','.join(map(str, t))}" for model, t in TARGETS.items())
    p.add_argument("--targets", type=_accuracies, default=None, help="comma-separated target accuracies (default "
                   f"{defaults}; --quick {','.join(map(str, QUICK_TARGETS))})")
    p.add_argument("--model", choices=sorted(TARGETS), default="cnn")
    p.add_argument("--framework", choices=sorted(EXAMPLES), default="torch",
                   help="the example to train: torch (default) or tensorflow (Keras model.fit; --model cnn only)")
    p.add_argument("--engine", choices=("gloo", "ps"), default="gloo", help="bpslaunch --engine (default gloo)")
    p.add_argument("--num-servers", type=int_in(1, 64), default=1, help="bpslaunch --num-servers with --engine ps")
    p.add_argument("--host-cpus", choices=("shared", "split"), default="shared",
                   help="with a scenario's links: split gives each emulated host its workers' share of the cores "
                   "(a CPU quota), as separate machines would have; shared (default) lets them all use every core")
    p.add_argument("--compression", choices=("none", "fp16"), default="none",
                   help="gradient compression on the wire: fp16 runs the example with --fp16-pushpull (torch only)")
    p.add_argument("--decision-interval", type=int_in(1), default=None, help="steps between policy decisions (default 10; --quick 5)")
    p.add_argument("--policy-start", type=int_in(MIN_BATCH, MAX_BATCH, "policy start"), default=POLICY_START,
                   metavar="B", help=f"the local batch every dynamic policy starts from, within their bounds "
                                     f"{MIN_BATCH}-{MAX_BATCH} (default {POLICY_START}): a user's other choice "
                                     "of --batch-size")
    p.add_argument("--warmup-steps", type=int_in(0), default=0, metavar="N",
                   help="the torch example's gradual learning-rate warm-up over the first N steps, for the "
                        "configurations --warmup-scope names (default 0: none)")
    p.add_argument("--warmup-scope", choices=WARMUP_SCOPES, default="all",
                   help="which configurations warm up: all (default), or large-start: only those whose first "
                        f"local batch is above the example's default {POLICY_START}, whose learning rate starts "
                        "scaled up, so static64 runs as a user who keeps the default runs it")
    p.add_argument("--ppo-policy", action="append", default=[], metavar="[LABEL=]NAME|DIR",
                   help="also run --policy ppo with this trained policy: a directory or a library name "
                   "(`dynamix policy list`); repeat it with LABEL= to compare policies in one run "
                   "(configuration ppo-LABEL)")
    p.add_argument("--repeats", type=int_in(1, 20), default=None, metavar="N",
                   help="runs per configuration, round-robin, seeds SEED..SEED+N-1 (default 3; --quick 2)")
    p.add_argument("--seed", type=int, default=42, help="the example's --seed of the first round (default 42)")
    p.add_argument("--allow-load", action="store_true", help="keep runs made while other work loaded the machine "
                   "(flagged LOADED) instead of waiting for quiet and remaking them")
    p.add_argument("--load-margin", type=float_in(0, 1000), default=0.75,
                   help="load beyond a run's own share that counts as other work (default 0.75)")
    p.add_argument("--load-wait", type=float_in(0, 86400, unit="s"), default=600.0,
                   help="without --allow-load: seconds to wait for a quiet machine before a run (default 600)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "time_to_accuracy",
                   help="where each run's log directory is kept, as DIR/<--out's name>/<config>/seed<S> "
                   "(default: runs/time_to_accuracy)")
    p.add_argument("--table-only", action="store_true", help="run nothing: redo the table and plot of --out "
                   "(e.g. for other --targets)")
    p.add_argument("--append", action="store_true", help="keep the runs of the other configurations already in "
                   "--out (same experiment), replacing those of the configurations run now")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/time_to_accuracy_<scenario>[_quick].json)")
    args = p.parse_args(argv)
    args.scenario = scenarios[args.scenario]
    if args.engine != "ps" and args.num_servers != 1:
        p.error("--num-servers needs --engine ps")
    if args.host_cpus == "split" and not args.scenario.links:
        p.error(f"--host-cpus split: scenario {args.scenario.name!r} has no emulated hosts (no links); "
                "choose a scenario with links, e.g. network")
    if args.framework == "tensorflow" and args.compression != "none":
        p.error("--compression fp16: the TensorFlow example has no --fp16-pushpull; use --framework torch")
    if args.framework == "tensorflow" and args.warmup_steps:
        p.error("--warmup-steps: the TensorFlow example has no --warmup-steps; use --framework torch")
    if args.warmup_scope != "all" and not args.warmup_steps:
        p.error(f"--warmup-scope {args.warmup_scope}: there is no warm-up to scope; add --warmup-steps N")
    if args.framework == "tensorflow" and args.model != "cnn":
        p.error(f"--model {args.model}: the TensorFlow example trains the CNN only; use --framework torch")
    try:
        args.ppo_policies = ppo_policies(args.ppo_policy)
    except ValueError as error:
        p.error(str(error))
    args.out = args.out or RESULTS / f"time_to_accuracy_{args.scenario.name}{'_quick' if args.quick else ''}.json"
    args.earlier = None
    if args.table_only and not args.out.exists():
        p.error(f"--table-only: no earlier report {args.out}")
    if (args.table_only or args.append) and args.out.exists():
        try:
            args.earlier = read_report(args.out)
        except ValueError as error:
            p.error(f"{'--table-only' if args.table_only else '--append'}: {error}")
    if args.table_only:  # the file's experiment, perhaps other targets
        args.budget, args.targets = args.earlier["budget_s"], args.targets or args.earlier["targets"]
    quick = args.quick
    args.budget = args.budget or (30.0 if quick else 150.0)
    args.eval_every = args.eval_every or (3.0 if quick else 4.0)
    args.eval_subset = args.eval_subset or (500 if quick else 2000)
    args.targets = args.targets or list(QUICK_TARGETS if quick else TARGETS[args.model])
    args.repeats = args.repeats or (2 if quick else 3)
    args.decision_interval = args.decision_interval or (5 if quick else 10)
    known = configurations(args.ppo_policies, args.decision_interval, args.policy_start)
    default = [*QUICK_CONFIGS, *args.ppo_policies] if args.quick else list(known)
    wanted = [c for c in args.configs.split(",") if c] if args.configs is not None else default
    if args.table_only:
        wanted = []
    elif not wanted:
        p.error("--configs is empty; name at least one configuration")
    unknown = [c for c in wanted if c not in known]
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(known)}"
                + ("" if args.ppo_policies else " (ppo needs --ppo-policy)"))
    args.configs = {c: known[c] for c in wanted}
    missing = [key for key in report_keys(args) if key not in args.earlier] if args.earlier else []
    if missing:
        p.error(f"{'--table-only' if args.table_only else '--append'}: {args.out} lacks {', '.join(missing)}; "
                "rerun the benchmark without --append (it replaces the file) to measure anew")
    if args.append and args.earlier:
        mismatch = {k: (args.earlier.get(k), v) for k, v in experiment(args).items() if args.earlier.get(k) != v}
        if mismatch:
            p.error(f"--append: {args.out} holds another experiment ("
                    + ", ".join(f"{k} {old!r} there, {new!r} now" for k, (old, new) in mismatch.items())
                    + "); use another --out")
    return args


def report_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """What a report holds besides its runs and table: the experiment and where it ran."""
    return ("benchmark", "schema", *experiment(args), "description", "workers", "load_margin", "measured_at",
            "measured_on")


#: Keys of :func:`experiment` added after reports were written without them, with the value every
#: run of such a report had.
LATER_EXPERIMENT_KEYS = {"warmup_steps": 0, "warmup_scope": "all"}


def experiment(args: argparse.Namespace) -> dict:
    """What makes runs comparable: runs with other values cannot share one table."""
    return {"scenario": args.scenario.name, "quick": args.quick, "framework": args.framework, "model": args.model,
            "budget_s": args.budget, "eval_every_s": args.eval_every, "eval_subset": args.eval_subset, "engine": args.engine,
            "num_servers": args.num_servers if args.engine == "ps" else None, "compression": args.compression,
            "host_cpus": args.host_cpus, "decision_interval": args.decision_interval, "policy_start": args.policy_start,
            "warmup_steps": args.warmup_steps, "warmup_scope": args.warmup_scope}


def read_report(path: Path) -> dict:
    """An earlier report of this benchmark; ValueError naming what is wrong with it (an old schema too)."""
    try:
        report = json.loads(path.read_text())
    except ValueError as error:  # json.JSONDecodeError is one
        raise ValueError(f"{path} is not JSON: {error}") from None
    if not isinstance(report, dict) or report.get("benchmark") != "time_to_accuracy":
        raise ValueError(f"{path} is not a time_to_accuracy report")
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path} is in the old schema ({report.get('schema', 1)}, one target, full test set every "
                         f"10 s, no load record); this version reads schema {SCHEMA} only: its table is in the file's "
                         "'rows'; rerun the benchmark without --append (it replaces the file) to measure anew")
    return {**LATER_EXPERIMENT_KEYS, **report}


def wait_for_quiet(args: argparse.Namespace, tail_now) -> None:
    """Without --allow-load, wait until the 1-minute load less ``tail_now()`` (this benchmark's
    own decaying share) is within --load-margin; SystemExit(1) naming the load after --load-wait."""
    deadline = time.monotonic() + args.load_wait
    while True:
        excess = os.getloadavg()[0] - tail_now()
        if excess <= args.load_margin:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"the machine is loaded by other work: 1-minute load {os.getloadavg()[0]:.2f} on "
                             f"{os.cpu_count()} CPUs, {excess:.2f} beyond this benchmark's own, for "
                             f"{args.load_wait:g} s; run when it is quiet, or pass --allow-load (runs flagged LOADED)")
        time.sleep(5)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    earlier = args.earlier or {}
    kept = [r for r in earlier.get("runs", []) if r["config"] not in args.configs]
    refused = [r for r in earlier.get("refused_runs", []) if r["config"] not in args.configs]
    report = {key: earlier[key] for key in report_keys(args)} if earlier else {
        "benchmark": "time_to_accuracy", "schema": SCHEMA, **experiment(args), "description": args.scenario.description,
        "workers": args.scenario.workers, "load_margin": args.load_margin,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "measured_on": machine()}
    runs = list(kept)
    try:
        for config in args.configs.values():
            config["policy"] = keep_policy(config.get("policy"), args.out.parent)
    except ConfigurationError as error:
        print(f"time_to_accuracy: {error}", file=sys.stderr)
        return 2
    if args.configs:
        print(f"scenario {args.scenario.name}: {args.scenario.description}; {args.repeats} round(s) of "
              f"{', '.join(args.configs)}; {args.budget:g} s of training each, evaluation on {args.eval_subset} test "
              f"images every {args.eval_every:g} s, targets {', '.join(f'{100 * t:g}%' for t in args.targets)}, "
              f"{args.framework} {args.model}, engine {args.engine}", flush=True)
        previous = {"share": 0.0, "end": time.monotonic()}

        def tail_now() -> float:
            return previous["share"] * math.exp(-(time.monotonic() - previous["end"]) / LoadSampler.TIME_CONSTANT_S)

        for repeat in range(args.repeats):  # round-robin: a drift in the machine's load hits every configuration
            for name, config in args.configs.items():
                for attempt in range(LOAD_RETRIES + 1):
                    if not args.allow_load:
                        wait_for_quiet(args, tail_now)
                    try:
                        run = run_config(name, config, args.scenario, args, repeat, tail_now())
                    except RuntimeError as error:
                        save(args, report, runs, refused, complete=False)
                        print(f"{name} seed {args.seed + repeat}: {error}; the runs so far are in {args.out}", file=sys.stderr)
                        return 1
                    previous.update(share=run["load"]["share"], end=time.monotonic())
                    times = ", ".join(_seconds(t) for t in run["times_to_target_s"].values())
                    print(f"  {name} seed {run['seed']}: to targets {times} s, accuracy {run['test_accuracy']:.4f}, "
                          f"{run['samples_per_s']:.0f} samples/s, load beyond own {run['load']['other_load']:.2f}"
                          f"{' LOADED' if run['load']['loaded'] else ''} ({run['run_wall_s']:.0f} s)", flush=True)
                    if args.allow_load or not run["load"]["loaded"]:
                        runs.append(run)
                        break
                    refused.append(run)
                    print(f"  set aside: loaded by other work (attempt {attempt + 1} of {LOAD_RETRIES + 1})", flush=True)
                else:
                    save(args, report, runs, refused, complete=False)
                    print(f"{name} seed {args.seed + repeat}: every attempt was loaded by other work; stopping "
                          "(--allow-load keeps loaded runs, flagged)", file=sys.stderr)
                    return 1
                save(args, report, runs, refused, complete=False)
    summary = save(args, report, runs, refused, complete=True)
    print()
    print_report(summary, runs, args.targets, args.markdown)
    plot(runs, summary, {**report, "targets": args.targets}, args.out.with_suffix(".png"))
    return 0


def save(args: argparse.Namespace, report: dict, runs: list[dict], refused: list[dict], complete: bool) -> dict:
    """Write the report with every run (also partway, ``complete`` False); the summary of ``runs``."""
    summary = summarise(runs, args.targets, args.budget)
    png = args.out.with_suffix(".png")
    write_report(args.out, finite({**report, "targets": args.targets, "complete": complete, "rows": summary["rows"],
                                   "verdict": summary["verdict"],
                                   "plot": shown_path(png),
                                   "runs": runs, "refused_runs": refused}))
    return summary


if __name__ == "__main__":
    sys.exit(main())
