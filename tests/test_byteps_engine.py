"""The optional byteps engine.

Real BytePS needs CUDA and NCCL, which cannot exist on this machine, so these tests run the
engine against a *recording stand-in* of the ``byteps.torch`` functions it calls (a fake, and
only here). They check the engine's contract with BytePS: in-place push_pull with
``average=False``, each name declared once, completion awaited by ``poll`` before
``synchronize``, and a clear error when BytePS is missing.
"""

import sys

import pytest
import torch
from byteps_stand_in import RecordingBytePSFrontend

import dynamix_byteps.torch as bps
from dynamix_byteps import engine, timing
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import EngineUnavailableError


class RecordingBytePS(RecordingBytePSFrontend):
    """``byteps.torch``: push_pull completes after two polls."""

    def __init__(self):
        super().__init__("torch")
        self._polls = {}

    def declare(self, name):
        self.calls.append(("declare", name))

    def push_pull_async_inplace(self, tensor, average=True, name=None):
        self.calls.append(("push_pull_async_inplace", name, average))
        handle = len(self.calls)
        self._polls[handle] = 0
        return handle

    def poll(self, handle):
        self._polls[handle] += 1
        self.calls.append(("poll", handle))
        return self._polls[handle] >= 2

    def synchronize(self, handle):
        if self._polls[handle] < 2:
            raise AssertionError("synchronize before poll reported completion (deadlocks on torch 2.x)")
        self.calls.append(("synchronize", handle))


@pytest.fixture
def fake_byteps(monkeypatch):
    fake = RecordingBytePS()
    fake.install(monkeypatch)
    engine.start(WorkerEnv(engine="byteps"))
    try:
        yield fake
    finally:
        engine.stop()


def test_push_pull_is_in_place_sum_polled_before_synchronize(fake_byteps):
    t = torch.ones(3)
    out = bps.push_pull_inplace(t, average=False, name="w")
    assert out is t
    kinds = [c[0] for c in fake_byteps.calls]
    pushes = [c for c in fake_byteps.calls if c[0] == "push_pull_async_inplace"]
    assert all(average is False for _, _, average in pushes)
    assert "w" in [c[1] for c in pushes]
    assert kinds.index("poll") < kinds.index("synchronize")


def test_each_name_is_declared_once(fake_byteps):
    for _ in range(3):
        bps.push_pull(torch.ones(2), name="g")
    declared = [c[1] for c in fake_byteps.calls if c[0] == "declare"]
    assert declared.count("g") == 1


def test_push_pull_is_timed(fake_byteps):
    timing.ring().drain()
    bps.push_pull(torch.ones(4, dtype=torch.float64), name="timed")
    events = timing.ring().drain()
    names = timing.names()
    assert [names[i] for i in events["name_id"]].count("timed") == 1
    assert 32 in events["nbytes"].tolist()


def test_optimizer_steps_through_the_engine(fake_byteps):
    model = torch.nn.Linear(3, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    opt.set_local_batch_size(2)  # before backward, as a training loop does: no reduce-in-step warning
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert any(c[0] == "push_pull_async_inplace" and c[1].startswith("Gradient.") for c in fake_byteps.calls)


def test_missing_byteps_names_the_engine_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "byteps", None)
    monkeypatch.setitem(sys.modules, "byteps.torch", None)
    with pytest.raises(EngineUnavailableError, match="--engine gloo"):
        engine.start(WorkerEnv(engine="byteps"))
    assert not engine.is_started()
