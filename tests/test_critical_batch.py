"""benchmarks/critical_batch.py: samples at a crossing, the E = E_min + S_min·M fit, and the simulator's side."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "critical_batch.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from critical_batch import analyse, fit_critical_batch, samples_at, simulated_samples  # noqa: E402

from dynamix_byteps.policy.sim.params import reference  # noqa: E402


def _run(config: str, seed: int, samples_to_target: float) -> dict:
    """A run that trains 1000 samples/s and crosses 0.9 exactly at ``samples_to_target``."""
    crossing = samples_to_target / 1000.0
    curve = [{"train_s": crossing - 1.0, "samples": samples_to_target - 1000.0, "test_accuracy": 0.85},
             {"train_s": crossing + 1.0, "samples": samples_to_target + 1000.0, "test_accuracy": 0.95}]
    return {"config": config, "seed": seed, "curve": curve}


def _report(runs: list[dict], workers: int = 4) -> dict:
    return {"workers": workers, "targets": [0.9], "runs": runs}


def test_samples_at_interpolates_in_time_from_zero():
    curve = [{"train_s": 2.0, "samples": 100.0}, {"train_s": 4.0, "samples": 300.0}]
    assert samples_at(curve, 1.0) == 50.0 and samples_at(curve, 3.0) == 200.0


def test_the_fit_recovers_the_critical_batch_and_a_free_large_batch_is_infinite():
    assert fit_critical_batch([128, 256, 1024], [1000 + 2 * m for m in (128, 256, 1024)]) == pytest.approx((1000, 2, 500))
    assert fit_critical_batch([128, 1024], [5000, 4000])[2] == math.inf


def test_analyse_pools_static_runs_by_global_batch_and_leaves_the_policies_out():
    samples = {64: 1000 + 2 * 256, 256: 1000 + 2 * 1024}  # local batch: E_min 1000, S_min 2 -> B_crit 500
    runs = [_run(f"static{b}", seed, samples[b] + (seed - 43) * 10) for b in samples for seed in (42, 43, 44)]
    report = analyse([_report(runs + [_run("proportional", 42, 99.0)])], reference(), reference=256)
    assert report["global_batches"] == [256, 1024]
    (row,) = report["rows"]
    assert row["critical_batch"] == pytest.approx(500, rel=1e-6)
    low, high = row["critical_batch_interval"]
    assert low <= 500 <= high
    cells = {cell["global_batch"]: cell for cell in row["batches"]}
    assert cells[1024]["ratio"] == pytest.approx((1000 + 2048) / (1000 + 512))
    assert cells[256]["runs"] == 3 and len(cells[256]["samples"]) == 3
    assert [cell["global_batch"] for cell in report["simulated"]] == [256, 1024]


def test_a_target_never_reached_has_no_median_and_no_fit():
    never = {"config": "static64", "seed": 42, "curve": [{"train_s": 10.0, "samples": 1e4, "test_accuracy": 0.5}]}
    row = analyse([_report([never, _run("static128", 42, 3000.0)])], reference(), reference=256)["rows"][0]
    assert row["batches"][0]["median_samples"] is None and row["critical_batch"] is None


def test_the_simulator_needs_more_samples_at_a_larger_batch():
    params = reference()
    small, large = simulated_samples(params, 256), simulated_samples(params, 1024)
    assert 0 < small < large < math.inf
    with pytest.raises(ValueError, match="does not split evenly"):
        simulated_samples(params, 258)


def test_a_reference_batch_without_runs_is_refused():
    with pytest.raises(ValueError, match="--reference 512 must be one"):
        analyse([_report([_run("static64", 42, 2000.0)])], reference(), reference=512)


def test_the_command_writes_json_and_names_a_foreign_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report([_run("static64", 42, 1600.0), _run("static128", 42, 2600.0)])))
    out = tmp_path / "c.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "simulator" in done.stdout and json.loads(out.read_text())["inputs"] == ["r.json"]
    path.write_text(json.dumps({"benchmark": "ps_engine"}))
    refused = subprocess.run([sys.executable, str(SCRIPT), str(path), "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "lacks the field 'runs'" in refused.stderr
    bad_sim = tmp_path / "sim.json"
    bad_sim.write_text("{not json")
    refused = subprocess.run([sys.executable, str(SCRIPT), str(path), "--sim", str(bad_sim), "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--sim" in refused.stderr and "not JSON" in refused.stderr
    assert not (tmp_path / "x.json").exists()
