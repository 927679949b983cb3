"""`dynamix report RUN_DIR` on a recorded run, and on directories that hold none."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import RECORDED_INTERVAL
from test_decision_record import MALFORMED_LINES

from dynamix_byteps.control.decision_record import DecisionRecord
from dynamix_byteps.report import (
    DECISION_CHANGES,
    DECISION_TICKS,
    PLOTS,
    WORKER_COUNT_CHANGES,
    RunData,
    Series,
    batch_figure,
    format_summary,
    global_batch_reported,
    load_decisions,
    load_run,
    loss_accuracy_figure,
    summary,
)


def dynamix_report(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamix_byteps.cli", "report", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_report_writes_decodable_pngs_and_the_summary_table(recorded_run, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "plots"
    result = dynamix_report(recorded_run.dir, "--out", out)
    assert result.returncode == 0, result.stderr
    for name in PLOTS:
        image = imread(out / name)  # decodes the PNG
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400, name
        assert image[..., :3].std() > 0.05, f"{name} is blank"
    assert not list(recorded_run.dir.glob("*.png")), "--out was not honoured"
    rows = {int(m[1]): [float(x) for x in m.groups()[1:]]
            for m in re.finditer(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+$", result.stdout, re.M)}
    assert sorted(rows) == [0, 1], result.stdout
    for rank, (batch, theta, step_ms, push_pull_ms) in rows.items():
        sizes = json.loads((recorded_run.out / f"rank{rank}.json").read_text())
        interval_means = np.reshape(sizes, (-1, RECORDED_INTERVAL)).mean(axis=1)
        assert batch == pytest.approx(interval_means[1:].mean(), abs=0.051)  # the first interval is warm-up
        assert theta > 0 and step_ms > push_pull_ms >= 0
    assert re.search(r"job: [\d.]+ s wall time, 96 steps, last training loss \(mean of the workers. last logged steps\) [\d.]+", result.stdout), result.stdout
    assert re.search(r"final accuracy: 0\.\d{4} \(test/accuracy \(worker 0\)\)", result.stdout), result.stdout
    lines = (recorded_run.dir / "decisions.jsonl").read_text().splitlines()
    assert re.search(rf"decisions: {len(lines)} \(\d+ changed the batch sizes\)", result.stdout), result.stdout
    ticks = [a for ax in batch_figure(load_run(recorded_run.dir)).axes for a in ax.lines if a.get_gid() == DECISION_TICKS]
    assert len(ticks) == 2 and all(len(t.get_xdata()) == len(lines) for t in ticks)


def _artists(ax, gid):
    return [a for a in [*ax.lines, *ax.collections] if a.get_gid() == gid]


def test_the_batch_plot_marks_each_decision_and_shows_the_global_batch(tmp_path):
    """Decisions at 10/20/30/40 s (at 20 s and 40 s the sizes change; the run starts at epoch 1000 s):
    a tick per decision, a line per change, and the global batch the decisions assigned and the workers ran."""
    sizes = [[64, 64], [64, 64], [128, 96], [128, 96], [32, 32]]
    log = tmp_path / "decisions.jsonl"
    log.write_text("".join(DecisionRecord(time=1000.0 + 10 * i, decision=i, step=20 * i, batch_sizes_before=sizes[i - 1],
                                          batch_sizes=sizes[i]).to_json() + "\n" for i in range(1, 5)) + "{half a li")
    decisions = load_decisions(tmp_path, start=1000.0)
    assert decisions.wall.tolist() == [10, 20, 30, 40] and decisions.changed.tolist() == [False, True, False, True]
    steps = np.array([20, 40, 60, 80])
    walls = steps / 2.0
    data = RunData(workers={r: {"batch_size": Series(steps, walls, np.array([64.0, 64, b, b]))} for r, b in ((0, 128), (1, 96))},
                   start=1000.0, end=40.0, decisions=decisions)
    local, total = batch_figure(data).axes
    for ax in (local, total):
        (ticks,) = _artists(ax, DECISION_TICKS)
        assert ticks.get_xdata().tolist() == [10, 20, 30, 40]
        (changes,) = _artists(ax, DECISION_CHANGES)
        assert [seg[0][0] for seg in changes.get_segments()] == [20, 40]
    lines = {line.get_label(): line for line in total.lines}
    assert lines["assigned by the decisions"].get_ydata().tolist() == [128, 224, 224, 64]
    assert lines["reported (sum of the workers' means)"].get_ydata().tolist() == [128, 128, 224, 224]
    assert "global batch" in total.get_title().lower()
    rows, job = summary(data)
    assert job["rhythm"] == {"decisions": 4, "changes": 2, "early_global_batch": 128.0, "late_global_batch": 64.0}
    assert "global batch assigned: 128 over the first third, 64 over the last (smaller late)" in format_summary(rows, job)
    (tmp_path / "decisions.jsonl").unlink()
    assert load_decisions(tmp_path, start=1000.0) is None


def test_a_folder_of_runs_names_the_runs_below_it(tmp_path):
    """A benchmark's configuration folder (one run per seed) is not a run; the error names its runs."""
    for seed in ("seed42", "seed43"):
        (tmp_path / seed / "tensorboard" / "worker-0").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    result = dynamix_report(tmp_path)
    assert result.returncode == 2
    assert "has no TensorBoard event files (runs below it: seed42, seed43; report one of them)" in result.stderr


