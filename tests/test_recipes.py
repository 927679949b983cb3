"""Common PyTorch training recipes through DistributedOptimizer and DistributedDataParallel on
real worker processes over loopback, each compared with PyTorch's own DDP on the same job."""

import pytest
from multiworker import ok, run_workers

WRAPPERS = ["bps_optimizer", "bps_ddp"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper, overflow_step, zeroed_by", [(w, 2, "optimizer") for w in WRAPPERS] + [
    ("bps_optimizer_plain", 0, "optimizer"), ("bps_optimizer_plain", 2, "optimizer"), ("bps_optimizer", 1, "model"),
    ("bps_optimizer_plain", 1, "model"), ("bps_optimizer_plain", 1, "model_in_place")])
def test_a_grad_scaler_overflow_on_one_worker_skips_the_step_on_every_worker(wrapper, overflow_step, zeroed_by):
    """bps_optimizer_plain: PyTorch's own AMP loop through DistributedOptimizer, without Horovod's
    synchronize (it left the workers' parameters apart, overflow or not: unscale_ wrote into
    gradients still being reduced); an overflow on the first step too. zeroed_by="model": the
    gradients of the skipped step are cleared by model.zero_grad(), which the optimizer does not see
    (the next backward, and a batch size declared before it, were refused as a second pass before step());
    model_in_place: zeroed in place, set_to_none=False (refused so until the zeros counted as cleared)."""
    results = ok(run_workers(2, "recipe_cases:grad_scaler_overflow_on_one_worker", wrapper, 4, overflow_step,
                             zeroed_by))
    for result in results:
        mine, reference = result["mine"], result["torch"]
        assert mine["scales"] == reference["scales"]
        assert mine["scales"][overflow_step] == 32768.0, "the overflow was not seen"
        if overflow_step:
            assert mine["params"][overflow_step] == mine["params"][overflow_step - 1], "the step was not skipped"
        for params, torch_params in zip(mine["params"], reference["params"]):
            assert params == pytest.approx(torch_params, abs=1e-6)
    assert results[0]["mine"]["params"] == results[1]["mine"]["params"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_complex_parameters_train_as_with_torch_ddp(wrapper):
    results = ok(run_workers(2, "recipe_cases:complex_parameters", wrapper))
    for result in results:
        assert result["mine"] == pytest.approx(result["torch"], abs=1e-6)
    assert results[0]["mine"] == results[1]["mine"]


@pytest.mark.timeout(120)
def test_a_resume_from_plain_state_dicts_keeps_the_scaled_learning_rate():
    """optimizer.state_dict() holds the base batch of lr_scaling: resumed through torch.save of the
    optimizer's, scheduler's and sampler's state_dicts (as torch DDP scripts checkpoint), a run whose
    global batch had doubled went on at half its learning rate (the first batch after the resume
    became the base)."""
    for result in ok(run_workers(2, "recipe_cases:lr_scaling_resumed_from_plain_state_dicts")):
        assert result["whole"] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05, 0.05])
        assert result["resumed"] == pytest.approx(result["whole"])


@pytest.mark.timeout(60)
def test_copying_the_ddp_wrapper_is_refused_naming_its_module():
    """copy.deepcopy(model), an EMA's AveragedModel(model) and torch.save(model) of the DDP wrapper
    raised "cannot pickle 'dynamix_byteps._core.TimingRing' object", naming neither the wrapper nor
    what to copy instead; copies of model.module work and the wrapper trains on."""
    (result,) = ok(run_workers(1, "recipe_cases:copies_of_the_ddp_wrapper"))
    for how, said in result["said"].items():
        assert said is not None and "bps.DistributedDataParallel cannot be copied" in said, how
        assert "copy.deepcopy(model.module)" in said and "AveragedModel(model.module)" in said
    assert result["ema"] == result["model"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_backward_under_compiled_autograd_is_refused_and_eager_training_goes_on(wrapper):
    """Compiled autograd traced the reduction's hooks and failed in dynamo on every worker with
    "AssertionError: queue_callback() is only supported when Compiled Autograd is enabled with
    fullgraph=True", naming neither the library nor the setting to change."""
    for result in ok(run_workers(2, "recipe_cases:compiled_autograd_backward", wrapper)):
        assert result["said"].startswith("ConfigurationError: compiled autograd cannot run")
        assert "torch._dynamo.config.compiled_autograd = False" in result["said"]
        assert result["params"] == pytest.approx(result["reference"], abs=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_tied_weight_listed_twice_in_the_optimizer_trains_as_with_torch_ddp(wrapper):
    """An optimizer over [*embedding.parameters(), ..., *head.parameters()] of a tied model lists
    the tied weight twice (torch warns and accepts it): DistributedOptimizer planned it twice and
    failed every step after the first with GradientReductionError 'gradients were replaced
    (embedding.weight) during backward ... by a hook on another tensor'."""
    results = ok(run_workers(2, "recipe_cases:tied_weight_listed_twice", wrapper))
    for result in results:
        assert result["mine"] == pytest.approx(result["torch"], abs=1e-6)
    assert results[0]["mine"] == results[1]["mine"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_layer_shared_by_reentrant_checkpoints_trains_as_with_torch_ddps_static_graph(wrapper):
    """The shared layer gets its gradient in three parts per backward pass: the second step raised
    GradientReductionError 'shared.bias got a gradient twice in one backward pass' on every worker."""
    results = ok(run_workers(2, "recipe_cases:layer_shared_by_reentrant_checkpoints", wrapper))
    for result in results:
        assert result["mine"] == pytest.approx(result["torch"], abs=1e-6)
    assert results[0]["mine"] == results[1]["mine"]
