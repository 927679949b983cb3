"""Workers drawing from different epochs of their samplers (set_epoch(epoch + rank), set_epoch
on some workers only, a checkpoint loaded on one worker), from samplers built differently
(seed=rank, another dataset size or batch sizes), from other ranks' slices (rank=0 everywhere), or
some from a shared sampler and others from their own shards, raise TensorMismatchError on every
worker at the first step, naming each rank's epoch and step, setting, sampler rank or sampler
kind; equal epochs train every sample exactly once per epoch, and samplers drawing their own
shards (num_replicas=1) everywhere are not compared. Real worker processes over loopback (cases
in tests/epoch_cases.py)."""

from collections import Counter

import numpy as np
import pytest
from epoch_cases import BATCH, EPOCHS, SIZE
from multiworker import ok, run_workers

from dynamix_byteps.aggregation import (
    INDEPENDENT,
    UNSET,
    SamplerPosition,
    _check_sampler_modes,
    _check_sampler_ranks,
    _check_samplers,
    trailer_digest,
)
from dynamix_byteps.assignment import Assignment
from dynamix_byteps.batch_plan import SamplerSettings
from dynamix_byteps.errors import TensorMismatchError
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
@pytest.mark.parametrize(("mode", "variant", "listed"), [
    ("rank_seed", "optimizer", "rank 0: seed 0, rank 1: seed 1"),
    ("rank_seed_and_size", "ddp", "rank 0: dataset_size 100, rank 1: dataset_size 90; rank 0: seed 0, rank 1: seed 1"),
])
def test_samplers_built_differently_raise_on_every_rank_at_the_first_step(mode, variant, listed):
    for result in ok(run_workers(2, "epoch_cases:train_epochs", mode, variant)):
        assert result["steps"] == 0, result
        message = result["error"] or ""
        assert f"different settings ({listed})" in message and "not seed=rank" in message, message


@pytest.mark.timeout(120)
def test_batch_sizes_sampler_ranks_or_kinds_that_differ_raise_at_the_first_step_and_own_shards_are_not_compared():
    results = ok(run_workers(2, "epoch_cases:misbuilt_samplers", "ddp"))
    for result in results:
        mixed = result["mixed_shards"]
        assert mixed["steps"] == 0 and ("ranks [1] draw their slices of a sampler shared by all 2 workers "
                                        "(num_replicas=2) while ranks [0] draw a shard of their own (num_replicas=1)"
                                        ) in (mixed["error"] or ""), mixed
        assert "the same num_replicas on every worker" in mixed["error"]
        for mode, listed in [("swapped_sizes", "settings (rank 0: batch_size [8,12], rank 1: batch_size [12,8])"),
                             ("rank_sizes", "settings (rank 0: batch_size [10,10], rank 1: batch_size [20,20])"),
                             ("rank_zero", "samplers (rank 0: sampler rank 0, rank 1: sampler rank 0)")]:
            assert result[mode]["steps"] == 0 and listed in (result[mode]["error"] or ""), (mode, result[mode])
        assert "not rank=bps.local_rank()" in result["rank_zero"]["error"]
        shards = result["shards"]
        assert shards["error"] is None and shards["steps"] == EPOCHS * SIZE // BATCH, shards
        assert all(sorted(shards["seen"][str(epoch)]) == list(range(SIZE)) for epoch in range(EPOCHS)), shards
    assert results[0]["shards"]["seen"] != results[1]["shards"]["seen"]  # seed=rank: each its own order


def _digests(*settings: SamplerSettings | None) -> np.ndarray:
    """Synthetic trailer column, one row per rank: the digest of ``settings`` (None: no sampler)."""
    return np.array([UNSET if each is None else trailer_digest(each.to_json()) for each in settings], dtype=np.int64)


def _check_rows(*settings: SamplerSettings | None) -> None:
    _check_samplers(_digests(*settings), lambda: ["" if each is None else each.to_json() for each in settings])


