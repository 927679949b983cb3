"""TensorFlow push_pull averages of values near float16's maximum, run in real workers
(tests/test_average_overflow.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import dynamix_byteps.tensorflow as bps

LARGE = 30000.0


def tf_large_averages() -> dict:
    """The mean of LARGE on every worker over an fp16 wire, eagerly and in a tf.function, and of
    a float16 tensor without compression."""
    fp16 = bps.Compression.fp16
    value = tf.fill([4], tf.constant(LARGE, tf.float32))

    @tf.function
    def in_graph(x):
        return bps.push_pull(x, average=True, name="graph", compression=fp16)

    return {
        "fp16_wire": bps.push_pull(value, average=True, name="eager", compression=fp16).numpy().tolist(),
        "fp16_wire_in_graph": in_graph(value).numpy().tolist(),
        "half_tensor": tf.cast(bps.push_pull(tf.cast(value, tf.float16), average=True, name="half"),
                               tf.float32).numpy().tolist(),
    }
