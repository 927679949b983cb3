"""A ``tf.data`` pipeline fed by the dynamic batch sampler, for ``model.fit`` and custom loops.

:func:`dynamic_batch_dataset` turns a :class:`~dynamix_byteps.data.sampler.DynamicBatchSampler`
and in-memory data into a dataset of this worker's batches: every iteration (every Keras epoch)
draws the sampler's next epoch, with the batch size in force at each step, so every sample is
seen once per epoch across the workers and all workers run the same number of steps. The
sampler runs in Python (``from_generator``), the gathering in TensorFlow.

A new iteration starts again from the oldest batch no optimizer trained on (Keras abandons an
iterator when an epoch ends early), so no sample is lost or repeated.

With ``model.fit``: the number of steps per epoch is not known in advance (it follows the
batch sizes), so Keras ends each epoch when the data runs out and says "Your input ran out of
data" once; that is expected here. Keras counts the later epochs of one ``fit`` call in its first
epoch's steps: when the global batch shrinks (``goodput``, ``ppo``, a schedule that lowers it), a
later epoch has more steps, Keras ends it early, the next one finishes the sampler's epoch first,
and the last call's epochs end before the sampler's (measured, Keras 3.15, one worker, 640 samples,
the batch 64 → 32 at step 12: ``fit(epochs=3)`` ran 10, 11 and 7 steps, two of the sampler's
epochs; one ``fit(initial_epoch=e, epochs=e + 1)`` per epoch ran 10, 18 and 20, all three). So
when the batch can shrink, call ``fit`` once per epoch. Pass ``shuffle=False`` (the sampler
shuffles).

tf.data autotuning is off for this dataset: there is nothing to tune (one Python generator, one
gather), and an iterator that Keras drops at an epoch's end waited for the autotuning thread's
current period before it was freed: 6–120 s at the start of a Keras epoch of 20,000–60,000 samples
(TensorFlow 2.21, measured), counted as training time.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from dynamix_byteps.data.sampler import DynamicBatchSampler
from dynamix_byteps.errors import ConfigurationError


def dynamic_batch_dataset(sampler: DynamicBatchSampler, data) -> tf.data.Dataset:
    """This worker's batches of ``data``, one sampler epoch per iteration.

    Args:
        sampler: the job's ``DynamicBatchSampler`` over ``len(data)`` samples.
        data: an array or tensor, or a tuple/dict of them (e.g. ``(images, labels)``), all with
            the samples along the first axis; kept in memory as TensorFlow tensors.

    Returns:
        ``tf.data.Dataset`` whose elements have ``data``'s structure, each array with a first
        axis of this worker's local batch size at that step.

    Raises:
        ConfigurationError: an array's first axis is not the sampler's dataset size.
    """
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
    lengths = {int(t.shape[0]) if t.shape.rank else -1 for t in tf.nest.flatten(tensors)}
    if lengths != {sampler.dataset_size}:
        raise ConfigurationError(f"data has {sorted(lengths)} samples along its first axis but the sampler was "
                                 f"built for {sampler.dataset_size}; build it over the same data")

    def batches():
        for indices in sampler:
            yield np.asarray(indices, dtype=np.int64)

    indices = tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec([None], tf.int64))
    options = tf.data.Options()
    options.autotune.enabled = False
    return indices.map(lambda batch: tf.nest.map_structure(lambda t: tf.gather(t, batch), tensors)).with_options(options)
