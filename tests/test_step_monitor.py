"""The worker's per-interval loss mean (what the divergence guardrail sees)."""

import math

import torch

from dynamix_byteps.control.worker import _take_mean_loss, report_loss


def test_loss_mean_per_interval_and_none_when_nothing_was_reported():
    assert _take_mean_loss() is None
    report_loss(1.0)
    report_loss(torch.tensor(3.0))
    assert _take_mean_loss() == 2.0
    assert _take_mean_loss() is None  # the next interval starts empty


def test_a_non_finite_loss_makes_the_interval_non_finite():
    report_loss(1.0)
    report_loss(float("nan"))
    assert math.isnan(_take_mean_loss())
