"""TensorFlow functions run inside real worker processes by ``multiworker.run_workers``.

TensorFlow starts slowly, so each function runs several checks and returns JSON-serialisable
results; the test in the parent asserts on them. References are computed inside the worker
from the same seeds: every rank checks against the exact single-process answer.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import dynamix_byteps.tensorflow as bps
import dynamix_byteps.tensorflow.keras as bps_keras
from dynamix_byteps.data.partition import permutation
from dynamix_byteps.errors import TensorMismatchError

DTYPES = [tf.float32, tf.float64, tf.int32, tf.int64]
SHAPES = [(17,), (5, 7), (3, 4, 6)]


def _value(rank: int, shape, dtype, round_: int = 0) -> tf.Tensor:
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return tf.constant((base % 11) * (rank + 1) + 3 * round_ + rank, dtype=dtype)


def _equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.allclose(a.numpy(), b.numpy(), rtol=1e-6))


def collectives() -> list[str]:
    """push_pull sum and average (eager and tf.function), broadcasts, gradients, mismatches."""
    n, rank, failures = bps.size(), bps.rank(), []
    in_graph = tf.function(lambda t, average: bps.push_pull(t, average=average, name="graph"))
    for dtype in DTYPES:
        for shape in SHAPES:
            total = sum(_value(r, shape, tf.int64) for r in range(n))
            mean = tf.cast(total, dtype) / n if dtype.is_floating else total // n
            mine = _value(rank, shape, dtype)
            tag = f"{dtype.name}{list(shape)}"
            if not _equal(bps.push_pull(mine, average=False, name=f"sum.{tag}"), tf.cast(total, dtype)):
                failures.append(f"eager sum {tag}")
            if not _equal(bps.push_pull(mine, name=f"avg.{tag}"), tf.cast(mean, dtype)):
                failures.append(f"eager average {tag}")
            if not _equal(bps.push_pull(mine, op=bps.Sum), tf.cast(total, dtype)):
                failures.append(f"op=Sum {tag}")
            if not _equal(in_graph(mine, False), tf.cast(total, dtype)):
                failures.append(f"tf.function sum {tag}")
            if not _equal(in_graph(mine, True), tf.cast(mean, dtype)):
                failures.append(f"tf.function average {tag}")
            if not _equal(mine, _value(rank, shape, dtype)):
                failures.append(f"input modified {tag}")
    half = bps.push_pull(tf.fill([8], 0.5 * (rank + 1)), compression=bps.Compression.fp16, name="fp16")
    if half.dtype != tf.float32 or half.numpy().tolist() != [0.25 * (n + 1)] * 8:
        failures.append(f"fp16 compression: {half}")
    root = 1 % n
    if not _equal(bps.broadcast(_value(rank, (4, 3), tf.float32), root), _value(root, (4, 3), tf.float32)):
        failures.append("broadcast")
    variables = [tf.Variable(_value(rank, (5,), tf.float32)), tf.Variable(_value(rank, (2, 2), tf.int64))]
    bps.broadcast_variables(variables, root)
    if not (_equal(variables[0].read_value(), _value(root, (5,), tf.float32))
            and _equal(variables[1].read_value(), _value(root, (2, 2), tf.int64))):
        failures.append("broadcast_variables eager")
    graph_variable = tf.Variable(_value(rank, (3,), tf.float64))

    @tf.function
    def broadcast_in_graph():
        bps.broadcast_variables([graph_variable], root)

    broadcast_in_graph()
    if not _equal(graph_variable.read_value(), _value(root, (3,), tf.float64)):
        failures.append("broadcast_variables in tf.function")
    # d/dx of sum_r push_pull(x_r)**2 summed over workers: 2 * n * sum_r x_r on every worker.
    x = tf.constant([1.0, 2.0]) * (rank + 1)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(bps.push_pull(x, average=False, name="differentiable") ** 2)
    expected = 2.0 * n * sum(r + 1 for r in range(n)) * np.array([1.0, 2.0])
    if not np.allclose(tape.gradient(y, x).numpy(), expected):
        failures.append("push_pull gradient")
    mismatches = {}
    for case, call in {"name": lambda: bps.push_pull(tf.ones(4), name=f"t{rank}"),
                       "shape": lambda: bps.push_pull(tf.ones(4 + rank), name="t")}.items():
        try:
            call()
            mismatches[case] = None
        except TensorMismatchError as exc:
            mismatches[case] = str(exc)
    if n > 1 and not all(m and f"rank {n - 1}:" in m for m in mismatches.values()):
        failures.append(f"mismatch not raised everywhere: {mismatches}")
    if bps.push_pull(tf.ones(2), average=False, name="after").numpy().tolist() != [float(n)] * 2:
        failures.append("job unusable after a mismatch")
    return failures


def gradients_that_change() -> list[str]:
    """A gradient None on every worker stays None; one that appears on every worker at once is
    reduced exactly; one None on some workers only raises TensorMismatchError on every worker,
    at once, and the job goes on afterwards."""
    n, rank, failures = bps.size(), bps.rank(), []
    w1, w2 = tf.Variable([1.0, 2.0]), tf.Variable([3.0])

    def gradients(use_w2: bool):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w1 * (rank + 1.0)) + (tf.reduce_sum(w2) * (rank + 1.0) if use_w2 else 0.0)
        return bps.DistributedGradientTape(tape).gradient(loss, [w1, w2])

    mean = sum(r + 1.0 for r in range(n)) / n
    g1, g2 = gradients(use_w2=False)
    if g2 is not None or not np.allclose(g1.numpy(), [mean, mean]):
        failures.append(f"step 0: {g1}, {g2}")
    g1, g2 = gradients(use_w2=True)  # every worker's w2 gets a gradient at the same step
    if g2 is None or not np.allclose(g2.numpy(), [mean]) or not np.allclose(g1.numpy(), [mean, mean]):
        failures.append(f"step 1: {g1}, {g2}")
    try:
        gradients(use_w2=rank != 0)
        failures.append("step 2: a gradient None on rank 0 only was reduced")
    except TensorMismatchError as error:
        if "rank 0:" not in str(error) or "rank 1:" not in str(error):
            failures.append(f"step 2: {error}")
    g1, g2 = gradients(use_w2=True)
    if g2 is None or not np.allclose(g2.numpy(), [mean]):
        failures.append(f"step 3 (after the mismatch): {g1}, {g2}")
    return failures


def alternating_gradient_sets() -> dict:
    """A GAN's two tapes over one reducer: sets of 1,000 and 3 values in turn, 8 calls. Every
    result is exact, and only the first change costs a round of its own."""
    from dynamix_byteps.tensorflow.gradients import GradientReducer

    n, rank = bps.size(), bps.rank()
    reducer = GradientReducer("sgd")
    sets = {"big": ["Gradient.g"], "small": ["Gradient.d"]}
    shapes = {"big": (1000,), "small": (3,)}
    wrong = []
    for call in range(8):
        which = "big" if call % 2 == 0 else "small"
        grad = tf.fill(shapes[which], float(rank + 1 + call))
        (reduced,), _ = reducer.reduce([grad], sets[which])
        if not np.allclose(reduced.numpy(), sum(r + 1 + call for r in range(n)) / n):
            wrong.append(call)
    return {"wrong": wrong, "rounds": reducer.aggregator._rounds}


def worker_without_samples() -> dict:
    """Rank 0 declares 0 samples and has an empty batch, whose BatchNormalization gradients are NaN;
    the other workers have equal batches. Their gradients reduced eagerly and in tf.function,
    against the mean of each batch's gradients in one process (BatchNormalization normalizes
    each batch by its own statistics)."""
    rank, per_worker = bps.rank(), 4
    x_all, y_all = _data(per_worker * (bps.size() - 1))
    batches = [(x_all[s:s + per_worker], y_all[s:s + per_worker]) for s in range(0, len(x_all), per_worker)]

    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                 keras.layers.Dense(3)])

    reference, per_batch = model(), []
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = _loss(reference, x, y)
        per_batch.append([g.numpy() for g in tape.gradient(loss, reference.trainable_variables)])
    expected = [np.mean(grads, axis=0) for grads in zip(*per_batch)]
    net = model()
    x, y = (x_all[:0], y_all[:0]) if rank == 0 else batches[rank - 1]

    def reduced(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(net, x, y)
        tape = bps.DistributedGradientTape(tape, local_batch_size=tf.shape(x)[0])
        return tape.gradient(loss, net.trainable_variables)

    def error(step) -> float:  # over all gradients: the first layer's bias has a gradient of ~0
        got, want = np.array(_flat(step(tf.constant(x), tf.constant(y)))), np.array(_flat(expected))
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    return {"eager": error(reduced), "graph": error(tf.function(reduced))}


def _tiny_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _data(size: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(size, 6)).astype("float32"), rng.integers(0, 3, size).astype("int64")


def _loss(model, x, y):
    logits = model(x, training=True)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def _reference(global_batches, steps_for_grad: int = 0):
    """Single-process SGD with momentum on the concatenated global batches."""
    model, opt, first = _tiny_model(0), keras.optimizers.SGD(0.1, momentum=0.9), None
    for x, y in global_batches:
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        first = first or [g.numpy() for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return first, [v.numpy() for v in model.trainable_variables]


def _relative_error(a, b) -> float:
    return max(float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in zip(a, b))


def _flat(variables) -> list[float]:
    return np.concatenate([np.ravel(np.asarray(v)) for v in variables]).astype(float).tolist()


def weighted_training(batch_sizes: list[int], steps: int) -> dict:
    """Per-worker batches against single-process training on the concatenated batches:
    (1) DistributedGradientTape in tf.function with local_batch_size; (2) model.fit with the
    Keras DistributedOptimizer fed by a DynamicBatchSampler (sizes taken from the sampler)."""
    rank, total = bps.rank(), sum(batch_sizes)
    start = sum(batch_sizes[:rank])
    x_all, y_all = _data(total * steps)
    global_batches = [(x_all[s * total:(s + 1) * total], y_all[s * total:(s + 1) * total]) for s in range(steps)]
    ref_grads, ref_params = _reference(global_batches)

    model, opt = _tiny_model(0), keras.optimizers.SGD(0.1, momentum=0.9)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        tape = bps.DistributedGradientTape(tape, local_batch_size=tf.shape(x)[0])
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    first = None
    for x, y in global_batches:
        grads = step(x[start:start + batch_sizes[rank]], y[start:start + batch_sizes[rank]])
        first = first or [g.numpy() for g in grads]
    tape_result = {"grad_error": _relative_error(first, ref_grads),
                   "param_error": _relative_error([v.numpy() for v in model.trainable_variables], ref_params)}

    # model.fit: the sampler cuts one shuffled permutation into the per-worker batches.
    sampler = bps.DynamicBatchSampler(len(x_all), batch_sizes, seed=5)
    order = permutation(len(x_all), 5, 0, True)
    _, fit_ref_params = _reference([(x_all[order[s * total:(s + 1) * total]], y_all[order[s * total:(s + 1) * total]])
                                    for s in range(steps)])
    fit_model = _tiny_model(0)
    fit_opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    fit_model.compile(optimizer=fit_opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit_model.fit(bps.dynamic_batch_dataset(sampler, (x_all, y_all)), epochs=1, verbose=0, shuffle=False)
    return {"tape": tape_result, "fit_param_error": _relative_error([v.numpy() for v in fit_model.trainable_variables],
                                                                    fit_ref_params),
            "fit_global_batch": fit_opt.global_batch_size, "fit_steps": fit_opt.dynamix.monitor.steps}


class _RecordingSampler(bps.DynamicBatchSampler):
    """Remembers the indices it hands out for each global step (a redraw overwrites)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drawn: dict[int, list[int]] = {}

    def __iter__(self):
        for indices in super().__iter__():
            self.drawn[self._position.step - 1] = list(indices)
            yield indices


