"""Gradients reduced during backward (DistributedOptimizer and DistributedDataParallel) on real
worker processes over loopback: exact batch weighting, unused parameters, mismatches."""

import pytest
from multiworker import ok, run_workers

SIZES = [13, 29, 50]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant", ["optimizer", "optimizer_accumulate", "ddp", "ddp_no_sync",
                                     "optimizer_reentrant", "ddp_no_sync_reentrant"])
def test_unequal_batches_reduced_during_backward_match_one_process(variant):
    for result in ok(run_workers(3, "overlap_cases:exact_weighting", variant, SIZES, 3)):
        assert result["grad_error"] < 1e-12
        assert result["param_error"] < 1e-12
        assert result["overlapped"] >= 2, "no bucket left before backward returned"
        assert result["unused_grad_none"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_parameters_without_gradients_on_some_ranks_neither_hang_nor_get_lost(variant):
    for result in ok(run_workers(2, "overlap_cases:unused_on_some_ranks", variant)):
        assert result["same_on_every_rank"]
        assert result["extra_error"] < 1e-12
        assert result["unused_none"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_a_different_model_on_one_rank_raises_on_every_rank(variant):
    for message in ok(run_workers(2, "overlap_cases:different_model", variant)):
        assert "rank 0" in message and "rank 1" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_samplers_out_of_step_raise_on_every_rank(variant):
    for message in ok(run_workers(2, "overlap_cases:out_of_step_samplers", variant)):
        assert "rank 0: step 3, rank 1: step 0" in message and "on every worker" in message, message


@pytest.mark.timeout(120)
def test_a_different_backward_passes_per_step_on_one_rank_raises_on_every_rank():
    for message in ok(run_workers(2, "overlap_cases:different_passes_per_step")):
        assert "backward_passes_per_step=2" in message and "backward_passes_per_step=1" in message, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_freezing_a_parameter_on_one_rank_raises_on_every_rank(variant):
    for result in ok(run_workers(2, "overlap_cases:frozen_mid_training", variant, "one")):
        assert result["step"] == 2 and "rank 0" in result["error"] and "rank 1" in result["error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_freezing_a_parameter_on_every_rank_trains_on_exactly(variant):
    for result in ok(run_workers(2, "overlap_cases:frozen_mid_training", variant, "all")):
        assert result["step"] is None and result["param_error"] < 1e-12


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["optimizer", "ddp"])
def test_the_ddp_wrapper_and_the_distributed_optimizer_on_one_model_are_refused(first):
    (result,) = ok(run_workers(1, "overlap_cases:both_wrappers", first))
    assert "already reduced by a live" in result["mixed"] and "not both" in result["mixed"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late_step", [0, 1])
def test_a_size_declared_after_backward_on_one_rank_raises_everywhere_from_backward(late_step):
    """The reduction ends with backward, so a size declared after it comes too late, on the first
    step too (it used to switch the job to reducing in step(), where a worker that skips the
    step, e.g. GradScaler after a local overflow, pairs its reductions with the others' next)."""
    for said in ok(run_workers(2, "overlap_cases:declared_late", late_step)):
        assert said.startswith(f"step {late_step}:"), said
        assert "ranks [0] declared a local batch size" in said and "before loss.backward()" in said


@pytest.mark.timeout(120)
def test_a_size_declared_after_a_reduction_without_one_is_refused():
    for said in ok(run_workers(2, "overlap_cases:declared_after_reduction")):
        assert "called after this step's gradients had started reducing" in said, said


def test_buckets_close_at_the_limit_and_the_first_is_small():
    from dynamix_byteps.aggregation import plan_buckets

    mib = 1 << 20
    # benchmarks/ddp_comparison.py's MLP, in the order backward produces its gradients (bytes)
    sizes = [40, 40_960, 4096, 4 * mib, 8192, 8 * mib, 8192, 16 * mib, 8192, 784 * 2048 * 4]
    assert plan_buckets([(n, "f32") for n in sizes], 25 * mib, mib) == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert plan_buckets([(n, "f32") for n in sizes], 8 * mib, mib) == [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9]]
    # the tensor that crosses the limit joins the bucket (DDP's rule)
    assert plan_buckets([(10, "f"), (15, "f"), (10, "f")], 20) == [[0, 1], [2]]
    # one kind per bucket, kinds by first appearance; a tensor above the limit is a bucket alone
    assert plan_buckets([(10, "a"), (10, "b"), (30, "a"), (10, "a")], 20) == [[0, 2], [3], [1]]


@pytest.mark.timeout(120)
def test_rank0_evaluation_an_empty_batch_and_fp16_with_a_large_batch():
    for result in ok(run_workers(2, "overlap_cases:found_by_a_tester")):
        assert result["evaluated"]
        assert result["empty_batch_error"] < 1e-12
        assert result["fp16_finite"]


@pytest.mark.timeout(60)
def test_an_lr_scheduler_built_before_wrapping_survives_load_state_dict_and_warns_of_nothing():
    [result] = ok(run_workers(1, "overlap_cases:scheduler_after_load"))
    assert result == {"rates": [0.5, 0.25, 0.125, 0.0625], "warnings": []}


def test_a_failed_reduction_is_named_for_the_user_not_by_its_internal_tensor():
    from dynamix_byteps.engine.base import describe_collective

    assert describe_collective("Gradient.bucket.3") == "the gradient reduction of bucket 3"
    assert describe_collective("Gradient.trailer").startswith("the gradient reduction's trailer")
    assert describe_collective("Gradient.announcement").startswith("the announcement that begins a gradient reduction")
    assert describe_collective("loss") == "push_pull of 'loss'"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("later_sizes, told", [([8, 8], 1), ([2, 6], 0)])
def test_the_ddp_wrapper_says_once_that_it_does_not_scale_the_lr_for_a_new_global_batch(later_sizes, told):
    for warned in ok(run_workers(2, "overlap_cases:ddp_global_batch_changes", later_sizes)):
        assert len(warned) == told, warned
        assert all("global batch is now 16 samples (8 at the first step)" in w and "lr_scaling" in w for w in warned)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_channels_last_gradients_keep_their_layout_in_the_buckets(variant):
    for result in ok(run_workers(2, "overlap_cases:channels_last_gradients_kept_between_steps", variant)):
        assert result["warnings"] == [] and result["strides_kept"], result
        assert max(result["errors"]) < 1e-12, result["errors"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_gradients_hold_the_mean_once_backward_returns_and_the_users_hooks_see_local_gradients(variant):
    for result in ok(run_workers(2, "overlap_cases:gradients_changed_during_reduction", variant)):
        assert max(result["hook_errors"]) < 1e-12, result["hook_errors"]  # from the second step too
        if variant == "ddp":
            continue
        assert result["norm_after_backward_error"] < 1e-12
        assert result["doubled_error"] < 1e-12
        assert result["recipe_error"] < 1e-12 and result["recipe_norm_error"] < 1e-12
        assert result["hand_made"] == pytest.approx([1.7] * 3)  # rank 0's 1 and rank 1's 2 weighted by 3 and 7 samples


@pytest.mark.timeout(120)
def test_a_hook_that_writes_a_gradient_already_reducing_raises_on_its_worker():
    said, other = ok(run_workers(2, "overlap_cases:hook_writes_a_launched_bucket"))
    assert "changed in place (2.bias" in said and "during backward after their bucket had started" in said, said
    assert other == "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["optimizer", "ddp"])
def test_a_backward_that_raised_half_way_is_not_reduced_as_if_complete(variant):
    for result in ok(run_workers(2, "overlap_cases:backward_that_raises", variant)):
        assert result["first"] == "out of memory (simulated)"
        assert "a backward pass raised before its end" in result["retry"]
        if variant == "ddp":
            assert "restart the job" in result["retry"]
        else:
            assert "optimizer.zero_grad()" in result["retry"]
            assert result["after_zero_grad_error"] < 1e-12


@pytest.mark.timeout(120)
def test_a_sparse_gradient_first_seen_after_the_first_step_is_refused_by_name():
    for result in ok(run_workers(2, "overlap_cases:sparse_gradient_after_the_first_step")):
        assert result.startswith("step 1: sparse gradients are not supported (emb.weight)")


@pytest.mark.timeout(120)
def test_backward_with_create_graph_is_reduced_exactly_with_one_warning():
    for result in ok(run_workers(2, "overlap_cases:create_graph_backward")):
        assert max(result["errors"]) < 1e-12
        assert len(result["warnings"]) == 1


@pytest.mark.timeout(120)
def test_a_parameter_inside_and_outside_a_reentrant_checkpoint_from_the_first_step_is_reduced_exactly():
    """As PyTorch's DDP with static_graph=True, the first step shows which parameters get their gradient in
    several parts per backward pass (an ALBERT-style layer shared by several reentrant checkpoints): their
    buckets are launched at the end of backward. Before, the second step raised GradientReductionError."""
    for result in ok(run_workers(2, "overlap_cases:parameter_inside_and_outside_a_reentrant_checkpoint", 0)):
        assert result == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)


@pytest.mark.timeout(120)
def test_a_parameter_inside_and_outside_a_reentrant_checkpoint_only_after_the_first_step_is_refused_by_name():
    for result in ok(run_workers(2, "overlap_cases:parameter_inside_and_outside_a_reentrant_checkpoint", 1)):
        assert result.startswith(("step 1: weight got", "step 1: bias got")) and "a gradient twice in one backward pass" in result, result
        assert "which the first step did not show" in result and "use_reentrant=False" in result


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant", ["optimizer", "accumulate", "first_step", "ddp", "ddp_no_sync",
                                     "ddp_no_sync_buffers", "ddp_no_sync_buffers_forwards_first", "hook_first",
                                     "ddp_hook_first", "tensor_hook_first", "ddp_tensor_hook_first",
                                     "model_zero_grad", "model_zero_grad_in_place"])
