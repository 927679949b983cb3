"""The byteps.torch API on real worker processes over loopback (gloo engine)."""

import pytest
from multiworker import ok, run_workers


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_push_pull_sum_and_average_match_reference(workers):
    for failures in ok(run_workers(workers, "dist_cases:push_pull_matrix")):
        assert failures == []


@pytest.mark.timeout(120)
def test_back_to_back_rounds_on_one_name_stay_exact():
    for failures in ok(run_workers(3, "dist_cases:back_to_back", 50)):
        assert failures == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("passes", [1, 2])
def test_non_uniform_batches_match_single_process_training(passes):
    results = ok(run_workers(3, "dist_cases:weighted_training", [8, 24, 40], 5, passes))
    for result in results:
        assert result["grad_error"] < 1e-6
        assert result["param_error"] < 1e-6


@pytest.mark.timeout(120)
def test_equal_batches_without_sizes_give_the_plain_average():
    for result in ok(run_workers(2, "dist_cases:weighted_training", [16, 16], 3, 1)):
        assert result["grad_error"] < 1e-6


@pytest.mark.timeout(60)
def test_more_backward_passes_than_declared_raise():
    (message,) = ok(run_workers(1, "dist_cases:too_many_passes"))
    assert "backward_passes_per_step=1" in message


@pytest.mark.timeout(120)
def test_a_worker_that_declares_no_samples_adds_nothing_even_the_nan_of_its_empty_batch():
    # An empty batch's gradients can be NaN (a gain on the batch's mean input here), and NaN times
    # its weight 0 is NaN: every worker's gradients were NaN.
    for error in ok(run_workers(3, "dist_cases:worker_without_samples")):
        assert error < 1e-9


@pytest.mark.timeout(120)
def test_batch_size_declared_on_some_ranks_raises_everywhere():
    results = run_workers(3, "dist_cases:batch_size_on_some_ranks")
    assert [r.get("error") for r in results] == ["ConfigurationError"] * 3
    assert all("ranks [1, 2] did not" in r["message"] for r in results)


@pytest.mark.timeout(120)
def test_broadcasts_make_all_ranks_equal_to_the_root():
    results = ok(run_workers(3, "dist_cases:broadcasts"))
    root = results[1]
    assert results[0]["before"] != root["before"]
    for result in results:
        assert result["params"] == root["before"]
        assert result["opt"] == root["opt"]
        assert result["lr"] == pytest.approx(2e-3)
        assert result["obj"] == [1, [0, 1, 2], "é"]


@pytest.mark.timeout(120)
def test_mismatched_names_shapes_dtypes_raise_on_every_worker():
    for rank, errors in enumerate(ok(run_workers(3, "dist_cases:mismatches"))):
        for case in ("name", "shape", "dtype", "root"):
            assert errors[case] is not None, f"rank {rank}: {case} mismatch was not detected"
            assert "rank 2:" in errors[case]
        assert errors["after"] == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_fp16_compression_averages():
    for values in ok(run_workers(2, "dist_cases:fp16_compression")):
        assert values == [0.75] * 8


@pytest.mark.timeout(120)
def test_every_worker_switches_batch_size_at_the_same_step():
    results = ok(run_workers(3, "dist_cases:switch_at_step", 7, 12))
    for rank, result in enumerate(results):
        assert result["local"] == [[4, 6, 8][rank]] * 7 + [8] * 5
        assert result["global"] == [18] * 7 + [24] * 5
        assert result["lr_scale"] == pytest.approx([1.0] * 7 + [24 / 18] * 5)
    assert results[0]["noise_scale"] is not None and results[0]["noise_scale"] > 0
    assert all(r["stats"] == results[0]["stats"] for r in results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("every", "measured"), [("1", 12), ("5", 3)])
def test_the_gradient_noise_is_measured_every_noise_every_steps(every, measured):
    results = ok(run_workers(3, "dist_cases:switch_at_step", 7, 12, env={"DYNAMIX_NOISE_EVERY": every}))
    assert all(r["stats"]["steps"] == measured and r["stats"]["skipped"] == 0 for r in results)


@pytest.mark.timeout(120)
def test_two_batch_plans_in_one_process_do_not_interfere():
    steps = 8
    for rank, result in enumerate(ok(run_workers(2, "dist_cases:two_plans", steps))):
        assert result["local"][0] == [[3, 5][rank]] * 4 + [6] * (steps - 4)
        assert result["global"][0] == [8] * 4 + [12] * (steps - 4)
        assert result["local"][1] == [[7, 2][rank]] * 6 + [2] * (steps - 6)
        assert result["global"][1] == [9] * 6 + [4] * (steps - 6)
        assert result["next_step"] == [list(range(1, steps + 1))] * 2
        # bps.step_statistics() reports the newest sampler's optimizer, and only its steps
        assert result["default_monitor"] == {"steps": steps, "samples": sum(result["local"][1])}
        assert result["separate_noise"]


