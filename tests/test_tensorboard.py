"""TensorBoard event files of a run, read back with tensorboard's own event reader."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import RECORDED_INTERVAL

from dynamix_byteps import tensorboard_scalars


def read_scalars(path) -> dict:
    """tag -> list of tensorboard ScalarEvents (wall_time, step, value) of one run directory."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_each_worker_has_its_batch_size_series_and_the_interval_scalars(recorded_run):
    for rank in (0, 1):
        sizes = json.loads((recorded_run.out / f"rank{rank}.json").read_text())
        scalars = read_scalars(recorded_run.dir / "tensorboard" / f"worker-{rank}")
        missing = set(tensorboard_scalars.WORKER_TAGS) - set(scalars)
        assert not missing, f"worker {rank} lacks {missing}; has {sorted(scalars)}"
        series = scalars["batch_size"]
        # x = steps completed, one point per interval; y = the mean local batch the worker trained on
        assert [e.step for e in series] == list(range(RECORDED_INTERVAL, len(sizes) + 1, RECORDED_INTERVAL))
        expected = [np.mean(sizes[e.step - RECORDED_INTERVAL:e.step]) for e in series]
        assert [e.value for e in series] == pytest.approx(expected)
        walls = [e.wall_time for e in series]
        assert walls == sorted(walls)
        for e in scalars["step_s"]:
            assert e.value > 0
        assert all(e.value == 1.0 for e in scalars["lr_scale"])  # lr_scaling "none"
        accuracy = scalars["test/accuracy"]  # bps.log_scalar, once per epoch, at the global step
        assert [e.step for e in accuracy] == [32, 64, 96]
        assert all(0.1 < e.value <= 1.0 for e in accuracy)
        assert len(scalars["test/loss"]) == 3


@pytest.mark.timeout(300)
def test_scheduler_records_each_decision_as_scalars(recorded_run):
    decisions = [json.loads(line) for line in (recorded_run.dir / "decisions.jsonl").read_text().splitlines()]
    scalars = read_scalars(recorded_run.dir / "tensorboard" / "scheduler")
    assert decisions
    for rank in (0, 1):
        assigned = scalars[f"batch_size/worker-{rank}"]
        assert [(e.step, e.value) for e in assigned] == [(d["step"], d["batch_sizes"][rank]) for d in decisions]
    assert {e.value for e in scalars["global_batch"]} == {128.0}  # proportional keeps the global batch
    for tag in ("predicted_gain", "lr_scale", "reward/step_time_s"):
        assert len(scalars[tag]) == len(decisions), tag
    # the policy's own terms exist for the decisions that consulted it (not the guardrails' settling waits)
    consulted = [d["step"] for d in decisions if "step_time_now_s" in d["terms"]]
    assert consulted and [e.step for e in scalars["terms/step_time_now_s"]] == consulted
    assert all({"settling", "fallback"} & set(d["terms"]["guard"]) for d in decisions if "step_time_now_s" not in d["terms"])


def test_log_scalar_writes_into_this_workers_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIX_LOG_DIR", str(tmp_path))
    for name in ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "DYNAMIX_RANK_OFFSET", "DYNAMIX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tensorboard_scalars.close()
    try:
        tensorboard_scalars.log_scalar("test/accuracy", 0.5, step=3)
        tensorboard_scalars.log_scalar("test/accuracy", np.float32(0.75), step=7)
        tensorboard_scalars.log_scalar("test/loss", float("nan"), step=7)  # TensorBoard draws no point for it
    finally:
        tensorboard_scalars.close()
    scalars = read_scalars(tmp_path / "tensorboard" / "worker-0")
    assert [(e.step, e.value) for e in scalars["test/accuracy"]] == [(3, 0.5), (7, 0.75)]
    assert "test/loss" not in scalars