def test_a_backward_that_raised_on_one_worker_drops_the_step_on_every_worker(variant):
    """The step is dropped on every worker at once, and the workers' later reductions stay paired
    step for step (before: the healthy rank's remaining buckets met the next step's, silently; with
    an error in a hook on the first parameter to get its gradient, the failing rank's whole round
    went unsent and every later step paired with the others' previous one; inside the DDP wrapper's
    no_sync(), the failing rank skipped the step's reducing pass, the same; with a module buffer
    there, the failing rank's round met the healthy one's buffer broadcast, which timed out with
    CommunicationError; a user's tensor hook, which ran before the reducer's hooks on a parameter,
    did so with the DDP wrapper, silently, and with the optimizer each later step raised
    TensorMismatchError). A loop zeroing the gradients through the model goes on as one zeroing them
    through the optimizer (before: every later step raised GradientReductionError)."""
    failing_step = 0 if variant == "first_step" else 1
    healthy, failing = ok(run_workers(2, "overlap_cases:backward_raising_on_one_worker", variant,
                                      env={"DYNAMIX_TIMEOUT": "20"}, timeout=120))
    raised = "error in a gradient hook (simulated)" if variant.endswith("hook_first") else "out of memory (simulated)"
    assert failing["errors"][str(failing_step)] == ["RuntimeError", raised]
    kind, said = healthy["errors"][str(failing_step)]
    assert kind == "GradientReductionError" and "rank 1's backward pass raised before its end" in said, said
    later = [str(step) for step in range(failing_step + 1, 4)]
    if variant.startswith("ddp"):  # as with PyTorch's DDP, no rank goes on, and none waits for the others
        for result in (healthy, failing):
            assert [result["errors"][step][0] for step in later] == ["GradientReductionError"] * len(later)
            assert "restart the job" in result["errors"][later[0]][1]
        return
    for result in (healthy, failing):
        assert set(result["errors"]) == {str(failing_step)}, result["errors"]
        assert all(result["grad_errors"][step] < 1e-12 for step in later), result["grad_errors"]
    assert "optimizer.zero_grad() (or model.zero_grad()) on every worker" in said, said


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fails", [False, True], ids=["steady", "generator_backward_raises"])
def test_a_gan_s_two_optimizers_train_exactly_and_a_failure_drops_the_step_on_every_worker(fails):
    """Generator and discriminator each behind a DistributedOptimizer (as with Horovod); the
    generator's backward fills the discriminator's gradients too. When it raised inside the
    discriminator on one worker, before the generator's reducer had begun, that worker sent the
    discriminator's round only and gloo aborted the other ('Received data size doesn't match')."""
    healthy, failing = ok(run_workers(2, "overlap_cases:gan_with_two_optimizers", fails,
                                      env={"DYNAMIX_TIMEOUT": "20"}, timeout=120))
    for result in (healthy, failing):
        assert result["param_error"] < 1e-12, result
        assert set(result["errors"]) == ({"1"} if fails else set()), result["errors"]
    if fails:
        assert failing["errors"]["1"] == ["RuntimeError", "out of memory (simulated)"]
        kind, said = healthy["errors"]["1"]
        assert kind == "GradientReductionError" and "rank 1's backward pass raised before its end" in said, said


