"""How ``bps.DistributedDataParallel`` weights each worker without a sampler, on two real worker
processes (batches 2 and 7): a forward pass counts for the backward passes that go through its
outputs, so the gradients are exactly Σ w_i G_i / Σ w_i with w_i those forwards' batch sizes.

Each case is checked on two steps (the first builds the bucket plan, the second reduces during
backward) against the float64 reference computed in each worker (tests/ddp_counting_cases.py);
one job runs them all.
"""

import pytest
from ddp_counting_cases import CASES, SIZES
from multiworker import ok, run_workers


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return ok(run_workers(2, "ddp_counting_cases:all_cases", list(CASES), timeout=100))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_each_worker_is_weighted_by_the_forward_passes_its_backward_goes_through(job, case):
    # Before the rule: metric_forward_on_rank_0 was weighted [102, 7], eval_mode got the plain
    # mean, two_backward_one_forward's second backward the plain mean, input_gradient_on_rank_0
    # [4, 7]. The other cases guard what already held.
    error = max(result["errors"][case] for result in job)
    assert error < 1e-12, f"{case}: relative error {error:.3g}"


@pytest.mark.timeout(120)
def test_a_forward_reached_after_the_weight_was_taken_raises_on_every_worker_after_the_reduction(job):
    # A parameter whose gradient is complete before the backward reaches a forward's output: only
    # in the later of two forwards in one loss (the earlier one missed), or in the loss alone while
    # another forward's output is kept (counted but not reached). The wrapper trains on exactly.
    # A parameter in the loss alone, with no other output kept, is exact (learnable_loss_weight).
    for batch, result in zip(SIZES, job):
        messages = result["late"]["messages"]
        assert "did not reach it" in messages["kept_output"], messages
        assert "parameter 'temperature'" in messages["later_forward"], messages
        assert f"by {batch} samples instead of {2 * batch} samples" in messages["later_forward"], messages
        assert all("DynamicBatchSampler" in m for m in messages.values()), messages
        assert result["late"]["error_after"] < 1e-12
