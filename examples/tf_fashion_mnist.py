"""Data-parallel training of a small Keras CNN on Fashion-MNIST with the BytePS TensorFlow API of dynamix_byteps.

    bpslaunch --num-workers 4 -- python examples/tf_fashion_mnist.py            # custom loop
    bpslaunch --num-workers 4 -- python examples/tf_fashion_mnist.py --fit      # model.fit
    python examples/tf_fashion_mnist.py --limit-train 5000                      # one worker

    bpslaunch -n 4 --policy proportional --slowdown 3=3.0 -- python examples/tf_fashion_mnist.py --fit
    bpslaunch -n 4 --policy goodput -- python examples/tf_fashion_mnist.py --fit --epochs 100 \
        --time-budget 120 --eval-every 15 --output run.json     # accuracy against training time
    bpslaunch -n 4 -- python examples/tf_fashion_mnist.py --batch-size 32,48,80,96 --batch-schedule "100:64"

Porting a byteps.tensorflow script means changing one import. ``DynamicBatchSampler`` with
``dynamic_batch_dataset`` gives each worker its own batch size (changeable at any step);
gradients are averaged weighted by batch size and the learning rate follows the global batch.
The custom loop uses ``DistributedGradientTape``, ``--fit`` the Keras ``DistributedOptimizer``
and callbacks. Data: Fashion-MNIST (MIT, Zalando), ``apt-get install dataset-fashion-mnist`` or
``--data-dir``.
"""
import argparse
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

# Several workers share this machine's cores: one thread each unless OMP_NUM_THREADS says otherwise.
tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import dynamix_byteps.tensorflow as bps
import dynamix_byteps.tensorflow.keras as bps_keras
from dynamix_byteps.assignment import add_batch_arguments, parse_batch_schedule, parse_batch_sizes
from dynamix_byteps.data import add_dataset_arguments, load_fashion_mnist
from dynamix_byteps.run_metrics import RunMetrics, add_run_arguments, stop_reason

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training pixels, after scaling to [0, 1]
TEST_IMAGES = 10_000  # Fashion-MNIST's test set


