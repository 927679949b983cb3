"""``--engine byteps`` for the TensorFlow frontend.

Real BytePS needs CUDA and NCCL, which cannot exist on this machine, so these tests run the
engine against a *recording stand-in* of the ``byteps.tensorflow`` functions it calls (a fake,
and only here), as tests/test_byteps_engine.py does for torch. They check the contract: the
frontend's rounds reach BytePS's keyed TensorFlow op eagerly, under valid op names, the result
comes back into the engine's buffer, and a missing BytePS names the fix.
"""

import re
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
except RuntimeError:  # another test already started TensorFlow's runtime in this process
    pass

import keras
from byteps_stand_in import RecordingBytePSFrontend

import dynamix_byteps.tensorflow as bps
from dynamix_byteps.engine.byteps_tensorflow import op_name
from dynamix_byteps.errors import EngineUnavailableError

OP_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-/]*")


class RecordingBytePSTensorFlow(RecordingBytePSFrontend):
    """``byteps.tensorflow``: ``_push_pull`` returns the sum over the one worker."""

    def __init__(self):
        super().__init__("tensorflow")

    def _push_pull(self, tensor, scope="", name=None):
        if not tf.executing_eagerly():
            raise AssertionError("the engine must call BytePS eagerly (inside the py_function)")
        self.calls.append(("_push_pull", name, tensor.dtype.name, tuple(tensor.shape)))
        return tf.identity(tensor)


@pytest.fixture
def fake_byteps(monkeypatch):
    fake = RecordingBytePSTensorFlow()
    fake.install(monkeypatch)
    monkeypatch.setenv("DYNAMIX_ENGINE", "byteps")
    bps.init()
    try:
        yield fake
    finally:
        bps.shutdown()


def _pushed(fake):
    return [c for c in fake.calls if c[0] == "_push_pull"]


def test_push_pull_eager_and_in_tf_function_reaches_bytepss_keyed_op(fake_byteps):
    x = tf.constant([1.0, 2.0, 3.0])
    assert bps.push_pull(x, average=False, name="w").numpy().tolist() == [1.0, 2.0, 3.0]
    doubled = tf.function(lambda t: 2 * bps.push_pull(t, name="in graph"))(x)
    assert doubled.numpy().tolist() == [2.0, 4.0, 6.0]
    names = [c[1] for c in _pushed(fake_byteps)]
    assert "w" in names and "in_graph" in names
    assert all(OP_NAME.fullmatch(n) for n in names), names
    assert ("init",) in fake_byteps.calls


def test_gradient_tape_and_keras_fit_reduce_through_the_engine(fake_byteps):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    x, y = np.ones((4, 3), "float32"), np.zeros(4, "int64")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    local = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    reduced = bps.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    assert all(np.allclose(a.numpy(), b.numpy()) for a, b in zip(local, reduced))
    assert any(c[1] == "Gradient.bucket.0" for c in _pushed(fake_byteps))
    fake_byteps.calls.clear()
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert [c[1] for c in _pushed(fake_byteps)].count("Gradient.bucket.0") == 2


def test_op_names_are_valid_tensorflow_names():
    for name in ("Variable.sequential/dense/kernel:0", "push_pull.noname.3", "__x", "a b", "é"):
        assert OP_NAME.fullmatch(op_name(name)), name


def test_missing_byteps_tensorflow_names_the_engine_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "byteps", None)
    monkeypatch.setitem(sys.modules, "byteps.tensorflow", None)
    monkeypatch.setenv("DYNAMIX_ENGINE", "byteps")
    with pytest.raises(EngineUnavailableError, match="TensorFlow plugin.*--engine gloo"):
        bps.init()
    assert not bps.is_initialized()
