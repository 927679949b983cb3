"""A TensorFlow worker for the end-to-end control-plane test: model.fit of a wide MLP on
synthetic data through a DynamicBatchSampler (19200 samples, a multiple of the 192 global batch,
so no epoch ends in a partial step), with the Keras DistributedOptimizer and BatchSizeCallback.
Writes, per step, its local and the global batch size to ``<out_dir>/rank<r>.json``.
Usage: tf_control_worker.py OUT_DIR STEPS"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import dynamix_byteps.tensorflow as bps
import dynamix_byteps.tensorflow.keras as bps_keras

out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
bps.init()
rng = np.random.default_rng(0)
x, y = rng.normal(size=(19200, 64)).astype("float32"), rng.integers(0, 10, 19200)
sampler = bps.DynamicBatchSampler(len(x), 64, seed=1)
# Wide enough that compute grows with the batch (a per-step fixed cost would dominate a tiny model).
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                          keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
optimizer = bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.01))
model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
log = []


class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = optimizer.next_step - 1
        log.append([int(sampler.schedule.at(step).batch_sizes[bps.rank()]), optimizer.global_batch_size])
        if len(log) == steps:
            self.model.stop_training = True


model.fit(bps.dynamic_batch_dataset(sampler, (x, y)), epochs=100, verbose=0, shuffle=False,
          callbacks=[bps_keras.callbacks.BroadcastGlobalVariablesCallback(0), bps_keras.callbacks.BatchSizeCallback(),
                     Record()])
(out_dir / f"rank{bps.rank()}.json").write_text(json.dumps(log))
bps.shutdown()
