"""DynamicBatchSampler and the assignment schedule, one sampler per simulated rank in-process.

The samplers of a job never talk to each other (each computes the same plan), so building
one per rank here exercises exactly what separate worker processes would run.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamix_byteps.assignment import Assignment, InvalidAssignmentError
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.torch.sampler import DynamicBatchSampler


def make_job(dataset_size, sizes, **kwargs):
    return [DynamicBatchSampler(dataset_size, list(sizes), num_replicas=len(sizes), rank=r, **kwargs)
            for r in range(len(sizes))]


def apply_everywhere(samplers, sizes, at_step):
    for s in samplers:
        s.schedule.apply(Assignment(tuple(sizes), at_step, s.schedule.latest.version + 1))


def run_epoch(samplers, changes=()):
    """Draw one epoch on every rank in lockstep; apply ``changes`` [(after_steps, sizes, delay)]."""
    pending = sorted(changes)
    steps = []
    iterators = [iter(s) for s in samplers]
    while True:
        while pending and pending[0][0] <= len(steps):
            _, sizes, delay = pending.pop(0)
            apply_everywhere(samplers, sizes, samplers[0].schedule.next_open_step + delay)
        step = samplers[0]._position.step
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            return steps
        assert all(b is not None for b in batches), "ranks ran different numbers of steps"
        steps.append((step, batches))


sizes_strategy = st.lists(st.integers(1, 40), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(dataset_size=st.integers(1, 600), sizes=sizes_strategy, seed=st.integers(0, 3),
       changes=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(0, 3)), max_size=4),
       drop_last=st.booleans())
def test_epoch_covers_every_index_once_with_changing_assignments(dataset_size, sizes, seed, changes, drop_last):
    n = len(sizes)
    dataset_size = max(dataset_size, n)  # a global batch never exceeds the dataset
    sizes = [min(b, max(1, dataset_size // n)) for b in sizes]
    samplers = make_job(dataset_size, sizes, seed=seed, drop_last=drop_last)
    changes = [(after, [min(new, max(1, dataset_size // n))] * n, delay) for after, new, delay in changes]
    steps = run_epoch(samplers, changes)

    drawn = Counter(i for _, batches in steps for batch in batches for i in batch)
    for step, batches in steps[:-1]:
        assert [len(b) for b in batches] == list(samplers[0].schedule.at(step).batch_sizes)
    if drop_last:
        assert max(drawn.values(), default=1) == 1
        last_global = sum(samplers[0].schedule.at(samplers[0]._position.step).batch_sizes)
        assert dataset_size - len(drawn) < max(last_global, 1) or not steps
        if steps:
            assert [len(b) for b in steps[-1][1]] == list(samplers[0].schedule.at(steps[-1][0]).batch_sizes)
    else:
        assert set(drawn) == set(range(dataset_size))
        repeated = sum(c - 1 for c in drawn.values())
        assert repeated <= n - 1
        if repeated:
            assert all(len(b) == 1 for b in steps[-1][1])


def test_a_dataloader_given_it_as_sampler_says_to_pass_it_as_batch_sampler():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    sampler = DynamicBatchSampler(10, 4, num_replicas=1, rank=0, shuffle=False)
    for drop_last in (False, True):  # DistributedSampler's place in a DDP script
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=drop_last)
        with pytest.raises(ConfigurationError, match=r"as batch_sampler=, without batch_size= .*not as sampler="):
            next(iter(loader))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    assert [batch.tolist() for (batch,) in loader] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]


def test_sizes_switch_exactly_at_the_effective_step():
    samplers = make_job(1000, [4, 8, 12])
    apply_everywhere(samplers, [10, 10, 10], 7)
    steps = run_epoch(samplers)
    assert [len(b) for b in steps[6][1]] == [4, 8, 12]
    assert [len(b) for b in steps[7][1]] == [10, 10, 10]


def test_len_counts_steps_under_the_known_assignments():
    (sampler,) = make_job(100, [30])
    assert len(sampler) == 4
    apply_everywhere([sampler], [10], 2)
    assert len(sampler) == 2 + 4
    assert len(list(sampler)) == 6
    (sampler,) = make_job(100, [30], drop_last=True)
    assert len(sampler) == len(list(sampler)) == 3


def test_epochs_reshuffle_and_set_epoch_restarts():
    (sampler,) = make_job(50, [10])
    first, second = list(sampler), list(sampler)
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    sampler.set_epoch(0)
    assert list(sampler) == first


@pytest.mark.parametrize("bad, message", [
    ([0, 4, 4], "integer >= 1"),
    ([-1, 4, 4], "integer >= 1"),
    ([2.5, 4, 4], "integer >= 1"),
    ([4, 4], "2 batch sizes for 3 workers"),
    ([4, 4, 65], "outside its bounds"),
    ([40, 40, 40], "larger than the dataset"),
])
def test_invalid_assignments_raise_and_keep_the_previous_one(bad, message):
    sampler = make_job(100, [4, 4, 4], max_batch=64, drop_last=True)[0]
    before = sampler.schedule.latest
    with pytest.raises(InvalidAssignmentError, match=message):
        sampler.schedule.apply(Assignment(tuple(bad), 5, before.version + 1))
    assert sampler.schedule.latest == before


def test_a_dataset_smaller_than_the_global_batch_is_shared_out_in_one_step_per_epoch():
    """It was refused ('global batch 12 is larger than the dataset (10 samples)'), where torch's
    BatchSampler(drop_last=False) draws one partial batch and DistributedSampler pads every rank: the
    epoch's last partial global batch is shared out, as at the end of any epoch (partition.py)."""
    samplers = make_job(10, [4, 8], seed=1)
    for _ in range(2):
        ((_, batches),) = run_epoch(samplers)
        assert [len(b) for b in batches] == [4, 6] and sorted(sum(batches, [])) == list(range(10))


