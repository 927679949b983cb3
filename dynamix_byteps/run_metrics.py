"""The metrics file a training script writes with ``--output``, and the flags that ask for it.

Both examples write it and ``benchmarks/time_to_accuracy`` reads it: accuracy against seconds of
training under a time budget. One schema for both frameworks:

    parser = argparse.ArgumentParser()
    add_run_arguments(parser, test_images=10_000)   # --time-budget --eval-every --eval-subset --output
    ...
    RunMetrics(test_accuracy=0.89, ...).write(args.output)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from .argtypes import float_in, int_in
from .atomic import write_atomic

__all__ = ["CURVE_FIELDS", "STOP_REASONS", "RunMetrics", "add_run_arguments", "stop_reason"]

CURVE_FIELDS = ("train_s", "samples", "test_accuracy", "test_loss")
STOP_REASONS = ("epochs", "time_budget")  # RunMetrics.stopped_by


def stop_reason(budget_spent: bool, epochs_trained: float, epochs: int) -> str:
    """What ended training, for :attr:`RunMetrics.stopped_by`: ``"time_budget"`` when the budget was
    spent before ``epochs`` passes over the training set were trained, else ``"epochs"`` (a budget
    that runs out on the last step of the last epoch cut nothing short)."""
    return "time_budget" if budget_spent and epochs_trained < epochs else "epochs"


def add_run_arguments(parser: argparse.ArgumentParser, test_images: int) -> None:
    """Add ``--time-budget``, ``--eval-every`` (seconds, > 0), ``--eval-subset`` (1..``test_images``)
    and ``--output`` to ``parser``; out-of-range values are refused at parse time."""
    seconds = float_in(0, low_open=True, unit=" s")
    parser.add_argument("--time-budget", type=seconds, default=None, metavar="SECONDS",
                        help="stop after this many seconds of training (evaluation not counted)")
    parser.add_argument("--eval-every", type=seconds, default=None, metavar="SECONDS",
                        help="also evaluate on the test set every this many seconds of training")
    parser.add_argument("--eval-subset", type=int_in(1, test_images), default=None, metavar="N",
                        help="evaluate on a fixed subset of N test images, the same for every seed and run "
                             f"(default: all {test_images:,})")
    parser.add_argument("--output", default=None, metavar="FILE.json", help="rank 0 writes the final metrics here")


@dataclass(frozen=True)
class RunMetrics:
    """What one training run measured, as rank 0 writes it.

    Attributes:
        test_accuracy: final accuracy on the (subset of the) test set, in [0, 1].
        test_loss: final mean cross-entropy on it, nats.
        epochs: epochs asked for (``--epochs``; a time budget may end training sooner: see
            ``stopped_by`` and ``epochs_trained``).
        model: the model's name (``cnn``, ``resnet8``).
        wall_s: seconds from the start of training to the end of the final evaluation.
        train_s: seconds of training, evaluation and clock reads not counted, by the job's clock: the
            largest of the workers' own (a worker that finishes a step early waits for the others
            inside those pauses, so its own clock leaves part of the job's time out).
        samples: training samples all workers consumed.
        workers: number of workers.
        batch_sizes: each worker's first batch size.
        batch_schedule: the ``--batch-schedule`` text, or None.
        lr: learning rate for the first step's global batch.
        lr_scaling: the learning-rate scaling rule's name.
        warmup_steps: steps of gradual learning-rate warm-up (``--warmup-steps``; 0: none).
        test_samples: test images scored at each evaluation.
        curve: (seconds of training, global samples, test accuracy, test loss) at each evaluation.
        worker_statistics: one dict per rank: ``rank``, ``steps``, ``samples``, ``compute_s``,
            ``push_pull_s``, ``samples_per_s`` (samples over compute seconds).
        mode: how the TensorFlow example trained (``fit`` or ``loop``); None for PyTorch.
        stopped_by: what ended training: ``time_budget`` (``--time-budget`` ran out) or ``epochs``
            (all ``epochs`` trained); None when the script does not say.
        epochs_trained: passes over the training set actually trained, ``samples`` over its size
            (1.37: the budget ran out in the second epoch); None when the script does not say.

    Raises:
        ValueError: ``stopped_by`` is not None or one of :data:`STOP_REASONS`.
    """

    test_accuracy: float
    test_loss: float
    epochs: int
    model: str
    wall_s: float
    train_s: float
    samples: int
    workers: int
    batch_sizes: list[int]
    batch_schedule: str | None
    lr: float
    lr_scaling: str
    test_samples: int
    warmup_steps: int = 0
    curve: list[tuple[float, int, float, float]] = field(default_factory=list)
    worker_statistics: list[dict] = field(default_factory=list)
    mode: str | None = None
    stopped_by: str | None = None
    epochs_trained: float | None = None

    def __post_init__(self):
        if self.stopped_by is not None and self.stopped_by not in STOP_REASONS:
            raise ValueError(f"RunMetrics stopped_by={self.stopped_by!r} must be one of {', '.join(STOP_REASONS)}, "
                             "or None when the script does not say")

    def to_json(self) -> dict:
        """The JSON object: every attribute (``mode``, ``stopped_by`` and ``epochs_trained`` only
        when set, so files of scripts that do not set them read as before), each curve point as a dict of
        :data:`CURVE_FIELDS`, plus ``samples_per_s`` (samples over ``train_s``; 0 without training)
        and ``steps`` (rank 0's optimizer steps)."""
        record = dataclasses.asdict(self)
        for optional in ("mode", "stopped_by", "epochs_trained"):
            if record[optional] is None:
                del record[optional]
        record["curve"] = [dict(zip(CURVE_FIELDS, point)) for point in self.curve]
        record["samples_per_s"] = self.samples / self.train_s if self.train_s else 0.0
        record["steps"] = self.worker_statistics[0]["steps"] if self.worker_statistics else 0
        return record

    def write(self, path: str | os.PathLike) -> None:
        """Replace ``path`` with :meth:`to_json`'s object, atomically (readers never see half a file)."""
        write_atomic(path, json.dumps(self.to_json(), indent=2))
