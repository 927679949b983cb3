"""Workers drawing from different epochs of their samplers (set_epoch(epoch + rank), set_epoch
on some workers only, a checkpoint loaded on one worker) raise TensorMismatchError on every
worker at the first step, naming each rank's epoch and step; equal epochs train every sample
exactly once per epoch. Real worker processes over loopback (cases in tests/epoch_cases.py)."""

from collections import Counter

import pytest
from epoch_cases import EPOCHS, SIZE
from multiworker import ok, run_workers

from dynamix_byteps.torch.sampler import DynamicBatchSampler


def _every_sample_once(results: list[dict], epochs) -> None:
    for epoch in epochs:
        drawn = Counter(i for result in results for i in result["seen"][str(epoch)])
        assert sorted(drawn) == list(range(SIZE)) and set(drawn.values()) == {1}, (epoch, drawn)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_equal_epochs_train_every_sample_once_per_epoch(variant):
    results = ok(run_workers(2, "epoch_cases:train_epochs", "same", variant))
    assert [r["error"] for r in results] == [None, None]
    assert [r["steps"] for r in results] == [EPOCHS * SIZE // 20] * 2
    _every_sample_once(results, range(EPOCHS))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_rank_dependent_epochs_raise_on_every_rank_at_the_first_step(variant):
    results = ok(run_workers(2, "epoch_cases:train_epochs", "rank_dependent", variant))
    for result in results:
        assert result["steps"] == 0, result
        message = result["error"] or ""
        assert "rank 0: epoch 0 step 0, rank 1: epoch 1 step 0" in message and "set_epoch" in message, message


@pytest.mark.timeout(120)
def test_rank_dependent_epochs_raise_also_behind_a_prefetching_loader():
    results = ok(run_workers(2, "epoch_cases:train_epochs", "rank_dependent", "optimizer", 2))
    for result in results:
        assert result["steps"] == 0 and "rank 1: epoch 1 step 0" in (result["error"] or ""), result


@pytest.mark.timeout(120)
def test_set_epoch_on_rank_0_only_raises_on_every_rank_when_the_epochs_part():
    results = ok(run_workers(2, "epoch_cases:train_epochs", "rank0_only", "optimizer"))
    for result in results:
        # epoch 0 agrees (5 steps); then rank 0 is at epoch 2, rank 1 went on to epoch 1
        assert result["steps"] == SIZE // 20, result
        assert "rank 0: epoch 2 step 5, rank 1: epoch 1 step 5" in (result["error"] or ""), result
    _every_sample_once(results, [0])


@pytest.mark.timeout(120)
def test_set_epoch_in_the_middle_of_an_epoch_on_one_rank_raises_on_every_rank():
    results = ok(run_workers(2, "epoch_cases:train_epochs", "mid_epoch", "optimizer"))
    for result in results:
        assert result["steps"] == 2, result
        assert "rank 0: epoch 5 step 2, rank 1: epoch 0 step 2" in (result["error"] or ""), result


@pytest.mark.timeout(120)
def test_a_checkpoint_resumed_on_every_rank_keeps_its_epoch_and_agrees():
    results = ok(run_workers(2, "epoch_cases:resumed_from_checkpoint", "every"))
    assert [r["error"] for r in results] == [None, None]
    _every_sample_once(results, [0, 1, 2])


@pytest.mark.timeout(120)
def test_a_checkpoint_resumed_on_rank_0_only_raises_on_every_rank():
    results = ok(run_workers(2, "epoch_cases:resumed_from_checkpoint", "rank0"))
    for result in results:
        assert "rank 0: step 8, rank 1: step 0" in (result["error"] or ""), result


@pytest.mark.timeout(300)
def test_tensorflow_tape_checks_the_epoch_too():
    same = ok(run_workers(2, "epoch_cases:tensorflow_tape", "same", timeout=280))
    assert [r["error"] for r in same] == [None, None]
    _every_sample_once(same, [0, 1])
    for result in ok(run_workers(2, "epoch_cases:tensorflow_tape", "rank_dependent", timeout=280)):
        assert "rank 0: epoch 0 step 0, rank 1: epoch 1 step 0" in (result["error"] or ""), result


@pytest.mark.parametrize("epoch", [-1, 1.5, 2.0, "3", True, None, 2**53])
def test_set_epoch_refuses_what_is_no_epoch(epoch):
    sampler = DynamicBatchSampler(10, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"set_epoch takes an integer epoch >= 0"):
        sampler.set_epoch(epoch)
    assert sampler.epoch == 0


def test_set_epoch_takes_numpy_and_torch_integers():
    import numpy as np
    import torch

    sampler = DynamicBatchSampler(10, 2, num_replicas=1, rank=0)
    sampler.set_epoch(np.int64(3))
    assert sampler.epoch == 3 and type(sampler.epoch) is int
    sampler.set_epoch(torch.tensor(4))
    assert sampler.epoch == 4 and type(sampler.epoch) is int


def test_set_epoch_in_the_middle_of_a_pass_draws_the_new_epochs_permutation():
    """What a resumed run would draw at that position: the new epoch's order from its start."""
    sampler = DynamicBatchSampler(20, 5, num_replicas=1, rank=0, seed=4)
    passing = iter(sampler)
    next(passing)
    sampler.set_epoch(3)
    rest = list(passing)
    fresh = DynamicBatchSampler(20, 5, num_replicas=1, rank=0, seed=4)
    fresh.set_epoch(3)
    assert rest == list(fresh)
