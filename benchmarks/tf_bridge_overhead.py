"""What the TensorFlow frontend costs on top of the engine, on the example CNN's gradients.

    python benchmarks/tf_bridge_overhead.py [--runs 7] [--calls 200]

One worker (the collective itself is then trivial, so what remains is the frontend):

* crossing: a TensorFlow tensor to the engine's torch buffer through DLPack (no copy), against
  the copy the numpy route makes (``tensor.numpy()`` copies in TensorFlow 2.21, then
  ``torch.from_numpy``); and back, torch to TensorFlow through DLPack;
* a whole gradient reduction (negotiation, fusion copy, weighting, all-reduce, unfusing) of the
  CNN's 8 gradients (421,642 float32), from TensorFlow eagerly, inside ``tf.function`` (next to
  the cost of calling a ``tf.function`` at all, which a training step pays anyway), and from the
  torch ``DistributedOptimizer`` for comparison.

Prints a table (median and minimum ns per call over ``--runs`` runs) and writes
benchmarks/results/tf_bridge_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from common import RESULTS, report_ns_per_call
from tf_fashion_mnist import build_model

import dynamix_byteps.tensorflow as bps
import dynamix_byteps.torch as bps_torch
from dynamix_byteps.tensorflow.bridge import to_tf, to_torch
from dynamix_byteps.tensorflow.gradients import GradientReducer


def measure(case: str, fn, calls: int, runs: int) -> dict:
    fn()  # warm up (tracing, allocation)
    per_call = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter_ns() - start) / calls)
    return {"case": case, "ns_per_call_median": statistics.median(per_call), "ns_per_call_min": min(per_call)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS / "tf_bridge_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    bps.init()

    model = build_model()
    grads = [tf.random.normal(v.shape) for v in model.trainable_variables]
    names = [f"Gradient.{v.path}" for v in model.trainable_variables]
    big = max(grads, key=lambda g: g.shape.num_elements())  # fc1 kernel, 3136 x 128 float32
    big_torch = to_torch(big).clone()
    reducer = GradientReducer("sgd")
    graph_reduce = tf.function(lambda *g: reducer.reduce(list(g), names)[0])
    graph_identity = tf.function(lambda *g: [tf.identity(t) for t in g])

    torch_params = [torch.nn.Parameter(torch.from_numpy(g.numpy())) for g in grads]
    for p in torch_params:
        p.grad = torch.randn_like(p)
    torch_opt = bps_torch.DistributedOptimizer(torch.optim.SGD(torch_params, lr=0.0))

    c, r = args.calls, args.runs
    results = [
        measure(f"TF -> torch, DLPack view ({big.shape.num_elements() * 4} B)", lambda: to_torch(big), c, r),
        measure("TF -> torch, tensor.numpy() + torch.from_numpy (copy)", lambda: torch.from_numpy(big.numpy()), c, r),
        measure("torch -> TF, DLPack", lambda: to_tf(big_torch), c, r),
        measure("reduce 8 gradients (1.69 MB), TF eager", lambda: reducer.reduce(grads, names), c, r),
        measure("reduce 8 gradients (1.69 MB), TF in tf.function", lambda: graph_reduce(*grads), c, r),
        measure("  baseline: a tf.function returning its 8 inputs", lambda: graph_identity(*grads), c, r),
        measure("reduce 8 gradients (1.69 MB), torch DistributedOptimizer", torch_opt.synchronize, c, r),
    ]
    report_ns_per_call(Path(args.out), "tf_bridge_overhead", c, r, results)
    bps.shutdown()


if __name__ == "__main__":
    main()
