"""TensorFlow functions run inside real worker processes by ``multiworker.run_workers`` for
tests/test_parity.py: the BytePS names the TensorFlow and Keras frontends gained.

TensorFlow starts slowly, so one function runs every check and returns JSON-serialisable results.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import warnings

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import dynamix_byteps.tensorflow as bps
import dynamix_byteps.tensorflow.keras as bps_keras


class MySGD(keras.optimizers.SGD):
    """An optimizer class of the user's own, to be named in load_model(custom_optimizers=...)."""


def _refused(call) -> str | None:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _model(seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


def _data(rank: int, samples: int = 16):
    rng = np.random.default_rng(rank)
    return rng.normal(size=(samples, 4)).astype("float32"), rng.normal(size=(samples, 1)).astype("float32")


def keras_functions() -> dict:
    rank = bps.rank()
    return {
        "push_pull_sum": bps_keras.push_pull([1.0, 2.0 * rank], name="values", average=False).numpy().tolist(),
        "push_pull_mean": float(bps_keras.push_pull(np.float64(rank), name="mean")),
        "push_pull_default_name": float(bps_keras.push_pull(4.0 * rank)),
        "broadcast": bps_keras.broadcast(np.arange(3) + 10 * rank, root_rank=bps.size() - 1, name="b").numpy().tolist(),
        "same_functions": [bps_keras.init is bps.init, bps_keras.shutdown is bps.shutdown,
                           bps_keras.size() == bps.size(), bps_keras.Compression is bps.Compression],
    }


def refusals() -> dict:
    return {
        "bpps": _refused(lambda: bps.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)),
        "optimizer_sum": _refused(lambda: bps.DistributedOptimizer(keras.optimizers.SGD(0.1), op=bps.Sum)),
        "tape_adasum": _refused(lambda: bps.DistributedGradientTape(tf.GradientTape(), op=bps.Adasum)),
        "push_pull_adasum": _refused(lambda: bps.push_pull(tf.ones(2), op=bps.Adasum)),
        "v1_optimizer": _refused(lambda: bps.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))),
        "eager_global_variables": _refused(lambda: bps.broadcast_global_variables(0)),
    }


def byteps_positional_optimizer() -> list[float]:
    """``bps.DistributedOptimizer`` with every BytePS argument by position trains in step."""
    model = _model()
    optimizer = bps.DistributedOptimizer(keras.optimizers.SGD(0.1), None, False, "", "", bps.Compression.none,
                                         False, 1, bps.Average)
    x, y = _data(bps.rank())
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return [float(v) for v in np.concatenate([w.numpy().ravel() for w in model.weights])]


def graph_global_variables() -> list:
    """TensorFlow 1-style: broadcast_global_variables' op, run in a session (root: the last rank)."""
    rank = bps.rank()
    with tf.Graph().as_default():
        vector, scalar = tf.Variable(np.arange(3.0) + 10 * rank), tf.Variable(float(rank))
        op = bps.broadcast_global_variables(bps.size() - 1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(op)
            return [session.run(vector).tolist(), float(session.run(scalar))]


def loaded_model(directory: str) -> dict:
    """Each rank trains the same model locally (2 steps), saves it and loads it with
    bps_keras.load_model, with a Keras optimizer and one of its own; training then goes on in step
    on every worker."""
    rank, results = bps.rank(), {}
    for label, optimizer_class, custom in [("builtin", keras.optimizers.SGD, None), ("custom", MySGD, [MySGD])]:
        model = _model()
        model.compile(optimizer=optimizer_class(0.05, momentum=0.9), loss="mse")
        x, y = _data(7)  # the same local training on every rank
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        path = os.path.join(directory, f"{label}{rank}.keras")
        model.save(path)
        velocity = float(sum(np.abs(v.numpy()).sum() for v in model.optimizer.momentums))
        loaded = bps_keras.load_model(path, custom_optimizers=custom, compression=bps.Compression.fp16)
        optimizer = loaded.optimizer
        results[label] = {
            "wrapped": hasattr(optimizer, "dynamix") and isinstance(optimizer, optimizer_class),
            "class": type(optimizer).__name__,
            "saved_velocity": velocity,
            "loaded_velocity": float(sum(np.abs(v.numpy()).sum() for v in optimizer.momentums)),
            "iterations": int(optimizer.iterations.numpy()),
        }
    x, y = _data(rank)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # in step on every worker
    results["weights"] = [float(v) for v in np.concatenate([w.numpy().ravel() for w in loaded.weights])]
    uncompiled = _model()
    path = os.path.join(directory, f"plain{rank}.keras")
    uncompiled.save(path)
    results["uncompiled_optimizer"] = repr(getattr(bps_keras.load_model(path), "optimizer", None))
    return results


def _flat(variables) -> list[float]:
    return [float(v) for v in np.concatenate([np.ravel(variable.numpy()) for variable in variables])]


def horovod_keras_optimizer() -> dict:
    """Horovod's tensorflow2_keras_mnist.py call, ``DistributedOptimizer(opt, backward_passes_per_step=1,
    average_aggregated_gradients=True)``, and the TensorFlow one with Horovod's arguments, train as
    the plain wrapper does (the trained weights); more than one pass per step is refused."""
    horovod = {"backward_passes_per_step": 1, "average_aggregated_gradients": True}
    weights = {}
    for label, wrap in [("plain", bps_keras.DistributedOptimizer),
                        ("horovod_keras", lambda opt: bps_keras.DistributedOptimizer(opt, **horovod)),
                        ("horovod_tf", lambda opt: bps.DistributedOptimizer(opt, op=bps.Average,
                                                                            gradient_predivide_factor=2.0, **horovod))]:
        model = _model()
        model.compile(optimizer=wrap(keras.optimizers.Adam(0.01)), loss=keras.losses.MeanSquaredError())
        x, y = _data(bps.rank())
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
        weights[label] = _flat(model.weights)
    more = _refused(lambda: bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                                           average_aggregated_gradients=True))
    warned = {}
    for label, make in [("horovod_warmup", lambda: bps_keras.callbacks.LearningRateWarmupCallback(0.02)),
                        ("byteps_warmup", lambda: bps_keras.callbacks.LearningRateWarmupCallback(3)),
                        ("named_warmup", lambda: bps_keras.callbacks.LearningRateWarmupCallback(0.5, initial_lr=0.1))]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        warned[label] = [str(w.message) for w in caught]
    return {"weights": weights, "more_passes": more, "warmup_warnings": warned}


