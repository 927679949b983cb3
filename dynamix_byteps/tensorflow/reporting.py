"""``report_loss`` for TensorFlow: eager values directly, graph tensors through an op."""

from __future__ import annotations

import tensorflow as tf

from dynamix_byteps.control import step_monitor
from dynamix_byteps.tensorflow.bridge import call


def report_loss(loss) -> None:
    """Add a training loss (float or scalar tensor, also inside ``tf.function``) to the mean of
    this interval that the batch-size policy sees."""
    if not tf.is_tensor(loss):
        step_monitor.report_loss(float(loss))
        return
    call(lambda value: step_monitor.report_loss(float(value)) or [], [tf.cast(loss, tf.float64)], [])