SHARED = SamplerSettings(100, 42, True, False, 3, (10, 10, 10))


def test_sampler_settings_check_names_every_rank_value_of_what_differs():
    a = SHARED
    b = SamplerSettings(90, 1, True, False, 3, (10, 10, 10))
    c = SamplerSettings(100, None, False, True, 3, (10, 10, 10))
    with pytest.raises(TensorMismatchError) as raised:
        _check_rows(a, None, b)
    assert "(rank 0: dataset_size 100, rank 2: dataset_size 90; rank 0: seed 42, rank 2: seed 1)" in str(raised.value)
    with pytest.raises(TensorMismatchError) as raised:
        _check_rows(a, c, a)
    assert ("(rank 0: seed 42, rank 1: no seed, rank 2: seed 42; rank 0: shuffle True, rank 1: shuffle False, "
            "rank 2: shuffle True; rank 0: drop_last False, rank 1: drop_last True, rank 2: drop_last False)"
            ) in str(raised.value)


@pytest.mark.parametrize("settings", [(SHARED,) * 3, (SHARED, None, SHARED), (None, None, None), (None, SHARED, None)])
def test_sampler_settings_check_passes_equal_samplers_and_workers_without_one(settings):
    _check_samplers(_digests(*settings), lambda: pytest.fail("gathered without a mismatch"))


@pytest.mark.parametrize("sampler_ranks", [(0, 1, 2), (0, UNSET, 2), (UNSET, UNSET, UNSET), (INDEPENDENT,) * 3])
def test_sampler_rank_check_passes_samplers_drawing_their_own_slice_and_workers_without_one(sampler_ranks):
    _check_sampler_ranks(np.array(sampler_ranks, dtype=np.int64))


@pytest.mark.parametrize("sampler_ranks", [(0, 1, 2), (0, UNSET, 2), (UNSET, UNSET, UNSET), (INDEPENDENT,) * 3,
                                           (INDEPENDENT, UNSET, INDEPENDENT)])
def test_sampler_kind_check_passes_one_kind_of_sampler_with_or_without_samplerless_workers(sampler_ranks):
    _check_sampler_modes(np.array(sampler_ranks, dtype=np.int64))


@pytest.mark.parametrize(("sampler_ranks", "listed"), [
    ((0, INDEPENDENT, 2), "ranks [0, 2] draw their slices of a sampler shared by all 3 workers (num_replicas=3) "
                          "while ranks [1] draw a shard of their own (num_replicas=1)"),
    ((INDEPENDENT, UNSET, 2), "ranks [2] draw their slices of a sampler shared by all 3 workers (num_replicas=3) "
                              "while ranks [0] draw"),
])
def test_sampler_kind_check_names_the_ranks_of_shared_and_own_shard_samplers_when_mixed(sampler_ranks, listed):
    with pytest.raises(TensorMismatchError, match=r"the same num_replicas on every worker") as raised:
        _check_sampler_modes(np.array(sampler_ranks, dtype=np.int64))
    assert listed in str(raised.value)
    assert "a validation sampler on rank 0) replaces the training one there" in str(raised.value)  # the other cause


@pytest.mark.parametrize(("sampler_ranks", "listed"), [
    ((0, 0, 2), "rank 0: sampler rank 0, rank 1: sampler rank 0, rank 2: sampler rank 2"),
    ((1, 0, UNSET), "rank 0: sampler rank 1, rank 1: sampler rank 0"),
    ((UNSET, 0, UNSET), "rank 1: sampler rank 0"),
])
def test_sampler_rank_check_names_every_workers_sampler_rank_when_one_draws_another_slice(sampler_ranks, listed):
    with pytest.raises(TensorMismatchError, match=r"Leave the DynamicBatchSampler's rank= out") as raised:
        _check_sampler_ranks(np.array(sampler_ranks, dtype=np.int64))
    assert f"({listed})" in str(raised.value)