def fit_with_batch_change(dataset_size: int, sizes: list[int], change: str, epochs: int) -> dict:
    """model.fit over a DynamicBatchSampler with BatchSizeCallback(change) and all dynamix
    callbacks; returns per trained step (global step, local samples, global batch), the
    indices trained on, by epoch, and whether the dataset runs tf.data autotuning."""
    x, y = _data(dataset_size, seed=3)
    sampler = _RecordingSampler(dataset_size, sizes, seed=11)
    model = _tiny_model(100 + bps.rank())  # different initial weights: the callback broadcasts rank 0's
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.05), lr_scaling="linear")
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    steps, epoch_of_step, epoch_logs = [], {}, []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            step = opt.next_step - 1
            steps.append([step, len(sampler.drawn[step]), opt.global_batch_size, opt.lr_scale])
            epoch_of_step[step] = self.epoch

        def on_epoch_end(self, epoch, logs=None):
            epoch_logs.append(dict(logs))

    dataset = bps.dynamic_batch_dataset(sampler, (x, y))
    history = model.fit(dataset, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=[bps_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                                   bps_keras.callbacks.MetricAverageCallback(),
                                   bps_keras.callbacks.BatchSizeCallback(change), Record()])
    trained = [[] for _ in range(epochs)]
    for step, epoch in epoch_of_step.items():
        trained[epoch] += sampler.drawn[step]
    return {"steps": steps, "trained": trained, "weights": float(sum(np.sum(v) for v in model.get_weights())),
            "logs": epoch_logs, "history_epochs": len(history.history["loss"]),
            "autotune": dataset.options().autotune.enabled}


