"""Bad inputs to the byteps.tensorflow API, run in a real worker (tests/test_tf_inputs.py)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import dynamix_byteps.tensorflow as bps
from dynamix_byteps.assignment import InvalidAssignmentError


def _type_error(call, *args, **kwargs) -> str | None:
    try:
        call(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    return None


def unsupported_dtypes() -> dict:
    """The TypeError message for each unsupported dtype, eagerly and in tf.function; then a
    push_pull that must still work (the job goes on)."""
    errors = {}
    for dtype, value in {"string": ["a", "b"], "bool": [True, False], "int16": [1, 2]}.items():
        tensor = tf.constant(value) if dtype != "int16" else tf.constant(value, dtype=tf.int16)
        errors[dtype] = _type_error(bps.push_pull, tensor, name=f"bad.{dtype}")
        errors[f"{dtype}.graph"] = _type_error(tf.function(bps.push_pull), tensor)
    after = bps.push_pull(tf.ones(2), average=False, name="after").numpy().tolist()
    return {"errors": errors, "after": after}


def set_batch_sizes_inputs() -> dict:
    """set_batch_sizes with None, an integer tensor and a NumPy array (one worker)."""
    bps.DynamicBatchSampler(64, [8])
    results = {}
    for label, sizes in {"none": None, "int": 16, "tensor": tf.constant([12]), "array": np.array([10])}.items():
        try:
            results[label] = list(bps.set_batch_sizes(sizes).batch_sizes)
        except InvalidAssignmentError as exc:
            results[label] = f"InvalidAssignmentError: {exc}"
    return results


def _raised(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type and the message
        return f"{type(exc).__name__}: {exc}"
    return None


def xla_compiled_steps() -> dict:
    """What a tape, a Keras DistributedOptimizer under model.fit and a push_pull raise in a step
    compiled with XLA (jit_compile=True); then a push_pull that must still work."""
    import keras

    import dynamix_byteps.tensorflow.keras as bps_keras

    variable = tf.Variable(tf.ones([3]), name="xla")

    @tf.function(jit_compile=True)
    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * variable)
        return bps.DistributedGradientTape(tape).gradient(loss, [variable])

    def fit():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                      jit_compile=True)
        model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), batch_size=2, verbose=0)

    push_pull = tf.function(lambda t: bps.push_pull(t, name="xla"), jit_compile=True)
    return {"tape": _raised(tape_step), "fit": _raised(fit), "push_pull": _raised(lambda: push_pull(tf.ones(2))),
            "after": bps.push_pull(tf.ones(2), average=False, name="after").numpy().tolist()}
