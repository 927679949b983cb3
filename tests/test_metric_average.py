"""MetricAverageCallback weights every worker's epoch metric by the samples behind it: with
per-worker batches 4/8/48 the unweighted mean of the workers' losses is not the epoch's loss.
Real TensorFlow workers over loopback."""

import pytest
from multiworker import ok, run_workers

pytest.importorskip("tensorflow")


@pytest.mark.timeout(300)
def test_epoch_metrics_are_sample_weighted_means_over_the_workers():
    epochs = 2
    results = ok(run_workers(3, "tf_metric_cases:fit_with_metric_average", 120, [4, 8, 48], epochs,
                              timeout=280))
    for result in results:
        assert len(result["logs"]) == epochs
        for logs in result["logs"]:
            for key, expected in result["expected"].items():
                assert logs[key] == pytest.approx(expected, rel=1e-5), (key, logs)
    assert all(result["logs"] == results[0]["logs"] for result in results)