def build_model() -> keras.Model:
    """conv32-pool-conv64-pool-fc128-fc10 on uint8 (28, 28) images (421,642 parameters)."""
    return keras.Sequential([
        keras.Input((28, 28), dtype="uint8"),
        keras.layers.Rescaling(1 / (255 * STD), offset=-MEAN / STD),
        keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="train with model.fit instead of the custom loop")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train (with --time-budget: at most; default 1)")
    add_run_arguments(p, TEST_IMAGES)
    add_batch_arguments(p)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for the first step's global batch (default: 0.01 x global batch / 64)")
    p.add_argument("--seed", type=int, default=42)
    add_dataset_arguments(p)
    return p.parse_args()


def loss_fn(labels, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


class TrainingClock:
    """Seconds of training, the same number on every worker: the largest of the workers' times since
    :meth:`start` less the pauses to read the clock and evaluate (a worker that finishes a step early
    waits for the others inside those pauses; the last to arrive waited least, so its clock is the
    job's). After each step :meth:`out_of_time` reads it,
    evaluates every ``eval_every`` s (``curve``: (seconds, global samples, test accuracy, test
    loss)) and says whether ``budget`` s are spent. Without either, it does nothing per step."""

    def __init__(self, rank, size, budget, eval_every, evaluate, log):
        self.rank, self.size, self.evaluate, self.log = rank, size, evaluate, log
        self.budget = math.inf if budget is None else budget
        self.eval_every = eval_every or math.inf
        self.next_eval = self.eval_every
        self.curve, self.seconds = [], 0.0
        self.start()

    def start(self):
        self.started, self.untimed_s = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        """This worker's seconds of training so far."""
        return time.perf_counter() - self.started - self.untimed_s

    def read(self) -> float:
        """The job's seconds of training (a collective: every worker calls it at the same point)."""
        mine = np.zeros(self.size)
        mine[self.rank] = self.elapsed()
        return float(bps.push_pull(tf.constant(mine), average=False, name="training_clock").numpy().max())

    def out_of_time(self) -> bool:
        if self.budget == math.inf and self.eval_every == math.inf:
            return False
        pause = time.perf_counter()
        with bps.untimed():  # the clock and evaluation are not training
            self.seconds = self.read()
            if self.seconds >= min(self.next_eval, self.budget):
                seen = bps.push_pull(tf.constant(float(bps.step_statistics().samples), tf.float64), average=False,
                                     name="seen").numpy()
                accuracy, test_loss = self.evaluate()
                self.curve.append((self.seconds, int(seen), accuracy, test_loss))
                self.log(f"t={self.seconds:.1f}s samples={int(seen)} test_accuracy={accuracy:.4f}")
                self.next_eval += self.eval_every
        self.untimed_s += time.perf_counter() - pause
        return self.seconds >= self.budget


class TimeBudgetCallback(keras.callbacks.Callback):
    """A :class:`TrainingClock` during ``model.fit``: it starts with training, and training stops
    after the step that spends the budget."""

    def __init__(self, clock: TrainingClock):
        super().__init__()
        self.clock = clock

    def on_train_begin(self, logs=None):
        self.clock.start()

    def on_train_batch_end(self, batch, logs=None):
        if self.clock.out_of_time():
            self.model.stop_training = True


def train_custom_loop(args, model, dataset, lr, clock, log) -> None:
    """DistributedGradientTape in a tf.function, until ``args.epochs`` or the clock's budget."""
    optimizer = keras.optimizers.SGD(lr, momentum=0.9)
    optimizer.build(model.trainable_variables)
    bps.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    @tf.function(input_signature=[tf.TensorSpec([None, 28, 28], tf.uint8), tf.TensorSpec([None], tf.int64)])
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = bps.DistributedGradientTape(tape, lr_scaling=args.lr_scaling)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.learning_rate.assign(lr * tape.lr_scale)  # the global batch of this step
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        bps.report_loss(loss)  # the loss trend the batch-size policy watches
        return loss

    clock.start()
    for epoch in range(args.epochs):
        stats = np.zeros(3)  # [sum of losses, samples, steps] on this worker
        start, out_of_time = time.time(), False
        for x, y in dataset:
            stats += [float(train_step(x, y)) * len(y), len(y), 1]
            if clock.out_of_time():
                out_of_time = True
                break
        totals = bps.push_pull(tf.constant(stats), average=False, name="train_stats").numpy()
        elapsed = time.time() - start
        noise = bps.gradient_noise_scale()
        log(f"epoch {epoch + 1}/{args.epochs} train_loss={totals[0] / max(totals[1], 1):.4f} "
            f"samples/s={totals[1] / elapsed:.0f} time={elapsed:.1f}s mean_global_batch={totals[1] / max(stats[2], 1):.0f} "
            f"noise_scale={'n/a' if noise is None else f'{noise:.0f}'}")
        if out_of_time:
            break


def train_fit(args, model, dataset, lr, clock, rank) -> None:
    """model.fit with the Keras DistributedOptimizer and callbacks, until ``args.epochs`` or the clock's budget."""
    optimizer = bps_keras.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), lr_scaling=args.lr_scaling)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [bps_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                 bps_keras.callbacks.MetricAverageCallback(),
                 bps_keras.callbacks.BatchSizeCallback(args.batch_schedule),
                 TimeBudgetCallback(clock)]
    model.fit(dataset, epochs=args.epochs, shuffle=False, callbacks=callbacks, verbose=2 if rank == 0 else 0)


def evaluate(model, images, labels, rank, size) -> tuple[float, float]:
    """Test accuracy and loss: each worker scores every size-th image, the sums cover all once."""
    stats = np.zeros(3)  # [sum of losses, correct, samples]
    for start in range(rank, len(images), 1000 * size):
        x, y = images[start:start + 1000 * size:size], labels[start:start + 1000 * size:size]
        logits = model(x, training=False)
        stats += [float(loss_fn(y, logits)) * len(y), int(np.sum(np.argmax(logits, 1) == y)), len(y)]
    total = bps.push_pull(tf.constant(stats), average=False, name="test_stats").numpy()
    accuracy, test_loss = total[1] / total[2], total[0] / total[2]
    if rank == 0:  # TensorBoard, with bpslaunch --log-dir: what `dynamix report` reads
        bps.log_scalar("test/accuracy", accuracy)
        bps.log_scalar("test/loss", test_loss)
    return accuracy, test_loss