def resumed_optimizer_state(directory: str, suffix: str) -> dict:
    """A model trained 4 steps with SGD and momentum, saved as ``model.<suffix>`` (``h5`` or ``keras``)
    as BytePS's and Horovod's ModelCheckpoint does, loaded with bps_keras.load_model and trained 4
    steps more: the optimizer's variables saved and loaded, and the iteration count at the end."""
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=keras.losses.MeanSquaredError())
    x, y = _data(7)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    path = os.path.join(directory, f"model.{suffix}")
    model.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = bps_keras.load_model(path)
    result = {"saved": _flat(model.optimizer.variables), "loaded": _flat(loaded.optimizer.variables),
              "wrapped": hasattr(loaded.optimizer, "dynamix"), "warnings": [str(w.message) for w in caught]}
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    result["iterations_after_resuming"] = int(loaded.optimizer.iterations.numpy())
    return result


class _Recorder(keras.callbacks.Callback):
    """Records, per batch, the learning rate the step will use and the size (sum of absolute
    values) of SGD's velocity before and after it.

    On a dataset of unknown length Keras begins one batch more per epoch than it runs, to find
    the end; ``steps`` leaves that one out.
    """

    def __init__(self):
        super().__init__()
        self.rows = []

    def _velocity(self) -> float:
        return float(sum(np.abs(v.numpy()).sum() for v in self.model.optimizer.momentums))

    def on_train_batch_begin(self, batch, logs=None):
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self.rows.append([batch, rate, self._velocity() if self.model.optimizer.built else 0.0])

    def on_train_batch_end(self, batch, logs=None):
        self.rows[-1].append(self._velocity())

    @property
    def steps(self) -> list:
        return [row for row in self.rows if len(row) == 4]


def lr_callbacks() -> dict:
    """Warm-up over 2 epochs of 4 known steps, then a 0.1 schedule from epoch 2; the same warm-up
    on a dataset of unknown length (per epoch); and a LearningRateSchedule refused."""
    rank, results = bps.rank(), {}
    x, y = _data(rank, samples=32)
    known = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    unknown = known.filter(lambda *_: True)
    for label, dataset in [("known", known), ("unknown", unknown)]:
        model = _model()
        model.compile(optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
        recorder = _Recorder()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(dataset, epochs=3, verbose=0, callbacks=[
                bps_keras.callbacks.LearningRateWarmupCallback(warmup_epochs=2, verbose=0),
                bps_keras.callbacks.LearningRateScheduleCallback(0.1, start_epoch=2),
                recorder,
            ])
        results[label] = {"rows": recorder.steps, "lr_log": history.history["lr"],
                          "warnings": [str(w.message) for w in caught if "steps per epoch" in str(w.message)]}
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    results["schedule_refused"] = _refused(lambda: model.fit(
        known, epochs=1, verbose=0, callbacks=[bps_keras.callbacks.LearningRateWarmupCallback()]))
    return results


def all_checks(directory: str) -> dict:
    return {"keras_functions": keras_functions(), "refusals": refusals(),
            "positional_optimizer": byteps_positional_optimizer(), "graph_global_variables": graph_global_variables(),
            "loaded_model": loaded_model(directory), "lr_callbacks": lr_callbacks()}


def rank0_resume(directory: str) -> str | None:
    """Horovod's Keras resume recipe: rank 0 loads the checkpoint, the others build a fresh model;
    the error of BroadcastGlobalVariablesCallback at fit's start, or None."""
    model = _model()
    model.compile(optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    if bps.rank() == 0:
        path = os.path.join(directory, "checkpoint.keras")
        model.save(path)
        model = bps_keras.load_model(path)
    x, y = _data(bps.rank())
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[bps_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
