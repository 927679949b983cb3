"""Step time of dynamix_byteps against torch's ``DistributedDataParallel`` on the same process group.

Three variants train the same model with the same SGD settings (lr 0.01, momentum 0.9, no LR
scaling), the same fixed synthetic batch on every worker (64 float32 inputs of shape 1x28x28,
labels 0-9) and the same number of steps, over the process group that ``bps.init()`` creates
(torch.distributed's default group: gloo on the CPU, or nccl on one GPU per worker with
``--engine nccl``, where every step is timed until the GPU has finished it):

* ``DistributedOptimizer``: a plain torch model, ``bps.DistributedOptimizer(SGD(...))``; a step is
  zero_grad, forward, ``opt.set_local_batch_size(64)``, backward, ``opt.step()``;
* ``bps.DistributedDataParallel``: ``bps.DistributedDataParallel(model)`` (gradients reduced
  during backward) and a plain SGD; skipped, with a note, while dynamix_byteps has no such class;
* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel(model)`` and a plain SGD, the baseline.

DDP averages gradients, dynamix weights them by batch size: with equal batches the same update.
Models: ``cnn``, the example's CNN (examples/torch_fashion_mnist.py:Net, 421,642 parameters),
``mlp``, a communication-heavy 784-2048-2048-1024-1024-10 perceptron (8,962,058 parameters), and,
when named in ``--models``, ``small-mlp``, a 784-256-10 perceptron (203,530 parameters) whose
steps of a few milliseconds show the fixed cost of a step, and ``resnet8``, the example's ResNet-8
(examples/torch_fashion_mnist.py:ResNet8, 77,754 parameters in 29 tensors, 27 BatchNorm buffers that
both wrappers broadcast before each forward), whose many small tensors show the cost per tensor.

Each (model, worker count) is one bpslaunch job, one torch thread per worker. A run builds a fresh
model (same seed) and optimizer, takes untimed warm-up steps, meets the other workers at a barrier
and times each step on rank 0 (a worker stuck for more than ``--timeout`` seconds, 300 by default,
ends the job with every thread's stack in its output). Runs alternate A B C C B A ... over the
repeats, so drift in the machine's load hits every variant alike. After each run the workers
exchange a digest of their parameters (every rank must hold rank 0's model), and rank 0 compares
each variant's parameters with torch DDP's of the same repeat (the same training up to rounding:
the largest difference relative to the largest change since initialisation must stay below 1e-3). A
mismatch is printed as a sanity failure and the exit status is 1: a benchmark that trains wrong
proves nothing.

Reported per (model, workers, variant): the median step time over all timed steps and its 90%
bootstrap interval (resampling repeats, then steps within them), the range of the per-repeat
medians, and the ratio to torch DDP with its 90% interval (resampled paired by repeat). Verdict:
``ahead`` or ``behind`` when the ratio's interval excludes 1.00, else ``tie``. Targets: every
dynamix variant at most 1.00x torch DDP, at most 0.97x on the MLP at 4 workers; ``met`` when the
whole interval is at or below the target, ``missed`` when it is entirely above, else ``unresolved``.

    python benchmarks/ddp_comparison.py --workers 2,4 --models cnn,mlp --repeats 5
    python benchmarks/ddp_comparison.py --workers 2 --models small-mlp --steps 200 --out small.json
    python benchmarks/ddp_comparison.py --table-only --markdown     # the README table, from --out
    python benchmarks/ddp_comparison.py --engine nccl --workers 1 --out cuda.json    # one worker per GPU

Prints a table and writes JSON (``--out``) with every repeat's per-step times (seconds).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import RESULTS, cnn_worker, interval90, markdown_table, text_table, timed_steps, verdict, worker_counts, write_report

VARIANTS = ("DistributedOptimizer", "bps.DistributedDataParallel", "torch DDP")
BASELINE = "torch DDP"
MODELS = ("cnn", "mlp", "small-mlp", "resnet8")
DEFAULT_MODELS = ("cnn", "mlp")
MLP_WIDTHS = {"mlp": (784, 2048, 2048, 1024, 1024, 10), "small-mlp": (784, 256, 10)}
LR, MOMENTUM = 0.01, 0.9
PARITY_TOLERANCE = 1e-3  # largest parameter difference to torch DDP / largest change since initialisation
BOOTSTRAP_ROUNDS = 2000
TARGET = 1.00
TARGETS = {("mlp", 4): 0.97}  # (model, workers) with a stricter target than TARGET


def mlp(widths: tuple[int, ...]):
    """Flatten, then Linear+ReLU layers of ``widths`` (:data:`MLP_WIDTHS`: the communication-heavy
    ``mlp`` has 8,962,058 float32 parameters, 36 MB of gradients per step)."""
    import torch.nn as nn

    layers = [nn.Flatten()]
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _worker(args: argparse.Namespace) -> None:
    import torch

    # A collective that waits longer than --timeout raises; anything else stuck that long (a lock, the
    # shutdown) ends the worker with every thread's stack on stderr instead of hanging the job.
    watchdog_s = args.timeout + 5
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    bps, Net, x, y, loss_fn = cnn_worker(args.batch_size)
    from torch_fashion_mnist import ResNet8  # beside Net, which cnn_worker put on the path
    if not torch.distributed.is_initialized():
        raise SystemExit("torch DDP needs the default process group that the gloo and nccl engines create; "
                         "launch with --engine gloo or nccl")
    device = x.device
    device_ids = [device.index] if device.type == "cuda" else None
    if device.type == "cuda":  # cuDNN's default kernels differ run to run, which the parity check would flag
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def build():
        if args.model in MLP_WIDTHS:
            return mlp(MLP_WIDTHS[args.model]).to(device)
        return (Net() if args.model == "cnn" else ResNet8()).to(device)

    def distributed_optimizer():
        model = build()
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                       named_parameters=model.named_parameters(), lr_scaling="none")

        def step():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            opt.set_local_batch_size(args.batch_size)  # before backward: the reduction starts during it
            loss.backward()
            opt.step()
        return model, step

    def wrapped(wrapper):
        def make():
            model = wrapper(build(), device_ids=device_ids)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

            def step():
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
            return model, step
        return make

    makers = {"DistributedOptimizer": distributed_optimizer,
              "torch DDP": wrapped(torch.nn.parallel.DistributedDataParallel)}
    if hasattr(bps, "DistributedDataParallel"):
        makers["bps.DistributedDataParallel"] = wrapped(bps.DistributedDataParallel)
    order = [name for name in VARIANTS if name in makers]

    def watched(step):
        def rearmed():
            faulthandler.dump_traceback_later(watchdog_s, exit=True)
            step()
        return rearmed

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()

    def run(name):
        """Step times and final parameters of one run; its model (for torch DDP, the group's user) dies on return."""
        torch.manual_seed(args.seed)
        faulthandler.dump_traceback_later(watchdog_s, exit=True)
        model, step = makers[name]()
        step = watched(step)
        for _ in range(args.warmup):
            step()
        return timed_steps(bps, step, args.steps, device), flat(model)

    torch.manual_seed(args.seed)
    initial = flat(build())
    step_s = {name: [] for name in order}
    same_on_every_rank = {name: [] for name in order}
    drift = {name: [] for name in order if name != BASELINE}
    for repeat in range(args.repeats):
        final = {}
        for name in order if repeat % 2 == 0 else reversed(order):
            times, final[name] = run(name)
            step_s[name].append(times)
            same_on_every_rank[name].append(_same_on_every_rank(bps, final[name], device))
        moved = float((final[BASELINE] - initial).abs().max())
        for name in drift:
            drift[name].append(float((final[name] - final[BASELINE]).abs().max()) / moved)
    if bps.rank() == 0:
        Path(args.result).write_text(json.dumps({
            "parameters": initial.numel(), "skipped": [name for name in VARIANTS if name not in makers],
            "step_s": step_s, "same_on_every_rank": same_on_every_rank, "relative_difference_to_torch_ddp": drift}))
    bps.shutdown()


def _same_on_every_rank(bps, params, device) -> bool:
    """Whether every worker holds the same parameters as this one: four 31-bit pieces of a SHA-256
    of their bytes, summed over the workers (exact in float64), equal size x this worker's."""
    import torch

    digest = hashlib.sha256(params.numpy().tobytes()).digest()
    pieces = torch.tensor([int.from_bytes(digest[i:i + 4], "little") >> 1 for i in range(0, 16, 4)],
                          dtype=torch.float64, device=device)
    return torch.equal(bps.push_pull(pieces, average=False, name="bench.digest"), pieces * bps.size())


def _launch(model: str, workers: int, args: argparse.Namespace) -> dict:
    """One bpslaunch job of every variant of ``model`` on ``workers`` workers; its worker result."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "dynamix_byteps.launcher", "--engine", args.engine, "--num-workers", str(workers),
                   "--timeout", str(args.timeout),
                   "--", sys.executable, __file__, "--worker", "--model", model, "--result", str(result),
                   "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--repeats", str(args.repeats), "--seed", str(args.seed), "--timeout", str(args.timeout)]
        job = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
        if job.returncode != 0:
            raise RuntimeError(f"{model} on {workers} workers: the workers failed with exit code "
                               f"{job.returncode}:\n{job.stdout[-12000:]}")
        return {"model": model, "workers": workers, **json.loads(result.read_text())}


def _resampled_medians(step_ms: np.ndarray, repeats: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap medians of ``step_ms`` (repeats x steps): per round, the repeats drawn in
    ``repeats`` (rounds x repeats), then steps drawn with replacement within each."""
    steps = rng.integers(step_ms.shape[1], size=(*repeats.shape, step_ms.shape[1]))
    return np.median(step_ms[repeats[:, :, None], steps].reshape(len(repeats), -1), axis=1)


def summarise(run: dict) -> list[dict]:
    """The rows of one job's result (``step_s``: variant -> repeats -> seconds per step)."""
    rng = np.random.default_rng(0)
    step_ms = {name: 1e3 * np.asarray(times) for name, times in run["step_s"].items()}
    base = step_ms[BASELINE]
    repeats = rng.integers(len(base), size=(BOOTSTRAP_ROUNDS, len(base)))
    base_medians = _resampled_medians(base, repeats, rng)
    target = TARGETS.get((run["model"], run["workers"]), TARGET)
    rows = []
    for name in VARIANTS:
        if name not in step_ms:
            continue
        ms = step_ms[name]
        medians = base_medians if name == BASELINE else _resampled_medians(ms, repeats, rng)
        per_repeat = np.median(ms, axis=1)
        row = {"model": run["model"], "workers": run["workers"], "variant": name,
               "median_ms": float(np.median(ms)), "median_ci90_ms": interval90(medians),
               "repeat_medians_ms": [float(per_repeat.min()), float(per_repeat.max())], "steps": int(ms.size)}
        if name != BASELINE:
            low, high = interval90(medians / base_medians)
            row.update(ratio=row["median_ms"] / float(np.median(base)), ratio_ci90=[low, high],
                       verdict=verdict([low, high]), target=target,
                       target_met="met" if high <= target else "missed" if low > target else "unresolved")
        rows.append(row)
    return rows


def sanity_failures(run: dict) -> list[str]:
    """Sentences for every run whose workers disagreed or whose training left torch DDP's."""
    where = f"{run['model']} on {run['workers']} workers"
    failures = [f"{where}, {name}, repeat {r}: the workers' parameters differ from rank 0's"
                for name, same in run["same_on_every_rank"].items() for r, ok in enumerate(same) if not ok]
    failures += [f"{where}, {name}, repeat {r}: parameters differ from torch DDP's by {d:.2g} of the "
                 f"training's change (tolerance {PARITY_TOLERANCE:g})"
                 for name, drift in run["relative_difference_to_torch_ddp"].items()
                 for r, d in enumerate(drift) if not d <= PARITY_TOLERANCE]
    return failures


def _cells(row: dict) -> list[str]:
    low, high = row["median_ci90_ms"]
    cells = [row["model"], str(row["workers"]), row["variant"], f"{row['median_ms']:.1f} [{low:.1f}, {high:.1f}]",
             "{:.1f}-{:.1f}".format(*row["repeat_medians_ms"])]
    if "ratio" in row:
        cells += ["{:.3f}x [{:.3f}, {:.3f}]".format(row["ratio"], *row["ratio_ci90"]), row["verdict"],
                  f"<= {row['target']:.2f}x {row['target_met']}"]
    else:
        cells += ["1.000x", "baseline", ""]
    return cells


HEADER = ["model", "workers", "variant", "median step ms [90%]", "repeat medians ms", "ratio to torch DDP [90%]",
          "verdict", "target"]


def table(rows: list[dict]) -> str:
    return text_table(HEADER, [_cells(row) for row in rows])


def markdown(rows: list[dict]) -> str:
    return markdown_table(HEADER, [_cells(row) for row in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated subset of {', '.join(MODELS)} (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per worker and step (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant, interleaved (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation seed (default 0)")
    parser.add_argument("--engine", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU tensors (default); nccl: one GPU per worker")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective, or anything else a worker does between two steps, may take "
                             "before the job fails with every thread's stack in its output (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS / "ddp_comparison.json")
    parser.add_argument("--table-only", action="store_true", help="run nothing: print the table of --out again")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown (for README)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.table_only:
        if not args.out.exists():
            parser.error(f"--table-only: no earlier report {args.out}")
        runs = json.loads(args.out.read_text())["runs"]
    else:
        models = [m for m in args.models.split(",") if m]
        if not models or set(models) - set(MODELS):
            parser.error(f"--models {args.models!r}: choose from {', '.join(MODELS)}")
        if min(args.batch_size, args.steps, args.repeats) < 1 or args.warmup < 0:
            parser.error("--batch-size, --steps and --repeats must be >= 1, --warmup >= 0")
        if not 0 < args.timeout <= 7 * 86400:
            parser.error(f"--timeout {args.timeout:g}: give seconds > 0 and at most 7 days")
        runs = []
        for workers in worker_counts(parser, args.workers):
            for model in models:
                print(f"{model} on {workers} workers ...", flush=True)
                try:
                    runs.append(_launch(model, workers, args))
                except RuntimeError as error:
                    print(error, file=sys.stderr)
                    return 1
                for name in runs[-1]["skipped"]:
                    print(f"  note: {name} skipped, dynamix_byteps.torch has no such class yet")
    rows = [row for run in runs for row in summarise(run)]
    failures = [failure for run in runs for failure in sanity_failures(run)]
    print(table(rows))
    if args.markdown:
        print("\n" + markdown(rows))
    for failure in failures:
        print(f"SANITY FAILURE: {failure}")
    if not args.table_only:
        write_report(args.out, {"benchmark": "ddp_comparison", "engine": args.engine, "batch_size": args.batch_size, "steps": args.steps,
                                "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed, "lr": LR,
                                "momentum": MOMENTUM, "rows": rows, "sanity_failures": failures, "runs": runs})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