def float64_training() -> float:
    """The largest difference between a float64 model trained by a plain SGD and by a
    DistributedOptimizer of it, on the same batches (one worker: the same gradients)."""
    keras.config.set_floatx("float64")
    try:
        x, y = _data(12)
        weights = []
        for wrap in (lambda opt: opt, bps.DistributedOptimizer):
            model, opt = _tiny_model(0), wrap(keras.optimizers.SGD(0.1))
            for start in range(0, len(x), 4):
                with tf.GradientTape() as tape:
                    loss = _loss(model, x[start:start + 4].astype("float64"), y[start:start + 4])
                opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            weights.append(_flat(model.trainable_variables))
    finally:
        keras.config.set_floatx("float32")
    return float(np.max(np.abs(np.subtract(*weights))))


def dataset_where_keras_moved_its_epoch_iterator() -> dict:
    """The warnings ``dynamic_batch_dataset`` gives where ``keras.src.trainers.epoch_iterator``
    cannot be imported, as in a Keras version that moved it, and this Keras's version."""
    with mock.patch.dict(sys.modules, {"keras.src.trainers.epoch_iterator": None}), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bps.dynamic_batch_dataset(bps.DynamicBatchSampler(8, [4], seed=0), np.zeros(8))
    return {"warnings": [str(w.message) for w in caught], "keras": keras.__version__}


