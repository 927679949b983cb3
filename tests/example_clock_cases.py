"""The examples' training clocks in real workers (tests/test_example.py): each worker has trained a
different number of seconds; every worker must read the largest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_clock() -> float:
    example = _example("torch_fashion_mnist")
    bps = example.bps
    bps.init()
    try:
        return example.training_clock(bps.rank(), bps.size(), 10.0 * (bps.rank() + 1))
    finally:
        bps.shutdown()


def tensorflow_clock() -> float:
    example = _example("tf_fashion_mnist")
    bps = example.bps
    bps.init()
    try:
        clock = example.TrainingClock(bps.rank(), bps.size(), None, None, evaluate=None, log=print)
        clock.elapsed = lambda: 10.0 * (bps.rank() + 1)
        return clock.read()
    finally:
        bps.shutdown()
