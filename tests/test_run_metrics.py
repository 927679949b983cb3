"""RunMetrics: the metrics file the examples write and benchmarks/time_to_accuracy reads."""
import json

import pytest

from dynamix_byteps.run_metrics import RunMetrics


def metrics(**overrides):
    fields = dict(test_accuracy=0.9, test_loss=0.3, epochs=2, model="cnn", wall_s=12.0, train_s=10.0, samples=5000,
                  workers=2, batch_sizes=[32, 64], batch_schedule="", lr=0.015, lr_scaling="linear",
                  test_samples=2000, curve=[(5.0, 2500, 0.8, 0.5), (10.0, 5000, 0.9, 0.3)],
                  worker_statistics=[{"rank": 0, "steps": 52, "samples": 1664, "compute_s": 8.0, "push_pull_s": 1.0,
                                      "samples_per_s": 208.0}])
    return RunMetrics(**{**fields, **overrides})


def test_the_file_carries_the_curve_as_points_with_throughput_and_steps(tmp_path):
    path = tmp_path / "run.json"
    metrics().write(path)
    record = json.loads(path.read_text())
    assert record["curve"][1] == {"train_s": 10.0, "samples": 5000, "test_accuracy": 0.9, "test_loss": 0.3}
    assert record["samples_per_s"] == 500.0 and record["steps"] == 52
    assert "mode" not in record and metrics(mode="fit").to_json()["mode"] == "fit"


def test_a_run_without_training_time_has_zero_throughput_not_a_division_error():
    assert metrics(train_s=0.0, samples=0, worker_statistics=[]).to_json()["samples_per_s"] == 0.0


def test_what_ended_training_is_written_when_the_script_says_and_left_out_when_it_does_not():
    record = metrics(stopped_by="time_budget", epochs_trained=0.37).to_json()
    assert record["stopped_by"] == "time_budget" and record["epochs_trained"] == 0.37 and record["epochs"] == 2
    assert not {"stopped_by", "epochs_trained"} & set(metrics().to_json())


def test_an_unknown_stop_reason_is_refused_by_name():
    with pytest.raises(ValueError, match="stopped_by='budget' must be one of epochs, time_budget"):
        metrics(stopped_by="budget")


def test_a_budget_spent_on_the_last_step_of_the_last_epoch_cut_nothing_short():
    from dynamix_byteps.run_metrics import stop_reason

    assert stop_reason(True, 0.37, 2) == "time_budget"
    assert stop_reason(True, 1.0, 2) == "time_budget"  # at the end of an earlier epoch
    assert stop_reason(True, 2.0, 2) == "epochs"
    assert stop_reason(False, 2.0, 2) == "epochs"
