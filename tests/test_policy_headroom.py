"""benchmarks/policy_headroom.py: balanced schedules against the heuristics in the fitted simulator."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from policy_headroom import balanced, main  # noqa: E402

from dynamix_byteps.policy.ppo.mixture import Profile, write_profiles  # noqa: E402
from dynamix_byteps.policy.sim.params import SimParams, WorkerParams  # noqa: E402


def _straggler() -> SimParams:
    fast = WorkerParams(fixed_s=0.01, samples_per_s=600.0)
    return SimParams(workers=(fast, fast, fast, replace(fast, samples_per_s=200.0)), initial_batch=(64,) * 4,
                     min_batch=16, max_decisions=60)


def test_balanced_batches_end_every_workers_compute_together_and_sum_to_the_global_batch():
    params = _straggler()
    b = balanced(params, 700)
    compute = [w.fixed_s + x / w.samples_per_s for w, x in zip(params.workers, b)]
    assert abs(int(b.sum()) - 700) <= 2 and max(compute) - min(compute) < 0.003, (b, compute)
    assert b[3] < b[0] and b.dtype == np.int64
    assert balanced(params, 40).tolist() == [16, 16, 16, 16]  # never below the job's minimum batch


@pytest.mark.timeout(120)
def test_quick_run_fills_every_column_and_the_best_schedule_beats_static_on_a_straggler(tmp_path, capsys):
    profiles = tmp_path / "profiles.json"
    write_profiles(profiles, [Profile("straggler", "straggler", "test", _straggler())], ["swapping-stragglers"])
    out = tmp_path / "headroom.json"
    assert main(["--quick", "--profiles", str(profiles), "--ppo-policy", "none", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert report["policies"] == ["static", "proportional", "goodput"] and report["held_out"] == ["swapping-stragglers"]
    assert set(row["times"]) == {"static", "proportional", "goodput", "best constant", "best schedule"}
    assert all(len(t) == 2 and None not in t for t in row["times"].values())
    assert np.mean(row["times"]["best schedule"]) < np.mean(row["times"]["static"])
    low, high = row["headroom_interval"]
    assert low <= row["headroom"] <= high and row["verdict"] in ("ahead", "tie", "behind")
    assert "best / best heuristic [90%]" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_the_initial_batch_flag_starts_static_there_and_is_recorded(tmp_path):
    out = tmp_path / "headroom.json"
    assert main(["--quick", "--profiles", str(_profiles(tmp_path, _straggler())), "--ppo-policy", "none",
                 "--initial-batch", "16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    fitted = tmp_path / "fitted.json"
    assert main(["--quick", "--profiles", str(_profiles(tmp_path, _straggler())), "--ppo-policy", "none",
                 "--out", str(fitted)]) == 0
    assert report["initial_batch"] == 16 and json.loads(fitted.read_text())["initial_batch"] is None
    slow_start, fitted_start = ([np.inf if t is None else t for t in json.loads(path.read_text())["rows"][0]["times"]["static"]]
                                for path in (out, fitted))
    assert np.mean(slow_start) > np.mean(fitted_start)  # 64 samples a step, not 256


def test_an_initial_batch_outside_the_jobs_bounds_is_refused_not_clipped(tmp_path, capsys):
    out = tmp_path / "headroom.json"
    assert main(["--quick", "--profiles", str(_profiles(tmp_path, _straggler())), "--ppo-policy", "none",
                 "--initial-batch", "2048", "--out", str(out)]) == 2
    assert "--initial-batch 2048 is outside the local batch bounds of profile(s) ['straggler']" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [(["--grid", "128,x"], "not a comma-separated list of global batches"),
                                          (["--switch", "0.5,1.5"], "must be in (0, 1)"),
                                          (["--episodes", "0"], "episodes 0 must be between 1 and 1000"),
                                          (["--seed", "-1"], "seed -1 must be >= 0"),
                                          (["--initial-batch", "0"], "initial batch 0 must be >= 1")])
def test_bad_flags_are_refused_naming_the_flag(args, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def _profiles(tmp_path: Path, params: SimParams) -> Path:
    path = tmp_path / "profiles.json"
    write_profiles(path, [Profile("straggler", "straggler", "test", params)], [])
    return path


def test_the_table_names_the_global_batches_that_ran_not_those_asked_for(tmp_path):
    # the simulator clips every worker to [16, 512]: asked 1 and 10^9, the job ran 64 and 2048
    out = tmp_path / "headroom.json"
    assert main(["--grid", "1,1000000000", "--switch", "0.5", "--episodes", "1", "--ppo-policy", "none",
                 "--profiles", str(_profiles(tmp_path, replace(_straggler(), max_batch=512))), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["candidates"] == 4 and row["best_constant"][0] in (64, 2048) and row["best_schedule"][0] in (64, 2048)


def test_no_headroom_is_claimed_when_an_episode_misses_the_target(tmp_path):
    out = tmp_path / "headroom.json"
    short = replace(_straggler(), max_decisions=2)  # episodes end long before the target loss
    assert main(["--quick", "--ppo-policy", "none", "--profiles", str(_profiles(tmp_path, short)), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["headroom"] is None and row["verdict"].startswith("n/a: best schedule"), row["verdict"]


@pytest.mark.timeout(120)
def test_a_reader_that_goes_away_neither_loses_the_report_nor_shows_a_traceback(tmp_path):
    out = tmp_path / "headroom.json"
    result = subprocess.run(f"{sys.executable} {REPO / 'benchmarks' / 'policy_headroom.py'} --quick --ppo-policy none "
                            f"--profiles {_profiles(tmp_path, _straggler())} --out {out} | head -c 1",
                            shell=True, capture_output=True, text=True, timeout=100, check=False)
    assert out.is_file() and "Traceback" not in result.stderr, result.stderr


def test_a_missing_profiles_file_is_refused_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "headroom.json"
    assert main(["--profiles", str(tmp_path / "nope.json"), "--out", str(out)]) == 2
    assert "cannot read profiles file" in capsys.readouterr().err and not out.exists()