@pytest.mark.timeout(150)
def test_a_backward_that_raised_before_its_step_s_last_pass_with_a_sampler_says_the_job_cannot_go_on():
    """The failing worker's loop skipped the step's second sampler draw, so every later step raises
    TensorMismatchError; the messages said to zero the gradients and go on, then to load a
    checkpoint on every worker or use no_sync() alike, none of which was the cause."""
    healthy, failing = ok(run_workers(2, "overlap_cases:backward_raising_before_the_last_pass_with_a_sampler",
                                      env={"DYNAMIX_TIMEOUT": "20"}, timeout=120))
    assert failing["1"] == ["RuntimeError", "out of memory (simulated)"], failing
    kind, said = healthy["1"]
    assert kind == "GradientReductionError" and "the workers' samplers stay a draw apart" in said, said
    assert "restart the job" in said and "go on with the next batch" not in said, said
    for errors in (healthy, failing):
        kind, said = errors["2"]
        assert kind == "TensorMismatchError" and "skipped the rest of the step's batches" in said, said


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant", ["forward", "forward_zero_grad_last", "backward"])
def test_a_step_skipped_on_one_worker_raises_on_every_worker_at_the_next_step(variant):
    """Without a sampler, a worker that skipped a step paired each later step with the others'
    previous one, silently, until the job's end; every worker now raises at the next reduction."""
    healthy, skipping = ok(run_workers(2, "overlap_cases:step_skipped_on_one_worker", variant,
                                       env={"DYNAMIX_TIMEOUT": "20"}, timeout=120))
    assert (healthy["step"], skipping["step"]) == (1, 2), (healthy, skipping)
    begun = "rank 0: 1, rank 1: 2" if variant == "forward_zero_grad_last" else "rank 0: 2, rank 1: 3"
    for kind, said in (healthy["error"], skipping["error"]):
        assert kind == "TensorMismatchError", said
        assert "different steps of their training loops" in said and begun in said, said
        assert "same number of steps" in said and "drop_last" in said, said


def test_a_model_the_optimizer_reduces_is_saved_whole_and_its_plain_tensors_without_a_warning(single_process_job):
    """torch.save(model) raised TypeError ('cannot pickle ...': the reducer's record of its hooks
    lay in each parameter's __dict__), and torch.save of a plain leaf tensor warned that the
    reducer's tensor hook 'will not be serialized'."""
    import io
    import warnings

    import torch

    model, scale = torch.nn.Linear(2, 2), torch.ones(2, requires_grad=True)
    named = [*model.named_parameters(), ("scale", scale)]
    single_process_job.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.save(model, io.BytesIO())
        torch.save(scale, io.BytesIO())
