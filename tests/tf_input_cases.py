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