def test_a_dataset_smaller_than_the_job_pads_every_rank_as_distributed_sampler_does():
    ((_, batches),) = run_epoch(make_job(3, [2, 2, 2, 2]))
    assert [len(b) for b in batches] == [1, 1, 1, 1] and set(sum(batches, [])) == {0, 1, 2}


def test_an_assignment_larger_than_the_dataset_is_one_step_per_epoch_without_drop_last():
    samplers = make_job(100, [4, 4, 4], max_batch=64)
    apply_everywhere(samplers, [40, 40, 40], at_step=0)
    assert [len(run_epoch(samplers)) for _ in range(2)] == [1, 1]


@pytest.mark.parametrize("dataset_size, sizes", [(10, [4, 8]), (3, [1, 1, 1, 1])])
def test_drop_last_refuses_a_global_batch_larger_than_the_dataset_saying_what_to_do(dataset_size, sizes):
    """No epoch would have a step: torch's samplers then yield nothing and the loop trains nothing."""
    global_batch = sum(sizes)
    with pytest.raises(InvalidAssignmentError,
                       match=rf"global batch {global_batch} is larger than the dataset \({dataset_size} samples\): with "
                             rf"drop_last=True no epoch would have a step. Give batch sizes of at most {dataset_size} "
                             r"in total, or drop_last=False to share the dataset out in one step per epoch"):
        make_job(dataset_size, sizes, drop_last=True)


def test_assignment_for_an_already_drawn_step_is_rejected():
    (sampler,) = make_job(100, [10])
    iterator = iter(sampler)
    next(iterator), next(iterator)
    with pytest.raises(InvalidAssignmentError, match="too late"):
        sampler.schedule.apply(Assignment((5,), 1, 1))
    sampler.schedule.apply(Assignment((5,), 2, 1))
    assert len(next(iterator)) == 5


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4), (3, 3)])
def test_resume_mid_epoch_with_another_worker_count_loses_and_repeats_nothing(before, after):
    dataset_size = 997
    old = make_job(dataset_size, [7 * (r + 1) for r in range(before)], seed=5)
    iterators = [iter(s) for s in old]
    seen = Counter()
    for _ in range(9):
        for it in iterators:
            seen.update(next(it))
    for it in iterators:  # a prefetching loader drew two more steps that were never trained on
        next(it), next(it)
    state = old[0].state_dict(step=9)

    new = make_job(dataset_size, [1] * after, seed=5)
    for s in new:
        s.load_state_dict(state)
    assert sum(new[0].schedule.at(9).batch_sizes) == sum(7 * (r + 1) for r in range(before))
    for _, batches in run_epoch(new):
        for batch in batches:
            seen.update(batch)
    assert set(seen) == set(range(dataset_size))
    assert sum(c - 1 for c in seen.values()) <= after - 1


