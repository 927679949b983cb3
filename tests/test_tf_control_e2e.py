"""A TensorFlow job driven by the control plane: bpslaunch --policy, the scheduler, real workers."""

import json
import sys
from pathlib import Path

import pytest
from conftest import kill_tree
from test_control_e2e import bpslaunch, logs

pytest.importorskip("tensorflow")

WORKER = Path(__file__).resolve().parent / "scripts/tf_control_worker.py"


@pytest.mark.timeout(600)
def test_proportional_policy_drives_a_keras_fit_job(tmp_path):
    """80 steps, a decision every 5: the straggler's batch is below half the others' from the first or
    second change on (measured: [71, 89, 32] at step 15, [78, 91, 23] at 25, [87, 100, 5] at 75)."""
    steps = 80
    job = bpslaunch("-n", 3, "--policy", "proportional", "--slowdown", "2=3.0", "--decision-interval", 5,
                    "--log-dir", tmp_path, "--", sys.executable, WORKER, tmp_path, steps)
    try:
        output, _ = job.communicate(timeout=580)
    finally:
        kill_tree(job)
    assert job.returncode == 0, output
    ranks = logs(tmp_path, 3)
    assert all(len(rank) == steps for rank in ranks)
    assert all(global_batch == 192 for rank in ranks for _, global_batch in rank), "the global batch changed"
    sizes_per_step = [[rank[step][0] for rank in ranks] for step in range(steps)]
    assert all(sum(sizes) == 192 for sizes in sizes_per_step), "workers switched at different steps"
    changes = [s for s in range(1, steps) if sizes_per_step[s] != sizes_per_step[s - 1]]
    assert changes, "the policy never changed a batch size"
    final = sizes_per_step[-1]
    assert final[2] < 0.5 * min(final[:2]), final
    decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert decisions and any(d.get("action") for d in decisions)


@pytest.mark.timeout(400)
def test_a_pytorch_trained_ppo_policy_drives_a_keras_fit_job(tmp_path):
    """The packaged ``ppo:small-cnn-sgd`` (trained with RLlib on torch, exported to ONNX) drives a Keras job:
    the policy format carries across frameworks. Training and exporting a policy is tested in test_ppo.py."""
    pytest.importorskip("onnxruntime")
    steps = 40
    job = bpslaunch("-n", 3, "--policy", "ppo:small-cnn-sgd", "--slowdown", "2=3.0",
                    "--decision-interval", 5, "--log-dir", tmp_path / "run", "--", sys.executable, WORKER, tmp_path,
                    steps)
    try:
        output, _ = job.communicate(timeout=280)
    finally:
        kill_tree(job)
    assert job.returncode == 0, output
    decisions = [json.loads(line) for line in (tmp_path / "run" / "decisions.jsonl").read_text().splitlines()]
    assert decisions and all(d["policy"].startswith("ppo") and d["error"] is None for d in decisions)
    ranks = logs(tmp_path, 3)
    assert all(len(rank) == steps for rank in ranks)
    for step in range(steps):  # every worker applies each assignment at the same step
        assert len({rank[step][1] for rank in ranks}) == 1
