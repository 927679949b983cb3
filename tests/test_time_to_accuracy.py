"""benchmarks/time_to_accuracy.py: its pure parts, and a --quick run end to end (slow, in CI)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from time_to_accuracy import median_run, straggler_efficiency, summarise, time_to_target


def test_time_to_target_interpolates_between_evaluations_and_starts_at_chance():
    curve = [{"train_s": 10.0, "test_accuracy": 0.5}, {"train_s": 20.0, "test_accuracy": 0.7}]
    assert time_to_target(curve, 0.6) == pytest.approx(15.0)
    assert time_to_target(curve, 0.3) == pytest.approx(5.0)  # from (0 s, 0.1)
    assert time_to_target(curve, 0.7) == pytest.approx(20.0)
    assert time_to_target(curve, 0.71) is None
    assert time_to_target([], 0.5) is None


def test_straggler_efficiency_is_achieved_over_summed_compute_throughput():
    # 1 of 4 workers 3x slower, uniform batch, no communication: 4/(3 + 1/3) / 3... = 0.4
    result = {"samples_per_s": 4 * 100 / 3,
              "worker_statistics": [{"samples_per_s": 100.0}] * 3 + [{"samples_per_s": 100 / 3}]}
    assert straggler_efficiency(result) == pytest.approx(0.4)
    assert math.isnan(straggler_efficiency({"samples_per_s": 1.0, "worker_statistics": []}))


def _run(accuracies, samples_per_s):
    return {"curve": [{"train_s": 10.0 * (i + 1), "test_accuracy": a} for i, a in enumerate(accuracies)],
            "steps": 10, "samples": 640, "test_accuracy": accuracies[-1], "samples_per_s": samples_per_s,
            "train_s": 20.0, "run_wall_s": 30.0, "worker_statistics": [{"samples_per_s": 100.0}]}


def test_repeated_runs_report_the_median_of_each_column_and_plot_the_median_run():
    runs = [_run([0.5, 0.9], 60.0), _run([0.5, 0.6], 70.0), _run([0.95, 0.96], 90.0)]  # 19.5 s, never, 9.2 s
    result = {**median_run(runs, 0.88), "runs": runs}
    assert result["curve"] == runs[0]["curve"]  # the median time to target
    row = summarise("goodput", result, 0.88)
    assert row["time_to_target_s"] == pytest.approx(19.5)
    assert row["accuracy_at_budget"] == 0.9 and row["samples_per_s"] == 70.0 and row["runs"] == 3
    assert row["time_to_target_runs_s"][1] is None
    # a target most runs never reach has no median time
    assert summarise("goodput", {**result, "runs": runs[:2] + [_run([0.5, 0.6], 1.0)]}, 0.88)["time_to_target_s"] is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_benchmark_writes_every_column(tmp_path):
    """A --quick run trimmed to its CI core: one static batch and one policy (the scheduler's
    decision path), 15 s of training each (4 workers start up in ~30 s more), evaluated every 5 s.
    The target is lowered with the budget (--quick: 60% in 30 s) so that a loaded machine still
    reaches it: time to target is a column, and it must be filled."""
    out = tmp_path / "tta.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/time_to_accuracy.py"), "--quick", "--scenario", "straggler",
         "--configs", "static32,proportional", "--budget", "15", "--eval-every", "5", "--target", "0.5",
         "--runs-dir", str(tmp_path / "runs"), "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["rows"]] == ["static32", "proportional"]
    assert [report["results"][c]["seed"] for c in ("static32", "proportional")] == [42, 42]
    assert report["quick"] and report["budget_s"] == 15.0
    for row in report["rows"]:
        for column, value in row.items():
            assert value is not None and not (isinstance(value, float) and math.isnan(value)), (row["config"], column)
        assert 0.0 < row["straggler_efficiency"] <= 1.05
    assert out.with_suffix(".png").stat().st_size > 0
    assert "straggler eff." in proc.stdout