@pytest.mark.timeout(120)
def test_invalid_or_disputed_assignments_are_refused_everywhere():
    for result in ok(run_workers(3, "dist_cases:rejected_assignment")):
        assert result == {"error": "InvalidAssignmentError", "mismatch": "TensorMismatchError", "kept": True}


@pytest.mark.timeout(240)
def test_resume_mid_epoch_from_4_to_2_workers_loses_and_repeats_nothing(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    before = ok(run_workers(4, "dist_cases:train_then_checkpoint", path, 5))
    after = ok(run_workers(2, "dist_cases:resume_and_finish_epoch", path))
    assert after[0]["extra"] == {"note": "mid-epoch"}
    assert after[0]["sizes"] == [13, 13]  # the global batch 26 kept, split over 2 workers
    seen = sorted(i for r in before for i in r) + sorted(i for r in after for i in r["trained"])
    counts = {i: seen.count(i) for i in set(seen)}
    assert set(counts) == set(range(203))
    assert sum(c - 1 for c in counts.values()) <= 1  # the documented tail padding, at most workers - 1


@pytest.mark.timeout(120)
def test_unfrozen_parameters_closures_gan_loops_and_added_groups_stay_in_sync():
    results = ok(run_workers(2, "dist_cases:optimizer_patterns"))
    for key in ("unfrozen", "after_closure", "gan_loop", "added_group"):
        assert results[0][key] == results[1][key], key
    assert results[0]["closure_loss"] != results[1]["closure_loss"]  # each rank's own loss, as in torch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frontend", ["ddp", "optimizer"])
@pytest.mark.parametrize("grads_during_conversion", [False, True])
@pytest.mark.parametrize("conversion", ["double", "there and back", "first layer there and back"])
def test_a_model_converted_to_another_dtype_after_wrapping_trains_as_in_one_process(frontend, grads_during_conversion,
                                                                                    conversion):
    # model.double() after wrapping: autograd builds new gradient accumulators, which the old hooks
    # never see, and converts the .grad bucket views; each worker used to train on its own gradients.
    # There and back (model.double(); model.float()) leaves the dtypes, so the plan, as they were.
    results = ok(run_workers(2, "dist_cases:converted_after_wrapping", frontend, grads_during_conversion,
                             conversion))
    assert results[0]["digest"] == results[1]["digest"]
    assert max(r["error"] for r in results) < 1e-12


@pytest.mark.timeout(120)
def test_push_pull_from_two_threads_never_aborts_and_bad_types_are_refused():
    results = ok(run_workers(2, "dist_cases:thread_safety_and_types"))
    for result in results:
        assert result["all_correct"] and result["done"] == 30
        assert all(message and "push_pull" in message for message in result["types"].values())
        assert result["after"] == [2.0]
    assert results[0]["unpicklable"] == "TypeError" and results[1]["unpicklable"] == "DynamixError"


@pytest.mark.timeout(120)
def test_different_fusion_sizes_raise_instead_of_aborting():
    assert [r.get("error") for r in run_workers(2, "dist_cases:fusion_mismatch")] == ["TensorMismatchError"] * 2


@pytest.mark.timeout(120)
def test_a_warmup_built_on_the_wrapped_optimizer_scales_the_averaged_update():
    results = ok(run_workers(2, "dist_cases:warmup_after_wrapping"))
    assert results[0] == results[1]
    averaged = 1.5  # the gradients 1 and 2 of the two ranks' equal (default) batches
    expected = [lr * averaged for lr in (0.2, 0.3, 0.4, 0.4) for _ in range(3)]  # 0.4 x (0.5, 0.75, 1, 1)
    assert [u for step in results[0]["updates"] for u in step] == pytest.approx(expected)


@pytest.mark.timeout(120)
def test_scheduler_before_wrapping_new_optimizers_and_early_epoch_exit():
    results = ok(run_workers(2, "dist_cases:second_break_test"))
    for key in ("scheduler_first", "second_optimizer"):
        assert results[0][key] == results[1][key], key
    assert results[0]["lr_after_scheduler"] == pytest.approx(0.05)
    together = sorted(results[0]["epoch_indices"] + results[1]["epoch_indices"])
    assert together == list(range(64)), "samples lost or repeated after leaving an epoch early"
