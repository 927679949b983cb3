"""The byteps.tensorflow API on real worker processes over loopback (gloo engine).

Each job starts TensorFlow in every worker (slow), so one job runs a batch of checks
(tests/tf_dist_cases.py) and these tests assert on what it returns.
"""

import subprocess
import sys

import pytest
from multiworker import ok, run_workers

pytest.importorskip("tensorflow")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_push_pull_broadcast_and_gradients_match_reference(workers):
    for failures in ok(run_workers(workers, "tf_dist_cases:collectives", timeout=400)):
        assert failures == []


@pytest.mark.timeout(300)
def test_a_gradient_none_on_one_worker_only_is_a_mismatch_on_every_worker_not_a_crash():
    for failures in ok(run_workers(2, "tf_dist_cases:gradients_that_change", timeout=120)):
        assert failures == []


@pytest.mark.timeout(300)
def test_alternating_gradient_sets_cost_one_extra_round_in_all():
    for result in ok(run_workers(2, "tf_dist_cases:alternating_gradient_sets", timeout=120)):
        assert result == {"wrong": [], "rounds": 9}


@pytest.mark.timeout(300)
def test_non_uniform_batches_match_single_process_training():
    results = ok(run_workers(3, "tf_dist_cases:weighted_training", [8, 24, 40], 5, timeout=280))
    for result in results:
        assert result["tape"]["grad_error"] < 1e-5
        assert result["tape"]["param_error"] < 1e-5
        assert result["fit_param_error"] < 1e-5
        assert result["fit_steps"] == 5 and result["fit_global_batch"] == 72


@pytest.mark.timeout(300)
def test_a_worker_that_declares_no_samples_adds_nothing_even_the_nan_of_its_empty_batch():
    # An empty batch's BatchNormalization gradients are NaN, and NaN times its weight 0 is NaN:
    # every worker's gradients were NaN.
    for errors in ok(run_workers(3, "tf_dist_cases:worker_without_samples", timeout=280)):
        assert errors["eager"] < 1e-5 and errors["graph"] < 1e-5, errors


@pytest.mark.timeout(300)
def test_keras_fit_switches_batch_size_on_every_worker_at_the_same_step():
    epochs, size = 2, 300
    results = ok(run_workers(3, "tf_dist_cases:fit_with_batch_change", size, [4, 6, 10], "7:12,8,4", epochs,
                              timeout=280))
    for rank, result in enumerate(results):
        steps = result["steps"]
        assert [s[0] for s in steps] == list(range(len(steps))), "a step was skipped or trained twice"
        before, after = [s for s in steps if s[0] < 7], [s for s in steps if s[0] >= 7]
        assert {s[1] for s in before} == {[4, 6, 10][rank]} and {s[2] for s in before} == {20}
        full = [s for s in after if s[2] == 24]
        assert full and {s[1] for s in full} == {[12, 8, 4][rank]}
        assert all(s[3] == pytest.approx(s[2] / 20) for s in steps)  # linear LR scaling, base = first batch
        assert result["history_epochs"] == epochs
        assert result["autotune"] is False, "tf.data autotuning stalls each Keras epoch's start when an iterator is dropped"
    for rank in range(1, 3):
        assert [s[0] for s in results[rank]["steps"]] == [s[0] for s in results[0]["steps"]]
        assert [s[2] for s in results[rank]["steps"]] == [s[2] for s in results[0]["steps"]]
        assert results[rank]["weights"] == pytest.approx(results[0]["weights"], rel=1e-6)
        assert results[rank]["logs"] == results[0]["logs"]  # MetricAverageCallback
    for epoch in range(epochs):
        seen = sorted(i for result in results for i in result["trained"][epoch])
        assert seen == list(range(size)), f"epoch {epoch}: a sample was lost or repeated"


