"""benchmarks/slow_link_sweep.py: the step ratio, the two floors, and refusals of reports it cannot compare."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "slow_link_sweep.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from slow_link_sweep import markdown, sweep  # noqa: E402


def _worker(rank: int, batch: float, compute_ms: float, transfer_ms: float, steps: int = 100) -> dict:
    return {"rank": rank, "steps": steps, "samples": batch * steps, "compute_s": compute_ms * steps / 1000,
            "push_pull_s": transfer_ms * steps / 1000}


def _run(config: str, seed: int, step_ms: float, slow: tuple[float, float, float] = (64, 70, 60)) -> dict:
    workers = [_worker(rank, 64, 90, 15) for rank in range(3)] + [_worker(3, *slow)]
    return {"config": config, "seed": seed, "train_s": step_ms * 100 / 1000, "steps": 100, "worker_statistics": workers}


def _report(scenario: str, runs: list[dict], engine: str = "ps") -> dict:
    return {"scenario": scenario, "engine": engine, "budget_s": 60.0, "runs": runs}


def _homogeneous(step_ms: float = 100.0) -> dict:
    return _report("homogeneous", [_run("static64", seed, step_ms) for seed in (42, 43, 44)])


def _linked(scenario: str, static_ms: list[float], split_ms: list[float], slow=(20, 35, 120)) -> dict:
    seeds = range(42, 42 + len(static_ms))
    return _report(scenario, [_run("static64", s, ms) for s, ms in zip(seeds, static_ms)]
                   + [_run("proportional", s, ms, slow) for s, ms in zip(seeds, split_ms)])


def test_rows_give_the_step_ratio_its_verdict_and_both_floors_in_order_of_link_rate():
    report = sweep([_linked("network-300", [128, 127, 129], [118, 119, 117], slow=(24, 37, 84)),
                    _homogeneous(100.0),
                    _linked("network", [313, 310, 316], [290, 291, 292], slow=(19, 38, 254))])
    slow, fast = report["rows"]
    assert (slow["link_mbit"], fast["link_mbit"]) == (100.0, 300.0)
    assert slow["ratio"] == pytest.approx(291 / 313) and slow["verdict"] == "ahead"
    assert slow["link_floor"] == pytest.approx(254 / 313) and slow["cpu_floor"] == pytest.approx(100 / 313)
    assert (slow["slow_batch"], slow["slow_compute_ms"], slow["slow_transfer_ms"]) == pytest.approx((19, 38, 254))
    assert fast["cpu_floor"] == pytest.approx(100 / 128) and fast["link_floor"] == pytest.approx(84 / 128)
    table = markdown(report)
    assert table.count("\n") == 3 and "| 100 | 313 [310, 316] | 291 [290, 292] | 0.93x" in table


def test_a_ratio_whose_interval_holds_one_is_a_tie():
    row = sweep([_homogeneous(), _linked("network", [300, 320, 310], [310, 300, 320])])["rows"][0]
    assert row["ratio_interval"][0] < 1 < row["ratio_interval"][1] and row["verdict"] == "tie"



def test_one_seed_gives_no_verdict():
    """One pair of runs has a degenerate interval; like time_to_accuracy.py, it gets no verdict."""
    row = sweep([_homogeneous(), _linked("network", [318], [303])])["rows"][0]
    assert row["ratio"] == pytest.approx(303 / 318) and row["verdict"] == "n/a"
    assert "0.95x [0.95x, 0.95x] n/a" in markdown({"rows": [row]})

@pytest.mark.parametrize("reports, message", [
    ([_linked("network", [300], [290])], "needs one homogeneous report"),
    ([_homogeneous(), _homogeneous(), _linked("network", [300], [290])], "needs one homogeneous report"),
    ([_homogeneous(), _report("network", [_run("static64", 42, 300), _run("proportional", 43, 290)])],
     "at the same seeds"),
    ([_homogeneous(), _report("network", [_run("static64", 42, 300)], engine="gloo")], "--engine ps"),
    ([_homogeneous(), _linked("straggler", [300], [290])], "has no slow link"),
])
def test_reports_it_cannot_compare_are_refused_by_name(reports, message):
    with pytest.raises(ValueError, match=message):
        sweep(reports)


def test_the_command_prints_the_table_writes_json_and_names_a_foreign_file(tmp_path):
    paths = []
    for name, report in (("h.json", _homogeneous()), ("n.json", _linked("network", [300, 310], [280, 285]))):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, paths), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "link floor" in done.stdout
    written = json.loads(out.read_text())
    assert written["inputs"] == ["h.json", "n.json"] and len(written["rows"]) == 1

    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"benchmark": "ps_engine"}))
    refused = subprocess.run([sys.executable, str(SCRIPT), str(foreign), "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "lacks the field 'scenario'" in refused.stderr
    assert not (tmp_path / "x.json").exists()
