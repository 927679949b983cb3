"""BatchPlan: each sampler's own record of the batches it drew, and the process's default plan.

In-process, no engine: samplers are built with an explicit ``num_replicas`` and ``rank``.
"""

from __future__ import annotations

import warnings

import pytest

from dynamix_byteps import batch_plan
from dynamix_byteps.batch_plan import BatchPlan
from dynamix_byteps.data.sampler import DynamicBatchSampler
from dynamix_byteps.errors import ConfigurationError


@pytest.fixture(autouse=True)
def _own_default_plan(monkeypatch):
    """Each test starts without a default plan, as a new process does."""
    monkeypatch.setattr(batch_plan, "_default", None)


def _sampler(sizes, dataset_size=100):
    return DynamicBatchSampler(dataset_size, sizes, num_replicas=len(sizes), rank=0, shuffle=False)


def test_each_sampler_logs_its_draws_in_its_own_plan():
    first, second = _sampler([3, 5]), _sampler([7, 2])
    first_batches, second_batches = iter(first), iter(second)
    next(first_batches), next(first_batches), next(second_batches)
    assert first.batch_plan is not second.batch_plan
    assert first.batch_plan.take_draws(5) == [(0, 3), (1, 3)]
    assert second.batch_plan.take_draws(5) == [(0, 7)]
    assert first.batch_plan.trained_position() == (0, 16)  # two global batches of 8
    assert second.batch_plan.trained_position() == (0, 9)


def test_the_newest_sampler_is_the_default_and_set_batch_sizes_needs_one():
    with pytest.raises(ConfigurationError, match="DynamicBatchSampler"):
        batch_plan.set_batch_sizes([4, 4])
    first = _sampler([3, 5])
    assert batch_plan.default() is first.batch_plan
    second = _sampler([7, 2])
    assert batch_plan.default() is second.batch_plan
    assert first.batch_plan.schedule is first.schedule and second.batch_plan.schedule is second.schedule


def test_a_new_sampler_keeps_the_newest_frontends_statistics_reachable():
    monitor, noise = object(), object()
    batch_plan.default().attach(monitor, noise)  # a frontend built before any sampler
    sampler = _sampler([4, 4])
    assert (sampler.batch_plan.monitor, sampler.batch_plan.gradient_noise) == (monitor, noise)


def test_objects_kept_for_default_followers_move_with_the_default_and_bound_ones_stay():
    first = _sampler([4, 4])
    following = first.batch_plan.shared("tape", object, follows_default=True)
    bound = first.batch_plan.shared("bound tape", object)
    second = _sampler([4, 4])
    assert second.batch_plan.shared("tape", object, follows_default=True) is following
    assert first.batch_plan.shared("bound tape", object) is bound
    assert second.batch_plan.shared("bound tape", object) is not bound


def test_replacing_a_default_plan_warns_only_when_a_frontend_following_it_trained_on_it():
    bound = _sampler([4, 4])
    bound.batch_plan.take_draws(1)  # a frontend handed this plan explicitly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        followed = _sampler([4, 4])
    followed.batch_plan.take_draws(1, as_default=True)
    with pytest.warns(UserWarning, match="replaces the one training has used"):
        _sampler([4, 4])


def test_training_that_follows_a_sampler_built_after_the_one_handing_out_its_batches_is_warned(monkeypatch):
    # Keras: the training and the validation datasets are both built before fit, each on its own
    # sampler; the optimizer followed the newer (validation) one and weighted by no batch, silently.
    training, validation = _sampler([2, 6]), _sampler([4, 4])
    next(iter(training))  # fit's first training batch
    with pytest.warns(UserWarning, match="the batches come from the one built before it"):
        assert validation.batch_plan.take_draws(1, as_default=True) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validation.batch_plan.take_draws(1, as_default=True)  # once
        monkeypatch.setattr(batch_plan, "_default", None)
        unused, trained = _sampler([4, 4]), _sampler([4, 4])
        next(iter(unused))
        next(iter(trained))  # the newest sampler hands out the batches: nothing to say
        assert trained.batch_plan.take_draws(1, as_default=True) == [(0, 4)]


def test_a_plan_without_a_sampler_refuses_set_batch_sizes():
    with pytest.raises(ConfigurationError, match="needs a DynamicBatchSampler"):
        BatchPlan().set_batch_sizes([4])


class _Frontend:
    """Stands in for a frontend's step path: any object that can be weakly referenced."""


def test_two_frontends_taking_one_samplers_draws_in_turn_are_refused_and_a_replacement_is_not():
    plan = _sampler([4, 4]).batch_plan
    discriminator, generator = _Frontend(), _Frontend()
    plan.take_draws(1, taker=discriminator)
    plan.take_draws(1, taker=generator)
    with pytest.raises(ConfigurationError, match="from one DynamicBatchSampler in turn"):
        plan.take_draws(1, taker=discriminator)
    replaced, replacement = _Frontend(), _Frontend()
    plan = _sampler([4, 4]).batch_plan
    for taker in (replaced, replaced, replacement, replacement):  # a new optimizer after the old one
        plan.take_draws(1, taker=taker)
    without_sampler = BatchPlan()  # sizes come from set_local_batch_size: nothing to share
    for taker in (discriminator, generator, discriminator):
        without_sampler.take_draws(1, taker=taker)


def test_a_gan_s_two_optimizers_on_one_sampler_are_refused_at_the_first_alternation(single_process_job):
    import torch

    bps = single_process_job
    sampler = bps.DynamicBatchSampler(64, 4, seed=1)
    generator, critic = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    opt_g, opt_d = (bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters())
                    for net in (generator, critic))
    with pytest.raises(ConfigurationError, match="from one DynamicBatchSampler in turn"):
        for batch in sampler:
            fake = generator(torch.randn(len(batch), 2))
            opt_d.zero_grad()
            critic(fake.detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            critic(fake).mean().backward()
            opt_g.step()