@contextlib.contextmanager
def _global_policy(policy: str):
    keras.mixed_precision.set_global_policy(policy)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _fit_loss_scaled(wrap, policy: str = "float32", overflow_rank: int | None = None) -> keras.Model:
    """One epoch of model.fit over batches of 4 and 12 (linear LR scaling from B0 = 8: a factor
    of 2) with ``DistributedOptimizer(wrap(SGD))`` under the dtype ``policy``; every input of
    ``overflow_rank`` is 1e6 (inf in float16)."""
    with _global_policy(policy):
        x, y = _data(64, seed=4)
        if bps.rank() == overflow_rank:
            x = x * 1e6
        sampler = bps.DynamicBatchSampler(len(x), [4, 12], seed=2)
        model = _tiny_model(0)
        model.compile(optimizer=bps.DistributedOptimizer(wrap(keras.optimizers.SGD(0.1, momentum=0.9)),
                                                         lr_scaling="linear", base_batch_size=8,
                                                         batch_plan=sampler.batch_plan),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(bps.dynamic_batch_dataset(sampler, (x, y)), epochs=1, verbose=0, shuffle=False)
        return model


def _compile_wrapped() -> dict:
    """The arrangement refused: compile(DistributedOptimizer(SGD)) under mixed_float16, which
    compile wraps in a LossScaleOptimizer of its own; rank 1's second batch overflows float16."""
    with _global_policy("mixed_float16"):
        x, y = _data(32, seed=4)
        if bps.rank() == 1:
            x[8:16] *= 1e6
        model = _tiny_model(0)
        model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        try:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        except ValueError as exc:
            return {"refused": str(exc)}
        return {"refused": None, "weights": _flat(model.weights)}


def _loss_scale_state(optimizer) -> list[float]:
    return _flat([optimizer.dynamic_scale, optimizer.step_counter, optimizer.iterations,
                  *optimizer.inner_optimizer.momentums])


def _saved_and_loaded(model: keras.Model, directory: str) -> dict:
    """``model`` (mixed_float16, DistributedOptimizer(LossScaleOptimizer(SGD))) saved as .keras and
    .h5, loaded with bps_keras.load_model under mixed_float16 and trained one more epoch."""
    results = {}
    with _global_policy("mixed_float16"):
        for suffix in ("keras", "h5"):
            path = os.path.join(directory, f"rank{bps.rank()}.{suffix}")
            model.save(path)
            loaded = bps_keras.load_model(path)
            optimizer = loaded.optimizer
            state = _loss_scale_state(optimizer)
            x, y = _data(16, seed=5)
            loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
            results[suffix] = {"class": type(optimizer).__name__, "wrapped": hasattr(optimizer, "dynamix"),
                               "state_error": float(np.max(np.abs(np.subtract(state, _loss_scale_state(model.optimizer))))),
                               "iterations": int(optimizer.iterations.numpy()), "weights": _flat(loaded.weights)}
    return results


def _tape_loss_scaled() -> dict:
    """A custom loop under mixed_float16: DistributedGradientTape, then a plain
    LossScaleOptimizer(SGD); rank 1's second batch overflows float16."""
    with _global_policy("mixed_float16"):
        x, y = _data(24, seed=4)
        if bps.rank() == 1:
            x[8:16] *= 1e6
        model, optimizer = _tiny_model(0), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        for start in range(0, len(x), 8):
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(_loss(model, x[start:start + 8], y[start:start + 8]))
            grads = bps.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
        return {"iterations": int(optimizer.iterations.numpy()), "scale": float(optimizer.dynamic_scale.numpy()),
                "weights": _flat(model.weights)}


def mixed_precision(directory: str) -> dict:
    """Under mixed_float16: compile's own LossScaleOptimizer around DistributedOptimizer(SGD) is
    refused on every worker; DistributedOptimizer(LossScaleOptimizer(SGD)) trains as
    DistributedOptimizer(SGD), learning-rate factor included, takes the inner optimizer's family,
    skips on every worker when one worker's gradients overflow, and saves and loads; the tape
    path decides on the reduced gradients too. mixed_bfloat16 needs no loss scaling."""
    refused = _compile_wrapped()  # first: the job goes on in step after it
    scaled = keras.optimizers.LossScaleOptimizer
    plain, loss_scaled = _fit_loss_scaled(lambda opt: opt), _fit_loss_scaled(scaled)
    adam = bps.DistributedOptimizer(scaled(keras.optimizers.Adam()), lr_scaling="adascale")
    skipped = _fit_loss_scaled(scaled, "mixed_float16", overflow_rank=1)
    bfloat16 = _fit_loss_scaled(lambda opt: opt, "mixed_bfloat16")
    return {**refused,
            "error": _relative_error(loss_scaled.get_weights(), plain.get_weights()),
            "rule": type(adam.dynamix.aggregator.lr_scaling).__name__,
            "skipped_moved": _relative_error(skipped.get_weights(), _tiny_model(0).get_weights()),
            "skipped_iterations": int(skipped.optimizer.iterations.numpy()),
            "skipped_scale": float(skipped.optimizer.dynamic_scale.numpy()),
            "saved": _saved_and_loaded(_fit_loss_scaled(scaled, "mixed_float16"), directory),
            "bfloat16_error": _relative_error(bfloat16.get_weights(), plain.get_weights()),
            "bfloat16_weights": _flat(bfloat16.weights),
            "tape": _tape_loss_scaled()}