def eval_subset(images, labels, n):
    """``n`` (1..len(labels)) test images drawn by a permutation seeded with 0, independent of
    ``--seed``, so that every run and configuration scores the same images."""
    chosen = np.random.default_rng(0).permutation(len(labels))[:n]
    return images[chosen], labels[chosen]


def worker_statistics(rank, size):
    """Every worker's step statistics (steps, samples, compute_s, push_pull_s), one row per rank."""
    rows = np.zeros((size, 4))
    stats = bps.step_statistics()
    rows[rank] = [stats.steps, stats.samples, stats.compute_s, stats.push_pull_s]
    rows = bps.push_pull(tf.constant(rows), average=False, name="worker_statistics").numpy()
    return [{"rank": r, "steps": int(steps), "samples": int(samples), "compute_s": compute_s, "push_pull_s": push_pull_s,
             "samples_per_s": samples / compute_s if compute_s > 0 else 0.0}
            for r, (steps, samples, compute_s, push_pull_s) in enumerate(rows.tolist())]


def main():
    args = parse_args()
    bps.init()
    rank, size = bps.rank(), bps.size()
    batch_sizes = parse_batch_sizes(args.batch_size, size)  # before the data loads: a typo fails at once
    schedule = parse_batch_schedule(args.batch_schedule, size)
    keras.utils.set_random_seed(args.seed)
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    train_x, train_y = load_fashion_mnist("train", root=args.data_dir)
    test_x, test_y = load_fashion_mnist("test", root=args.data_dir)
    if args.eval_subset is not None:
        test_x, test_y = eval_subset(test_x, test_y, args.eval_subset)
    if args.limit_train:
        train_x, train_y = train_x[:args.limit_train], train_y[:args.limit_train]
    # One shared permutation per epoch, cut by each worker's batch size: every sample once.
    sampler = bps.DynamicBatchSampler(len(train_x), batch_sizes, seed=args.seed)
    if not args.fit:  # with --fit, BatchSizeCallback applies the schedule
        for step, sizes in schedule:
            bps.set_batch_sizes(sizes, at_step=step)
    dataset = bps.dynamic_batch_dataset(sampler, (train_x, train_y))
    model = build_model()
    lr = args.lr if args.lr is not None else 0.01 * sum(batch_sizes) / 64
    log(f"workers={size} batch_sizes={list(batch_sizes)} lr={lr:g} train_samples={len(train_x)} "
        f"mode={'fit' if args.fit else 'custom loop'}")

    start = time.time()
    clock = TrainingClock(rank, size, args.time_budget, args.eval_every,
                          lambda: evaluate(model, test_x, test_y, rank, size), log)
    if args.fit:
        train_fit(args, model, dataset, lr, clock, rank)
    else:
        train_custom_loop(args, model, dataset, lr, clock, log)
    train_s = max(clock.read(), clock.seconds)  # the job's clock, at least the last reading all workers shared
    workers = worker_statistics(rank, size)
    if clock.curve and clock.seconds >= clock.budget:  # evaluated at the budget's last step already
        accuracy, test_loss = clock.curve[-1][2:]
    else:
        with bps.untimed():
            accuracy, test_loss = evaluate(model, test_x, test_y, rank, size)
    samples = sum(w["samples"] for w in workers)
    stopped_by = stop_reason(clock.seconds >= clock.budget, samples / len(train_x), args.epochs)
    if stopped_by == "time_budget":
        log(f"time budget of {args.time_budget:g} s ran out at t={train_s:.1f}s of training: "
            f"{workers[0]['steps']} steps, {samples} samples ({samples / len(train_x):.2f} epochs) trained")
    if rank == 0:
        if args.output:
            RunMetrics(test_accuracy=float(accuracy), test_loss=float(test_loss), epochs=args.epochs, model="cnn",
                       wall_s=time.time() - start, train_s=train_s, samples=samples, workers=size,
                       batch_sizes=list(batch_sizes), batch_schedule=args.batch_schedule, lr=lr,
                       lr_scaling=args.lr_scaling, test_samples=len(test_y), curve=clock.curve,
                       worker_statistics=workers, mode="fit" if args.fit else "loop",
                       stopped_by=stopped_by,
                       epochs_trained=samples / len(train_x)).write(args.output)
        print(f"test_accuracy={accuracy:.4f} test_loss={test_loss:.4f}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
