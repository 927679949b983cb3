"""``model.fit`` runs every Keras epoch over a whole pass of a ``dynamic_batch_dataset``.

Keras 3 (``keras/src/trainers/epoch_iterator.py``) counts the steps of a dataset of unknown
length in the first epoch of a ``fit`` call (``EpochIterator.catch_stop_iteration`` keeps them in
``_num_batches``) and ends every later epoch of that call after as many steps
(``EpochIterator._enumerate_iterator``), although ``fit``'s docstring says that without
``steps_per_epoch`` an epoch over a ``tf.data.Dataset`` runs until the dataset is exhausted. A
sampler epoch has more steps when the global batch shrinks, so ``fit(epochs=N)`` ended its later
epochs early and never trained the last ones. ``fit`` holds that iterator in a local variable, out
of a callback's reach, so :func:`run_whole_passes` wraps ``EpochIterator._enumerate_iterator``
(once per process): before each epoch over a registered dataset, or one built on it
(``.prefetch()``, ``class_weight``), without ``steps_per_epoch``, the remembered count is
forgotten, as before the first epoch. Every other dataset goes through Keras unchanged. These are
private Keras names: where a Keras version lacks them, a warning names the version and the remedy.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import keras
import tensorflow as tf

_REGISTERED: weakref.WeakSet = weakref.WeakSet()


def run_whole_passes(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Registers ``dataset`` (returned as is): each epoch of ``model.fit`` over it, or over a dataset
    built on it, runs until it is exhausted. Warns (``UserWarning``) where this Keras version lacks
    the internals that takes; ``fit`` then behaves as Keras alone does."""
    if _wrap_keras_epochs():
        _REGISTERED.add(dataset)
    return dataset


@functools.cache
def _wrap_keras_epochs() -> bool:
    """Wraps ``EpochIterator._enumerate_iterator``; False (with a warning) where Keras moved what it uses."""
    try:
        from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter
        from keras.src.trainers.epoch_iterator import EpochIterator

        enumerate_steps = EpochIterator._enumerate_iterator
        probe = EpochIterator(x=tf.data.Dataset.range(1).prefetch(1))
        missing = [name for name in ("steps_per_epoch", "data_adapter", "_num_batches") if not hasattr(probe, name)]
        if not isinstance(probe.data_adapter, TFDatasetAdapter) or not hasattr(probe.data_adapter.get_tf_dataset(),
                                                                               "_inputs"):
            missing.append("TFDatasetAdapter.get_tf_dataset()._inputs")
    except (ImportError, AttributeError) as exc:
        missing = [str(exc)]
    if missing:
        warnings.warn(f"Keras {keras.__version__} (TensorFlow {tf.__version__}) lacks what dynamix_byteps uses to make "
                      f"each epoch of model.fit over dynamic_batch_dataset run to the sampler's epoch end "
                      f"({', '.join(missing)}): when the global batch can shrink, call fit once per epoch "
                      f"(model.fit(dataset, initial_epoch=e, epochs=e + 1, ...)) or the later epochs end early",
                      stacklevel=4)
        return False

    @functools.wraps(enumerate_steps)
    def enumerate_whole_passes(self):
        if (self.steps_per_epoch is None and isinstance(self.data_adapter, TFDatasetAdapter)
                and _built_on_registered(self.data_adapter.get_tf_dataset())):
            self._num_batches = None  # as before the first epoch: run until the dataset is exhausted
        return enumerate_steps(self)

    EpochIterator._enumerate_iterator = enumerate_whole_passes
    return True


def _built_on_registered(dataset) -> bool:
    """Whether ``dataset`` is a registered dataset or has one among its inputs, however deep."""
    pending = [dataset]
    while pending:
        current = pending.pop()
        if current in _REGISTERED:
            return True
        pending.extend(getattr(current, "_inputs", list)())
    return False