def test_an_empty_directory_is_a_usage_error_that_says_how_to_record_a_run(tmp_path):
    result = dynamix_report(tmp_path)
    assert result.returncode == 2
    assert "has no TensorBoard event files" in result.stderr
    assert "tensorboard/worker-<rank>" in result.stderr and "bpslaunch --log-dir" in result.stderr
    assert f"under torchrun with DYNAMIX_LOG_DIR={tmp_path} in the workers' environment" in result.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written on error"


def test_a_missing_directory_and_one_without_worker_scalars_are_usage_errors(tmp_path):
    result = dynamix_report(tmp_path / "nope")
    assert result.returncode == 2 and "is not a directory" in result.stderr
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    writer = ScalarWriter(tmp_path / "tensorboard" / "worker-0")
    writer.open()  # an event file, but the job ended before its first interval
    writer.close()
    result = dynamix_report(tmp_path)
    assert result.returncode == 2 and "has no TensorBoard scalars of any worker yet" in result.stderr


def test_a_damaged_event_file_is_left_out_with_a_warning_naming_it(tmp_path, caplog):
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    writer = ScalarWriter(tmp_path / "tensorboard" / "worker-0")
    writer.open()
    writer.add({"batch_size": 64.0}, step=10)
    writer.close()
    damaged = tmp_path / "tensorboard" / "worker-1"
    damaged.mkdir()
    (damaged / "events.out.tfevents.1.host").write_bytes(bytes(range(256)) * 4)
    with caplog.at_level("WARNING", logger="dynamix_byteps.report"):
        data = load_run(tmp_path)
    assert list(data.workers) == [0]
    assert "no readable TensorBoard event in worker-1" in caplog.text



@pytest.mark.parametrize("ranks, decided_workers", [((0,), 2), ((0, 2), None)], ids=["decisions", "rank_gap"])
def test_a_worker_without_scalars_is_named_and_no_partial_sum_is_drawn_as_the_global_batch(
        tmp_path, caplog, ranks, decided_workers):
    """A multi-host run whose --log-dir is not shared holds only its host's workers: the report
    showed them alone, without a word, and drew their sum as the job's global batch."""
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    for rank in ranks:
        writer = ScalarWriter(tmp_path / "tensorboard" / f"worker-{rank}")
        writer.open()
        writer.add({"batch_size": 64.0}, step=10)
        writer.close()
    if decided_workers:
        (tmp_path / "decisions.jsonl").write_text(DecisionRecord(
            time=1e9, decision=1, step=10, batch_sizes=[64] * decided_workers).to_json() + "\n")
    with caplog.at_level("WARNING", logger="dynamix_byteps.report"):
        data = load_run(tmp_path)
    assert f"no batch sizes of worker 1 (of {decided_workers or 3} workers" in caplog.text and "--log-dir" in caplog.text
    lines = {line.get_label() for line in batch_figure(data).axes[1].lines}
    assert "reported (sum of the workers' means)" not in lines