@pytest.mark.timeout(150)
def test_one_keras_fit_of_several_epochs_trains_each_whole_when_the_batch_shrinks():
    # Keras counts an unknown-length dataset's steps in the first epoch of a fit call and ended the
    # later, longer ones there (before fit_epochs: 10, 11 and 7 steps, the second sampler epoch over two).
    epochs, size = 3, 640
    (result,) = ok(run_workers(1, "tf_dist_cases:fit_with_batch_change", size, [64], "12:32", epochs, timeout=120))
    for epoch in range(epochs):
        assert sorted(result["trained"][epoch]) == list(range(size)), f"epoch {epoch} did not train every sample once"
    assert [s[2] for s in result["steps"]] == [64] * 12 + [32] * 36  # 10 + 18 + 20 steps
    assert result["history_epochs"] == epochs


@pytest.mark.timeout(150)
def test_where_keras_moved_its_epoch_iterator_a_dynamic_batch_dataset_warns_naming_the_version_and_the_remedy():
    (result,) = ok(run_workers(1, "tf_dist_cases:dataset_where_keras_moved_its_epoch_iterator", timeout=120))
    (message,) = result["warnings"]
    assert f"Keras {result['keras']}" in message and "keras.src.trainers.epoch_iterator" in message
    assert "call fit once per epoch" in message


@pytest.mark.timeout(150)
def test_a_float64_model_trains_as_with_the_plain_optimizer():
    # The learning rate went through float32 on its way to the update (0.1 became 0.10000000149).
    (difference,) = ok(run_workers(1, "tf_dist_cases:float64_training", timeout=120))
    assert difference == 0.0


@pytest.fixture(scope="module")
def mixed_precision(tmp_path_factory):
    """One 2-worker job of mixed-precision checks (tests/tf_dist_cases.py:mixed_precision)."""
    return ok(run_workers(2, "tf_dist_cases:mixed_precision", str(tmp_path_factory.mktemp("saved")), timeout=280))


@pytest.mark.timeout(300)
def test_under_mixed_float16_compile_may_not_wrap_the_distributed_optimizer_every_worker_refuses(mixed_precision):
    for result in mixed_precision:
        assert result["refused"] is not None, f"trained unprotected, weights {result.get('weights')}"
        assert "DistributedOptimizer(SGD) under the mixed_float16 dtype policy" in result["refused"]
        assert "bps.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(SGD(...)))" in result["refused"]


@pytest.mark.timeout(300)
def test_a_loss_scale_optimizer_inside_the_distributed_one_gets_the_learning_rate_factor_and_skips_together(
        mixed_precision):
    for result in mixed_precision:
        assert result["error"] < 1e-6, "the inner optimizer updated with the base learning rate"
        assert result["rule"] == "AdamScale"
        assert result["skipped_moved"] == 0.0 and result["skipped_iterations"] == 0
        assert result["skipped_scale"] == 2.0 ** 15 / 2 ** 4  # 64 samples in global batches of 16


@pytest.mark.timeout(300)
def test_a_loss_scale_optimizer_inside_the_distributed_one_saves_and_loads(mixed_precision):
    for suffix in ("keras", "h5"):
        loaded = [result["saved"][suffix] for result in mixed_precision]
        for result in loaded:
            assert result["class"] == "LossScaleOptimizer" and result["wrapped"]
            assert result["state_error"] == 0.0
            assert result["iterations"] == 4 + 2  # 4 steps saved, 2 after loading
        assert loaded[1]["weights"] == pytest.approx(loaded[0]["weights"], rel=1e-6)


@pytest.mark.timeout(300)
def test_mixed_bfloat16_trains_without_loss_scaling(mixed_precision):
    for result in mixed_precision:
        assert result["bfloat16_error"] < 0.05
    assert mixed_precision[1]["bfloat16_weights"] == mixed_precision[0]["bfloat16_weights"]


@pytest.mark.timeout(300)
def test_a_distributed_tape_under_mixed_float16_skips_an_overflow_on_every_worker(mixed_precision):
    """The tape returns reduced gradients, so a plain LossScaleOptimizer decides on them."""
    for result in mixed_precision:
        assert result["tape"]["iterations"] == 2 and result["tape"]["scale"] == 2.0 ** 15 / 2
    assert mixed_precision[1]["tape"]["weights"] == mixed_precision[0]["tape"]["weights"]


def test_torch_users_never_import_tensorflow():
    code = "import sys, dynamix_byteps, dynamix_byteps.torch; assert 'tensorflow' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