@pytest.mark.parametrize("setting, saved, resumed", [
    ("dataset_size", 100, 101), ("seed", 1, 2), ("shuffle", True, False),
    ("drop_last", False, True), ("drop_last", True, False)])  # drop_last was taken without a word
def test_resume_refuses_a_setting_that_changes_the_epoch_naming_it_and_the_fix(setting, saved, resumed):
    """drop_last decides whether an epoch's last partial global batch is trained: resuming with the
    other value changed the epoch's length and which samples it trains, silently."""
    built = {"dataset_size": 100, "seed": 1, "shuffle": True, "drop_last": False}
    (old,) = make_job(**dict(built, **{setting: saved}), sizes=[10])
    (new,) = make_job(**dict(built, **{setting: resumed}), sizes=[10])
    state = old.state_dict()
    with pytest.raises(ConfigurationError, match=rf"checkpoint was taken with {setting}={saved!r}, this sampler has "
                                                 rf"{setting}={resumed!r}.*build the sampler with {setting}={saved!r}"):
        new.load_state_dict(state)


def test_a_batch_size_list_for_another_job_size_names_both_counts():
    with pytest.raises(ConfigurationError, match="batch_size has 4 entries but the job has 1 workers"):
        DynamicBatchSampler(100, [32, 48, 80, 96], num_replicas=1, rank=0)


@pytest.mark.parametrize("batch_size, sizes", [(np.int64(8), [8, 8]), (torch.tensor(8), [8, 8]),
                                               ([np.int64(4), 5], [4, 5]), (torch.tensor([8, 9]), [8, 9])])
def test_numpy_and_torch_integers_are_batch_sizes(batch_size, sizes):
    sampler = DynamicBatchSampler(100, batch_size, num_replicas=2, rank=0)
    assert list(sampler.schedule.at(0).batch_sizes) == sizes
    assert all(type(b) is int for b in sampler.schedule.at(0).batch_sizes)


@pytest.mark.parametrize("batch_size", [8.5, None, True, b"ab", "88", {8: 8, 9: 9}, [8.5, 8], [True, 8]])
def test_a_batch_size_that_is_no_integer_or_list_of_integers_is_a_configuration_error(batch_size):
    with pytest.raises(ConfigurationError, match="batch_size must be an integer or one integer per worker"):
        DynamicBatchSampler(100, batch_size, num_replicas=2, rank=0)


@pytest.mark.parametrize("seed", [-5, 1.5, np.float64(2.0)])
def test_a_seed_that_is_no_integer_at_least_zero_is_refused_by_name(seed):
    with pytest.raises(ConfigurationError, match="seed must be an integer >= 0"):
        DynamicBatchSampler(100, 8, num_replicas=2, rank=0, seed=seed)


def test_a_numpy_integer_is_a_dataset_length():
    sampler = DynamicBatchSampler(np.int64(40), 8, num_replicas=2, rank=1, seed=np.int64(3))
    assert sampler.dataset_size == 40 and sampler.seed == 3
    drawn = [i for batch in sampler for i in batch]
    assert len(drawn) == 20 and len(set(drawn)) == 20  # its half of the epoch, each sample once


def test_num_replicas_other_than_the_jobs_size_is_refused(single_process_job):
    with pytest.raises(ConfigurationError, match="num_replicas=4 but the job has 1 workers"):
        DynamicBatchSampler(100, 8, num_replicas=4, rank=0)
    DynamicBatchSampler(100, 8, num_replicas=1, rank=0)  # a worker's own shard
