"""benchmarks/sim_calibration.py: samples to a training loss, recorded and simulated."""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_sim_fit import simulated_static_run

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from sim_calibration import analyse, main, samples_to_loss  # noqa: E402

from dynamix_byteps.policy.sim.fit import RunLog, fit_log, load_log  # noqa: E402
from dynamix_byteps.policy.sim.params import reference  # noqa: E402


def _log(losses, global_batch=100, steps_per_interval=10) -> RunLog:
    t = len(losses)
    return RunLog(path=Path("x/decisions.jsonl"), steps=np.arange(1, t + 1) * steps_per_interval,
                  batch=np.full((t, 2), global_batch / 2), compute_s=np.ones((t, 2)), push_pull_s=np.zeros((t, 2)),
                  loss=np.asarray(losses, dtype=np.float64), noise_scale=np.full(t, np.nan), initial_batch=(50, 50),
                  min_batch=1, max_batch=None, dataset_size=None, node_metrics=False)


def test_samples_to_loss_crosses_the_smoothed_loss_and_says_never_or_before_the_start():
    # Each interval trains 1000 samples; its loss sits at its middle (500, 1500, ...). The 5-interval
    # means fall 1.0 (middle 2500) ... by 0.1 per interval.
    log = _log([1.2, 1.1, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert samples_to_loss(log, 0.95) == pytest.approx(3000)
    assert samples_to_loss(log, 0.65) == pytest.approx(6000)
    assert samples_to_loss(log, 0.55) is None  # the last mean is 0.6
    assert samples_to_loss(log, 1.5) is None  # already below at the first mean
    noisy = _log([1.2, 1.1, np.nan, 1.0, 0.9, 0.8, 0.7])  # an interval without a loss is skipped
    assert samples_to_loss(noisy, 0.95) == pytest.approx(3700)  # middles 3100 and 4300
    assert samples_to_loss(_log([1.0, 0.5, np.nan]), 0.4) is None  # too few losses to average (was 0.3 = 1.5/5)
    assert samples_to_loss(_log([np.nan] * 6), 0.4) is None


def test_the_fit_of_simulated_runs_reproduces_their_samples_ratios(tmp_path):
    truth = replace(reference(2).stats, noise_scale=300.0, noise_growth=1.5, measured_noise_scale=50.0,
                    measured_noise_growth=1.0, loss_noise=0.0, noise_scale_noise=0.0, loss_tail=1.0,
                    target_loss=0.3, steps_scale=150.0)
    logs = [load_log(simulated_static_run(tmp_path / f"b{b}", b, truth, decisions=400, interval=5, seed=i))
            for i, b in enumerate((128, 64, 256, 512))]
    report = analyse(logs, {"fit": fit_log(logs[0], logs[1:])[0], "one run": fit_log(logs[0])[0]}, [1.5, 1.0])
    assert report["global_batches"] == [128, 256, 512, 1024] and report["reference_batch"] == 256
    for row in report["rows"]:
        recorded = row["recorded"]["ratio"]
        assert recorded[1] == 1.0 and recorded[3] > recorded[2] > 1.0 > recorded[0]
        assert row["fit"]["ratio"] == pytest.approx(recorded, rel=0.05)
    assert row["one run"]["ratio"][3] > recorded[3] * 1.1  # the measured noise scale (50) overcharges


def test_the_cli_refuses_bad_runs_losses_reference_and_out(tmp_path, capsys):
    run = simulated_static_run(tmp_path / "b64", 64, reference(2).stats)  # global 128
    other = simulated_static_run(tmp_path / "b32", 32, reference(2).stats)  # global 64
    with pytest.raises(SystemExit) as exit_:
        main([str(run)])
    assert exit_.value.code == 2 and "at least two runs" in capsys.readouterr().err
    for losses, message in (("0.3,x", "comma-separated list of losses"), ("0.3,inf", "finite number > 0")):
        with pytest.raises(SystemExit):
            main([str(run), str(other), "--losses", losses])
        assert message in capsys.readouterr().err
    out = tmp_path / "out.json"
    assert main([str(run), str(run), "--out", str(out)]) == 2
    assert "every run has global batch 128; give runs at two or more" in capsys.readouterr().err
    assert main([str(run), str(other), "--reference", "256", "--out", str(out)]) == 2
    assert "global batches [64, 128]; --reference 256 must be one" in capsys.readouterr().err
    assert main([str(run), str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "sim_calibration:" in capsys.readouterr().err and not out.exists()
    assert main([str(run), str(other), "--out", str(tmp_path)]) == 2  # was an IsADirectoryError traceback
    assert f"--out {tmp_path}:" in capsys.readouterr().err


def test_runs_at_one_global_batch_pool_by_their_median():
    losses = [1.2, 1.1, 1.0, 0.9, 0.8, 0.7]
    runs = [_log(losses), _log(losses, steps_per_interval=20), _log(losses, global_batch=200)]
    (row,) = analyse(runs, {}, [0.95])["rows"]  # 3000, 6000 and 6000 samples
    assert row["recorded"]["median_samples"] == pytest.approx([4500, 6000])
    assert row["recorded"]["ratio"] == pytest.approx([1.0, 6000 / 4500])
    assert [run["samples"] for run in row["runs"]] == pytest.approx([3000, 6000, 6000])
