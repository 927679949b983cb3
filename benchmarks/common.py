"""What every benchmark script shares: the machine it ran on and its load, the ns/call table, the
JSON file, and the statistics of repeated runs (bootstrap intervals, ahead/tie/behind verdicts)."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

from dynamix_byteps.atomic import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def cnn_worker(batch_size: int):
    """Join the job as a worker with one torch thread, and return what the step-time benchmarks
    train: ``(bps, Net, x, y, loss_fn)``, the example's CNN class and one fixed synthetic batch
    (``x`` float32 of shape (batch_size, 1, 28, 28), ``y`` int64 labels 0-9) on the device the
    job's engine reduces on (the CPU for gloo and ps, this worker's GPU for nccl)."""
    import torch

    import dynamix_byteps.torch as bps
    from dynamix_byteps import engine

    sys.path.insert(0, str(REPO / "examples"))
    from torch_fashion_mnist import Net

    torch.set_num_threads(1)
    bps.init()
    torch.manual_seed(0)
    device = engine.current().device
    x = torch.randn(batch_size, 1, 28, 28).to(device)
    y = torch.randint(0, 10, (batch_size,)).to(device)
    return bps, Net, x, y, torch.nn.CrossEntropyLoss()


def timed_steps(bps, step, steps: int, device=None) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step()``, after a barrier so that every worker starts
    timing together. On a CUDA ``device`` each step ends when the GPU has finished its work."""
    import time

    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    bps.push_pull(torch.zeros(1, device=device), name="bench.barrier")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def policy_identity(name_or_dir: str) -> dict | None:
    """Which PPO policy a benchmark ran: ``{"source", "sha256"}`` of the ``policy.onnx`` of a policy
    directory or of a library policy by name, or None when there is no such file."""
    from dynamix_byteps.policy.ppo import library
    from dynamix_byteps.policy.ppo.policy_format import POLICY_FILE, sha256

    root = Path(name_or_dir) if Path(name_or_dir).is_dir() else library.library_root() / name_or_dir
    onnx = root / POLICY_FILE
    if not onnx.is_file():
        return None
    return {"source": str(name_or_dir), "sha256": sha256(onnx)}


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when it is inside it, else as given (so that a report
    names files the same way in any clone)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def keep_policy(identity: dict | None, results: Path) -> dict | None:
    """Keep a copy of a policy directory a report ran (``identity`` from :func:`policy_identity`)
    in ``results/policies/<first 12 hex digits of its SHA-256>/``, so that the report can be rerun
    after the directory (often a scratch one) is gone; the identity with ``kept``, that folder.

    A library policy (a name) and None pass unchanged; an earlier copy of the same policy is reused.
    Copies ``policy.onnx`` and ``features.json`` (what ``--policy-path`` serves) and the training
    record where there is one (``training.json`` of ``dynamix policy train``, a library entry's
    ``policy.json``), not the RLlib checkpoint.

    Raises:
        ConfigurationError: the directory is not a policy this version can serve
            (:func:`~dynamix_byteps.policy.ppo.policy_format.read_metadata`).
        OSError: the copy cannot be written.
    """
    from dynamix_byteps.policy.ppo.library import INFO_FILE
    from dynamix_byteps.policy.ppo.policy_format import FEATURES_FILE, POLICY_FILE, TRAINING_FILE, read_metadata

    if identity is None or not Path(identity["source"]).is_dir():
        return identity
    directory, _ = read_metadata(identity["source"])
    kept = results / "policies" / identity["sha256"][:12]
    if not (kept / POLICY_FILE).is_file():
        staging = kept.with_name(f"{kept.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in (POLICY_FILE, FEATURES_FILE, INFO_FILE, TRAINING_FILE):
            if (directory / name).is_file():
                shutil.copy2(directory / name, staging / name)
        try:
            staging.rename(kept)
        except OSError:  # another benchmark kept the same policy meanwhile
            shutil.rmtree(staging)
            if not (kept / POLICY_FILE).is_file():
                raise
    return {**identity, "kept": shown_path(kept)}


def machine() -> dict:
    """Where the figures come from: CPUs, load, Python and platform."""
    return {"cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
            "python": sys.version.split()[0], "platform": platform.platform()}


def print_ns_table(results: list[dict]) -> None:
    """Rows with ``case``, ``ns_per_call_median`` and ``ns_per_call_min``."""
    width = max(len(r["case"]) for r in results)
    print(f"{'case':<{width}}  {'median ns/call':>14}  {'min ns/call':>11}")
    for r in results:
        print(f"{r['case']:<{width}}  {r['ns_per_call_median']:>14.1f}  {r['ns_per_call_min']:>11.1f}")


def report_ns_per_call(out: Path, benchmark: str, calls: int, runs: int, results: list[dict]) -> None:
    """Print the ns/call table of ``results`` and write it with the run sizes to ``out``."""
    print_ns_table(results)
    write_report(out, {"benchmark": benchmark, "calls_per_run": calls, "runs": runs, "results": results})


def text_table(header: list[str], lines: list[list[str]]) -> str:
    """``header`` and ``lines`` (rows of cell strings) as left-aligned columns two spaces apart."""
    lines = [header, *lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """``header`` and ``lines`` (rows of cell strings) as a GitHub markdown table."""
    return "\n".join("| " + " | ".join(line) + " |" for line in [header, ["---"] * len(header), *lines])


def save_report(out: Path, report: dict) -> None:
    """Write ``report`` plus :func:`machine` as indented JSON to ``out`` (atomically); raises OSError."""
    write_atomic(out, json.dumps({**report, "machine": machine()}, indent=2) + "\n")


def write_report(out: Path, report: dict) -> None:
    """:func:`save_report`, then say so on stdout."""
    save_report(out, report)
    print(f"wrote {out}")


def publish(name: str, out: Path, report: dict, text: str) -> int:
    """Save ``report`` to ``out`` (:func:`save_report`), then print ``text`` (its table) and where it
    went; the report is on disk before anything is printed. Returns 0, or 2 after a message
    prefixed ``name`` when ``out`` cannot be written."""
    try:
        save_report(out, report)
    except OSError as error:
        print(f"{name}: --out {out}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(text)
    print(f"wrote {out}")
    return 0


def run_main(main) -> None:
    """``sys.exit(main())``, except that a reader of stdout that has gone (``| head``) ends the
    script with status 1 and no traceback (the handling Python's ``signal`` documentation gives
    for SIGPIPE): scripts write their report before printing, so it is not lost."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 1
    sys.exit(code)


def summarise_reports(name: str, paths: list[Path], build, table, out: Path, extra: dict | None = None) -> int:
    """Read the ``benchmarks/time_to_accuracy.py`` reports at ``paths``, ``build`` one summary of them
    (a callable of the list of reports), print ``table(summary)`` (header, rows) and write the summary,
    the inputs' file names and ``extra`` to ``out``. Returns the exit status: 0, or 2 after a message
    prefixed ``name`` when a file cannot be read, is not JSON, lacks a field, or ``build`` refuses
    it (ConfigurationError, ValueError)."""
    from dynamix_byteps.errors import ConfigurationError

    try:
        summary = build([json.loads(path.read_text()) for path in paths])
    except KeyError as error:
        print(f"{name}: a report lacks the field {error}; is it a time_to_accuracy.py report?", file=sys.stderr)
        return 2
    except (OSError, json.JSONDecodeError, ConfigurationError, ValueError) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 2
    print(text_table(*table(summary)))
    write_report(out, {**summary, "inputs": [path.name for path in paths], **(extra or {})})
    return 0


def worker_counts(parser, text: str) -> list[int]:
    """``--workers 4,32,256`` as a list of counts in 1..4096, or ``parser.error`` naming the flag."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--workers {text!r} is not a comma-separated list of integers")
    if not counts or any(not 1 <= c <= 4096 for c in counts):
        parser.error(f"--workers {text!r}: worker counts must be 1..4096")
    return counts


def interval90(samples, method: str = "linear") -> list[float]:
    """The 5th and 95th percentiles of ``samples`` (bootstrap replicates, 1-D): a 90% interval.

    ``method`` is :func:`numpy.quantile`'s; ``"inverted_cdf"`` returns sample values without
    interpolating, which keeps infinite samples (a target never reached) meaningful.
    """
    return [float(q) for q in np.quantile(np.asarray(samples, dtype=float), [0.05, 0.95], method=method)]


MIN_PAIRS = 2  # common seeds a verdict needs


def verdict(interval: list[float], lower_is_better: bool = True) -> str:
    """``ahead``, ``behind`` or ``tie`` from the 90% interval ``[low, high]`` of a ratio
    (configuration / reference): ahead when the whole interval is on the better side of 1,
    behind when it is wholly on the worse side, else tie."""
    low, high = interval
    better, worse = (high < 1, low > 1) if lower_is_better else (low > 1, high < 1)
    return "ahead" if better else "behind" if worse else "tie"


def bootstrap_medians(values, rounds: int = 2000, seed: int = 0) -> np.ndarray:
    """Medians of ``rounds`` resamples (with replacement, numpy's PCG64 seeded with ``seed``) of
    ``values`` (1-D, float; ``inf`` allowed): shape (rounds,)."""
    values = np.asarray(values, dtype=float)
    draws = np.random.default_rng(seed).integers(len(values), size=(rounds, len(values)))
    return np.median(values[draws], axis=1)


def paired_ratio_interval(values, reference, rounds: int = 2000, seed: int = 0, statistic=np.median) -> list[float]:
    """90% bootstrap interval of statistic(``values``) / statistic(``reference``) (the median unless
    ``statistic`` is another numpy reduction taking ``axis``, e.g. ``np.mean``), resampling the pairs
    (``values[i]``, ``reference[i]``: the same seed or repeat) together.

    Both 1-D of equal length >= 1; ``inf`` allowed (a target never reached): a ratio inf/inf
    counts as 1, finite/inf as 0 and inf/finite as inf. Percentiles by ``inverted_cdf`` (see
    :func:`interval90`). Raises ValueError on empty or unequal inputs.
    """
    values, reference = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    if len(values) == 0 or values.shape != reference.shape:
        raise ValueError(f"paired samples must be non-empty and of equal length, got {len(values)} and {len(reference)}")
    draws = np.random.default_rng(seed).integers(len(values), size=(rounds, len(values)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = statistic(values[draws], axis=1) / statistic(reference[draws], axis=1)
    return interval90(np.where(np.isnan(ratios), 1.0, ratios), method="inverted_cdf")


class LoadSampler:
    """Samples :func:`os.getloadavg`'s 1-minute load every ``every_s`` seconds in a thread while
    in its ``with`` block; ``samples`` holds ``(seconds since entry, load)`` pairs.

    :meth:`other_load` estimates the load of other work: each sample less this run's own
    expected share, where the share is ``share`` runnable processes since entry, seen through
    the kernel's 1-minute exponential filter (time constant 60 s), on top of ``tail`` (this
    benchmark's load still in the average at entry, from a previous run).
    """

    TIME_CONSTANT_S = 60.0  # the kernel's 1-minute load average: exp(-5 s / 60 s) per 5-s tick

    def __init__(self, share: float, tail: float = 0.0, every_s: float = 2.0):
        self.share, self.tail, self.every_s = share, tail, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self._start, os.getloadavg()[0]))
            if self._stop.wait(self.every_s):
                return

    def expected(self, t: float) -> float:
        """This run's own share of the 1-minute load ``t`` seconds after entry."""
        decay = math.exp(-t / self.TIME_CONSTANT_S)
        return self.share * (1 - decay) + self.tail * decay

    def other_load(self) -> float:
        """Mean over the samples of (load - :meth:`expected`), at least 0; 0 without samples."""
        excess = [load - self.expected(t) for t, load in self.samples]
        return max(0.0, sum(excess) / len(excess)) if excess else 0.0
