"""benchmarks/ddp_comparison.py: its statistics and sanity checks, and its quickest run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "ddp_comparison.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from conftest import clean_env, run_in_session
from ddp_comparison import MLP_WIDTHS, VARIANTS, markdown, mlp, sanity_failures, summarise

from dynamix_byteps.launcher.topology import free_port


def _run(model, workers, scale):
    """A job result whose variants take ``scale[variant]`` x 100 ms per step, +-2% noise, 3 repeats of 30 steps."""
    rng = np.random.default_rng(1)
    return {"model": model, "workers": workers,
            "step_s": {name: (0.1 * factor * rng.uniform(0.98, 1.02, (3, 30))).tolist() for name, factor in scale.items()},
            "same_on_every_rank": {name: [True] * 3 for name in scale},
            "relative_difference_to_torch_ddp": {name: [0.0] * 3 for name in scale if name != "torch DDP"}}


def test_verdict_needs_the_ratio_interval_to_exclude_one_and_targets_follow_model_and_workers():
    rows = {r["variant"]: r for r in summarise(_run("mlp", 4, dict(zip(VARIANTS, (0.9, 1.0, 1.0)))))}
    ahead, tie, base = rows["DistributedOptimizer"], rows["bps.DistributedDataParallel"], rows["torch DDP"]
    assert ahead["ratio"] == pytest.approx(0.9, abs=0.01) and ahead["ratio_ci90"][1] < 1
    assert ahead["verdict"] == "ahead" and ahead["target"] == 0.97 and ahead["target_met"] == "met"
    assert tie["verdict"] == "tie" and tie["ratio_ci90"][0] < 1 < tie["ratio_ci90"][1]
    assert tie["target_met"] == "missed"  # the whole interval lies above 0.97
    assert "ratio" not in base and base["median_ci90_ms"][0] <= base["median_ms"] <= base["median_ci90_ms"][1]
    behind = summarise(_run("cnn", 2, {"DistributedOptimizer": 1.1, "torch DDP": 1.0}))[0]
    assert behind["verdict"] == "behind" and behind["target"] == 1.0 and behind["target_met"] == "missed"
    assert markdown([ahead, base]).count("\n") == 3  # header, rule, two rows


def test_sanity_failures_name_ranks_that_disagree_and_training_that_left_torch_ddps():
    run = _run("cnn", 2, {"DistributedOptimizer": 1.0, "torch DDP": 1.0})
    assert sanity_failures(run) == []
    run["same_on_every_rank"]["torch DDP"][1] = False
    run["relative_difference_to_torch_ddp"]["DistributedOptimizer"][2] = 0.02
    failures = sanity_failures(run)
    assert len(failures) == 2
    assert "torch DDP, repeat 1" in failures[0] and "DistributedOptimizer, repeat 2" in failures[1]


def test_the_mlps_are_the_communication_heavy_model_and_the_small_one_of_fixed_step_costs():
    assert sum(p.numel() for p in mlp(MLP_WIDTHS["mlp"]).parameters()) == 8_962_058
    assert sum(p.numel() for p in mlp(MLP_WIDTHS["small-mlp"]).parameters()) == 203_530


@pytest.mark.timeout(120)
def test_a_worker_stuck_past_the_timeout_ends_with_every_threads_stack_instead_of_hanging(tmp_path):
    # Rank 1 of 2 whose rank 0 never comes: its rendezvous would wait DYNAMIX_TIMEOUT (300 s).
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), DYNAMIX_TIMEOUT="300", OMP_NUM_THREADS="1")
    code, output = run_in_session(
        [sys.executable, SCRIPT, "--worker", "--model", "cnn", "--result", tmp_path / "result.json", "--batch-size", 4,
         "--steps", 1, "--warmup", 0, "--repeats", 1, "--seed", 0, "--timeout", 2], timeout=90, env=env)
    assert code != 0
    assert "Timeout (0:00:07)!" in output and "most recent call first" in output and "cnn_worker" in output, output


@pytest.mark.timeout(300)
def test_quickest_run_measures_all_three_variants_and_the_table_comes_back_from_the_json(tmp_path):
    out = tmp_path / "ddp.json"
    # A stuck worker ends the job after 65 s (--timeout 60, the workers' watchdog 5 s later), with its stacks.
    code, output = run_in_session(
        [sys.executable, SCRIPT, "--workers", 2, "--models", "cnn", "--repeats", 1, "--steps", 3, "--warmup", 1,
         "--timeout", 60, "--out", out], timeout=240)
    assert code == 0, output[-12000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["skipped"] == [] and list(run["step_s"]) == list(VARIANTS)
    assert all(len(times) == 1 and len(times[0]) == 3 for times in run["step_s"].values())
    assert report["sanity_failures"] == [] and [r["variant"] for r in report["rows"]] == list(VARIANTS)
    again = subprocess.run([sys.executable, str(SCRIPT), "--table-only", "--markdown", "--out", str(out)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| cnn | 2 | torch DDP |" in again and "SANITY FAILURE" not in again
