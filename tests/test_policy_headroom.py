"""benchmarks/policy_headroom.py: balanced schedules against the heuristics in the fitted simulator."""

import json
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


@pytest.mark.parametrize("args, needle", [(["--grid", "128,x"], "not a comma-separated list of global batches"),
                                          (["--switch", "0.5,1.5"], "must be in (0, 1)"),
                                          (["--episodes", "0"], "--episodes must be >= 1")])
def test_bad_flags_are_refused_naming_the_flag(args, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_a_missing_profiles_file_is_refused_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "headroom.json"
    assert main(["--profiles", str(tmp_path / "nope.json"), "--out", str(out)]) == 2
    assert "cannot read profiles file" in capsys.readouterr().err and not out.exists()