def test_the_job_s_wall_time_counts_from_its_first_worker_not_from_a_scheduler_started_earlier(tmp_path, monkeypatch):
    """The torchrun recipe starts the scheduler by hand: one started 60 s before 2 s of training
    made the report say 62 s of wall time."""
    import time

    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    started = time.time()
    scheduler = ScalarWriter(tmp_path / "tensorboard" / "scheduler")
    scheduler.open()
    monkeypatch.setattr(time, "time", lambda: started + 60.0)
    worker = ScalarWriter(tmp_path / "tensorboard" / "worker-0")
    worker.open()
    worker.add({"batch_size": 64.0}, step=10, walltime=started + 61.0)
    scheduler.add({"global_batch": 64.0}, step=10, walltime=started + 61.5)
    worker.add({"batch_size": 64.0}, step=20, walltime=started + 62.0)
    for writer in (worker, scheduler):
        writer.close()
    _, job = summary(load_run(tmp_path))
    assert job["wall_s"] == pytest.approx(2.0)


def test_an_empty_loss_plot_says_what_reports_the_loss():
    # A Keras model.fit run under --policy without BatchSizeCallback reports no loss: the loss panel was blank.
    steps = np.array([20, 40])
    batch = {"batch_size": Series(steps, steps / 2.0, np.array([64.0, 64]))}
    loss_ax, acc_ax = loss_accuracy_figure(RunData(workers={0: batch}, start=1000.0, end=20.0)).axes
    assert [t.get_text() for t in loss_ax.texts] == ["no loss reported: call bps.report_loss(loss) each step\n"
                                                      "(Keras model.fit: add callbacks.BatchSizeCallback())"]
    assert "no accuracy logged" in acc_ax.texts[0].get_text()
    with_loss = {**batch, "loss": Series(steps, steps / 2.0, np.array([2.0, 1.5]))}
    loss_ax, _ = loss_accuracy_figure(RunData(workers={0: with_loss}, start=1000.0, end=20.0)).axes
    assert loss_ax.lines and not loss_ax.texts


def test_a_run_dir_reused_by_a_later_run_is_reported_from_its_newest_events_with_a_warning(tmp_path, caplog):
    """bpslaunch --log-dir DIR run twice (or a restart from a checkpoint): each worker's series
    went back to step 10 half-way, and the report died with IndexError in the global batch."""
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    for batch, steps in ((64, (10, 20, 30, 40)), (32, (10, 20))):
        for rank in (0, 1):
            writer = ScalarWriter(tmp_path / "tensorboard" / f"worker-{rank}")
            for step in steps:
                writer.add({"batch_size": float(batch)}, step=step)
            writer.close()
    with caplog.at_level("WARNING", logger="dynamix_byteps.report"):
        data = load_run(tmp_path)
    assert "the steps of worker 0, 1 go back" in caplog.text and "own --log-dir" in caplog.text
    assert {rank: s["batch_size"].value.tolist() for rank, s in data.workers.items()} == {0: [32, 32], 1: [32, 32]}
    lines = {line.get_label(): line for line in batch_figure(data).axes[1].lines}
    assert lines["reported (sum of the workers' means)"].get_ydata().tolist() == [64, 64]