def _settings(batch_size=10, **kwargs) -> SamplerSettings:
    """The settings of a sampler of rank 1 of 2 over 100 samples."""
    return DynamicBatchSampler(100, batch_size, num_replicas=2, rank=1, **kwargs).batch_plan.sampler_settings


def test_sampler_settings_hold_the_per_rank_batch_sizes_and_leave_out_the_seed_without_shuffling():
    assert _settings(seed=1) == SamplerSettings(100, 1, True, False, 2, (10, 10))
    assert _settings(shuffle=False).seed is None
    assert _settings([8, 12]) != _settings([12, 8]) and _settings(10) != _settings(20)
    assert _settings(10) == _settings([10, 10])  # the same cut however it is written
    assert _settings(seed=0, shuffle=False) == _settings(seed=1, shuffle=False)  # one order for any seed


def test_settings_text_is_canonical_and_reads_back():
    settings = _settings([8, 12], seed=7, drop_last=True)
    assert SamplerSettings.from_json(settings.to_json()) == settings
    assert settings.to_json() == _settings([8, 12], seed=7, drop_last=True).to_json()
    assert settings.describe("batch_size") == "batch_size [8,12]" and _settings(shuffle=False).describe("seed") == "no seed"


def _columns(plan) -> tuple:
    return SamplerPosition(3, 1, plan.sampler_settings, plan.sampler_rank).trailer_columns()


def test_a_sampler_drawing_its_own_shard_sends_only_its_kind_and_a_shared_one_its_position_and_rank():
    own = DynamicBatchSampler(100, 10, num_replicas=1, rank=0).batch_plan
    assert _columns(own) == (UNSET, UNSET, UNSET, INDEPENDENT)
    shared = DynamicBatchSampler(100, 10, num_replicas=3, rank=2).batch_plan
    assert _columns(shared) == (3, 1, trailer_digest(shared.sampler_settings.to_json()), 2)


def test_sampler_settings_survive_a_resume_and_a_new_assignment():
    saved = DynamicBatchSampler(100, 20, num_replicas=4, rank=0, seed=1)  # drop_last must match (test_sampler)
    resumed = DynamicBatchSampler(100, 10, num_replicas=2, rank=1, seed=1)
    resumed.load_state_dict(saved.state_dict())
    resumed.schedule.apply(Assignment((30, 50), 4, resumed.schedule.latest.version + 1))
    assert resumed.batch_plan.sampler_settings == _settings(seed=1)


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
def test_tensorflow_tape_checks_the_epoch_and_the_seed_too():
    results = ok(run_workers(2, "epoch_cases:tensorflow_tape", timeout=280))
    assert [r["error"] for r in results] == [None, None]
    _every_sample_once(results, [0, 1])
    for result in results:
        assert "rank 0: epoch 0 step 0, rank 1: epoch 1 step 0" in (result["epoch_error"] or ""), result
        assert "rank 0: seed 0, rank 1: seed 1" in (result["seed_error"] or ""), result


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


@pytest.mark.timeout(200)
def test_batches_that_no_dynamix_frontend_trains_on_are_warned_about():
    """torch's own DistributedDataParallel on the process group bps.init() set up trains on a
    DynamicBatchSampler's batches without weighting them (nor reporting to a scheduler): warned once
    per worker; bps's wrapper (with a validation sampler no frontend takes from), or equal batches
    without a scheduler, are not."""
    for warned in ok(run_workers(2, "epoch_cases:untaken_batches", "torch_ddp", [1, 3], timeout=100)):
        assert len(warned) == 1 and "batch sizes [1, 3]" in warned[0] and "bps.DistributedDataParallel" in warned[0]
    for frontend, sizes in (("ddp", [1, 3]), ("torch_ddp", [2, 2])):
        assert ok(run_workers(2, "epoch_cases:untaken_batches", frontend, sizes, timeout=100)) == [[], []]
