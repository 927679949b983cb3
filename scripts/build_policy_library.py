"""Rebuild the packaged policy library (dynamix_byteps/policy/library/<name>/).

Each library policy is trained in the simulator with the parameters of one model/optimizer
profile (:data:`PROFILES`), then installed with its metadata::

    python scripts/build_policy_library.py params small-cnn-adam /tmp/adam.json
    dynamix policy train --scenario homogeneous,straggler,two-speed,interference,network \\
        --workers 4,8,16,32 --sim-params /tmp/adam.json --out runs/lib/small-cnn-adam \\
        [--init runs/lib/small-cnn-sgd/checkpoint --iterations 30]
    python scripts/build_policy_library.py install small-cnn-adam runs/lib/small-cnn-adam [--fine-tuned-from small-cnn-sgd]

or, better, on parameters fitted to a real run of the profile's job on this machine::

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
import shutil
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dynamix_byteps.policy.ppo.features import FEATURE_VERSION
from dynamix_byteps.policy.ppo.library import INFO_FILE, library_root
from dynamix_byteps.policy.ppo.serve import FEATURES_FILE, POLICY_FILE, read_metadata
from dynamix_byteps.policy.sim.params import SimParams, reference

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


def install(name: str, run_dir: Path, init: str | None = None, fitted: Path | None = None) -> Path:
    """Copy ``policy.onnx`` + ``features.json`` of ``run_dir`` into the library with ``policy.json``;
    ``init`` names the library policy it was fine-tuned from (``train --init``), if any; ``fitted``
    is the ``dynamix sim fit`` output it was trained on (``train --sim-params``), else the profile's
    :func:`params`."""
    _, meta = read_metadata(run_dir)
    training = meta.get("training", {})
    history = json.loads((run_dir / "training.json").read_text()) if (run_dir / "training.json").is_file() else {}
    prof = PROFILES[name]
    job = SimParams.from_json(fitted) if fitted else params(name)
    workers = training.get("workers", [])
    workers = [workers] if isinstance(workers, int) else workers  # policies trained before multi-N
    info = {
        "name": name, "model": prof["model"], "optimizer": prof["optimizer"],
        "description": f"{prof['model']} with {prof['optimizer'].upper()}, trained on "
                       f"{','.join(str(n) for n in workers)} simulated workers",
        "feature_version": FEATURE_VERSION,
        "scenarios": training.get("scenarios", []), "workers": workers,
        "profile": {"source": "reference SimParams + measured step times (scripts/build_policy_library.py); "
                              "statistical parameters assumed, not fitted by `dynamix sim fit`",
                    "note": prof["note"], "measured_samples_per_s": MEASURED, "parameters": PARAMETERS[prof["model"]]}
        if fitted is None else
        {"source": f"`dynamix sim fit` of a real run ({job.scenario}): timings, "
                   "communication, noise scale and loss curve fitted"
                   + ("; the B_noise that sets progress calibrated with runs at other global batches"
                      if job.stats.measured_noise_scale is not None else "")
                   + "; generalisation gap assumed",
         "note": prof["note"], "parameters": PARAMETERS[prof["model"]]},
        "training": {"iterations": training.get("iterations"), "seconds": training.get("seconds"),
                     "seed": training.get("seed"), "fine_tuned_from": init, "reward": training.get("reward"),
                     "final_return": history.get("final_return")},
    }
    dest = library_root() / name
    staging = dest.with_name(f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in (POLICY_FILE, FEATURES_FILE):
        shutil.copy2(run_dir / f, staging / f)
    job.to_json(staging / "sim_params.json")
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
    args = p.parse_args()
    if args.cmd == "params":
        params(args.name).to_json(args.out)
        print(f"wrote {args.out}")
    else:
        print(f"installed {install(args.name, args.run_dir, args.fine_tuned_from, args.sim_params)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