def test_an_elastic_restart_on_fewer_workers_is_reported_in_both_parts_with_a_boundary(tmp_path, caplog):
    """bpslaunch --restart-on-failure --min-workers: 4 workers to step 8, a worker lost, the job resumed
    at step 7 on 3 (the checkpoint after step 6). The report kept only the 4-worker decisions, silently,
    and summed the reported batches only while worker 3 reported."""
    import time

    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    runs = [(4, [8, 8, 8, 8], (2, 4, 6, 8)), (3, [10, 10, 14], (8, 10, 12))]
    lines = []
    for workers, sizes, steps in runs:
        for rank in range(workers):
            writer = ScalarWriter(tmp_path / "tensorboard" / f"worker-{rank}")
            for step in steps:
                writer.add({"batch_size": float(sizes[rank])}, step=step)
            writer.close()
        lines += [DecisionRecord(time=time.time(), decision=i, step=step, batch_sizes_before=sizes, batch_sizes=sizes)
                  for i, step in enumerate(steps)]
    (tmp_path / "decisions.jsonl").write_text("".join(r.to_json() + "\n" for r in lines))
    with caplog.at_level("WARNING", logger="dynamix_byteps.report"):
        data = load_run(tmp_path)
    assert "no batch sizes" not in caplog.text
    decisions = data.decisions
    assert decisions.step.tolist() == [2, 4, 6, 8, 10, 12]  # the restarted run's step 8 supersedes the lost one's
    assert decisions.workers.tolist() == [4, 4, 4, 3, 3, 3] and decisions.global_batch.tolist() == [32] * 3 + [34] * 3
    rows, job = summary(data)
    table = format_summary(rows, job)
    assert "decisions: 6 (" in table and "workers: 4 -> 3 from the decision at step 8" in table, table
    for ax in batch_figure(data).axes:
        (boundary,) = _artists(ax, WORKER_COUNT_CHANGES)
        assert boundary.get_xdata()[0] == decisions.wall[3]
        assert any(text.get_text().strip() == "4 → 3 workers" for text in ax.texts)
    lines = {line.get_label(): line for line in batch_figure(data).axes[1].lines}
    assert lines["assigned by the decisions"].get_ydata().tolist() == [32] * 3 + [34] * 3
    reported = lines["reported (sum of the workers' means)"]
    assert reported.get_ydata().tolist() == [32] * 3 + [34] * 3  # from step 8 workers 0-2: worker 3 left the job
    assert global_batch_reported(data).step.tolist() == [2, 4, 6, 8, 10, 12]

def test_a_run_whose_every_worker_file_is_unreadable_names_them(tmp_path):
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    writer = ScalarWriter(tmp_path / "tensorboard" / "scheduler")
    writer.open()
    writer.add({"reward": 1.0}, step=1)
    writer.close()
    (tmp_path / "tensorboard" / "worker-0" / "events.out.tfevents.1.host").mkdir(parents=True)  # a folder, not a file
    result = dynamix_report(tmp_path)
    assert result.returncode == 2, result.stderr
    assert "no readable event in worker-0: missing, empty or damaged" in result.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("line, why", [*MALFORMED_LINES, (bytes(range(128, 256)) * 8, "not UTF-8 text (byte 0x80")])
def test_a_malformed_or_undecodable_decision_is_left_out_with_a_warning_naming_it(tmp_path, monkeypatch, line, why):
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    writer = ScalarWriter(tmp_path / "tensorboard" / "worker-0")
    writer.open()
    writer.add({"batch_size": 8.0}, step=10)
    writer.close()
    good = [DecisionRecord(time=float(i), decision=i, step=10 * i, batch_sizes=[8]).to_json().encode() for i in (1, 2)]
    log = tmp_path / "decisions.jsonl"
    log.write_bytes(b"\n".join([good[0], line, good[1]]) + b"\n")
    result = dynamix_report(tmp_path, "--out", tmp_path / "plots")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"skipping a malformed line in {log}: line 2 is not a decision record ({why}" in result.stderr
    assert "decisions: 2 (0 changed the batch sizes)" in result.stdout
