"""The byteps.torch API on real worker processes over loopback (gloo engine)."""

import pytest

from multiworker import run_workers


def _ok(results):
    for rank, result in enumerate(results):
        assert "ok" in result, f"rank {rank} raised {result.get('error')}: {result.get('traceback')}"
    return [result["ok"] for result in results]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_push_pull_sum_and_average_match_reference(workers):
    for failures in _ok(run_workers(workers, "dist_cases:push_pull_matrix")):
        assert failures == []


@pytest.mark.timeout(120)
def test_back_to_back_rounds_on_one_name_stay_exact():
    for failures in _ok(run_workers(3, "dist_cases:back_to_back", 50)):
        assert failures == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("passes", [1, 2])
def test_non_uniform_batches_match_single_process_training(passes):
    results = _ok(run_workers(3, "dist_cases:weighted_training", [8, 24, 40], 5, passes))
    for result in results:
        assert result["grad_error"] < 1e-6
        assert result["param_error"] < 1e-6


@pytest.mark.timeout(120)
def test_equal_batches_without_sizes_give_the_plain_average():
    for result in _ok(run_workers(2, "dist_cases:weighted_training", [16, 16], 3, 1)):
        assert result["grad_error"] < 1e-6


@pytest.mark.timeout(60)
def test_more_backward_passes_than_declared_raise():
    (message,) = _ok(run_workers(1, "dist_cases:too_many_passes"))
    assert "backward_passes_per_step=1" in message


@pytest.mark.timeout(120)
def test_batch_size_declared_on_some_ranks_raises_everywhere():
    results = run_workers(3, "dist_cases:batch_size_on_some_ranks")
    assert [r.get("error") for r in results] == ["ConfigurationError"] * 3
    assert all("ranks [1, 2] did not" in r["message"] for r in results)


@pytest.mark.timeout(120)
def test_broadcasts_make_all_ranks_equal_to_the_root():
    results = _ok(run_workers(3, "dist_cases:broadcasts"))
    root = results[1]
    assert results[0]["before"] != root["before"]
    for result in results:
        assert result["params"] == root["before"]
        assert result["opt"] == root["opt"]
        assert result["lr"] == pytest.approx(2e-3)
        assert result["obj"] == [1, [0, 1, 2], "é"]


@pytest.mark.timeout(120)
def test_mismatched_names_shapes_dtypes_raise_on_every_worker():
    for rank, errors in enumerate(_ok(run_workers(3, "dist_cases:mismatches"))):
        for case in ("name", "shape", "dtype", "root"):
            assert errors[case] is not None, f"rank {rank}: {case} mismatch was not detected"
            assert "rank 2:" in errors[case]
        assert errors["after"] == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_fp16_compression_averages():
    for values in _ok(run_workers(2, "dist_cases:fp16_compression")):
        assert values == [0.75] * 8