def test_the_steps_after_the_last_decision_boundary_are_written_when_training_ends(tmp_path, no_job_variables,
                                                                                   monkeypatch):
    """A run of 7 steps with a decision every 5: its record ended at step 5 (a 32-step run read
    "20 steps" in `dynamix report`, with the loss of 12 steps before the end)."""
    import torch

    import dynamix_byteps.torch as bps

    monkeypatch.setenv("DYNAMIX_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("DYNAMIX_DECISION_INTERVAL", "5")
    bps.init()
    try:
        sampler = bps.DynamicBatchSampler(100, batch_size=4, seed=0)
        model = torch.nn.Linear(1, 1)
        optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
        for step, indices in zip(range(7), sampler):
            if step == 4:
                bps.set_batch_sizes([2], at_step=5)  # the last two steps train smaller batches
            optimizer.zero_grad()
            loss = model(torch.tensor(indices, dtype=torch.float32).unsqueeze(1)).sum()
            loss.backward()
            optimizer.step()
            bps.report_loss(float(step))
    finally:
        bps.shutdown()
    scalars = read_scalars(tmp_path / "tensorboard" / "worker-0")
    assert [e.step for e in scalars["batch_size"]] == [5, 7]
    assert [e.step for e in scalars["loss"]] == [5, 7] and scalars["loss"][-1].value > scalars["loss"][0].value
    assert [e.value for e in scalars["batch_size"]] == [4.0, 2.0]


def test_a_killed_process_loses_no_scalar_it_had_written(tmp_path):
    code = ("import os, signal, sys; from dynamix_byteps.tensorboard_scalars import ScalarWriter; w = ScalarWriter(sys.argv[1]); "
            "w.add({'loss': 0.5, 'step_s': 0.25}, 20); os.kill(os.getpid(), signal.SIGKILL)")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, timeout=60)
    assert result.returncode == -9, result.stderr
    scalars = read_scalars(tmp_path)
    assert [(e.step, e.value) for e in scalars["loss"]] == [(20, 0.5)]
    assert [(e.step, e.value) for e in scalars["step_s"]] == [(20, 0.25)]


def test_a_process_s_event_files_sort_in_the_order_it_made_them(tmp_path, monkeypatch):
    """TensorBoard (and ``dynamix report``) read a directory's files in name order: the 10th file
    of a second must not come before the 9th."""
    import itertools

    monkeypatch.setattr(tensorboard_scalars, "_file_ids", itertools.count(8))
    made = []
    for value in range(4):
        tensorboard_scalars.ScalarWriter(tmp_path / str(value)).open()
        made.append(next((tmp_path / str(value)).iterdir()).name)
    assert sorted(made) == made, made


def test_without_a_log_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAMIX_LOG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    tensorboard_scalars.close()
    tensorboard_scalars.log_scalar("test/accuracy", 0.5)
    assert tensorboard_scalars.worker_writer() is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [("", 1.0), (3, 1.0), ("acc", "high"), ("acc", None), ("acc", 1.0, -1),
                                  ("acc", 1.0, 2.5), ("acc", 1.0, True), ("acc", 10**400), ("acc", "0.5"),
                                  ("acc", True), ("acc", np.ones(1))])
def test_log_scalar_refuses_bad_arguments(args):
    with pytest.raises(ValueError, match="log_scalar"):
        tensorboard_scalars.log_scalar(*args)


def test_decision_scalars_keep_numbers_only():
    record = {"batch_sizes": [30, 98], "lr_scale": 1.0, "predicted_gain": 0.2,
              "state": {"noise_scale": None}, "reward": {"loss": 0.5, "loss_change": None},
              "terms": {"comm_s": 0.01, "samples_per_s": [1.0, 2.0], "guard": {"notes": [], "predicted_gain_after_guard": 0.1},
                        "fallback": "proportional", "flag": True, "bad": float("inf")}}
    assert tensorboard_scalars.decision_scalars(record) == {
        "batch_size/worker-0": 30.0, "batch_size/worker-1": 98.0, "global_batch": 128.0, "lr_scale": 1.0,
        "predicted_gain": 0.2, "reward/loss": 0.5, "terms/comm_s": 0.01, "terms/guard/predicted_gain_after_guard": 0.1,
    }
