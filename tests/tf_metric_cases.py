"""Keras MetricAverageCallback with per-worker batch sizes that differ, run in real workers
(tests/test_metric_average.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import dynamix_byteps.tensorflow as bps
import dynamix_byteps.tensorflow.keras as bps_keras


def _targets(size: int, offset: float) -> np.ndarray:
    return (np.arange(size, dtype="float32") + offset).reshape(-1, 1)


def _validation(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank r validates on 3 * (r + 1) ** 2 samples of its own, so the workers' counts differ."""
    targets = _targets(3 * (rank + 1) ** 2, 100.0 * rank)
    return np.zeros_like(targets), targets


def fit_with_metric_average(dataset_size: int, sizes: list[int], epochs: int) -> dict:
    """A model that predicts 0 and never learns (lr 0): each sample's loss is its target squared,
    so the sample-weighted means over the job are known exactly. Returns the averaged epoch logs
    and those means."""
    targets = _targets(dataset_size, 1.0)
    sampler = bps.DynamicBatchSampler(dataset_size, sizes, seed=5)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse", metrics=["mae"])
    logs = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, epoch_logs=None):
            logs.append({k: float(v) for k, v in epoch_logs.items()})

    model.fit(bps.dynamic_batch_dataset(sampler, (np.zeros_like(targets), targets)), epochs=epochs, verbose=0,
              validation_data=_validation(bps.rank()), validation_batch_size=4,
              callbacks=[bps_keras.callbacks.MetricAverageCallback(), Record()])
    validated = np.concatenate([_validation(r)[1] for r in range(bps.size())])
    expected = {"loss": float(np.mean(targets.astype("float64") ** 2)), "mae": float(np.mean(targets)),
                "val_loss": float(np.mean(validated.astype("float64") ** 2)), "val_mae": float(np.mean(validated))}
    return {"logs": logs, "expected": expected}
