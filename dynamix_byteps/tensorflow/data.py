"""A ``tf.data`` pipeline fed by the dynamic batch sampler, for ``model.fit`` and custom loops.

:func:`dynamic_batch_dataset` turns a :class:`~dynamix_byteps.data.sampler.DynamicBatchSampler`
and in-memory data into a dataset of this worker's batches: every iteration (every Keras epoch)
draws the sampler's next epoch, with the batch size in force at each step, so every sample is
seen once per epoch across the workers and all workers run the same number of steps. The
sampler runs in Python (``from_generator``), the gathering in TensorFlow.

A new iteration starts again from the oldest batch no optimizer trained on (Keras abandons an
iterator when an epoch ends early), so no sample is lost or repeated.

With ``model.fit``: the number of steps per epoch is not known in advance (it follows the
batch sizes), so each Keras epoch runs until the data runs out, and Keras says "Your input ran out
of data" once; that is expected here. Keras 3 alone would end every later epoch of one ``fit``
call at the first epoch's step count, so with a global batch that shrinks (``goodput``, ``ppo``, a
schedule that lowers it) the later epochs ended early and the last ones never trained (Keras 3.15,
one worker, 640 samples, the batch 64 → 32 at step 12: ``fit(epochs=3)`` ran 10, 11 and 7 steps,
two of the sampler's epochs). This dataset, and any built on it (``.prefetch()``), makes every
epoch of ``fit`` run to the sampler's epoch end (now 10, 18 and 20 steps), through private Keras
internals (:mod:`dynamix_byteps.tensorflow.fit_epochs`); where a Keras version lacks them, the
first call warns, naming the version: then call ``fit`` once per epoch
(``fit(initial_epoch=e, epochs=e + 1)``). Keras's progress bar keeps the first epoch's step count
as every later epoch's total. Pass ``shuffle=False`` (the sampler shuffles).

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
from dynamix_byteps.tensorflow.fit_epochs import run_whole_passes


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

    Warns:
        UserWarning: (first call only) this Keras version lacks the internals that make each
            ``model.fit`` epoch run to the sampler's epoch end; call ``fit`` once per epoch.
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
    gathered = indices.map(lambda batch: tf.nest.map_structure(lambda t: tf.gather(t, batch), tensors))
    return run_whole_passes(gathered.with_options(options))
