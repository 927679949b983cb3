"""Rebuild the packaged policy library (dynamix_byteps/policy/library/<name>/).

Each library policy is trained in the simulator with the parameters of one model/optimizer
profile (:data:`PROFILES`), then installed with its metadata::

    python scripts/build_policy_library.py params small-cnn-adam /tmp/adam.json
    dynamix policy train --scenario homogeneous,straggler,two-speed,interference,network \\
        --workers 4,8,16,32 --sim-params /tmp/adam.json --out runs/lib/small-cnn-adam \\
        [--init runs/lib/small-cnn-sgd/checkpoint --iterations 30]
    python scripts/build_policy_library.py install small-cnn-adam runs/lib/small-cnn-adam [--fine-tuned-from small-cnn-sgd]

or, best (how ``small-cnn-sgd`` is built), on a mixture of profiles fitted to real runs of every CPU
scenario but the one held aside for evaluation (:data:`HELD_OUT`)::

    python scripts/build_policy_library.py record homogeneous      # and straggler, two-speed, interference
    python scripts/build_policy_library.py fit                     # -> library/small-cnn-sgd/profiles.json
    dynamix policy train --profiles dynamix_byteps/policy/library/small-cnn-sgd/profiles.json \\
        --workers 4,8,16,32 --ladder full --reward step_time=0.08 --reward batch_change=0.03 \\
        --reward accuracy=30 --seed 12 --iterations 45 --out runs/lib/small-cnn-sgd
    python scripts/build_policy_library.py install small-cnn-sgd runs/lib/small-cnn-sgd \\
        --profiles dynamix_byteps/policy/library/small-cnn-sgd/profiles.json

``small-cnn-sgd`` was trained so at commit 6329543, when every episode started at the fitted batch.
Since 334bb13 the mixture starts episodes at 1/4x to 4x the fitted batch, and the same command
with ``--iterations 120`` builds ``small-cnn-sgd-any-start`` (installed with ``--entry
small-cnn-sgd-any-start --use "..."``).

or on parameters fitted to a real run of the profile's job on this machine::

    dynamix sim fit runs/time_to_accuracy/homogeneous/goodput [RUNS AT OTHER GLOBAL BATCHES...] --out /tmp/fit.json
    dynamix policy train ... --sim-params /tmp/fit.json [--ladder full] --out runs/lib/small-cnn-sgd
    python scripts/build_policy_library.py install small-cnn-sgd runs/lib/small-cnn-sgd --sim-params /tmp/fit.json

Profiles: the simulator's reference job (:func:`dynamix_byteps.policy.sim.params.reference`, a
small CNN with SGD) adjusted by step times of ``examples/torch_fashion_mnist.py``'s models measured
on this machine (one torch thread, forward + backward + optimizer step at local batches 16 and 128;
``MEASURED``) and by the model's gradient bytes (4 × parameters). The optimizer's statistical
parameters are assumptions from the literature, not fitted (see each profile's ``note``); a
policy for your own job comes from ``dynamix sim fit RUN_DIR`` + ``dynamix policy train --sim-params``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.features import FEATURE_VERSION
from dynamix_byteps.policy.ppo.library import INFO_FILE, library_root
from dynamix_byteps.policy.ppo.mixture import Profile, load_profiles, profile_from_fit, write_profiles
from dynamix_byteps.policy.ppo.policy_format import FEATURES_FILE, POLICY_FILE, TRAINING_FILE, read_metadata
from dynamix_byteps.policy.sim.params import SimParams, reference

#: Scenarios declared for evaluation only, before training (scenarios.toml says so in their
#: description): no profile is fitted to them and the training record names them.
HELD_OUT = ("swapping-stragglers",)
#: Scenarios the library policy's profiles are fitted to (every CPU scenario but the held-out one).
FITTED_SCENARIOS = ("homogeneous", "straggler", "two-speed", "interference")
#: The profiles file inside a library entry.
PROFILES_FILE = "profiles.json"

#: Measured samples/s of the batch-dependent compute (one thread; busy 2-core machine, load ~13):
#: small CNN (421,642 parameters) 837 with SGD, 624 with Adam; ResNet-8 (77,754) 325 with SGD.
MEASURED = {"small-cnn": 837.0, "resnet8": 325.0}
PARAMETERS = {"small-cnn": 421_642, "resnet8": 77_754}

PROFILES = {
    "small-cnn-sgd": {
        "model": "small-cnn", "optimizer": "sgd", "stats": {},
        "note": "the reference job as it is: examples/torch_fashion_mnist.py --model cnn --optimizer sgd",
    },
    "small-cnn-adam": {
        "model": "small-cnn", "optimizer": "adam", "stats": {"steps_scale": 80.0, "gap_per_doubling": 0.03},
        "note": "assumed: Adam needs ~1/3 fewer noise-free steps than momentum SGD and loses more accuracy to "
                "large batches (gap 0.03 per doubling instead of 0.02); compute as the CNN",
    },
    "resnet8-sgd": {
        "model": "resnet8", "optimizer": "sgd", "stats": {"steps_scale": 150.0, "noise_scale": 300.0},
        "note": "compute per sample scaled by the measured CNN/ResNet-8 throughput ratio, gradient bytes "
                "4 x 77,754; assumed: a deeper net needs ~25% more steps and has a larger gradient noise scale",
    },
}


def params(name: str) -> SimParams:
    """The simulator parameters of profile ``name`` (4 workers; scenarios tile them to any N)."""
    prof = PROFILES[name]
    base = reference(4)
    ratio = MEASURED[prof["model"]] / MEASURED["small-cnn"]
    workers = tuple(replace(w, samples_per_s=w.samples_per_s * ratio) for w in base.workers)
    comm = base.comm  # the reference's 1.7 MB is the CNN's 4 x 421,642 bytes
    if prof["model"] != "small-cnn":
        comm = replace(comm, model_bytes=4.0 * PARAMETERS[prof["model"]])
    return replace(base, workers=workers, comm=comm, stats=replace(base.stats, **prof["stats"]))


#: Real runs recorded per scenario for its fitted profile (``record``): (policy, local batch). The
#: proportional run moves the batches at global batch 256; the static ones at global 128 and 512 widen
#: the span of batches each worker's compute is fitted over (a_i apart from θ_i) and calibrate how
#: much a smaller and a larger batch cost in progress
#: (``dynamix sim fit`` needs median global batches x1.5 apart). Calibrated on 128 and 256 only, the
#: law charged nothing for batches past 256 late in training, and policies trained on it grew the
#: global batch to 860-1010 and were slower on the real job; calibrated on 128-1024 runs, a policy
#: trained the same way chose 140-200 in the simulator (docs/results.md, "The fitted simulator against
#: its own runs"). A 150-s homogeneous run at local 128 made 410 steps, 82 decisions of 5.
RECORDINGS = (("proportional", 64), ("static", 32), ("static", 128))
#: Decisions every 5 steps: twice the intervals of the benchmark's 10 for the fit in a short run
#: (a 3x straggler's 40 s gave 7); the profile's K is set to the benchmark's (:data:`SERVED_INTERVAL`).
RECORD_FLAGS = ["--decision-interval", "5", "--min-batch", "16", "--max-batch", "512"]
SERVED_INTERVAL = 10
#: Seconds of training per recorded run: the time-to-accuracy benchmark's budget. The fit ends its
#: episodes where the recordings ended, so they last as long as the jobs the policy will drive
#: (50-s recordings put the target 21 s into a 150-s straggler run).
RECORD_BUDGET_S = 150.0


def record(scenario_name: str, runs_dir: Path, budget_s: float, seed: int, again: bool = False) -> list[Path]:
    """Run :data:`RECORDINGS` of ``examples/torch_fashion_mnist.py`` on ``scenario_name`` through
    bpslaunch (4 workers, the scenario's ``--slowdown`` flags) for ``budget_s`` seconds of training
    each; return the run directories (``runs_dir/<scenario>/<policy><batch>``, decision logs inside).
    A run that finished before (its ``result.json`` is there) is kept unless ``again``.

    Raises:
        RuntimeError: a run failed (its directory holds the launcher's output).
    """
    from dynamix_byteps.scenarios import scenario

    sc = scenario(scenario_name)
    if sc.links:
        raise SystemExit(f"scenario {scenario_name!r} needs network namespaces; record it with benchmarks/time_to_accuracy.py")
    out = []
    for policy, batch in RECORDINGS:
        run_dir = (runs_dir / scenario_name / f"{policy}{batch}").resolve()
        out.append(run_dir)
        if (run_dir / "result.json").is_file() and not again:
            continue  # recorded before
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        argv = [sys.executable, "-m", "dynamix_byteps.launcher", "-n", str(sc.workers), "--policy", policy, *RECORD_FLAGS,
                "--log-dir", str(run_dir), *[f for s in sc.slowdowns for f in ("--slowdown", s.launch_flag(budget_s))],
                "--", sys.executable, str(REPO / "examples" / "torch_fashion_mnist.py"), "--batch-size", str(batch),
                "--epochs", "1000", "--seed", str(seed), "--time-budget", str(budget_s), "--eval-every", str(10 * budget_s),
                "--output", str(run_dir / "result.json")]
        with open(run_dir / "launcher.log", "wb") as log:
            code = subprocess.run(argv, check=False, stdout=log, stderr=subprocess.STDOUT, timeout=4 * budget_s + 300).returncode
        if code != 0:
            raise RuntimeError(f"{policy}{batch} on {scenario_name} exited {code}; see {run_dir / 'launcher.log'}")
    return out


def fit_profiles(runs_dir: Path, scenarios: list[str], out: Path) -> list[Profile]:
    """Fit one profile per scenario and write the profiles file ``out`` with :data:`HELD_OUT`.

    A scenario's timings come from all its runs: its first :data:`RECORDINGS` run (``dynamix sim
    fit RUN_DIR``, which also gives the initial batches, bounds and K) and the others recorded under
    ``runs_dir/<scenario>`` (``--timings-from``); the statistics (noise scale, loss curve) from the
    losses of every run recorded under ``runs_dir`` (``MORE_RUN_DIRS``): they are the model's and the
    data's, whatever the scenario, and runs at other global batches calibrate them. K is set to :data:`SERVED_INTERVAL`.

    Raises:
        ConfigurationError: a run's decision log is missing or unusable, or a scenario is held out.
    """
    from dynamix_byteps.control.cluster import DECISION_LOG
    from dynamix_byteps.policy.sim.fit import fit_log, load_log
    from dynamix_byteps.scenarios import scenario

    held = [s for s in scenarios if s in HELD_OUT]
    if held:
        raise ConfigurationError(f"scenario(s) {held} are held out for evaluation; fit the others")
    recorded = sorted(log.parent for log in runs_dir.glob(f"*/*/{DECISION_LOG}")  # finished runs only
                      if (log.parent / "result.json").is_file() and log.parent.parent.name not in HELD_OUT)
    policy, batch = RECORDINGS[0]
    profiles = []
    for name in scenarios:
        timing = runs_dir / name / f"{policy}{batch}"
        others = {d: load_log(d) for d in recorded if d != timing}
        same_job = [log for d, log in others.items() if d.parent.name == name]
        fitted, _ = fit_log(load_log(timing), list(others.values()), same_job)
        fitted = replace(fitted, decision_interval=SERVED_INTERVAL)
        source = (f"`dynamix sim fit` of 4-worker runs of examples/torch_fashion_mnist.py --model cnn (SGD) on a shared "
                  f"2-core machine: timings of the {name} runs, losses of {name}/{policy}{batch} and of "
                  f"{', '.join(f'{d.parent.name}/{d.name}' for d in others)}")
        profiles.append(profile_from_fit(fitted, scenario(name), source=source))
    write_profiles(out, profiles, list(HELD_OUT))
    return profiles


def install(name: str, run_dir: Path, init: str | None = None, fitted: Path | None = None,
            profiles: Path | None = None, entry: str | None = None, use: str | None = None) -> Path:
    """Copy ``policy.onnx`` + ``features.json`` of ``run_dir`` into the library with ``policy.json``;
    ``init`` names the library policy it was fine-tuned from (``train --init``), if any; ``fitted``
    is the ``dynamix sim fit`` output it was trained on (``train --sim-params``), else the profile's
    :func:`params`; ``profiles``: the profiles file it was trained on (``train --profiles``), copied
    beside it as ``profiles.json``, whose homogeneous profile (else the first) becomes
    ``sim_params.json``, the job the scenarios of the benchmarks shape. ``entry``: the library name
    (``--policy ppo:ENTRY``), default ``name``, for a second policy of one profile; ``use``: when to
    choose it, appended to the description."""
    _, meta = read_metadata(run_dir)
    training = meta.get("training", {})
    history = json.loads((run_dir / TRAINING_FILE).read_text()) if (run_dir / TRAINING_FILE).is_file() else {}
    prof = PROFILES[name]
    mixture = load_profiles(profiles)[0] if profiles else []
    base = next((p for p in mixture if p.scenario == "homogeneous"), mixture[0]) if mixture else None
    job = base.params if base else SimParams.from_json(fitted) if fitted else params(name)
    workers = training.get("workers", [])
    workers = [workers] if isinstance(workers, int) else workers  # policies trained before multi-N
    entry = entry or name
    info = {
        "name": entry, "model": prof["model"], "optimizer": prof["optimizer"],
        "description": f"{prof['model']} with {prof['optimizer'].upper()}, trained on "
                       f"{','.join(str(n) for n in workers)} simulated workers" + (f"; {use}" if use else ""),
        "feature_version": FEATURE_VERSION,
        "scenarios": training.get("scenarios", []), "workers": workers,
        "profile": {"source": "reference SimParams + measured step times (scripts/build_policy_library.py); "
                              "statistical parameters assumed, not fitted by `dynamix sim fit`",
                    "note": prof["note"], "measured_samples_per_s": MEASURED, "parameters": PARAMETERS[prof["model"]]}
        if fitted is None and not mixture else
        {"source": f"`dynamix sim fit` of real runs of each of {', '.join(p.scenario for p in mixture)} "
                   "(profiles.json): timings, communication, noise scale and loss curve fitted per scenario, "
                   "calibrated with a run at another global batch; one profile per training episode, perturbed; "
                   "generalisation gap assumed", "note": prof["note"], "parameters": PARAMETERS[prof["model"]]}
        if mixture else
        {"source": f"`dynamix sim fit` of a real run ({job.scenario}): timings, "
                   "communication, noise scale and loss curve fitted"
                   + ("; the B_noise that sets progress calibrated with runs at other global batches"
                      if job.stats.measured_noise_scale is not None else "")
                   + "; generalisation gap assumed",
         "note": prof["note"], "parameters": PARAMETERS[prof["model"]]},
        "training": {"iterations": training.get("iterations"), "seconds": training.get("seconds"),
                     "seed": training.get("seed"), "fine_tuned_from": init, "reward": training.get("reward"),
                     "imitation": training.get("imitation"),
                     "final_return": history.get("final_return"),
                     "profiles": training.get("profiles", []), "held_out": training.get("held_out", [])},
    }
    dest = library_root() / entry
    staging = dest.with_name(f".{entry}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in (POLICY_FILE, FEATURES_FILE):
        shutil.copy2(run_dir / f, staging / f)
    job.to_json(staging / "sim_params.json")
    if profiles:
        shutil.copy2(profiles, staging / PROFILES_FILE)
    (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("params", help="write a profile's SimParams JSON")
    a.add_argument("name", choices=sorted(PROFILES))
    a.add_argument("out", type=Path)
    b = sub.add_parser("install", help="install a trained policy directory into the library")
    b.add_argument("name", choices=sorted(PROFILES))
    b.add_argument("run_dir", type=Path)
    b.add_argument("--fine-tuned-from", metavar="NAME", help="the library policy whose checkpoint was --init")
    b.add_argument("--sim-params", type=Path, metavar="JSON", help="the `dynamix sim fit` output the policy was "
                   "trained on (default: the profile's parameters)")
    r = sub.add_parser("record", help="record the real runs a scenario's fitted profile is fitted to")
    r.add_argument("scenario")
    r.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "profiles")
    r.add_argument("--budget", type=float, default=RECORD_BUDGET_S,
                   help=f"seconds of training per run (default {RECORD_BUDGET_S:g})")
    r.add_argument("--seed", type=int, default=7)
    r.add_argument("--again", action="store_true", help="record runs that finished before again")
    f = sub.add_parser("fit", help="fit every scenario's profile to its recorded runs; write the profiles file")
    f.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "profiles")
    f.add_argument("--scenarios", default=",".join(FITTED_SCENARIOS))
    f.add_argument("--out", type=Path, default=library_root() / "small-cnn-sgd" / PROFILES_FILE)
    b.add_argument("--profiles", type=Path, metavar="JSON", help="the profiles file the policy was trained on "
                   "(`dynamix policy train --profiles`)")
    b.add_argument("--entry", metavar="NAME", help="library name of the policy (default: the profile's name), for "
                   "a second policy of one profile")
    b.add_argument("--use", metavar="TEXT", help="when to choose this policy, appended to its description")
    args = p.parse_args()
    if args.cmd == "fit":
        for prof in fit_profiles(args.runs_dir, args.scenarios.split(","), args.out):
            ws = prof.params.workers
            print(f"{prof.name:<13} θ {[round(w.samples_per_s) for w in ws]} samples/s, a {[round(w.fixed_s, 3) for w in ws]} s, "
                  f"B_noise {prof.params.stats.noise_scale:.1f}, τ {prof.params.stats.steps_scale:.1f}")
        print(f"wrote {args.out} (held out: {', '.join(HELD_OUT)})")
    elif args.cmd == "record":
        for run_dir in record(args.scenario, args.runs_dir, args.budget, args.seed, args.again):
            print(f"recorded {run_dir}")
    elif args.cmd == "params":
        params(args.name).to_json(args.out)
        print(f"wrote {args.out}")
    else:
        if args.entry is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", args.entry):
            p.error(f"--entry {args.entry!r}: use lower-case letters, digits and '-' (it is a directory name and --policy ppo:NAME)")
        print(f"installed {install(args.name, args.run_dir, args.fine_tuned_from, args.sim_params, args.profiles, args.entry, args.use)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
